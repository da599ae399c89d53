"""Round cost of two_stage_generations against the default, interleaved in one process.

Two trainers on the embedded default recipe, one with `--two_stage_generations K`, run training
rounds alternately (A, B, A, B, ...; round 0 warms up) so that both see the same load; reported:
median seconds per round and per phase, questions dropped after the first stage, completions
scored and kept, the share of zero-variance groups, and the paired per-round time ratio. Run on
the base model and, with --trained DIR, on a trained checkpoint (more zero-variance groups).
The held-out accuracy comparison is `default_run.py --rows default two_stage`.

    python benchmarks/two_stage.py --rounds 15 --trained RUN/checkpoint-600

Writes benchmarks/results/two_stage/round_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from common import machine, spread, trainer_for, write_results


def round_cost(model: str | None, k: int, rounds: int) -> dict:
    recipes = {"default": {}, f"two_stage {k}": {"two_stage_generations": k}}
    trainers = {name: trainer_for(model, quiet=False, prefix="cppo_two_stage_", **flags)
                for name, flags in recipes.items()}
    times: dict[str, list] = {n: [] for n in recipes}
    for i in range(rounds + 1):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            m = trainer.training_round()
            took = time.perf_counter() - start
            phases = trainer.timer.pop_last()
            if i:
                times[name].append({"round": took, "generate": phases.get("generate", 0.0),
                                    "update": phases.get("update", 0.0),
                                    "dropped": m.get("cppo/two_stage_dropped", 0),
                                    "kept": m["cppo/completions_kept"],
                                    "scored": m["cppo/completions_scored"],
                                    "zero_std": m.get("frac_reward_zero_std", 0)})
    out = {}
    for name, recs in times.items():
        out[name] = {key: spread([r[key] for r in recs], digits=3)["median"] for key in recs[0]}
        rounds = spread([r["round"] for r in recs], digits=2)
        out[name]["round_range"] = [rounds["min"], rounds["max"]]
        out[name]["generation_dtype"] = trainers[name].generation_dtype   # auto, resolved
    a, b = times.values()
    ratios = spread([y["round"] / x["round"] for x, y in zip(a, b)], digits=3)
    out["paired round ratio"] = {"median": ratios["median"], "range": [ratios["min"], ratios["max"]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--k", type=int, default=4, help="two_stage_generations")
    parser.add_argument("--trained", help="a trained checkpoint directory to measure on as well")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/two_stage")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    models = {"base": None, **({"trained": args.trained} if args.trained else {})}
    results = {}
    for label, model in models.items():
        results[label] = round_cost(model, args.k, args.rounds)
        print(label, json.dumps(results[label], indent=1), flush=True)
    meta = {"rounds": args.rounds, "threads": args.threads, "machine": machine(),
            "load_average_after": os.getloadavg()[0], "trained": args.trained}
    write_results(args.output, {"meta": meta, "results": results}, None, indent=1,
                  json_name="round_cost.json")


if __name__ == "__main__":
    main()
