"""The headline results, each read from a committed results file, never typed by hand.

`scripts/update_docs.py` writes them into README.md (the `README` rows) and docs/benchmarks.md
(every row, with the command that wrote its file); `--check` fails when either is stale. A
headline is a function of its results file: rerun the benchmark, rerun the script, and every
place that quotes the figure changes together.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine_of  # noqa: E402
RESULTS = "benchmarks/results"


@dataclass(frozen=True)
class Headline:
    what: str
    results: str                     # the results file, relative to the repository root
    command: str                     # the command that wrote it
    figure: Callable[[dict], str]    # the results file's data -> the one-line result
    readme: bool = True              # in README.md (at most eight); always in docs/benchmarks.md

    def data(self, root: Path = ROOT) -> dict:
        return json.loads((root / self.results).read_text())

    def page(self) -> str:
        """The human-readable results page beside the json (results.md when there is one)."""
        md = Path(self.results).with_suffix(".md")
        return str(md) if (ROOT / md).exists() else self.results


def cpu(data: dict) -> str:
    """'AMD EPYC, AVX512': the CPU and torch's capability from a results file's machine record
    (common.machine_of: every shape the programs have written)."""
    machine = machine_of(data)
    name = machine.get("cpu") or "x86_64"
    name = {"x86_64": "x86_64 CPU"}.get(name, name).replace("(R)", "").replace(" Processor", "")
    return f"{name}, {machine.get('cpu_capability', '?')}"


def span(values, digits: int = 1, unit: str = "") -> str:
    """'14.2 to 15.3 s': the range measured (one value when they agree at that rounding)."""
    low, high = min(values), max(values)
    text = f"{low:.{digits}f}" if round(low, digits) == round(high, digits) \
        else f"{low:.{digits}f} to {high:.{digits}f}"
    return text + unit


def default_run(data: dict) -> str:
    rows = [r for r in data["rows"] if r["label"] == "default"]
    before = 100 * rows[0]["accuracy_before"]
    gains = [r["gain_points"] for r in rows]
    seconds = [r.get("process_seconds") or r["wall_seconds"] for r in rows]
    return (f"+{span(gains).replace(' to ', ' to +')} points of held-out accuracy from {before:.1f} % "
            f"(mean +{statistics.mean(gains):.1f}, {len(rows)} seeds) in {span(seconds, 0, ' s')} "
            f"({cpu(data)})")


def paper_table(data: dict) -> str:
    stats = data["stats"]
    rows = [k for k in ("cppo-0.5", "cppo-0.75", "cppo-0.875", "cppo-0.9375") if k in stats]
    speed = " / ".join(f"{stats[k]['speedup_train']:.2f}x" for k in rows)
    accuracy = [100 * stats[k]["accuracy"][0] for k in rows]
    return (f"{speed} faster than GRPO at P = {' / '.join(k.split('-')[1] for k in rows)} "
            f"(the paper: 1.81x / 3.27x / 4.89x / 8.32x), accuracy {span(accuracy)} % against "
            f"{100 * stats['grpo']['accuracy'][0]:.1f} % ({cpu(data)})")


def real_shape(data: dict) -> str:
    goals, trl = data["summary"]["goals"], data["summary"]["trl_grpo"]
    return (f"GRPO step {goals['bf16_sampling_grpo_step_speedup_vs_trl']:.2f}x faster than TRL "
            f"1.16's GRPOTrainer ({trl['seconds_per_step']:.1f} s), CPPO (P = 0.875) "
            f"{goals['bf16_sampling_cppo_per_question_speedup_vs_trl']:.1f}x per training question "
            f"({cpu(data)})")


def eca_operations(data: dict) -> str:
    at = {(c["scheme"], c["d"]): c["executed"] for c in data["counts"] if c["L"] == 16384}
    return (f"{at[('eca', 128)]:.3f} of the naive masked product's operations at d = 128, "
            f"L = 16,384 (ug-444: {at[('ug444', 128)]:.3f}); counted, machine-independent")


def eca_attention(data: dict) -> str:
    rows = [a for a in data["attention"] if a["d"] == 128 and a["L"] >= 2048]
    ratios = " / ".join(f"{a['times']['ECA c32']['ratio']:.2f}x" for a in rows)
    sdpa = " / ".join(f"{a['times']['SDPA (is_causal)']['ratio']:.2f}x" for a in rows)
    lengths = " / ".join(f"{a['L']:,}" for a in rows)
    return (f"{ratios} the time of eager full-then-mask at L = {lengths} (fused SDPA: {sdpa}; "
            f"{cpu(data)})")


def fsdp_memory(data: dict) -> str:
    def mib(run: str) -> float:
        rank0 = data["runs"][run][0][0]
        return sum(rank0["bytes"].values()) / 2 ** 20
    params = data["runs"]["2 x fsdp"][0][0]["parameters"]
    return (f"parameters + gradients + AdamW per process, {params / 1e6:.0f}M Llama on 2 processes: "
            f"ddp {mib('2 x ddp'):.0f} MiB, fsdp {mib('2 x fsdp'):.0f} MiB "
            f"(= 16 bytes x parameters / 2)")


def process_ends(data: dict) -> str:
    restarts = json.loads((ROOT / RESULTS / "restarts" / "results.json").read_text())
    two_nodes = [r for r in data["rows"] if "two nodes" in r["variant"]]
    launches = sum(r["launches"] for r in two_nodes)
    clean = sum(r["exit codes"].get("0", 0) for r in two_nodes)
    ours = [r for r in restarts["rows"] if "cppo's start_group" in r["rendezvous"]]
    resumed = sum(r["ends"].get("resumed, bit-identical", 0) for r in ours)
    return (f"two-node torchrun (c10d, fsdp and ddp): {clean} of {launches} launches exit 0; a "
            f"worker SIGKILLed mid-run under --max-restarts: {resumed} of "
            f"{sum(r['launches'] for r in ours)} restarts resume bit-identical "
            f"({cpu(data)})")


def objectives(data: dict) -> str:
    gains: dict[tuple[str, float], list[float]] = {}
    for run in data["runs"]:
        key = (run["objective"], run["pruning_rate"])
        gains.setdefault(key, []).append(100 * (run["accuracy_after"] - run["accuracy_before"]))
    names = sorted({k[0] for k in gains})
    above = [n for n in names if min(gains[(n, 0.75)]) > max(gains[(n, 0.0)])]
    return (f"{len(above)} of {len(names)} ({', '.join(above)}): every seed with P = 0.75 gains "
            f"more than every seed without pruning ({span([g for n in names for g in gains[(n, 0.75)]])} "
            f"points against {span([g for n in names for g in gains[(n, 0.0)]])}; "
            f"{cpu(data)})")


def cpu_paths(data: dict) -> str:
    paths = data["paths"]
    headroom = min(w["bound"] / max(w["difference"], 1e-300)
                   for p in paths.values() for w in p["worst"].values())
    passed = [p["run"]["summary"].split(" passed")[0] for p in paths.values()]
    return (f"the numeric comparisons (TRL twin, lean forward, padding-free, one vs two processes, "
            f"vLLM log-probs) on {len(paths)} CPU code paths ({', '.join(paths)}): "
            f"{' / '.join(passed)} passed, every difference at least {headroom:.0f}x under its "
            f"bound ({cpu(data)})")


def chunked_head(data: dict) -> str:
    peak = {r["variant"]: r["peak_growth_mb"] for r in data["runs"]}
    return (f"log-probs and entropies over a {data['vocab']:,}-token head, {data['tokens']:,} tokens: "
            f"peak {peak['chunked']:,.0f} MiB in chunks of {data['head_chunk']} tokens against "
            f"{peak['full']:,.0f} MiB with the full logits ({cpu(data)})")


def update_precision(data: dict) -> str:
    ratios = [r["ratio"] for r in data["rows"] if r["auto_picks"] == "bfloat16"]
    return (f"the update with bfloat16 Linear matmuls where `matmul_dtype: auto` picks them: "
            f"{span(ratios, 2, 'x')} the float32 time ({cpu(data)})")


def shared_prefixes(data: dict) -> str:
    rows = {r["model"]: r for r in data["rows"]}
    return (f"decoding identical completions once: {100 * rows['embedded']['rows_saved']:.0f} % of "
            f"the embedded round's decode rows saved ({rows['embedded']['ratio']:.2f}x the time), "
            f"{100 * rows['trained']['rows_saved']:.0f} % after training "
            f"({rows['trained']['ratio']:.2f}x) ({cpu(data)})")


def sampling_step(data: dict) -> str:
    rows = [r for r in data["results"] if r["logits dtype"] == "bfloat16" and r["vocabulary"] > 1000]
    return (f"drawing a token and its log-prob for {data['rows']} completions: "
            + " / ".join(f"{r['speed-up']:.2f}x" for r in rows) + " faster at a "
            + " / ".join(f"{r['vocabulary']:,}" for r in rows)
            + f"-token vocabulary than softmax + cumsum + log-softmax ({cpu(data)})")


def async_rollout(data: dict) -> str:
    speed = {(r["model"], r["algorithm"], r["mode"]): r for r in data["speed"]}
    parts = []
    for model in dict.fromkeys(r["model"] for r in data["speed"]):
        best = max((r for key, r in speed.items() if key[0] == model and key[1] == "CPPO"
                    and key[2] != "sync"), key=lambda r: r["speedup"])
        runs = best.get("repeats", 1)
        spread = (f" (range {best['speedup_range'][0]:.2f}-{best['speedup_range'][1]:.2f}x over "
                  f"{runs} runs)" if runs > 1 else "")
        parts.append(f"{model}: {best['speedup']:.2f}x the synchronous step{spread} at "
                     f"{best['mode'].removeprefix('async ')} ({100 * best['of_bound']:.0f} % of the "
                     f"overlap bound {best['bound']:.2f}x)")
    return f"CPPO, trainer and generator on a core each: {'; '.join(parts)} ({cpu(data)})"


def sampling_replay(data: dict) -> str:
    def of(name: str, key) -> list[float]:
        return [key(r) for r in data["rows"] if r["setting"] == name]

    def gain(r: dict) -> float:
        return 100 * (r["accuracy_after"] - r["accuracy_before"])

    def seconds(r: dict) -> float:
        return r["train_seconds"]
    replay, full = "replay", "full softmax (TRL)"
    weight = {n: statistics.mean(of(n, lambda r: r["ratio_mean"])) for n in (replay, full)}
    return (f"top_p {data['top_p']} on the embedded default: the sampler's importance weights "
            f"average {weight[replay]:.4f} with the training passes replaying it, "
            f"{weight[full]:.4f} with the full softmax (TRL's); held-out gain "
            f"{span(of(replay, gain), 1)} against {span(of(full, gain), 1)} points, train time "
            f"{span(of(replay, seconds), 0, ' s')} against {span(of(full, seconds), 0, ' s')} "
            f"({len(of(replay, gain))} seeds; {cpu(data)})")


HEADLINES = [
    Headline("`cppo train`, the embedded default (CPPO G = 8, P = 0.75, 600 steps)",
             f"{RESULTS}/default_run/shared_prefixes/results.json",
             "python benchmarks/default_run.py --rows default", default_run),
    Headline("The CPPO paper's table (N = 1,024, G = 16, embedded task)",
             f"{RESULTS}/cppo_table/results.json", "python benchmarks/cppo_table.py", paper_table),
    Headline("Real shape (0.12B Qwen2, 32k vocabulary, G = 16, ~128-token completions)",
             f"{RESULTS}/real_shape/results.json",
             "python benchmarks/real_shape.py --systems cppo_grpo trl_grpo cppo_cppo "
             "cppo_grpo_bf16_sampling cppo_cppo_bf16_sampling", real_shape),
    Headline("TRL's objectives with and without pruning (mu = 2)",
             f"{RESULTS}/objectives/num_iterations_2/results.json",
             "python benchmarks/objectives.py --seeds 42,1,2", objectives),
    Headline("ECA: operations of exact causal attention", f"{RESULTS}/eca/results.json",
             "python benchmarks/eca.py", eca_operations),
    Headline("ECA: attention forward + backward, d = 128", f"{RESULTS}/eca/results.json",
             "python benchmarks/eca.py", eca_attention),
    Headline("Sharding with FSDP2", f"{RESULTS}/distributed/results.json",
             "python benchmarks/distributed.py", fsdp_memory),
    Headline("Processes that end and restart cleanly", f"{RESULTS}/exit_codes/results.json",
             "python benchmarks/exit_codes.py; python benchmarks/restarts.py", process_ends),
    Headline("Numeric checks on every CPU code path", f"{RESULTS}/cpu_paths/results.json",
             "python benchmarks/cpu_paths.py", cpu_paths, readme=False),
    Headline("The LM head in chunks", f"{RESULTS}/chunked_head/results.json",
             "python benchmarks/chunked_head.py", chunked_head, readme=False),
    Headline("Training matmuls in bfloat16", f"{RESULTS}/update_precision/results.json",
             "python benchmarks/update_precision.py", update_precision, readme=False),
    Headline("Shared prefixes", f"{RESULTS}/shared_prefixes/results.json",
             "python benchmarks/shared_prefixes.py --trained RUN/checkpoint-600", shared_prefixes,
             readme=False),
    Headline("A decode step's draw", f"{RESULTS}/sampling_step/results.json",
             "python benchmarks/sampling_step.py", sampling_step, readme=False),
    Headline("Truncated sampling, replayed (replay_sampling)",
             f"{RESULTS}/sampling_replay/results.json", "python benchmarks/sampling_replay.py",
             sampling_replay, readme=False),
    Headline("Asynchronous rollouts (async_rollout) on split cores",
             f"{RESULTS}/async_rollout/results.json",
             "python benchmarks/async_rollout.py --models embedded real --real quick --repeats 3; "
             "python benchmarks/async_rollout.py --models real --real full --staleness 2",
             async_rollout, readme=False),
]


def rows(readme: bool) -> list[Headline]:
    return [h for h in HEADLINES if h.readme or not readme]


def readme_table() -> str:
    lines = ["| what | result | results |", "|---|---|---|"]
    lines += [f"| {h.what} | {h.figure(h.data())} | [{Path(h.page()).parent.name}]({h.page()}) |"
              for h in rows(readme=True)]
    return "\n".join(lines)


def docs_table() -> str:
    """docs/benchmarks.md's table: links relative to docs/."""
    lines = ["| what | result | command | results |", "|---|---|---|---|"]
    lines += [f"| {h.what} | {h.figure(h.data())} | `{h.command}` | [{h.page()}](../{h.page()}) |"
              for h in rows(readme=False)]
    return "\n".join(lines)
