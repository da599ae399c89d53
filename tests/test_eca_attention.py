"""eca_attention matches torch's causal SDPA in values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from cppo.eca import eca_attention


@pytest.mark.parametrize("scheme", ["eca", "ug444"])
@pytest.mark.parametrize("length, dim", [(64, 16), (50, 12)])
def test_matches_sdpa_forward_and_backward(scheme, length, dim):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, dim, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, length, dim)
    out = eca_attention(q, k, v, scheme=scheme, cutoff=2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_scale_argument():
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    torch.testing.assert_close(
        eca_attention(q, k, v, scale=0.3, cutoff=2), F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    )


def test_gradcheck_fp64():
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: eca_attention(a, b, c, cutoff=1), (q, k, v), fast_mode=True)


def test_bf16_close_to_fp32_reference():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    out = eca_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cutoff=2)
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="equal shapes"):
        eca_attention(torch.ones(1, 2, 8, 4), torch.ones(1, 1, 8, 4), torch.ones(1, 1, 8, 4))
    with pytest.raises(ValueError, match="4D tensor"):
        eca_attention(torch.ones(8, 4), torch.ones(8, 4), torch.ones(8, 4))


def test_separate_masked_and_triangular_cutoffs():
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = eca_attention(q, k, v, cutoff=(2, 1000))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(mine, theirs)
    with pytest.raises(ValueError, match="cutoff must be an int >= 1 or a pair"):
        eca_attention(q, k, v, cutoff=(2, 0))
