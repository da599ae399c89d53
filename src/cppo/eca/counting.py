"""Exact operation counts: analytic (a recursion over the scheme) and measured (an instrumented run).

Conventions, the same on both sides:
- A dense product (a x b) @ (b x c) costs a*b*c multiplications and a*(b-1)*c additions.
- The base case is the ideal triangular product: tril(A B^T) with A, B (n x m) costs m*n(n+1)/2
  multiplications and (m-1)*n(n+1)/2 additions; tril(L) X with X (n x d) costs d*n(n+1)/2 and
  d*n(n-1)/2. "Naive masked" is the masked base case at full size.
- A linear combination of t blocks costs t-1 additions per element, plus one per element for each
  coefficient other than +-1 (2x = x + x). Where a block is structurally triangular (a diagonal
  block of a triangular operand, or a diagonal output block of the masked product), only its
  triangle counts: n(n+1)/2 elements instead of n^2.
- Zero padding (sizes not divisible by 4) is counted as executed.
- With common-subexpression elimination (cse=True), every coefficient matrix is first rewritten by
  a greedy pair-sharing pass (Paar's algorithm) and additions are counted after sharing.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass

import torch

_local = threading.local()


@dataclass
class OpCount:
    """Multiplications and additions (element-wise scalar operations)."""

    multiplications: int = 0
    additions: int = 0

    @property
    def total(self) -> int:
        return self.multiplications + self.additions

    def __add__(self, other: "OpCount") -> "OpCount":
        return OpCount(self.multiplications + other.multiplications, self.additions + other.additions)

    def __mul__(self, k: int) -> "OpCount":
        return OpCount(self.multiplications * k, self.additions * k)

    __rmul__ = __mul__


# ----------------------------------------------------------------------------------------------
# Measured: the executor calls these hooks; they do nothing unless a count is being recorded


@contextlib.contextmanager
def record_ops():
    """Count the operations of every executor call inside the block (tip: run on device='meta').

    >>> with record_ops() as ops: masked_matmul(a, b)
    >>> ops.multiplications, ops.additions
    """
    previous = getattr(_local, "counter", None)
    _local.counter = OpCount()
    try:
        yield _local.counter
    finally:
        _local.counter = previous


def _active() -> OpCount | None:
    return getattr(_local, "counter", None)


def _triangle(n: int) -> int:
    return n * (n + 1) // 2


def _block_elements(shape, triangular: bool) -> int:
    *batch, rows, cols = shape
    per_block = _triangle(rows) if triangular else rows * cols
    return math.prod(batch) * per_block


def _combination_additions(row: list[int], triangular: tuple[bool, ...], shape) -> int:
    """Additions to form one linear combination (nonzero coefficients `row`) of blocks of `shape`."""
    terms = [k for k, c in enumerate(row) if c != 0]
    if not terms:
        return 0
    tri = [bool(triangular) and triangular[k] for k in terms]
    full, triangles = tri.count(False), tri.count(True)
    scalings = sum(_block_elements(shape, tri[t]) for t, k in enumerate(terms) if abs(row[k]) != 1)
    if full:  # a full block plus triangles: each triangle adds only its nonzero half
        return (full - 1) * _block_elements(shape, False) + triangles * _block_elements(shape, True) + scalings
    return (triangles - 1) * _block_elements(shape, True) + scalings


def record_combination(coefficients: torch.Tensor, block_shape, triangular: tuple[bool, ...] = ()) -> None:
    """Operand pre-additions: rows of `coefficients` (P, K) combine K blocks of `block_shape`."""
    counter = _active()
    if counter is not None:
        for row in coefficients.tolist():
            counter.additions += _combination_additions(row, triangular, block_shape)


def record_output_additions(coefficients: torch.Tensor, block_shape, triangular_outputs: tuple[bool, ...]) -> None:
    """Output additions: output block k = sum_p coefficients[k, p] * product p (triangle only if flagged)."""
    counter = _active()
    if counter is not None:
        for row, tri in zip(coefficients.tolist(), triangular_outputs):
            counter.additions += _combination_additions(row, (tri,) * len(row), block_shape)


def record_gemm(x_shape, y_shape) -> None:
    counter = _active()
    if counter is not None:
        *batch, a, b = x_shape
        c = y_shape[-1]
        counter.multiplications += math.prod(batch) * a * b * c
        counter.additions += math.prod(batch) * a * (b - 1) * c


def record_additions(additions: int) -> None:
    counter = _active()
    if counter is not None:
        counter.additions += additions


def record_masked_base(batch: int, n: int, m: int) -> None:
    counter = _active()
    if counter is not None:
        counter.multiplications += batch * m * _triangle(n)
        counter.additions += batch * (m - 1) * _triangle(n)


def record_triangular_base(batch: int, n: int, d: int) -> None:
    counter = _active()
    if counter is not None:
        counter.multiplications += batch * d * _triangle(n)
        counter.additions += batch * d * (n * (n - 1) // 2)


# ----------------------------------------------------------------------------------------------
# Analytic: the same recursion written down without tensors


def naive_masked(n: int, m: int) -> OpCount:
    """The naive masked product tril(A B^T), A, B (n x m): only the lower triangle, dot by dot."""
    return OpCount(m * _triangle(n), (m - 1) * _triangle(n))


def naive_triangular(n: int, d: int) -> OpCount:
    """The naive tril(L) X, X (n x d)."""
    return OpCount(d * _triangle(n), d * (n * (n - 1) // 2))


def general_count(a: int, b: int, c: int, general: str = "gemm", general_cutoff: int = 256) -> OpCount:
    """(a x b) @ (b x c) by GEMM, or Strassen / Winograd levels while dims are even and > cutoff."""
    if general == "gemm" or min(a, b, c) <= general_cutoff or a % 2 or b % 2 or c % 2:
        return OpCount(a * b * c, a * (b - 1) * c)
    h = (a // 2) * (b // 2), (b // 2) * (c // 2), (a // 2) * (c // 2)
    adds = (5 * h[0] + 5 * h[1] + 8 * h[2]) if general == "strassen" else (4 * h[0] + 4 * h[1] + 7 * h[2])
    return 7 * general_count(a // 2, b // 2, c // 2, general, general_cutoff) + OpCount(0, adds)


def _recurses(n: int, inner: int, cutoff: int) -> bool:
    return min(n, inner) > cutoff and min(n, inner) >= 4


def analytic_count(scheme, form: str, n: int, inner: int, cutoff: int = 1, general: str = "gemm",
                   general_cutoff: int = 256, cse: bool = False) -> OpCount:
    """Exact operations of one masked (n x inner operands) or lower/upper (n x n by n x inner) product."""
    from .executor import make_plan
    from .scheme import load_scheme

    plan = make_plan(load_scheme(scheme), form)
    return _analytic(plan, n, inner, cutoff, general, general_cutoff, cse)


def _analytic(plan, n, inner, cutoff, general, general_cutoff, cse) -> OpCount:
    if not _recurses(n, inner, cutoff):
        return naive_masked(n, inner) if plan.form == "masked" else naive_triangular(n, inner)
    n4, m4 = -(-n // 4), -(-inner // 4)
    g, r = plan.num_general, plan.num_products - plan.num_general
    masked = plan.form == "masked"
    total = OpCount()
    if masked:
        total += g * general_count(n4, m4, n4, general, general_cutoff)
        left_shape = right_shape = (n4, m4)
        left_tri: tuple[bool, ...] = ()
        out_shape, out_tri = (n4, n4), tuple(i == j for i, j in plan.out_blocks)
    else:
        total += g * general_count(n4, n4, m4, general, general_cutoff)
        left_shape, right_shape = (n4, n4), (n4, m4)
        left_tri = tuple(i == j for i, j in plan.left_blocks)
        out_shape, out_tri = (n4, m4), (False,) * len(plan.out_blocks)
    total += r * _analytic(plan, n4, m4, cutoff, general, general_cutoff, cse)
    total.additions += _matrix_additions(plan.left, left_tri, left_shape, cse)
    total.additions += _matrix_additions(plan.right, (), right_shape, cse)
    total.additions += _matrix_additions(plan.out, out_tri, out_shape, cse, per_row_tri=True)
    return total


def _matrix_additions(coefficients, triangular, shape, cse, per_row_tri=False) -> int:
    """Additions for all rows of a coefficient matrix (rows = results), without or with sharing."""
    rows = [tuple(r) for r in coefficients.tolist()]
    if per_row_tri:  # output side: the triangle flag belongs to the result row
        if cse:
            return shared_additions(rows, shape, row_triangular=triangular)
        return sum(_combination_additions(list(r), (t,) * len(r), shape) for r, t in zip(rows, triangular))
    if cse:
        return shared_additions(rows, shape, column_triangular=triangular)
    return sum(_combination_additions(list(r), triangular, shape) for r in rows)


# ----------------------------------------------------------------------------------------------
# Common-subexpression elimination of additions (greedy, Paar 1997)


@functools.lru_cache(maxsize=None)
def cse_terms(rows: tuple[tuple[int, ...], ...]) -> tuple[int, int, int]:
    """Greedy sharing of signed pairs across rows of a coefficient matrix.

    Returns (additions after sharing, additions without, shared intermediates). A pair
    (u, v) with ratio c_v / c_u = s that occurs in several rows is formed once as w = x_u + s x_v
    and replaces the pair in each of those rows.
    """
    work = [{k: c for k, c in enumerate(row) if c != 0} for row in rows]
    plain = sum(max(len(r) - 1, 0) for r in work)
    next_column, shared = len(rows[0]) if rows else 0, 0
    while True:
        counts: dict[tuple[int, int, float], list[int]] = {}
        for index, row in enumerate(work):
            keys = sorted(row)
            for a in range(len(keys)):
                for b in range(a + 1, len(keys)):
                    u, v = keys[a], keys[b]
                    if abs(row[v]) != abs(row[u]):
                        continue  # share only x_u +- x_v: no hidden scalings
                    counts.setdefault((u, v, row[v] / row[u]), []).append(index)
        best = max(counts.items(), key=lambda kv: (len(kv[1]), -kv[0][0], -kv[0][1]), default=None)
        if best is None or len(best[1]) < 2:
            break
        (u, v, ratio), where = best
        for index in where:
            row = work[index]
            if u in row and v in row and row[v] / row[u] == ratio:
                row[next_column] = row.pop(u)
                del row[v]
        next_column += 1
        shared += 1
    return shared + sum(max(len(r) - 1, 0) for r in work), plain, shared


def shared_additions(rows, shape, row_triangular=(), column_triangular=()) -> int:
    """Additions after CSE. Triangular structure is kept conservative: a shared intermediate costs
    a full block unless every row it serves is a triangular result."""
    if column_triangular and any(column_triangular):
        # Operand side with triangular blocks (lower/upper forms): sharing changes which sums are
        # triangular; count without sharing there to stay exact rather than optimistic.
        return sum(_combination_additions(list(r), column_triangular, shape) for r in rows)
    scalings = sum(1 for r in rows for c in r if c != 0 and abs(c) != 1)
    if row_triangular and any(row_triangular):
        full_rows = tuple(r for r, t in zip(rows, row_triangular) if not t)
        tri_rows = tuple(r for r, t in zip(rows, row_triangular) if t)
        adds_full = cse_terms(full_rows)[0] if full_rows else 0
        adds_tri = cse_terms(tri_rows)[0] if tri_rows else 0
        return adds_full * _block_elements(shape, False) + adds_tri * _block_elements(shape, True) + scalings * _block_elements(shape, False)
    return (cse_terms(tuple(rows))[0] + scalings) * _block_elements(shape, False)
