"""Run a 4x4 scheme on tensors: masked product tril(A B^T), tril(L) X and triu(U) X.

Every level splits the long side n and the inner side by 4. All general products of a level run as
one batched matmul; all recursive products of a level run as one recursive call with a 4x larger
batch (so the Python work grows with the depth, not with 34^depth). Operand pre-additions and output
additions are one small matmul each against the scheme's coefficient matrix. Sizes that do not
divide by 4 are padded with zeros (exact). Half types are computed in fp32 and cast back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import counting
from .scheme import BLOCKS, LOWER_BLOCKS, Block, Scheme, load_scheme

DEFAULT_CUTOFF = 512
GENERAL_METHODS = ("gemm", "strassen", "winograd")
ALL_BLOCKS: tuple[Block, ...] = tuple((i, j) for i in range(BLOCKS) for j in range(BLOCKS))
UPPER_BLOCKS: tuple[Block, ...] = tuple((j, i) for i, j in LOWER_BLOCKS)


@dataclass(frozen=True)
class Options:
    """Tuning knobs: recurse while min(n, inner) > cutoff; how to run the general products."""

    cutoff: int = DEFAULT_CUTOFF
    general: str = "gemm"
    general_cutoff: int = 256  # Strassen/Winograd recurse while all dims are even and > this

    def __post_init__(self):
        if not isinstance(self.cutoff, int) or self.cutoff < 1:
            raise ValueError(f"cutoff must be an int >= 1, got {self.cutoff!r}")
        if self.general not in GENERAL_METHODS:
            raise ValueError(f"general must be one of {GENERAL_METHODS}, got {self.general!r}")
        if not isinstance(self.general_cutoff, int) or self.general_cutoff < 1:
            raise ValueError(f"general_cutoff must be an int >= 1, got {self.general_cutoff!r}")


@dataclass(frozen=True)
class Plan:
    """A scheme as coefficient matrices for one form ("masked", "lower" or "upper").

    left (P, len(left_blocks)), right (P, len(right_blocks)), out (len(out_blocks), P); the first
    num_general products are plain products, the rest recurse. For the lower/upper forms the
    left operands of recursive products are single diagonal blocks (rec_blocks indexes left_blocks).
    """

    form: str
    left: torch.Tensor
    right: torch.Tensor
    out: torch.Tensor
    left_blocks: tuple[Block, ...]
    right_blocks: tuple[Block, ...]
    out_blocks: tuple[Block, ...]
    num_general: int
    rec_blocks: tuple[int, ...]

    @property
    def num_products(self) -> int:
        return self.out.shape[1]


_converted: dict = {}


def _on(matrix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """An integer coefficient matrix in `like`'s dtype and device (cached; plans live forever)."""
    key = (id(matrix), like.dtype, like.device)
    if key not in _converted:
        _converted[key] = (matrix, matrix.to(dtype=like.dtype, device=like.device))
    return _converted[key][1]


def _matrix(combinations, blocks) -> torch.Tensor:
    index = {b: k for k, b in enumerate(blocks)}
    matrix = torch.zeros(len(combinations), len(blocks), dtype=torch.int64)
    for row, combination in enumerate(combinations):
        for block, coefficient in combination:
            matrix[row, index[block]] = coefficient
    return matrix


@functools.lru_cache(maxsize=None)
def make_plan(scheme: Scheme, form: str) -> Plan:
    """Coefficient matrices of `scheme` for the masked (dual), lower or upper form."""
    if form not in ("masked", "lower", "upper"):
        raise ValueError(f"form must be 'masked', 'lower' or 'upper', got {form!r}")
    if form == "upper":
        scheme = scheme.reversed()
    products = scheme.products
    g = scheme.num_general
    if form == "masked":
        # Tensor dual: A-side reads the O-coefficients, B-side the V-coefficients, S gets the L ones.
        return Plan(
            form,
            left=_matrix([p.output for p in products], ALL_BLOCKS),
            right=_matrix([p.general for p in products], ALL_BLOCKS),
            out=_matrix([p.lower for p in products], LOWER_BLOCKS).T.contiguous(),
            left_blocks=ALL_BLOCKS,
            right_blocks=ALL_BLOCKS,
            out_blocks=LOWER_BLOCKS,
            num_general=g,
            rec_blocks=(),
        )
    tri_blocks = LOWER_BLOCKS if form == "lower" else UPPER_BLOCKS
    out = _matrix([p.output for p in products], ALL_BLOCKS).T.contiguous()
    rec_blocks = []
    for k, p in enumerate(products[g:], start=g):
        (block, coefficient), = p.lower
        out[:, k] *= coefficient  # fold the single L coefficient into the output coefficients
        rec_blocks.append(tri_blocks.index(block))
    return Plan(
        form,
        left=_matrix([p.lower for p in products[:g]], tri_blocks),
        right=_matrix([p.general for p in products], ALL_BLOCKS),
        out=out,
        left_blocks=tri_blocks,
        right_blocks=ALL_BLOCKS,
        out_blocks=ALL_BLOCKS,
        num_general=g,
        rec_blocks=tuple(rec_blocks),
    )


# ----------------------------------------------------------------------------------------------
# Block plumbing: (B, R, C) <-> (K, B, R/4, C/4) stacks of blocks


def split_blocks(x: torch.Tensor, blocks: tuple[Block, ...]) -> torch.Tensor:
    """(B, R, C) -> (len(blocks), B, R/4, C/4): the listed 4x4-grid blocks, stacked (one copy)."""
    batch, rows, cols = x.shape
    grid = x.view(batch, BLOCKS, rows // BLOCKS, BLOCKS, cols // BLOCKS).permute(1, 3, 0, 2, 4)
    if len(blocks) == BLOCKS * BLOCKS:
        return grid.reshape(len(blocks), batch, rows // BLOCKS, cols // BLOCKS)
    r, c = zip(*blocks)
    return grid[list(r), list(c)]


def merge_blocks(stack: torch.Tensor, blocks: tuple[Block, ...]) -> torch.Tensor:
    """(K, B, r, c) -> (B, 4r, 4c): blocks placed on the 4x4 grid, zeros where none is listed."""
    _, batch, rows, cols = stack.shape
    if len(blocks) == BLOCKS * BLOCKS:
        grid = stack.view(BLOCKS, BLOCKS, batch, rows, cols).permute(2, 0, 3, 1, 4)
        return grid.reshape(batch, BLOCKS * rows, BLOCKS * cols)
    out = stack.new_zeros(batch, BLOCKS * rows, BLOCKS * cols)
    grid = out.view(batch, BLOCKS, rows, BLOCKS, cols).permute(1, 3, 0, 2, 4)
    r, c = zip(*blocks)
    grid[list(r), list(c)] = stack
    return out


def combine(coefficients: torch.Tensor, stack: torch.Tensor, triangular: tuple[bool, ...] = ()) -> torch.Tensor:
    """(P, K) integer coefficients x (K, *block) -> (P, *block): each row a combination of the K blocks.

    triangular[k] says block k is structurally triangular (zero on one side), for counting only.
    """
    counting.record_combination(coefficients, stack.shape[1:], triangular)
    k = stack.shape[0]
    if k != coefficients.shape[1]:
        raise ValueError(f"coefficient matrix has {coefficients.shape[1]} columns for {k} blocks")
    flat = torch.mm(_on(coefficients, stack), stack.reshape(k, -1))
    return flat.view(coefficients.shape[0], *stack.shape[1:])


def _pad_to_blocks(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape[-2:]
    pad_rows, pad_cols = -rows % BLOCKS, -cols % BLOCKS
    if pad_rows or pad_cols:
        return F.pad(x, (0, pad_cols, 0, pad_rows))
    return x


def _recurses(n: int, inner: int, options: Options) -> bool:
    return min(n, inner) > options.cutoff and min(n, inner) >= BLOCKS


# ----------------------------------------------------------------------------------------------
# General (dense) products: GEMM, or Strassen / Winograd on top of it


def general_matmul(x: torch.Tensor, y: torch.Tensor, options: Options) -> torch.Tensor:
    """(G, a, b) @ (G, b, c) -> (G, a, c) with plain batched GEMM or Strassen/Winograd levels."""
    a, b, c = x.shape[-2], x.shape[-1], y.shape[-1]
    if options.general == "gemm" or min(a, b, c) <= options.general_cutoff or a % 2 or b % 2 or c % 2:
        counting.record_gemm(x.shape, y.shape)
        return torch.matmul(x, y)
    x00, x01, x10, x11 = _quarters(x)
    y00, y01, y10, y11 = _quarters(y)
    h = (a // 2) * (b // 2), (b // 2) * (c // 2), (a // 2) * (c // 2)
    batch = x.shape[0]
    rec = functools.partial(general_matmul, options=options)
    if options.general == "strassen":  # 7 products, 18 additions
        counting.record_additions(5 * batch * h[0] + 5 * batch * h[1] + 8 * batch * h[2])
        m1 = rec(x00 + x11, y00 + y11)
        m2 = rec(x10 + x11, y00)
        m3 = rec(x00, y01 - y11)
        m4 = rec(x11, y10 - y00)
        m5 = rec(x00 + x01, y11)
        m6 = rec(x10 - x00, y00 + y01)
        m7 = rec(x01 - x11, y10 + y11)
        c00 = m1 + m4 - m5 + m7
        c01 = m3 + m5
        c10 = m2 + m4
        c11 = m1 - m2 + m3 + m6
    else:  # Winograd's variant: 7 products, 15 additions
        counting.record_additions(4 * batch * h[0] + 4 * batch * h[1] + 7 * batch * h[2])
        s1 = x10 + x11
        s2 = s1 - x00
        s3 = x00 - x10
        s4 = x01 - s2
        t1 = y01 - y00
        t2 = y11 - t1
        t3 = y11 - y01
        t4 = t2 - y10
        m1 = rec(x00, y00)
        m2 = rec(x01, y10)
        m3 = rec(s4, y11)
        m4 = rec(x11, t4)
        m5 = rec(s1, t1)
        m6 = rec(s2, t2)
        m7 = rec(s3, t3)
        u2 = m1 + m6
        u3 = u2 + m7
        u4 = u2 + m5
        c00 = m1 + m2
        c01 = u4 + m3
        c10 = u3 - m4
        c11 = u3 + m5
    top = torch.cat((c00, c01), dim=-1)
    bottom = torch.cat((c10, c11), dim=-1)
    return torch.cat((top, bottom), dim=-2)


def _quarters(x: torch.Tensor):
    r, c = x.shape[-2] // 2, x.shape[-1] // 2
    return x[..., :r, :c], x[..., :r, c:], x[..., r:, :c], x[..., r:, c:]


# ----------------------------------------------------------------------------------------------
# The three forms on (B, ., .) tensors in the compute dtype


def _masked(a: torch.Tensor, b: torch.Tensor, plan: Plan, options: Options) -> torch.Tensor:
    """tril(a b^T): (B, n, m), (B, n, m) -> (B, n, n)."""
    batch, n, m = a.shape
    if not _recurses(n, m, options):
        counting.record_masked_base(batch, n, m)
        return torch.matmul(a, b.mT).tril_()
    a, b = _pad_to_blocks(a), _pad_to_blocks(b)
    n4, m4 = a.shape[-2] // BLOCKS, a.shape[-1] // BLOCKS
    g, r = plan.num_general, plan.num_products - plan.num_general
    left = combine(plan.left, split_blocks(a, plan.left_blocks))  # (P, B, n4, m4)
    right = combine(plan.right, split_blocks(b, plan.right_blocks))
    general = general_matmul(left[:g].reshape(g * batch, n4, m4), right[:g].reshape(g * batch, n4, m4).mT, options)
    recursive = _masked(left[g:].reshape(r * batch, n4, m4), right[g:].reshape(r * batch, n4, m4), plan, options)
    out = _combine_products(plan.out, general, recursive, batch, plan.out_blocks, tri_out=True)
    return merge_blocks(out, plan.out_blocks)[:, :n, :n]


def _triangular(t: torch.Tensor, x: torch.Tensor, plan: Plan, options: Options) -> torch.Tensor:
    """tril(t) x (plan.form "lower") or triu(t) x ("upper"): (B, n, n), (B, n, d) -> (B, n, d)."""
    batch, n, d = x.shape
    lower = plan.form == "lower"
    if not _recurses(n, d, options):
        counting.record_triangular_base(batch, n, d)
        return torch.matmul(t.tril() if lower else t.triu(), x)
    t, x = _pad_to_blocks(t), _pad_to_blocks(x)
    n4, d4 = t.shape[-1] // BLOCKS, x.shape[-1] // BLOCKS
    g, r = plan.num_general, plan.num_products - plan.num_general
    t_blocks = split_blocks(t, plan.left_blocks)  # (10, B, n4, n4)
    diagonal = [k for k, (i, j) in enumerate(plan.left_blocks) if i == j]
    for k in diagonal:  # only the triangle of a diagonal block belongs to the operand
        t_blocks[k] = t_blocks[k].tril() if lower else t_blocks[k].triu()
    tri = tuple(k in diagonal for k in range(len(plan.left_blocks)))
    left = combine(plan.left, t_blocks, tri).reshape(g * batch, n4, n4)
    right = combine(plan.right, split_blocks(x, plan.right_blocks))  # (P, B, n4, d4)
    general = general_matmul(left, right[:g].reshape(g * batch, n4, d4), options)
    rec_left = t_blocks[list(plan.rec_blocks)].reshape(r * batch, n4, n4)
    recursive = _triangular(rec_left, right[g:].reshape(r * batch, n4, d4), plan, options)
    out = _combine_products(plan.out, general, recursive, batch, plan.out_blocks, tri_out=False)
    return merge_blocks(out, plan.out_blocks)[:, :n, :d]


def _combine_products(out_c, general, recursive, batch, out_blocks, tri_out):
    """Output additions: (K, P) coefficients x (general ++ recursive products) -> (K, B, r, c)."""
    g, r = general.shape[0] // batch, recursive.shape[0] // batch
    shape = general.shape[-2:]
    tri = tuple(tri_out and i == j for i, j in out_blocks)
    counting.record_output_additions(out_c, (batch, *shape), tri)
    coefficients = _on(out_c, general)
    out = torch.mm(coefficients[:, :g], general.reshape(g, -1))
    out.addmm_(coefficients[:, g:], recursive.reshape(r, -1))
    out = out.view(len(out_blocks), batch, *shape)
    if tri_out:
        for k, (i, j) in enumerate(out_blocks):
            if i == j:  # the upper parts of diagonal output blocks are not part of the result
                out[k].tril_()
    return out


# ----------------------------------------------------------------------------------------------
# Public entry points


def _compute_dtype(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    result = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    if result in (torch.float16, torch.bfloat16):
        return result, torch.float32
    if result in (torch.float32, torch.float64, torch.int64, torch.int32):
        return result, result
    raise TypeError(f"unsupported dtype {result}: expected float32, float64, bfloat16, float16 or an integer type")


def _as_batched(x: torch.Tensor, batch_shape, dtype) -> torch.Tensor:
    return x.to(dtype).expand(*batch_shape, *x.shape[-2:]).reshape(-1, *x.shape[-2:])


def _check_matrix(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"{name} must be a tensor with at least 2 dims (..., rows, cols), got {getattr(x, 'shape', x)!r}")


def _resolve(scheme, cutoff, general) -> tuple[Scheme, Options]:
    return load_scheme(scheme), Options(cutoff=cutoff, general=general)


def masked_matmul(a, b, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm") -> torch.Tensor:
    """tril(a @ b^T) with a 4x4 scheme: a (..., n, m), b (..., n, m) -> (..., n, n).

    Leading dims broadcast. Only the lower triangle (diagonal included) is computed; the rest is 0.
    """
    _check_matrix("a", a)
    _check_matrix("b", b)
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"a and b must have the same (n, m) shape, got {tuple(a.shape[-2:])} and {tuple(b.shape[-2:])}")
    scheme, options = _resolve(scheme, cutoff, general)
    result_dtype, dtype = _compute_dtype(a, b)
    batch_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n = a.shape[-2]
    out = _masked(_as_batched(a, batch_shape, dtype), _as_batched(b, batch_shape, dtype), make_plan(scheme, "masked"), options)
    return out.view(*batch_shape, n, n).to(result_dtype)


def lower_matmul(lower, x, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm") -> torch.Tensor:
    """tril(lower) @ x: lower (..., n, n), x (..., n, d) -> (..., n, d); entries above the diagonal are ignored."""
    return _triangular_matmul("lower", lower, x, scheme, cutoff, general)


def upper_matmul(upper, x, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm") -> torch.Tensor:
    """triu(upper) @ x: upper (..., n, n), x (..., n, d) -> (..., n, d); entries below the diagonal are ignored."""
    return _triangular_matmul("upper", upper, x, scheme, cutoff, general)


def _triangular_matmul(form, t, x, scheme, cutoff, general):
    _check_matrix(form, t)
    _check_matrix("x", x)
    n = t.shape[-1]
    if t.shape[-2] != n or x.shape[-2] != n:
        raise ValueError(f"{form} must be square (..., n, n) and x (..., n, d), got {tuple(t.shape)} and {tuple(x.shape)}")
    scheme, options = _resolve(scheme, cutoff, general)
    result_dtype, dtype = _compute_dtype(t, x)
    batch_shape = torch.broadcast_shapes(t.shape[:-2], x.shape[:-2])
    out = _triangular(_as_batched(t, batch_shape, dtype), _as_batched(x, batch_shape, dtype), make_plan(scheme, form), options)
    return out.view(*batch_shape, n, x.shape[-1]).to(result_dtype)
