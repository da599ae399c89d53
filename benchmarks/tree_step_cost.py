"""Seconds per training round of this tree against another checkout of cppo, interleaved.

Two worker processes, one importing this tree and one another checkout's src/ (e.g.
`git worktree add /tmp/before REV`), each build the trainer of the same recipe (the embedded
default unless --extra says otherwise) and run training rounds when told, one process at a time,
alternating (A, B, A, B, ...), so that both see the machine at the same moments: a drift of the
machine's speed, which sequential full runs cannot tell from a change of the code, moves both
sides alike. Reported per phase (generate, score, update, the whole round): the median seconds
of each side and the median of the paired ratios with their range.

    python benchmarks/tree_step_cost.py --against /tmp/before --rounds 40

Writes benchmarks/results/tree_step_cost/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, spread, trainer_for, write_results  # noqa: E402

PHASES = ("round", "generate", "score", "update")


def worker(extra: list[str]) -> None:
    """Build the trainer, then run one training round per 'round' line on stdin, answering with
    the round's seconds per phase as one JSON line."""
    import contextlib
    import io
    import torch
    overrides = dict(zip((k.lstrip("-") for k in extra[::2]), extra[1::2]))   # typed by load
    trainer = trainer_for(prefix="cppo_tree_step_", **overrides)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        before = dict(trainer.timer.totals)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.training_round()
        took = {"round": time.perf_counter() - start}
        took.update({k: trainer.timer.totals.get(k, 0.0) - before.get(k, 0.0) for k in PHASES[1:]})
        print(json.dumps(took), flush=True)


def start_worker(tree: str | None, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = str(Path(tree) / "src")
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "--extra", shlex.join(extra)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    ready = json.loads(proc.stdout.readline())
    assert ready.get("ready"), ready
    return proc


def one_round(proc: subprocess.Popen) -> dict:
    proc.stdin.write("round\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="another checkout of cppo (its src/ is imported)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--extra", default="", help="config overrides for both sides: --field value ...")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(HERE / "results" / "tree_step_cost"))
    args = parser.parse_args()
    extra = shlex.split(args.extra)
    if args.worker:
        return worker(extra)
    from default_run import tree_revision
    if not args.against:
        parser.error("--against DIR is required (a checkout of cppo to compare with)")
    load_before = os.getloadavg()[0]
    sides = {"this tree": start_worker(None, extra), f"tree at {tree_revision(args.against)}":
             start_worker(args.against, extra)}
    times: dict[str, list[dict]] = {name: [] for name in sides}
    for i in range(args.warmup + args.rounds):
        for name, proc in sides.items():
            took = one_round(proc)
            if i >= args.warmup:
                times[name].append(took)
    for proc in sides.values():
        proc.stdin.close()
        proc.wait()
    (new_name, new), (old_name, old) = times.items()
    rows = []
    for phase in PHASES:
        ratios = spread([a[phase] / b[phase] for a, b in zip(new, old) if b[phase] > 0], digits=3)
        rows.append({"phase": phase, "this_ms": spread([r[phase] for r in new], 1000, 1)["median"],
                     "against_ms": spread([r[phase] for r in old], 1000, 1)["median"],
                     "paired_ratio_median": ratios["median"],
                     "paired_ratio_range": [ratios["min"], ratios["max"]]})
    meta = {"argv": " ".join(sys.argv[1:]), "machine": machine(), "against": old_name,
            "rounds": args.rounds, "warmup": args.warmup, "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2)}
    m = meta["machine"]
    lines = [f"# Training round cost against another tree (`python benchmarks/tree_step_cost.py "
             f"{meta['argv']}`)", "",
             f"CPU: {m['cpu']}, torch {m['torch']}, CPU capability **{m['cpu_capability']}**, "
             f"AVX512-BF16: {m['avx512_bf16']}, fast bf16 as torch runs here: {m['fast_bfloat16']}; "
             f"1-minute load average {meta['load_before']} before, {meta['load_after']} after.", "",
             f"{args.rounds} rounds per side after {args.warmup} warm-up rounds, alternating one "
             f"round of this tree and one of the {old_name}; each side trains its own run of the "
             "same recipe from the same start. Median ms per round and phase, and the median "
             "(range) of the paired ratios this tree / the other.", "",
             f"| phase | this tree ms | {old_name} ms | this / other (paired median) | range |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['this_ms']} | {r['against_ms']} | "
                     f"{r['paired_ratio_median']:.2f}x | {r['paired_ratio_range'][0]:.2f}-"
                     f"{r['paired_ratio_range'][1]:.2f}x |")
    write_results(args.output, {"meta": meta, "rows": rows, "rounds": times}, lines)


if __name__ == "__main__":
    main()
