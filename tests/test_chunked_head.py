"""Log-probs and entropies over the head in chunks of tokens: the same values and gradients as
the full logits."""

import pytest
import torch

from cppo.models.head import chunked_logprobs_and_entropy


def _reference(hidden, weight, bias, targets, temperature):
    logits = (hidden @ weight.t() + (bias if bias is not None else 0)) / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("outputs", ["both", "logp", "entropy"])
def test_values_and_gradients_match_the_full_logits(with_bias, outputs):
    torch.manual_seed(0)
    m, d, v = 11, 6, 37
    hidden = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, v, (m,))
    g_logp, g_entropy = torch.randn(m, dtype=torch.float64), torch.randn(m, dtype=torch.float64)
    results = []
    for fn in (_reference, lambda *a: chunked_logprobs_and_entropy(*a, chunk=4)):
        logp, entropy = fn(hidden, weight, bias, targets, 0.7)
        loss = {"both": (logp.double() * g_logp).sum() + (entropy.double() * g_entropy).sum(),
                "logp": (logp.double() * g_logp).sum(),
                "entropy": (entropy.double() * g_entropy).sum()}[outputs]
        params = [hidden, weight] + ([bias] if with_bias else [])
        grads = torch.autograd.grad(loss, params)
        results.append((logp.detach().double(), entropy.detach().double(), grads))
    (lp_a, h_a, g_a), (lp_b, h_b, g_b) = results
    torch.testing.assert_close(lp_a, lp_b)
    torch.testing.assert_close(h_a, h_b)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b.double())
