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

from . import counting, reference
from .scheme import BLOCKS, LOWER_BLOCKS, Block, Scheme, load_scheme
from .workspace import arena

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
# Block plumbing and additions


def grid(x: torch.Tensor) -> dict[Block, torch.Tensor]:
    """(B, R, C) -> {(i, j): (B, R/4, C/4) view}: the 4x4 grid of blocks, without copying."""
    batch, rows, cols = x.shape
    r, c = rows // BLOCKS, cols // BLOCKS
    return {(i, j): x[:, i * r : (i + 1) * r, j * c : (j + 1) * c] for i in range(BLOCKS) for j in range(BLOCKS)}


@functools.lru_cache(maxsize=None)
def _terms(matrix_key: tuple[tuple[int, ...], ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per row: (source, coefficient) pairs, a +1 term first where there is one (saves a negation)."""
    rows = []
    for row in matrix_key:
        terms = [(k, c) for k, c in enumerate(row) if c != 0]
        terms.sort(key=lambda kc: kc[1] != 1)
        rows.append(tuple(terms))
    return tuple(rows)


def combine(coefficients: torch.Tensor, sources, destinations, triangular: tuple[bool, ...] = (), count_as=None) -> None:
    """destinations[p] = sum_k coefficients[p, k] sources[k], written in place, one pass per term.

    Sources and destinations are lists of same-shape tensors (any strides). Chained in-place adds
    on warm memory beat one (P, K) x (K, N) matmul here: K is tiny and MKL streams it poorly.
    triangular[k]: source k is structurally triangular (only the operation count uses it).
    """
    shape = destinations[0].shape
    if count_as is None:
        counting.record_combination(coefficients, shape, triangular)
    else:
        counting.record_output_additions(coefficients, shape, count_as)
    for destination, terms in zip(destinations, _terms(tuple(map(tuple, coefficients.tolist())))):
        if not terms:
            destination.zero_()
            continue
        (k0, c0), rest = terms[0], terms[1:]
        if rest and c0 == 1:
            (k1, c1), rest = rest[0], rest[1:]
            torch.add(sources[k0], sources[k1], alpha=c1, out=destination)
        elif c0 == 1:
            destination.copy_(sources[k0])
        else:
            torch.mul(sources[k0], c0, out=destination)
        for k, c in rest:
            destination.add_(sources[k], alpha=c)


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


def general_matmul(x: torch.Tensor, y: torch.Tensor, options: Options, out: torch.Tensor | None = None) -> torch.Tensor:
    """(G, a, b) @ (G, b, c) -> (G, a, c) with plain batched GEMM or Strassen/Winograd levels."""
    a, b, c = x.shape[-2], x.shape[-1], y.shape[-1]
    if options.general == "gemm" or min(a, b, c) <= options.general_cutoff or a % 2 or b % 2 or c % 2:
        counting.record_gemm(x.shape, y.shape)
        return torch.matmul(x, y, out=out) if out is not None else torch.matmul(x, y)
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
    result = torch.cat((torch.cat((c00, c01), dim=-1), torch.cat((c10, c11), dim=-1)), dim=-2)
    return out.copy_(result) if out is not None else result


def _quarters(x: torch.Tensor):
    r, c = x.shape[-2] // 2, x.shape[-1] // 2
    return x[..., :r, :c], x[..., :r, c:], x[..., r:, :c], x[..., r:, c:]


# ----------------------------------------------------------------------------------------------
# The three forms on (B, ., .) tensors in the compute dtype; each writes its result into `out`


def _masked(a: torch.Tensor, b: torch.Tensor, plan: Plan, options: Options, out: torch.Tensor) -> torch.Tensor:
    """out = tril(a b^T): a, b (B, n, m), out (B, n, n) contiguous."""
    batch, n, m = a.shape
    if not _recurses(n, m, options):  # base: the classical blocked triangular product
        counting.record_masked_base(batch, n, m)
        reference.masked_into(a, b, out)
        return out
    space = arena()
    with space.scope():
        if n % BLOCKS or m % BLOCKS:  # pad with zeros (exact), solve, copy the wanted part out
            padded = space.take((batch, n + (-n % BLOCKS), n + (-n % BLOCKS)), out)
            _masked(_pad_to_blocks(a), _pad_to_blocks(b), plan, options, padded)
            return out.copy_(padded[:, :n, :n])
        n4, m4 = n // BLOCKS, m // BLOCKS
        g, r, p = plan.num_general, plan.num_products - plan.num_general, plan.num_products
        left, right = space.take((p, batch, n4, m4), a), space.take((p, batch, n4, m4), a)
        a_grid, b_grid = grid(a), grid(b)
        combine(plan.left, [a_grid[k] for k in plan.left_blocks], left)
        combine(plan.right, [b_grid[k] for k in plan.right_blocks], right)
        products = space.take((p, batch, n4, n4), a)
        general_matmul(left[:g].view(g * batch, n4, m4), right[:g].view(g * batch, n4, m4).mT, options,
                       out=products[:g].view(g * batch, n4, n4))
        _masked(left[g:].view(r * batch, n4, m4), right[g:].view(r * batch, n4, m4), plan, options,
                products[g:].view(r * batch, n4, n4))
        out_grid = grid(out)
        diagonal = tuple(i == j for i, j in plan.out_blocks)
        combine(plan.out, products, [out_grid[k] for k in plan.out_blocks], count_as=diagonal)
        for (i, j), block in out_grid.items():
            if i == j:  # the upper parts of diagonal output blocks are not part of the result
                block.tril_()
            elif j > i:
                block.zero_()
    return out


def _triangular(t: torch.Tensor, x: torch.Tensor, plan: Plan, options: Options, out: torch.Tensor) -> torch.Tensor:
    """out = tril(t) x (plan.form "lower") or triu(t) x ("upper"): t (B, n, n), x (B, n, d), out (B, n, d)."""
    batch, n, d = x.shape
    lower = plan.form == "lower"
    tri = torch.tril if lower else torch.triu
    space = arena()
    with space.scope():
        if not _recurses(n, d, options):  # base: the classical blocked triangular product
            counting.record_triangular_base(batch, n, d)
            (reference.lower_into if lower else reference.upper_into)(t, x, out)
            return out
        if n % BLOCKS or d % BLOCKS:
            padded = space.take((batch, n + (-n % BLOCKS), d + (-d % BLOCKS)), out)
            _triangular(_pad_to_blocks(t), _pad_to_blocks(x), plan, options, padded)
            return out.copy_(padded[:, :n, :d])
        n4, d4 = n // BLOCKS, d // BLOCKS
        g, r, p = plan.num_general, plan.num_products - plan.num_general, plan.num_products
        t_grid = grid(t)
        diagonal = {}
        for i in range(BLOCKS):  # only the triangle of a diagonal block belongs to the operand
            diagonal[(i, i)] = tri(t_grid[(i, i)], out=space.take((batch, n4, n4), t))
        sources = [diagonal.get(k, t_grid[k]) for k in plan.left_blocks]
        left = space.take((g, batch, n4, n4), t)
        combine(plan.left, sources, left, triangular=tuple(i == j for i, j in plan.left_blocks))
        right = space.take((p, batch, n4, d4), x)
        x_grid = grid(x)
        combine(plan.right, [x_grid[k] for k in plan.right_blocks], right)
        products = space.take((p, batch, n4, d4), x)
        general_matmul(left.view(g * batch, n4, n4), right[:g].view(g * batch, n4, d4), options,
                       out=products[:g].view(g * batch, n4, d4))
        rec_left = space.take((r, batch, n4, n4), t)
        for q, k in enumerate(plan.rec_blocks):
            rec_left[q].copy_(sources[k])
        _triangular(rec_left.view(r * batch, n4, n4), right[g:].view(r * batch, n4, d4), plan, options,
                    products[g:].view(r * batch, n4, d4))
        out_grid = grid(out)
        combine(plan.out, products, [out_grid[k] for k in plan.out_blocks], count_as=(False,) * len(plan.out_blocks))
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
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} requires grad, but the ECA executor is not differentiable: call it under torch.no_grad() "
            "or use cppo.eca.eca_attention, whose backward runs the schemes too"
        )


def _resolve(scheme, cutoff, general, general_cutoff) -> tuple[Scheme, Options]:
    return load_scheme(scheme), Options(cutoff=cutoff, general=general, general_cutoff=general_cutoff)


def masked_matmul(a, b, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm",
                  general_cutoff: int = 256) -> torch.Tensor:
    """tril(a @ b^T) with a 4x4 scheme: a (..., n, m), b (..., n, m) -> (..., n, n).

    Leading dims broadcast. Only the lower triangle (diagonal included) is computed; the rest is 0.
    scheme: "eca", "ug444", "naive", a file path or a Scheme. Recurses while min(n, m) > cutoff.
    general: "gemm", "strassen" or "winograd" for the general products (fast ones recurse while
    all their dims are even and > general_cutoff). Not differentiable: see eca_attention.
    """
    _check_matrix("a", a)
    _check_matrix("b", b)
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"a and b must have the same (n, m) shape, got {tuple(a.shape[-2:])} and {tuple(b.shape[-2:])}")
    scheme, options = _resolve(scheme, cutoff, general, general_cutoff)
    result_dtype, dtype = _compute_dtype(a, b)
    batch_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n = a.shape[-2]
    a, b = _as_batched(a, batch_shape, dtype), _as_batched(b, batch_shape, dtype)
    out = a.new_empty(a.shape[0], n, n)
    with torch.no_grad(), arena().scope():
        _masked(a, b, make_plan(scheme, "masked"), options, out)
    return out.view(*batch_shape, n, n).to(result_dtype)


def lower_matmul(lower, x, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm",
                 general_cutoff: int = 256) -> torch.Tensor:
    """tril(lower) @ x: lower (..., n, n), x (..., n, d) -> (..., n, d); entries above the diagonal are ignored.

    Options as for masked_matmul; recurses while min(n, d) > cutoff.
    """
    return _triangular_matmul("lower", lower, x, scheme, cutoff, general, general_cutoff)


def upper_matmul(upper, x, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm",
                 general_cutoff: int = 256) -> torch.Tensor:
    """triu(upper) @ x: upper (..., n, n), x (..., n, d) -> (..., n, d); entries below the diagonal are ignored.

    Runs the lower scheme on reversed block indices (U X = J (J U J)(J X)); no data is flipped.
    """
    return _triangular_matmul("upper", upper, x, scheme, cutoff, general, general_cutoff)


def _triangular_matmul(form, t, x, scheme, cutoff, general, general_cutoff):
    _check_matrix(form, t)
    _check_matrix("x", x)
    n = t.shape[-1]
    if t.shape[-2] != n or x.shape[-2] != n:
        raise ValueError(f"{form} must be square (..., n, n) and x (..., n, d), got {tuple(t.shape)} and {tuple(x.shape)}")
    scheme, options = _resolve(scheme, cutoff, general, general_cutoff)
    result_dtype, dtype = _compute_dtype(t, x)
    batch_shape = torch.broadcast_shapes(t.shape[:-2], x.shape[:-2])
    t, x = _as_batched(t, batch_shape, dtype), _as_batched(x, batch_shape, dtype)
    out = x.new_empty(x.shape)
    with torch.no_grad(), arena().scope():
        _triangular(t, x, make_plan(scheme, form), options, out)
    return out.view(*batch_shape, n, x.shape[-1]).to(result_dtype)
