"""Log-probs and entropies over the head in chunks of tokens: the same values and gradients as
the full logits."""

import pytest
import torch

from cppo.models.head import chunked_logprobs_and_entropy

pytestmark = pytest.mark.cpu_paths   # two code paths compared: tests/test_cpu_paths.py


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


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_scoring_pass_takes_the_chunked_head_above_its_size(tiny_model_dir, monkeypatch,
                                                                 entropy_grad):
    """completion_logprobs with the chunked head (threshold 0) gives the full-logits pass's
    log-probs, entropies and parameter gradients; the full logits are never built."""
    from cppo.sampling import logprobs
    from cppo.models.lean import LeanForward
    from helpers import sampled_for_scoring
    model, args = sampled_for_scoring(tiny_model_dir)
    results = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(logprobs, "HEAD_CHUNK_ABOVE", threshold)
        logits_calls = []
        monkeypatch.setattr(LeanForward, "_logits", lambda self, w, h: logits_calls.append(h.shape)
                            or torch.nn.functional.linear(self._norm(h, w.norm), w.head, w.head_bias))
        model.zero_grad()
        entropies = []
        logps = logprobs.completion_logprobs(model, *args, temperature=0.7, entropies=entropies,
                                             entropy_grad=entropy_grad)
        (logps.sum() + (entropies[0].sum() if entropy_grad else 0)).backward()
        results.append((logps.detach(), entropies[0].detach(),
                        [p.grad.clone() for p in model.parameters()], len(logits_calls)))
    (lp_a, h_a, g_a, calls_a), (lp_b, h_b, g_b, calls_b) = results
    assert calls_a == 1 and calls_b == 0          # the chunked pass never builds the logits
    torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_a, h_b, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
