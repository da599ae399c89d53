"""A scheme turned into what the executor runs and the counter counts: coefficient matrices and
addition programs with shared subexpressions.

A Plan holds one form ("masked" tril(A B^T), "lower" tril(L) X, "upper" triu(U) X) of a scheme as
three coefficient matrices (left operand sums, right operand sums, output sums). Each matrix becomes
a Program: its rows written as sums over the sources and over shared intermediates, found by a
greedy pair-sharing pass (Paar 1997): a pair x_u + s x_v (s = +-1) that occurs in several rows is
formed once. Both the executor (executor.py) and the analytic count (counting.py) read Programs, so
the additions that are counted are the additions that run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .scheme import BLOCKS, LOWER_BLOCKS, Block, Scheme

ALL_BLOCKS: tuple[Block, ...] = tuple((i, j) for i in range(BLOCKS) for j in range(BLOCKS))
UPPER_BLOCKS: tuple[Block, ...] = tuple((j, i) for i, j in LOWER_BLOCKS)
FORMS = ("masked", "lower", "upper")
DEFAULT_CUTOFF = 1024  # one scheme level at the sizes benchmarks/eca.py runs: measured faster than two
DEFAULT_BASE_BLOCK = 64
GENERAL_METHODS = ("gemm", "strassen", "winograd")


@dataclass(frozen=True)
class Options:
    """Tuning knobs: recurse while min(n, inner) > cutoff; the base case is the blocked triangular
    product with dense diagonal blocks of at most base_block rows; how to run general products."""

    cutoff: int = DEFAULT_CUTOFF
    general: str = "gemm"
    general_cutoff: int = 256  # Strassen/Winograd recurse while all dims are even and > this
    base_block: int = DEFAULT_BASE_BLOCK

    def __post_init__(self):
        for name in ("cutoff", "general_cutoff", "base_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.general not in GENERAL_METHODS:
            raise ValueError(f"general must be one of {GENERAL_METHODS}, got {self.general!r}")


def recurses(n: int, inner: int, cutoff: int) -> bool:
    """Whether a product with long side n and inner side `inner` is split by a scheme level."""
    return min(n, inner) > cutoff and min(n, inner) >= BLOCKS


def padded_sizes(n: int, inner: int, cutoff: int) -> tuple[int, int]:
    """(n, inner) rounded up so that every level of the recursion divides by 4."""
    levels = 0
    while recurses(n, inner, cutoff):
        n, inner, levels = -(-n // BLOCKS), -(-inner // BLOCKS), levels + 1
    return n * BLOCKS**levels, inner * BLOCKS**levels



Terms = tuple[tuple[int, int], ...]  # ((source index, integer coefficient), ...)


@dataclass(frozen=True)
class Program:
    """Rows of a coefficient matrix as sums of sources (indices 0..num_sources-1) and intermediates.

    intermediates[j] (index num_sources + j) is a sum of two earlier terms, computed once.
    rows[r] is the r-th result. signs[r] = -1 where the row was negated to start with a positive term
    (operand programs only: the sign is folded into the product's coefficient, no pass over memory).
    """

    num_sources: int
    intermediates: tuple[Terms, ...]
    rows: tuple[Terms, ...]
    signs: tuple[int, ...]

    @property
    def additions(self) -> int:
        """Block additions: one per intermediate, terms - 1 per row (before accumulation)."""
        return len(self.intermediates) + sum(max(len(r) - 1, 0) for r in self.rows)

    @property
    def scalings(self) -> int:
        """Terms whose coefficient is not +-1 (each costs one more operation per element)."""
        return sum(abs(c) != 1 for terms in self.intermediates + self.rows for _, c in terms)

    def uses(self) -> list[int]:
        """How often each source/intermediate index is read by the intermediates and rows."""
        count = [0] * (self.num_sources + len(self.intermediates))
        for terms in self.intermediates + self.rows:
            for k, _ in terms:
                count[k] += 1
        return count


@dataclass(frozen=True)
class Plan:
    """A scheme as programs for one form.

    left: sums of the left operand's blocks (left_blocks), one row per *general* product for the
    lower/upper forms (recursive ones take the diagonal block rec_blocks[q] directly) and one per
    product for the masked form; right: sums of the right operand's blocks, one row per product;
    out: output blocks (out_blocks) as sums of products. The first num_general products are plain
    matrix products, the rest recurse.
    """

    form: str
    left: Program
    right: Program
    out: Program
    left_blocks: tuple[Block, ...]
    right_blocks: tuple[Block, ...]
    out_blocks: tuple[Block, ...]
    num_general: int
    rec_blocks: tuple[int, ...]

    @property
    def num_products(self) -> int:
        return self.out.num_sources


def _matrix(combinations, blocks) -> list[list[int]]:
    index = {b: k for k, b in enumerate(blocks)}
    matrix = [[0] * len(blocks) for _ in combinations]
    for row, combination in enumerate(combinations):
        for block, coefficient in combination:
            matrix[row][index[block]] = coefficient
    return matrix


def _transpose(matrix: list[list[int]]) -> list[list[int]]:
    return [list(column) for column in zip(*matrix)]


@functools.lru_cache(maxsize=None)
def make_plan(scheme: Scheme, form: str, share: bool = True) -> Plan:
    """Programs of `scheme` for the masked (tensor dual), lower or upper form; share: CSE on."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if form == "upper":
        scheme = scheme.reversed()
    products = scheme.products
    g = scheme.num_general
    if form == "masked":
        # Tensor dual: A-side reads the O-coefficients, B-side the V-coefficients, S gets the L ones.
        return Plan(
            form,
            left=make_program(_matrix([p.output for p in products], ALL_BLOCKS), signed=True, share=share),
            right=make_program(_matrix([p.general for p in products], ALL_BLOCKS), signed=True, share=share),
            out=make_program(_transpose(_matrix([p.lower for p in products], LOWER_BLOCKS)), share=share),
            left_blocks=ALL_BLOCKS,
            right_blocks=ALL_BLOCKS,
            out_blocks=LOWER_BLOCKS,
            num_general=g,
            rec_blocks=(),
        )
    tri_blocks = LOWER_BLOCKS if form == "lower" else UPPER_BLOCKS
    out = _matrix([p.output for p in products], ALL_BLOCKS)
    rec_blocks = []
    for k, p in enumerate(products[g:], start=g):
        (block, coefficient), = p.lower
        out[k] = [c * coefficient for c in out[k]]  # fold the single L coefficient into the outputs
        rec_blocks.append(tri_blocks.index(block))
    return Plan(
        form,
        left=make_program(_matrix([p.lower for p in products[:g]], tri_blocks), signed=True, share=share),
        right=make_program(_matrix([p.general for p in products], ALL_BLOCKS), signed=True, share=share),
        out=make_program(_transpose(out), share=share),
        left_blocks=tri_blocks,
        right_blocks=ALL_BLOCKS,
        out_blocks=ALL_BLOCKS,
        num_general=g,
        rec_blocks=tuple(rec_blocks),
    )


def make_program(matrix: list[list[int]], signed: bool = False, share: bool = True) -> Program:
    """Rows of `matrix` (results x sources) as a Program; signed: negate all-negative rows."""
    rows = [{k: c for k, c in enumerate(row) if c != 0} for row in matrix]
    signs = []
    for row in rows:
        negate = signed and row and all(c < 0 for c in row.values())
        signs.append(-1 if negate else 1)
        if negate:
            for k in row:
                row[k] = -row[k]
    num_sources = len(matrix[0]) if matrix else 0
    intermediates = _share_pairs(rows, num_sources) if share else []
    ordered = tuple(tuple(sorted(row.items(), key=lambda kc: (kc[1] != 1, kc[0]))) for row in rows)
    return Program(num_sources, tuple(intermediates), ordered, tuple(signs))


def _share_pairs(rows: list[dict[int, int]], next_index: int) -> list[Terms]:
    """Greedy CSE in place: replace the most frequent pair x_u + s x_v (|c_u| = |c_v|) while it
    occurs in at least two rows. Returns the intermediates in the order they are formed."""
    intermediates: list[Terms] = []
    while True:
        counts: dict[tuple[int, int, int], list[int]] = {}
        for index, row in enumerate(rows):
            keys = sorted(row)
            for a in range(len(keys)):
                for b in range(a + 1, len(keys)):
                    u, v = keys[a], keys[b]
                    if abs(row[v]) != abs(row[u]):
                        continue  # share only x_u +- x_v: no hidden scalings
                    counts.setdefault((u, v, row[v] // row[u]), []).append(index)
        best = max(counts.items(), key=lambda kv: (len(kv[1]), -kv[0][0], -kv[0][1]), default=None)
        if best is None or len(best[1]) < 2:
            return intermediates
        (u, v, ratio), where = best
        for index in where:
            row = rows[index]
            row[next_index] = row.pop(u)
            del row[v]
        intermediates.append(((u, 1), (v, ratio)))
        next_index += 1


def coefficient_matrix(program: Program) -> torch.Tensor:
    """The (rows x sources) integer matrix a Program computes (intermediates expanded)."""
    expanded: list[dict[int, int]] = [{k: 1} for k in range(program.num_sources)]

    def expand(terms: Terms) -> dict[int, int]:
        total: dict[int, int] = {}
        for k, c in terms:
            for source, x in expanded[k].items():
                total[source] = total.get(source, 0) + c * x
        return total

    for terms in program.intermediates:
        expanded.append(expand(terms))
    matrix = torch.zeros(len(program.rows), program.num_sources, dtype=torch.int64)
    for r, (terms, sign) in enumerate(zip(program.rows, program.signs)):
        for source, x in expand(terms).items():
            matrix[r, source] = sign * x
    return matrix


def fused_products(program: Program, num_general: int) -> list[bool]:
    """Per product: True where it is multiplied straight into the one sum that reads it."""
    uses = program.uses()
    coefficient = {k: c for terms in program.intermediates + program.rows for k, c in terms if k < program.num_sources}
    return [uses[k] == 1 and (k < num_general or abs(coefficient.get(k, 1)) == 1) for k in range(program.num_sources)]
