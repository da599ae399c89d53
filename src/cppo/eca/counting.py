"""Exact operation counts: measured (every torch op a block of code runs) and analytic (a recursion
over the same plans, without tensors).

Conventions, the same on both sides:
- A product (a x b) @ (b x c) costs a*b*c multiplications and a*(b-1)*c additions, plus a*c
  additions when it accumulates into its output (beta = 1) and a*c more when it is scaled by a
  coefficient other than +-1 (2x = x + x).
- An element-wise add costs one addition per element (two when scaled by alpha not +-1); a scaling
  by +-1 is free; copies, zeroing, views, padding and tril/triu are free.
- Zero padding (sizes not divisible by 4^levels) is counted as executed.
- "Naive masked" is the ideal triangular product: tril(A B^T) with A, B (n x m) costs m*n(n+1)/2
  multiplications and (m-1)*n(n+1)/2 additions.

record_ops() counts by watching the torch operators themselves (a TorchDispatchMode), so it measures
what the executor really runs; an operator it does not know raises instead of being skipped.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .plan import DEFAULT_BASE_BLOCK, Options, Plan, Program, fused_products, make_plan, padded_sizes, recurses
from .scheme import load_scheme


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
# Measured: a dispatch mode that sees every aten operator


_FREE = {
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "zero_", "fill_", "copy_", "_to_copy", "clone", "contiguous", "detach", "alias", "lift_fresh",
    "view", "_unsafe_view", "reshape", "slice", "select", "as_strided", "t", "transpose", "permute", "expand",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "cat", "stack", "constant_pad_nd", "pad",
    "tril", "tril_", "triu", "triu_", "set_", "resize_", "_reshape_alias", "promote_types", "result_type",
    "broadcast_tensors", "sym_size", "sym_stride", "sym_numel", "dim", "is_same_size",
}
_PRODUCTS = {"bmm", "mm", "baddbmm", "baddbmm_", "addmm", "addmm_"}
_ADDS = {"add", "add_", "sub", "sub_"}
_MULS = {"mul", "mul_"}


def _product(op_args, kwargs, accumulate: bool) -> OpCount:
    x, y = (op_args[1], op_args[2]) if accumulate else (op_args[0], op_args[1])
    a, b, c = x.shape[-2], x.shape[-1], y.shape[-1]
    batch = math.prod(x.shape[:-2])
    count = OpCount(batch * a * b * c, batch * a * (b - 1) * c)
    if accumulate:
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        extra = (beta != 0) + (beta not in (0, 1)) + (abs(alpha) != 1)
        count.additions += extra * batch * a * c
    return count


class _Counter(TorchDispatchMode):
    def __init__(self, count: OpCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, op_args=(), kwargs=None):
        kwargs = kwargs or {}   # torch passes the op's arguments positionally
        name = func.overloadpacket.__name__
        result = func(*op_args, **kwargs)
        if name in _PRODUCTS:
            self.count += _product(op_args, kwargs, accumulate=name.startswith(("baddbmm", "addmm")))
        elif name in _ADDS:
            alpha = kwargs.get("alpha", 1)
            self.count.additions += result.numel() * (1 + (abs(alpha) != 1))
        elif name in _MULS:
            if isinstance(op_args[1], torch.Tensor) and op_args[1].dim() > 0:
                self.count.multiplications += result.numel()
            elif abs(float(op_args[1])) != 1:
                self.count.additions += result.numel()  # a scaling by an integer: counted as adds
        elif name not in _FREE:
            raise RuntimeError(f"record_ops cannot count the operator {func} (not in its tables)")
        return result


@contextlib.contextmanager
def record_ops():
    """Count the multiplications and additions of every torch operator run inside the block.

    >>> with record_ops() as ops: masked_matmul(a, b)     # tip: meta tensors count any size for free
    >>> ops.multiplications, ops.additions
    """
    count = OpCount()
    mode = _Counter(count)
    with mode:
        yield count
    count.multiplications, count.additions = mode.count.multiplications, mode.count.additions


# ----------------------------------------------------------------------------------------------
# Analytic: the executor's recursion written down without tensors


def _triangle(n: int) -> int:
    return n * (n + 1) // 2


def naive_masked(n: int, m: int) -> OpCount:
    """The ideal masked product tril(A B^T), A, B (n x m): only the lower triangle, dot by dot."""
    return OpCount(m * _triangle(n), (m - 1) * _triangle(n))


def naive_triangular(n: int, d: int) -> OpCount:
    """The ideal tril(L) X, X (n x d)."""
    return OpCount(d * _triangle(n), d * (n * (n - 1) // 2))


def gemm_count(a: int, b: int, c: int, beta: int = 0, alpha: int = 1) -> OpCount:
    """out = beta * out + alpha * (a x b) @ (b x c), as record_ops counts a baddbmm."""
    extra = (beta != 0) + (beta not in (0, 1)) + (abs(alpha) != 1)
    return OpCount(a * b * c, a * (b - 1) * c + extra * a * c)


def general_count(a: int, b: int, c: int, general: str = "gemm", general_cutoff: int = 256) -> OpCount:
    """(a x b) @ (b x c) by GEMM, or Strassen / Winograd levels while dims are even and > cutoff."""
    if general == "gemm" or min(a, b, c) <= general_cutoff or a % 2 or b % 2 or c % 2:
        return gemm_count(a, b, c)
    h = (a // 2) * (b // 2), (b // 2) * (c // 2), (a // 2) * (c // 2)
    adds = (5 * h[0] + 5 * h[1] + 8 * h[2]) if general == "strassen" else (4 * h[0] + 4 * h[1] + 7 * h[2])
    return 7 * general_count(a // 2, b // 2, c // 2, general, general_cutoff) + OpCount(0, adds)


def analytic_count(scheme, form: str, n: int, inner: int, cutoff: int = 1, general: str = "gemm",
                   general_cutoff: int = 256, base_block: int | None = None, cse: bool = True) -> OpCount:
    """Exact operations of one masked (n x inner operands) or lower/upper (n x n by n x inner)
    product as the executor runs it (cse=True); cse=False: the same without shared additions."""
    options = Options(cutoff=cutoff, general=general, general_cutoff=general_cutoff,
                      base_block=DEFAULT_BASE_BLOCK if base_block is None else base_block)
    plan = make_plan(load_scheme(scheme), form, share=cse)
    rows, cols = padded_sizes(n, inner, cutoff)
    count = _level(plan, rows, cols, 0, options)  # cached: hand back a copy
    return OpCount(count.multiplications, count.additions)


def _masked_base(n: int, m: int, beta: int, block: int) -> OpCount:
    if n <= block:
        return gemm_count(n, m, n, beta)
    h = n // 2
    return gemm_count(n - h, m, h, beta) + _masked_base(h, m, beta, block) + _masked_base(n - h, m, beta, block)


def _triangular_base(n: int, d: int, beta: int, block: int) -> OpCount:
    if n <= block:
        return gemm_count(n, n, d, beta)
    h = n // 2
    return _triangular_base(h, d, beta, block) + _triangular_base(n - h, d, beta, block) + gemm_count(n - h, h, d, 1)


def _sum_cost(terms, beta: int, elements: int) -> int:
    """Additions of dest = beta * dest + sum c x over `terms` (executor._sum_into)."""
    if not terms:
        return 0
    return (len(terms) - 1 + beta + sum(abs(c) != 1 for _, c in terms)) * elements


def _operand_cost(program: Program, elements: int) -> int:
    cost = sum(_sum_cost(terms, 0, elements) for terms in program.intermediates)
    for terms in program.rows:
        if not (len(terms) == 1 and abs(terms[0][1]) == 1):  # one block: a view, free
            cost += _sum_cost(terms, 0, elements)
    return cost


@functools.lru_cache(maxsize=None)
def _level(plan: Plan, n: int, m: int, beta: int, options) -> OpCount:
    masked = plan.form == "masked"
    if not recurses(n, m, options.cutoff):
        block = options.base_block
        return _masked_base(n, m, beta, block) if masked else _triangular_base(n, m, beta, block)
    n4, m4 = n // 4, m // 4
    g = plan.num_general
    left_elements, right_elements = (n4 * m4, n4 * m4) if masked else (n4 * n4, n4 * m4)
    out_elements = n4 * n4 if masked else n4 * m4
    total = OpCount(0, _operand_cost(plan.left, left_elements) + _operand_cost(plan.right, right_elements))

    def product(k: int, beta: int, coefficient: int) -> OpCount:
        if k >= g:
            return _level(plan, n4, m4, beta, options)
        a, b, c = (n4, m4, n4) if masked else (n4, n4, m4)
        if options.general == "gemm":
            return gemm_count(a, b, c, beta, coefficient)
        return general_count(a, b, c, options.general, options.general_cutoff) + OpCount(
            0, _sum_cost([(0, coefficient)], beta, a * c))

    out, num_products = plan.out, plan.num_products
    direct = fused_products(out, g)
    total += sum((product(k, 0, 1) for k in range(num_products) if not direct[k]), OpCount())

    def node(terms, beta: int) -> OpCount:
        cost, b = OpCount(), beta
        for k, c in terms:
            if k < num_products and direct[k]:
                cost += product(k, b, c)
                b = 1
        rest = [(k, c) for k, c in terms if not (k < num_products and direct[k])]
        return cost + OpCount(0, _sum_cost(rest, b, out_elements))

    for terms in out.intermediates:
        total += node(terms, 0)
    for terms in out.rows:
        total += node(terms, beta)
    return total
