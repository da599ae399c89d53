"""Run a 4x4 scheme on tensors: masked product tril(A B^T), tril(L) X and triu(U) X.

Every level splits the long side n and the inner side by 4 and runs the level's Plan (plan.py):
- operand sums are formed once each, shared subexpressions included; a sum of one block is a view
  (its sign goes into the product's coefficient), so no copies;
- a product that feeds one output sum is multiplied straight into it (baddbmm with beta = 1 and
  alpha = its coefficient, or a recursive call that accumulates the same way); only products that
  feed several sums are written to scratch memory and added;
- recursive products recurse on views (the diagonal blocks of the triangular operand).
Every call computes out = beta * out + alpha * result. Sizes are padded once, at the top, to a
multiple of 4^levels (zeros, exact). Half types are computed in fp32 and cast back. Scratch memory
comes from a reused arena (workspace.py).
"""

from __future__ import annotations

import functools
import torch
import torch.nn.functional as F

from .plan import DEFAULT_BASE_BLOCK, DEFAULT_CUTOFF, Options, Plan, Program, fused_products, make_plan, padded_sizes, recurses
from .scheme import BLOCKS, Block, Scheme, load_scheme
from .workspace import arena

# ----------------------------------------------------------------------------------------------
# Block plumbing, sums and products


def grid(x: torch.Tensor) -> dict[Block, torch.Tensor]:
    """(B, R, C) -> {(i, j): (B, R/4, C/4) view}: the 4x4 grid of blocks, without copying."""
    _, rows, cols = x.shape
    r, c = rows // BLOCKS, cols // BLOCKS
    return {(i, j): x[:, i * r : (i + 1) * r, j * c : (j + 1) * c] for i in range(BLOCKS) for j in range(BLOCKS)}


def _gemm(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, beta: int, alpha: int) -> None:
    """out = beta * out + alpha * (x @ y) in one BLAS call (beta = 0 ignores out's contents)."""
    out.baddbmm_(x, y, beta=beta, alpha=alpha)


def _sum_into(dest: torch.Tensor, terms, values, beta: int = 0) -> None:
    """dest = beta * dest + sum c * values[k] over terms (k, c), one pass per term."""
    terms = sorted(terms, key=lambda kc: kc[1] != 1)  # a +1 term first saves a negation
    if not terms:
        if beta == 0:
            dest.zero_()
        return
    if beta == 0:
        (k0, c0), terms = terms[0], terms[1:]
        if terms and c0 == 1:
            (k1, c1), terms = terms[0], terms[1:]
            torch.add(values[k0], values[k1], alpha=c1, out=dest)
        elif c0 == 1:
            dest.copy_(values[k0])
        else:
            torch.mul(values[k0], c0, out=dest)
    for k, c in terms:
        dest.add_(values[k], alpha=c)


def _operands(program: Program, sources: list[torch.Tensor], space) -> list[tuple[torch.Tensor, int]]:
    """The rows of an operand program as (tensor, sign): views where a row is one block.

    Blocks of a transposed view (column-major, e.g. P^T in attention) are summed as their
    transposes, row by row in memory, and handed back transposed (GEMMs take either layout).
    """
    if sources[0].stride(-2) == 1 and sources[0].stride(-1) != 1:
        return [(x.mT, sign) for x, sign in _operands(program, [s.mT for s in sources], space)]
    values = list(sources)
    for terms in program.intermediates:
        buffer = space.take(sources[0].shape, sources[0])
        _sum_into(buffer, terms, values)
        values.append(buffer)
    rows = []
    for terms, sign in zip(program.rows, program.signs):
        if len(terms) == 1 and abs(terms[0][1]) == 1:
            rows.append((values[terms[0][0]], sign * terms[0][1]))
        else:
            buffer = space.take(sources[0].shape, sources[0])
            _sum_into(buffer, terms, values)
            rows.append((buffer, sign))
    return rows


def _outputs(plan: Plan, run_product, targets, beta: int, alpha: int, shape, like, space) -> None:
    """targets[r] = beta * targets[r] + alpha * (row r of plan.out over the products).

    run_product(k, dest, beta, alpha) computes dest = beta * dest + alpha * product k.
    """
    program, num_products = plan.out, plan.num_products
    direct = fused_products(program, plan.num_general)
    stored: dict[int, torch.Tensor] = {}

    def value(k: int) -> torch.Tensor:
        if k not in stored:  # a product read by several sums (or an intermediate: stored when made)
            stored[k] = space.take(shape, like)
            run_product(k, stored[k], 0, 1)
        return stored[k]

    def node(dest, terms, beta, alpha):
        b = beta
        for k, c in terms:
            if k < num_products and direct[k]:
                run_product(k, dest, b, alpha * c)
                b = 1
        rest = [(k, alpha * c) for k, c in terms if not (k < num_products and direct[k])]
        if rest or b == 0:
            _sum_into(dest, rest, _Lazy(value), b)

    for j, terms in enumerate(program.intermediates):
        buffer = space.take(shape, like)
        node(buffer, terms, 0, 1)
        stored[num_products + j] = buffer
    for dest, terms in zip(targets, program.rows):
        node(dest, terms, beta, alpha)


class _Lazy:
    """values[k] computed on first use."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, k):
        return self.fn(k)


def general_product(x, y, out, beta, alpha, options: Options) -> None:
    """out = beta * out + alpha * (x @ y): one GEMM, or Strassen/Winograd levels and then one add."""
    if options.general == "gemm":
        _gemm(x, y, out, beta, alpha)
        return
    result = general_matmul(x, y, options)
    _sum_into(out, [(0, alpha)], [result], beta)


def general_matmul(x: torch.Tensor, y: torch.Tensor, options: Options) -> torch.Tensor:
    """(G, a, b) @ (G, b, c) -> (G, a, c) with plain batched GEMM or Strassen/Winograd levels."""
    a, b, c = x.shape[-2], x.shape[-1], y.shape[-1]
    if options.general == "gemm" or min(a, b, c) <= options.general_cutoff or a % 2 or b % 2 or c % 2:
        return torch.bmm(x, y)
    x00, x01, x10, x11 = _quarters(x)
    y00, y01, y10, y11 = _quarters(y)
    rec = functools.partial(general_matmul, options=options)
    if options.general == "strassen":  # 7 products, 18 additions
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
    return torch.cat((torch.cat((c00, c01), dim=-1), torch.cat((c10, c11), dim=-1)), dim=-2)


def _quarters(x: torch.Tensor):
    r, c = x.shape[-2] // 2, x.shape[-1] // 2
    return x[..., :r, :c], x[..., :r, c:], x[..., r:, :c], x[..., r:, c:]


# ----------------------------------------------------------------------------------------------
# Base cases: the classical blocked triangular products (2x2 recursion, dense diagonal blocks)


def masked_base(a, b, out, beta: int, alpha: int, block: int) -> None:
    """Lower triangle of out = beta * out + alpha * a b^T (a, b (B, n, m)); above it: unspecified."""
    n = a.shape[-2]
    if n <= block:
        _gemm(a, b.mT, out, beta, alpha)
        return
    h = n // 2
    _gemm(a[:, h:], b[:, :h].mT, out[:, h:, :h], beta, alpha)
    masked_base(a[:, :h], b[:, :h], out[:, :h, :h], beta, alpha, block)
    masked_base(a[:, h:], b[:, h:], out[:, h:, h:], beta, alpha, block)


def triangular_base(t, x, out, beta: int, alpha: int, lower: bool, clean: bool, block: int) -> None:
    """out = beta * out + alpha * tri(t) x, tri = tril (lower) or triu; clean: t is already zero
    outside its triangle."""
    n = t.shape[-1]
    if n <= block:
        with arena().scope() as space:
            if not clean:
                t = (torch.tril if lower else torch.triu)(t, out=space.take(t.shape, t))
            _gemm(t, x, out, beta, alpha)
        return
    h = n // 2
    triangular_base(t[:, :h, :h], x[:, :h], out[:, :h], beta, alpha, lower, clean, block)
    triangular_base(t[:, h:, h:], x[:, h:], out[:, h:], beta, alpha, lower, clean, block)
    if lower:
        _gemm(t[:, h:, :h], x[:, :h], out[:, h:], 1, alpha)
    else:
        _gemm(t[:, :h, h:], x[:, h:], out[:, :h], 1, alpha)


# ----------------------------------------------------------------------------------------------
# One level of the three forms on (B, ., .) tensors in the compute dtype


def masked_level(a, b, plan: Plan, options: Options, out, beta: int = 0, alpha: int = 1) -> None:
    """Lower triangle of out = beta * out + alpha * a b^T; a, b (B, n, m); above it: unspecified."""
    batch, n, m = a.shape
    if not recurses(n, m, options.cutoff):
        masked_base(a, b, out, beta, alpha, options.base_block)
        return
    n4 = n // BLOCKS
    g = plan.num_general
    space = arena()
    with space.scope():
        a_grid, b_grid = grid(a), grid(b)
        left = _operands(plan.left, [a_grid[k] for k in plan.left_blocks], space)
        right = _operands(plan.right, [b_grid[k] for k in plan.right_blocks], space)

        def run(k, dest, beta, alpha):
            (x, sx), (y, sy) = left[k], right[k]
            if k < g:
                general_product(x, y.mT, dest, beta, alpha * sx * sy, options)
            else:
                masked_level(x, y, plan, options, dest, beta, alpha * sx * sy)

        out_grid = grid(out)
        _outputs(plan, run, [out_grid[k] for k in plan.out_blocks], beta, alpha, (batch, n4, n4), a, space)


def triangular_level(t, x, plan: Plan, options: Options, out, beta: int = 0, alpha: int = 1,
                     clean: bool = False) -> None:
    """out = beta * out + alpha * tri(t) x, tri = tril for plan.form "lower", triu for "upper";
    t (B, n, n), x (B, n, d); clean: t is already zero outside its triangle."""
    batch, n, d = x.shape
    lower = plan.form == "lower"
    if not recurses(n, d, options.cutoff):
        triangular_base(t, x, out, beta, alpha, lower, clean, options.base_block)
        return
    n4, d4 = n // BLOCKS, d // BLOCKS
    g = plan.num_general
    space = arena()
    with space.scope():
        t_grid, x_grid = grid(t), grid(x)
        sources = []
        for i, j in plan.left_blocks:  # only the triangle of a diagonal block belongs to the operand
            block = t_grid[(i, j)]
            if i == j and not clean:
                block = (torch.tril if lower else torch.triu)(block, out=space.take(block.shape, block))
            sources.append(block)
        left = _operands(plan.left, sources, space)
        right = _operands(plan.right, [x_grid[k] for k in plan.right_blocks], space)

        def run(k, dest, beta, alpha):
            y, sy = right[k]
            if k < g:
                l, sl = left[k]
                general_product(l, y, dest, beta, alpha * sl * sy, options)
            else:
                triangular_level(sources[plan.rec_blocks[k - g]], y, plan, options, dest, beta, alpha * sy, clean=True)

        out_grid = grid(out)
        _outputs(plan, run, [out_grid[k] for k in plan.out_blocks], beta, alpha, (batch, n4, d4), x, space)


# ----------------------------------------------------------------------------------------------
# Public entry points


def _compute_dtype(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    result = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    if result in (torch.float16, torch.bfloat16):
        return result, torch.float32
    if result in (torch.float32, torch.float64, torch.int64, torch.int32):
        return result, result
    raise TypeError(f"unsupported dtype {result}: expected float32, float64, bfloat16, float16 or an integer type")


def _as_batched(x: torch.Tensor, batch_shape, dtype, rows: int, cols: int) -> torch.Tensor:
    x = x.to(dtype).expand(*batch_shape, *x.shape[-2:]).reshape(-1, *x.shape[-2:])
    if (rows, cols) != tuple(x.shape[-2:]):
        x = F.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))
    return x


def _check_matrix(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"{name} must be a tensor with at least 2 dims (..., rows, cols), got {getattr(x, 'shape', x)!r}")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} requires grad, but the ECA executor is not differentiable: call it under torch.no_grad() "
            "or use cppo.eca.eca_attention, whose backward runs the schemes too"
        )


def _resolve(scheme, cutoff, general, general_cutoff, base_block) -> tuple[Scheme, Options]:
    return load_scheme(scheme), Options(cutoff=cutoff, general=general, general_cutoff=general_cutoff,
                                        base_block=base_block)


def masked_matmul(a, b, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm",
                  general_cutoff: int = 256, base_block: int = DEFAULT_BASE_BLOCK) -> torch.Tensor:
    """tril(a @ b^T) with a 4x4 scheme: a (..., n, m), b (..., n, m) -> (..., n, n).

    Leading dims broadcast. Only the lower triangle (diagonal included) is computed; the rest is 0.
    scheme: "eca", "ug444", "naive", a file path or a Scheme. Recurses while min(n, m) > cutoff;
    below, the blocked triangular product with dense diagonal blocks of <= base_block rows.
    general: "gemm", "strassen" or "winograd" for the general products (fast ones recurse while
    all their dims are even and > general_cutoff). Not differentiable: see eca_attention.
    """
    _check_matrix("a", a)
    _check_matrix("b", b)
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"a and b must have the same (n, m) shape, got {tuple(a.shape[-2:])} and {tuple(b.shape[-2:])}")
    scheme, options = _resolve(scheme, cutoff, general, general_cutoff, base_block)
    result_dtype, dtype = _compute_dtype(a, b)
    batch_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n, m = a.shape[-2:]
    rows, cols = padded_sizes(n, m, options.cutoff)
    with torch.no_grad(), arena().scope():
        a, b = _as_batched(a, batch_shape, dtype, rows, cols), _as_batched(b, batch_shape, dtype, rows, cols)
        out = a.new_empty(a.shape[0], rows, rows)
        masked_level(a, b, make_plan(scheme, "masked"), options, out)
        out = out[:, :n, :n].tril_()
    return out.reshape(*batch_shape, n, n).to(result_dtype)


def lower_matmul(lower, x, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm",
                 general_cutoff: int = 256, base_block: int = DEFAULT_BASE_BLOCK, clean: bool = False) -> torch.Tensor:
    """tril(lower) @ x: lower (..., n, n), x (..., n, d) -> (..., n, d); entries above the diagonal are ignored.

    Options as for masked_matmul; recurses while min(n, d) > cutoff. clean=True promises that the
    entries above the diagonal are already zero (saves copying the diagonal blocks).
    """
    return _triangular_matmul("lower", lower, x, scheme, Options(cutoff, general, general_cutoff, base_block), clean)


def upper_matmul(upper, x, scheme="eca", cutoff: int = DEFAULT_CUTOFF, general: str = "gemm",
                 general_cutoff: int = 256, base_block: int = DEFAULT_BASE_BLOCK, clean: bool = False) -> torch.Tensor:
    """triu(upper) @ x: upper (..., n, n), x (..., n, d) -> (..., n, d); entries below the diagonal are ignored.

    Runs the lower scheme on reversed block indices (U X = J (J U J)(J X)); no data is flipped.
    """
    return _triangular_matmul("upper", upper, x, scheme, Options(cutoff, general, general_cutoff, base_block), clean)


def _triangular_matmul(form, t, x, scheme, options: Options, clean: bool):
    _check_matrix(form, t)
    _check_matrix("x", x)
    n, d = t.shape[-1], x.shape[-1]
    if t.shape[-2] != n or x.shape[-2] != n:
        raise ValueError(f"{form} must be square (..., n, n) and x (..., n, d), got {tuple(t.shape)} and {tuple(x.shape)}")
    scheme = load_scheme(scheme)
    result_dtype, dtype = _compute_dtype(t, x)
    batch_shape = torch.broadcast_shapes(t.shape[:-2], x.shape[:-2])
    rows, cols = padded_sizes(n, d, options.cutoff)
    with torch.no_grad(), arena().scope():
        t, x = _as_batched(t, batch_shape, dtype, rows, rows), _as_batched(x, batch_shape, dtype, rows, cols)
        out = x.new_empty(x.shape)
        triangular_level(t, x, make_plan(scheme, form), options, out, clean=clean)
        out = out[:, :n, :d]
    return out.reshape(*batch_shape, n, d).to(result_dtype)
