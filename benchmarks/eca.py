"""ECA benchmark: executed operations, and CPU wall time of every attention product and of attention.

(a) executed multiplications + additions of the masked product relative to the naive masked product,
    measured with record_ops (a torch dispatch mode counting the operators that run, on meta tensors)
    where it is quick and from the analytic recursion (equal to the measurement; tested) elsewhere;
(b) wall time of the three product forms against the blocked triangular product, side by side:
    masked tril(A B^T) = forward S = QK^T and backward dP = dO V^T; lower tril(L) X = forward P V and
    backward dQ = dS K; upper triu(U) X = backward dV = P^T dO and dK = dS^T Q. Several scheme
    cut-offs per shape (the fastest is named), batch x heads, the crossover against blocked named;
(c) causal attention forward + backward: ECA against eager full-then-mask and SDPA, d = 64..256.
Repetitions are interleaved (every candidate once per round); ratios are taken within a round and
reported as median [min-max] over the rounds.

    python benchmarks/eca.py            # full run, about 10 minutes on a busy 2-core machine
    python benchmarks/eca.py --quick    # small sizes, under a minute

Writes benchmarks/results/eca/results.md and results.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cppo.eca import analytic_count, eca_attention, lower_matmul, masked_matmul, naive_masked, record_ops, upper_matmul
from cppo.eca.plan import recurses
from cppo.eca.reference import blocked_lower_matmul, blocked_masked_matmul, blocked_upper_matmul

from common import machine, spread, spread_text, write_results

COUNT_CUTOFF, COUNT_BASE_BLOCK = 8, 8  # counts: recurse while min(n, d) > 8; exact base below
COUNT_GOALS = {"eca": 0.91, "ug444": 0.88}
SCHEME_LABELS = {"eca": "ECA", "ug444": "ug-444", "naive": "plain 4x4 recursion"}
PRODUCTS = {  # form -> the attention products it computes
    "masked": "S = tril(QK^T) (fwd), dP = tril(dO V^T) (bwd)",
    "lower": "O = P V (fwd), dQ = dS K (bwd)",
    "upper": "dV = P^T dO (bwd), dK = dS^T Q (bwd)",
}


# ----------------------------------------------------------------------------------------------
# (a) executed operations


def count_rows(length: int, dims, measure_dims) -> list[dict]:
    naive_rows = []
    for scheme in ("eca", "ug444", "naive"):
        for dim in dims:
            naive = naive_masked(length, dim)
            run = dict(cutoff=COUNT_CUTOFF, base_block=COUNT_BASE_BLOCK)
            shared = analytic_count(scheme, "masked", length, dim, **run)
            plain = analytic_count(scheme, "masked", length, dim, cse=False, **run)
            measured = None
            if dim in measure_dims:
                meta = torch.empty(1, length, dim, device="meta")
                with record_ops() as ops:
                    masked_matmul(meta, meta, scheme, **run)
                measured = ops.total / naive.total
                assert ops == shared, f"measured {ops} != analytic {shared}"
            naive_rows.append({"scheme": scheme, "L": length, "d": dim,
                               "multiplications": shared.multiplications / naive.multiplications,
                               "executed": shared.total / naive.total, "measured": measured,
                               "without_sharing": plain.total / naive.total})
    return naive_rows


# ----------------------------------------------------------------------------------------------
# timing helpers


def interleaved(candidates: dict, reps: int, reference: str) -> dict:
    """Warm up every candidate, then `reps` rounds of all (each round starts one candidate later, so
    no candidate always runs first); per candidate: median seconds and the median/min/max of its
    per-round ratio to `reference`."""
    for run in candidates.values():
        run()
    times = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(reps):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            start = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - start)
    result = {}
    for name, t in times.items():
        ratios = spread([a / b for a, b in zip(t, times[reference])])
        result[name] = {"median_s": statistics.median(t), "ratio": ratios["median"],
                        "ratio_min": ratios["min"], "ratio_max": ratios["max"]}
    return result


def product_timings(shapes, reps) -> list[dict]:
    """shapes: (batch, L, d, ECA cut-offs, ug-444 cut-offs). Per shape and form: blocked triangular
    and the schemes at each of their cut-offs."""
    rows = []
    for batch, length, dim, cutoffs, ug_cutoffs in shapes:
        a, b = torch.randn(batch, length, dim), torch.randn(batch, length, dim)
        tri = torch.rand(batch, length, length).tril_()
        forms = {
            "masked": (lambda: blocked_masked_matmul(a, b), lambda s, c: masked_matmul(a, b, s, cutoff=c)),
            "lower": (lambda: blocked_lower_matmul(tri, a), lambda s, c: lower_matmul(tri, a, s, cutoff=c, clean=True)),
            "upper": (lambda: blocked_upper_matmul(tri.mT, a),
                      lambda s, c: upper_matmul(tri.mT, a, s, cutoff=c, clean=True)),
        }
        for form, (blocked, scheme) in forms.items():
            candidates = {"blocked triangular": blocked}
            for label, name, values in (("ECA", "eca", cutoffs), ("ug-444", "ug444", ug_cutoffs)):
                seen = set()
                for c in values:  # cut-offs giving the same number of levels run the same code: once
                    if c < min(length, dim) and levels(length, dim, c) not in seen:
                        seen.add(levels(length, dim, c))
                        candidates[f"{label} c{c}"] = lambda c=c, name=name: scheme(name, c)
            timing = interleaved(candidates, reps, "blocked triangular")
            rows.append({"form": form, "batch": batch, "L": length, "d": dim, "times": timing})
            print(f"  {form:6s} B={batch} L={length} d={dim}: " + ", ".join(
                f"{k} {v['ratio']:.3f}" for k, v in timing.items() if k != "blocked triangular"), flush=True)
        del a, b, tri
    return rows


def levels(n: int, inner: int, cutoff: int) -> int:
    count = 0
    while recurses(n, inner, cutoff):
        n, inner, count = -(-n // 4), -(-inner // 4), count + 1
    return count


def best(timing: dict, prefix: str) -> tuple[str, dict] | None:
    options = [(k, v) for k, v in timing.items() if k.startswith(prefix)]
    return min(options, key=lambda kv: kv[1]["ratio"]) if options else None


def crossover(rows, form: str, prefix: str, batch: int = 1):
    """Smallest L = d (batch 1) from which the best cut-off of `prefix` is no slower than blocked
    (median ratio <= 1) at every larger size run; None if it never is."""
    square = sorted((r for r in rows if r["form"] == form and r["L"] == r["d"] and r["batch"] == batch),
                    key=lambda r: r["L"])
    wins = [(b := best(r["times"], prefix)) is not None and b[1]["ratio"] <= 1.0 for r in square]
    for i in range(len(square)):
        if all(wins[i:]):
            return square[i]["L"]
    return None


def attention_timings(configs, cutoffs, reps) -> list[dict]:
    rows = []
    for heads, length, dim in configs:
        q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, length, dim)
        above = torch.ones(length, length, dtype=torch.bool).triu_(1)

        def step(fn):
            return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

        def eager(q, k, v):
            scores = (q @ k.mT) / dim**0.5
            return scores.masked_fill(above, float("-inf")).softmax(-1) @ v

        candidates = {"eager full + mask": step(eager),
                      "SDPA (is_causal)": step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))}
        for c in cutoffs:
            label = f"ECA c{c[0]}/{c[1]}" if isinstance(c, tuple) else f"ECA c{c}"
            candidates[label] = step(lambda q, k, v, c=c: eca_attention(q, k, v, cutoff=c))
        timing = interleaved(candidates, reps, "eager full + mask")
        rows.append({"heads": heads, "L": length, "d": dim, "times": timing})
        print(f"  attention H={heads} L={length} d={dim}: " + ", ".join(
            f"{k} {v['median_s']:.3f}s ({v['ratio']:.2f}x eager)" for k, v in timing.items()), flush=True)
        del q, k, v, grad
    return rows


# ----------------------------------------------------------------------------------------------
# report


def fmt_ratio(v: dict) -> str:
    return spread_text(v["ratio"], v["ratio_min"], v["ratio_max"], 3, 2, "[]")


def report(info, counts, products, attention, command, seconds) -> str:
    lines = ["# ECA benchmark results", "",
             f"Generated by `{command}` in {seconds:.0f} s ({seconds / 60:.1f} min). "
             f"CPU: {info['cpu']}, {info['cores']} cores, torch CPU capability {info['cpu_capability']}, "
             f"AVX512-BF16 {'present' if info['avx512_bf16'] else 'absent'}; torch {info['torch']}, "
             f"{info['threads']} torch thread(s). The machine was shared with other jobs: load average "
             f"{info['load_start']} at the start and {info['load_end']} at the end, so absolute times are "
             "noisy; ratios are taken within each interleaved round and given as median [min-max].", ""]
    lines += ["## (a) Executed operations relative to the naive masked product", "",
              f"Masked product tril(A B^T), A, B: L x d; recursion while min(n, d) > {COUNT_CUTOFF}, blocked base "
              f"with dense diagonal blocks of {COUNT_BASE_BLOCK} rows; element-wise operations as counted in "
              "src/cppo/eca/counting.py. *Executed* = the operations the executor runs, shared additions "
              "included; *measured* = counted from the torch operators of a real (meta-tensor) run; "
              "*without sharing* = the same schemes without common-subexpression elimination.", "",
              "| scheme | L | d | multiplications | executed mults + adds | measured | without sharing | goal |",
              "|---|---|---|---|---|---|---|---|"]
    for r in counts:
        goal = COUNT_GOALS.get(r["scheme"]) if r["d"] == 128 else None
        verdict = "" if goal is None else (
            f"<= {goal}: met by {goal - r['executed']:.4f}" if r["executed"] <= goal
            else f"<= {goal}: MISSED by {r['executed'] - goal:.4f}")
        measured = "" if r["measured"] is None else f"{r['measured']:.4f}"
        lines.append(f"| {SCHEME_LABELS[r['scheme']]} | {r['L']} | {r['d']} | {r['multiplications']:.4f} | "
                     f"{r['executed']:.4f} | {measured} | {r['without_sharing']:.4f} | {verdict} |")
    lines += ["", "## (b) Products: wall time relative to the blocked triangular product", "",
              "Ratio = scheme time / blocked triangular time in the same round (< 1: the scheme is faster). "
              "`c512` = scheme cut-off 512 (recurse while min(n, d) > 512). Blocked triangular = 2x2 "
              "recursion, dense below 256 rows. Triangular operands are passed with clean=True (zeros "
              "outside the triangle, as in attention).", ""]
    for form, what in PRODUCTS.items():
        sub = [r for r in products if r["form"] == form]
        if not sub:
            continue
        lines += [f"### {form}: {what}", "",
                  "| batch | L | d | blocked (s) | best ECA | ratio | best ug-444 | ratio | all cut-offs |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sub:
            t = r["times"]
            be, bu = best(t, "ECA"), best(t, "ug-444")
            others = "; ".join(f"{k}: {v['ratio']:.3f}" for k, v in t.items() if k != "blocked triangular")
            lines.append(f"| {r['batch']} | {r['L']} | {r['d']} | {t['blocked triangular']['median_s']:.4f} | "
                         f"{be[0] if be else '-'} | {fmt_ratio(be[1]) if be else '-'} | {bu[0] if bu else '-'} | "
                         f"{fmt_ratio(bu[1]) if bu else '-'} | {others} |")
        for prefix in ("ECA", "ug-444"):
            cross = crossover(products, form, prefix)
            lines.append(f"\nCrossover, {prefix} (best cut-off) no slower than blocked triangular (median) from "
                         f"L = d = {cross} on" if cross else
                         f"\nCrossover, {prefix}: none among the L = d sizes run")
        lines.append("")
    lines += ["## (c) Causal attention forward + backward (fp32, batch 1)", "",
              "Ratio = time / eager full-then-mask time in the same round. `ECA c32/1024` = masked products "
              "with cut-off 32, triangular ones with 1024 (i.e. blocked triangular, no scheme level).", ""]
    for r in attention:
        t = r["times"]
        names = list(t)
        lines += [f"### H = {r['heads']}, L = {r['L']}, d = {r['d']}", "",
                  "| implementation | median s | ratio to eager [min-max] |", "|---|---|---|"]
        lines += [f"| {n} | {t[n]['median_s']:.4f} | {fmt_ratio(t[n])} |" for n in names]
        lines.append("")
    return "\n".join(lines)


def write_profile(path: Path) -> None:
    """Operator self times of one call of each: attention fwd+bwd (H=4, L=2048, d=128, cut-off 32)
    and the upper product at L = d = 4096 (cut-off 1024) against its blocked baseline."""
    from torch.profiler import profile

    started = time.time()
    sections = []
    q, k, v = (torch.randn(1, 4, 2048, 128, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 4, 2048, 128)
    tri, x = torch.rand(1, 4096, 4096).tril_(), torch.randn(1, 4096, 4096)
    calls = {
        "attention fwd+bwd, H=4, L=2048, d=128, ECA cut-off 32":
            lambda: torch.autograd.grad(eca_attention(q, k, v, cutoff=32), (q, k, v), grad),
        "upper product triu(P^T) X, L = d = 4096, ECA cut-off 1024":
            lambda: upper_matmul(tri.mT, x, "eca", cutoff=1024, clean=True),
        "upper product, L = d = 4096, blocked triangular": lambda: blocked_upper_matmul(tri.mT, x),
    }
    for title, call in calls.items():
        call()
        with profile() as prof:
            call()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
        sections += [f"## {title}", "", "```", table, "```", ""]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    head = [f"# ECA profile", "", f"`python benchmarks/eca.py --profile`, {time.time() - started:.0f} s, torch "
            f"{torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}; machine shared with other jobs (load average {load}). "
            "One profiled call each (profiler overhead included).", ""]
    write_results(path.parent, None, head + sections, md_name=path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, two rounds (under a minute)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: stable on a shared machine)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved timed rounds (default 3, quick 2)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "eca")
    parser.add_argument("--profile", action="store_true",
                        help="only profile (torch.profiler) the calls the results discuss; writes profile.txt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        write_profile(args.out / "profile.txt")
        return
    info = machine(shared="yes: other jobs ran on the same cores during the run (see the load "
                   "averages)")
    info["load_start"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    started = time.time()

    if args.quick:
        count_length, count_dims, measure_dims = 4096, [64, 128], [128]
        shapes = [(1, 512, 512, [128, 256], [128]), (1, 1024, 1024, [256], [256]), (4, 1024, 128, [32], [32])]
        attention, attention_cutoffs, reps = [(2, 512, 64)], [16, (16, 1024)], args.reps or 2
    else:
        count_length, count_dims, measure_dims = 16384, [64, 128, 256, 1024], [64, 128]
        shapes = [(1, 1024, 1024, [64, 256], [256]), (1, 2048, 2048, [128, 512], [512]),
                  (1, 4096, 4096, [512, 1024], [1024]), (1, 8192, 512, [32, 128], [128]),
                  (8, 2048, 128, [8, 32], [32])]
        attention = [(4, 2048, 64), (4, 1024, 128), (4, 2048, 128), (2, 4096, 128), (2, 2048, 256)]
        attention_cutoffs, reps = [32, (32, 1024)], args.reps or 3

    print("(a) operation counts", flush=True)
    counts = count_rows(count_length, count_dims, measure_dims)
    print("(b) products", flush=True)
    products = product_timings(shapes, reps)
    print("(c) attention", flush=True)
    attn = attention_timings(attention, attention_cutoffs, reps)
    seconds = time.time() - started
    info["load_end"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    command = "python benchmarks/eca.py" + (" --quick" if args.quick else "")
    write_results(args.out, {"command": command, "seconds": seconds, "machine": info, "counts": counts,
                             "products": products, "attention": attn},
                  report(info, counts, products, attn, command, seconds) + "\n", indent=1)
    print(f"\nwrote {args.out / 'results.md'} and results.json")


if __name__ == "__main__":
    main()
