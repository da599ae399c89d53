"""ECA benchmark: operation counts and CPU wall time against the classical alternatives.

(a) counted multiplications and total operations relative to the naive masked product, for ECA,
    ug-444 and the plain 4x4 triangular recursion (counting only, no tensors are multiplied);
(b) CPU wall time of the masked product tril(A B^T), of P V and of causal attention forward +
    backward, side by side in one run (repetitions interleaved, medians reported).

    python benchmarks/eca.py            # full run, a few minutes
    python benchmarks/eca.py --quick    # small sizes, seconds

Writes benchmarks/results/eca/results.md and PNG plots next to it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cppo.eca import (  # noqa: E402
    DEFAULT_CUTOFF,
    analytic_count,
    eca_attention,
    lower_matmul,
    masked_matmul,
    naive_masked,
)
from cppo.eca.reference import blocked_lower_matmul, blocked_masked_matmul  # noqa: E402

SCHEMES = {"ECA": "eca", "ug-444": "ug444", "plain triangular recursion": "naive"}
COUNT_CUTOFF = 8  # recursion stops once min(n, d) <= 8: products thinner than that only add work


# ----------------------------------------------------------------------------------------------
# (a) operation counts


def count_table(lengths, dims):
    """rows: (scheme, L, d, mult ratio, total ratio, total ratio with CSE of additions)."""
    rows = []
    for label, scheme in SCHEMES.items():
        for length in lengths:
            for dim in dims:
                naive = naive_masked(length, dim)
                plain = analytic_count(scheme, "masked", length, dim, cutoff=COUNT_CUTOFF)
                shared = analytic_count(scheme, "masked", length, dim, cutoff=COUNT_CUTOFF, cse=True)
                rows.append((label, length, dim, plain.multiplications / naive.multiplications,
                             plain.total / naive.total, shared.total / naive.total))
    return rows


def plot_counts(rows, dims, path):
    fig, axes = plt.subplots(1, len(dims), figsize=(4 * len(dims), 3.6), sharey=True)
    for ax, dim in zip(axes, dims):
        for label in SCHEMES:
            pts = [(r[1], r[3], r[4], r[5]) for r in rows if r[0] == label and r[2] == dim]
            lengths = [p[0] for p in pts]
            line = ax.plot(lengths, [p[2] for p in pts], marker="o", label=f"{label}: total")[0]
            ax.plot(lengths, [p[1] for p in pts], ls=":", color=line.get_color(), label=f"{label}: mults")
            ax.plot(lengths, [p[3] for p in pts], ls="--", color=line.get_color(), label=f"{label}: total, CSE")
        ax.set_xscale("log", base=2)
        ax.set_title(f"d = {dim}")
        ax.set_xlabel("L")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("operations / naive masked")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# (b) wall time


def interleaved_medians(candidates: dict, reps: int) -> dict:
    """Run every candidate once (warm-up), then `reps` rounds of all candidates; median seconds."""
    for run in candidates.values():
        run()
    times = {name: [] for name in candidates}
    for _ in range(reps):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def product_timings(sizes, reps, cutoff):
    rows = []
    for size in sizes:
        a, b = torch.randn(1, size, size), torch.randn(1, size, size)
        probs = torch.rand(1, size, size).tril_()
        masked = interleaved_medians({
            "full + mask": lambda: torch.matmul(a, b.mT).tril_(),
            "blocked triangular": lambda: blocked_masked_matmul(a, b),
            "ECA": lambda: masked_matmul(a, b, "eca", cutoff=cutoff),
            "ug-444": lambda: masked_matmul(a, b, "ug444", cutoff=cutoff),
        }, reps)
        rows.append(("tril(A B^T)", size, masked))
        pv = interleaved_medians({
            "full + mask": lambda: torch.matmul(probs, a),
            "blocked triangular": lambda: blocked_lower_matmul(probs, a),
            "ECA": lambda: lower_matmul(probs, a, "eca", cutoff=cutoff),
            "ug-444": lambda: lower_matmul(probs, a, "ug444", cutoff=cutoff),
        }, reps)
        rows.append(("P V", size, pv))
    return rows


def attention_timings(configs, reps, cutoffs):
    rows = []
    for heads, length, dim in configs:
        q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, length, dim)

        def step(fn):
            return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

        def eager(q, k, v):
            scores = (q @ k.mT) / dim**0.5
            mask = torch.ones(length, length, dtype=torch.bool).triu_(1)
            return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v

        candidates = {"SDPA (is_causal)": step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                      "eager full + mask": step(eager)}
        for cutoff in cutoffs:
            candidates[f"ECA (cutoff {cutoff})"] = step(lambda q, k, v, c=cutoff: eca_attention(q, k, v, cutoff=c))
        rows.append((f"attention fwd+bwd, H={heads}, d={dim}", length, interleaved_medians(candidates, reps)))
    return rows


def plot_times(rows, path):
    kinds = sorted({r[0] for r in rows}, key=[r[0] for r in rows].index)
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.6))
    axes = [axes] if len(kinds) == 1 else axes
    for ax, kind in zip(axes, kinds):
        sub = [r for r in rows if r[0] == kind]
        for name in sub[0][2]:
            ax.plot([r[1] for r in sub], [r[2][name] for r in sub], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("L (= d for the products)")
        ax.set_ylabel("seconds (median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def crossover(rows, kind, name, reference="blocked triangular"):
    """Smallest size from which `name` is at least as fast as `reference` at every larger size run."""
    sub = sorted((r for r in rows if r[0] == kind), key=lambda r: r[1])
    wins = [r[2][name] <= r[2][reference] for r in sub]
    for i in range(len(sub)):
        if all(wins[i:]):
            return sub[i][1]
    return None


# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: stable on a shared machine; OpenMP barriers under "
                             "oversubscription make small element-wise ops 40x slower)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per size (median)")
    parser.add_argument("--cutoff", type=int, default=DEFAULT_CUTOFF, help="scheme recursion cut-off for the products")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "eca")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)

    count_lengths = [1024, 2048, 4096, 8192, 16384]
    count_dims = [64, 128, 256, 1024]
    if args.quick:
        sizes, attention, reps, cutoffs = [512, 1024], [(2, 512, 64)], args.reps or 2, [16]
    else:
        sizes, attention, reps, cutoffs = [512, 1024, 2048, 4096], [(4, 1024, 128), (4, 2048, 128), (1, 2048, 512)], args.reps or 5, [16, 64]

    started = time.time()
    counts = count_table(count_lengths, count_dims)
    plot_counts(counts, count_dims, args.out / "op_counts.png")
    products = product_timings(sizes, reps, args.cutoff)
    attn = attention_timings(attention, reps, cutoffs)
    plot_times(products + attn, args.out / "wall_time.png")

    lines = ["# ECA benchmark results", ""]
    lines += [f"Generated by `python benchmarks/eca.py{' --quick' if args.quick else ''}` in {time.time() - started:.0f} s. "
              f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPU cores shared with other jobs (load average at the end: "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}), torch threads = {args.threads}.", ""]
    lines += ["## (a) Operation counts relative to the naive masked product", "",
              f"Masked product tril(A B^T), A, B: L x d. Recursion while min(n, d) > {COUNT_CUTOFF}; ideal triangular "
              "base case; additions counted element-wise (see src/cppo/eca/counting.py). CSE: additions after greedy "
              "sharing of common pairs (counted; the executor does not share yet).", "",
              "| scheme | L | d | multiplications | mults + adds | mults + adds, CSE |", "|---|---|---|---|---|---|"]
    for label, length, dim, mult, total, shared in counts:
        if length == count_lengths[-1]:
            lines.append(f"| {label} | {length} | {dim} | {mult:.4f} | {total:.4f} | {shared:.4f} |")
    lines += ["", "All lengths are in `op_counts.png`.", "",
              "## (b) CPU wall time (median seconds)", "",
              f"Products: A, B, P of size L x L / L x d with L = d, batch 1, scheme cut-off {args.cutoff} "
              f"(recurse while min(n, d) > cut-off); blocked triangular = 2x2 recursion, dense below 256 rows.", ""]
    for kind in sorted({r[0] for r in products + attn}, key=[r[0] for r in products + attn].index):
        sub = [r for r in products + attn if r[0] == kind]
        names = list(sub[0][2])
        reference = "blocked triangular" if "blocked triangular" in names else "SDPA (is_causal)"
        lines += [f"### {kind}", "", "| L | " + " | ".join(names) + f" | best scheme / {reference} |",
                  "|---" * (len(names) + 2) + "|"]
        for _, size, t in sub:
            best = min(v for k, v in t.items() if k.startswith(("ECA", "ug")))
            lines.append(f"| {size} | " + " | ".join(f"{t[n]:.4f}" for n in names) + f" | {best / t[reference]:.3f} |")
        if reference == "blocked triangular":
            for name in ("ECA", "ug-444"):
                cross = crossover(products, kind, name)
                lines.append(f"\nCrossover ({name} no slower than blocked triangular from here on): "
                             f"{'L = d = ' + str(cross) if cross else 'none in the sizes run'}")
        lines.append("")
    text = "\n".join(lines)
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {args.out / 'results.md'}, op_counts.png, wall_time.png")


if __name__ == "__main__":
    main()
