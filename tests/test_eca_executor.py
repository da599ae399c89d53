"""Executor: exact in integer arithmetic for all forms, shapes, batch dims; float dtypes close."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo.eca import lower_matmul, masked_matmul, upper_matmul

SCHEMES = ["eca", "ug444", "naive"]


def _ints(*shape, seed=0):
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n, m", [(16, 16), (64, 16), (48, 20), (37, 13), (5, 3)])
def test_all_forms_exact_on_integers(scheme, n, m):
    a, b, t = _ints(2, n, m, seed=1), _ints(2, n, m, seed=2), _ints(2, n, n, seed=3)
    assert torch.equal(masked_matmul(a, b, scheme, cutoff=1), torch.tril(a @ b.mT))
    assert torch.equal(lower_matmul(t, a, scheme, cutoff=1), t.tril() @ a)
    assert torch.equal(upper_matmul(t, a, scheme, cutoff=1), t.triu() @ a)


@pytest.mark.parametrize("general", ["strassen", "winograd"])
def test_fast_general_products_exact(general):
    a, b, t = _ints(1, 64, 64, seed=4), _ints(1, 64, 64, seed=5), _ints(1, 64, 64, seed=6)
    assert torch.equal(masked_matmul(a, b, "eca", cutoff=1, general=general), torch.tril(a @ b.mT))
    assert torch.equal(lower_matmul(t, a, "ug444", cutoff=1, general=general), t.tril() @ a)


def test_leading_dims_broadcast():
    a, b = _ints(2, 3, 32, 8, seed=7), _ints(3, 32, 8, seed=8)
    assert torch.equal(masked_matmul(a, b, cutoff=1), torch.tril(a @ b.mT))
    t, x = _ints(32, 32, seed=9), _ints(2, 3, 32, 8, seed=10)
    assert torch.equal(lower_matmul(t, x, cutoff=1), t.tril() @ x)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), m=st.integers(1, 24), scheme=st.sampled_from(SCHEMES), seed=st.integers(0, 99))
def test_any_size_exact(n, m, scheme, seed):
    a, b, t = _ints(n, m, seed=seed), _ints(n, m, seed=seed + 1), _ints(n, n, seed=seed + 2)
    assert torch.equal(masked_matmul(a, b, scheme, cutoff=1), torch.tril(a @ b.mT))
    assert torch.equal(upper_matmul(t, a, scheme, cutoff=1), t.triu() @ a)


def test_entries_outside_the_triangle_are_ignored():
    t, x = torch.randn(64, 64, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64)
    torch.testing.assert_close(lower_matmul(t, x, cutoff=4), t.tril() @ x)
    torch.testing.assert_close(upper_matmul(t, x, cutoff=4), t.triu() @ x)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float64, 1e-12)])
def test_float_dtypes_close(dtype, tol):
    a, b = torch.randn(3, 128, 64, dtype=dtype), torch.randn(3, 128, 64, dtype=dtype)
    out = masked_matmul(a, b, cutoff=4)
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.tril(a @ b.mT), rtol=tol, atol=tol)


def test_bf16_computed_in_fp32():
    a, b = torch.randn(2, 128, 64), torch.randn(2, 128, 64)
    exact = torch.tril(a.bfloat16().double() @ b.bfloat16().double().mT)
    out = masked_matmul(a.bfloat16(), b.bfloat16(), cutoff=4)
    assert out.dtype == torch.bfloat16
    # fp32 accumulation: the only sizeable error is the final rounding to bf16 (rel 2^-8)
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    mixed = lower_matmul(torch.randn(128, 128), b[0].bfloat16(), cutoff=4)
    assert mixed.dtype == torch.float32


def test_cutoff_changes_path_not_result():
    a, b = torch.randn(256, 64, dtype=torch.float64), torch.randn(256, 64, dtype=torch.float64)
    results = [masked_matmul(a, b, cutoff=c) for c in (1, 8, 64, 10_000)]
    for r in results[1:]:
        torch.testing.assert_close(r, results[0])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="same \\(n, m\\) shape"):
        masked_matmul(torch.ones(4, 3), torch.ones(5, 3))
    with pytest.raises(ValueError, match="must be square"):
        lower_matmul(torch.ones(4, 5), torch.ones(4, 2))
    with pytest.raises(ValueError, match="cutoff must be an int >= 1, got 0"):
        masked_matmul(torch.ones(4, 3), torch.ones(4, 3), cutoff=0)
    with pytest.raises(ValueError, match="general must be one of"):
        masked_matmul(torch.ones(4, 3), torch.ones(4, 3), general="fast")
    with pytest.raises(RuntimeError, match="not differentiable"):
        masked_matmul(torch.ones(4, 3, requires_grad=True), torch.ones(4, 3))


def test_blocked_reference_exact_on_integers():
    from cppo.eca.reference import blocked_lower_matmul, blocked_masked_matmul, blocked_upper_matmul

    a, b, t = _ints(2, 100, 12, seed=11), _ints(2, 100, 12, seed=12), _ints(2, 100, 100, seed=13)
    assert torch.equal(blocked_masked_matmul(a, b, block=16), torch.tril(a @ b.mT))
    assert torch.equal(blocked_lower_matmul(t, a, block=16), t.tril() @ a)
    assert torch.equal(blocked_upper_matmul(t, a, block=16), t.triu() @ a)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transposed_and_clean_triangular_operands(scheme):
    """P^T in attention is a transposed view; clean=True skips copying diagonal blocks."""
    t, x = _ints(2, 64, 64, seed=14), _ints(2, 64, 12, seed=15)
    assert torch.equal(upper_matmul(t.mT, x, scheme, cutoff=2), t.mT.triu() @ x)
    assert torch.equal(lower_matmul(t.mT, x, scheme, cutoff=2), t.mT.tril() @ x)
    assert torch.equal(upper_matmul(t.tril().mT, x, scheme, cutoff=2, clean=True), t.mT.triu() @ x)
    assert torch.equal(lower_matmul(t.tril(), x, scheme, cutoff=2, clean=True, base_block=4), t.tril() @ x)


@pytest.mark.parametrize("base_block", [1, 3, 64])
def test_base_block_changes_path_not_result(base_block):
    a, b = _ints(2, 100, 40, seed=16), _ints(2, 100, 40, seed=17)
    assert torch.equal(masked_matmul(a, b, cutoff=8, base_block=base_block), torch.tril(a @ b.mT))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="base_block must be an int >= 1, got 0"):
        masked_matmul(torch.ones(4, 3), torch.ones(4, 3), base_block=0)
    with pytest.raises(ValueError, match="general_cutoff must be an int >= 1"):
        lower_matmul(torch.ones(4, 4), torch.ones(4, 3), general_cutoff=-1)
