"""The lean log-prob passes are padding-free: the same log-probs, entropies and gradients as the
model's own forward on padded [prompt, completion] rows, while the projections and the head see
only the real tokens."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cppo.sampling.logprobs import ForwardSettings, completion_logprobs, token_entropy
from helpers import closeness, note_margin
from test_lean_forward import MODELS

pytestmark = pytest.mark.cpu_paths   # two code paths compared: tests/test_cpu_paths.py

VOCAB, T = 40, 6


def batch(shared: bool):
    """Left-padded prompts of different lengths; completions of lengths 1 .. T (a prefix mask)."""
    g = torch.Generator().manual_seed(7)
    prompt_lengths = [5, 2, 7, 3] if shared else [5, 2, 7, 3, 1, 6, 4]
    rows = [0, 1, 0, 2, 1, 3, 0] if shared else list(range(7))   # row -> distinct prompt
    width = max(prompt_lengths)
    distinct_ids = torch.randint(3, VOCAB, (len(prompt_lengths), width), generator=g)
    distinct_mask = (torch.arange(width) >= width - torch.tensor(prompt_lengths)[:, None]).long()
    lengths = torch.tensor([1, T, 3, 4, 2, T, 5])
    completion_ids = torch.randint(3, VOCAB, (len(rows), T), generator=g)
    completion_mask = (torch.arange(T) < lengths[:, None]).long()
    return distinct_ids[rows], distinct_mask[rows], completion_ids, completion_mask


def reference(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """Log-probs and entropies (N, T) from the model's own forward on padded rows."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, prompt_ids.shape[1] - 1:-1].float() / temperature
    logps = F.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    return logps * completion_mask, token_entropy(logits) * completion_mask


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "distinct"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_packed_logprobs_and_entropies_match_the_models_padded_forward(name, shared, bf16):
    model = MODELS[name]
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(shared)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        expected, expected_entropy = reference(model, prompt_ids, prompt_mask, completion_ids,
                                               completion_mask, temperature=0.7)
        entropies = []
        got = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                  temperature=0.7, entropies=entropies)
    tolerance = dict(atol=1e-2, rtol=0) if bf16 else dict(atol=1e-5, rtol=1e-5)
    assert got.shape == completion_ids.shape and got.dtype == torch.float32
    assert not got[completion_mask == 0].any() and not entropies[0][completion_mask == 0].any()
    note_margin("padding_free", **{f"{'bf16' if bf16 else 'fp32'}_logprobs": closeness(got, expected, **tolerance),
                                   f"{'bf16' if bf16 else 'fp32'}_logprobs_bound": 1.0})
    torch.testing.assert_close(got, expected, **tolerance)
    torch.testing.assert_close(entropies[0], expected_entropy, **tolerance)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "distinct"])
def test_packed_gradients_match_the_padded_pass(name, shared):
    model = MODELS[name]
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(shared)
    weights = torch.randn(completion_ids.shape, generator=torch.Generator().manual_seed(3))
    grads = {}
    for packed in (True, False):
        model.zero_grad()
        logps = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                    temperature=0.7,
                                    forward=ForwardSettings(batch_size=4, packed=packed))
        (logps * completion_mask * weights).sum().backward()
        grads[packed] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for n, expected in grads[False].items():
        torch.testing.assert_close(grads[True][n], expected, atol=1e-5, rtol=1e-4, msg=n)


def test_rows_with_nothing_to_score_still_give_every_parameter_a_gradient():
    """Filler rows (completion mask 0) of a distributed batch: every parameter takes part in
    the backward (DDP waits for all of them), with zero gradients."""
    model = MODELS["qwen2-gqa-bias"]
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(shared=True)
    model.zero_grad()
    logps = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                torch.zeros_like(completion_mask))
    assert not logps.any()
    logps.sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), n
    model.zero_grad()


class MatmulRows(TorchDispatchMode):
    """Rows of every matrix product (mm / addmm), by output width."""

    def __init__(self):
        super().__init__()
        self.rows: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.rows[out.shape[1]] = self.rows.get(out.shape[1], 0) + out.shape[0]
        return out


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "distinct"])
def test_projections_and_head_see_only_real_tokens(shared):
    model = MODELS["qwen2-gqa-bias"]
    config = model.config
    layers, head_dim = config.num_hidden_layers, config.hidden_size // config.num_attention_heads
    qkv_width = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(shared)
    distinct = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0)
    prompt_tokens = int(distinct[:, prompt_ids.shape[1]:].sum())
    # every real completion token is an input but each row's last (it predicts nothing)
    inputs = prompt_tokens + int((completion_mask.sum(1) - 1).clamp(min=0).sum())
    counted = {}
    for packed in (True, False):
        with torch.no_grad(), MatmulRows() as mode:
            completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                forward=ForwardSettings(packed=packed))
        counted[packed] = mode.rows
    assert counted[True][qkv_width] == layers * inputs
    assert counted[True][2 * config.intermediate_size] == layers * inputs
    assert counted[True][VOCAB] == int(completion_mask.sum())        # the head: real tokens
    padded = distinct.shape[0] * prompt_ids.shape[1] + completion_ids.numel()
    assert counted[False][qkv_width] == layers * padded                # what packing saves
    assert counted[False][VOCAB] == completion_ids.numel()


def test_prompts_that_are_not_left_padded_are_refused():
    model = MODELS["llama"]
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(shared=True)
    with pytest.raises(ValueError, match="left-padded"):
        completion_logprobs(model, prompt_ids, prompt_mask.flip(1), completion_ids, completion_mask)
