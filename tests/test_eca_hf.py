"""attn_implementation="eca" in tiny Llama / Qwen2 models: same loss and gradients as sdpa."""

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import cppo.eca.hf as hf
from cppo.eca import register_eca_attention

FAMILIES = [(LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM)]


def _pair(config_cls, model_cls):
    def make(impl):
        return config_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=32, attn_implementation=impl)

    torch.manual_seed(0)
    reference = model_cls(make("sdpa"))
    model = model_cls(make("eca"))
    model.load_state_dict(reference.state_dict())
    return reference, model


@pytest.fixture
def eca_calls(monkeypatch):
    register_eca_attention(cutoff=2)
    register_eca_attention(cutoff=2)  # idempotent
    calls = []
    original = hf.eca_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(hf, "eca_attention", spy)
    return calls


@pytest.mark.parametrize("config_cls, model_cls", FAMILIES)
def test_same_loss_and_gradients_as_sdpa(config_cls, model_cls, eca_calls):
    reference, model = _pair(config_cls, model_cls)
    assert model.config._attn_implementation == "eca" and reference.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 32, (2, 40), generator=torch.Generator().manual_seed(1))
    ref_loss = reference(input_ids=ids, labels=ids).loss
    loss = model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    loss.backward()
    assert len(eca_calls) == 2 and eca_calls[0] == (2, 4, 40, 16)  # both layers ran the scheme path
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_padded_batch_runs_the_scheme_on_each_row(eca_calls):
    """Left padding in row 0, right padding in row 1 (a training batch): same loss and gradients."""
    reference, model = _pair(*FAMILIES[0])
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, 20:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    hf._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert sorted(c[2] for c in eca_calls) == [19, 19, 20, 20]  # each row's real tokens, both layers
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_other_masks_fall_back_to_sdpa(eca_calls):
    reference, model = _pair(*FAMILIES[0])
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, 10] = 0  # a hole inside the row: not causal + padding
    hf._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(input_ids=ids, attention_mask=mask).logits
    assert any("attention mask" in str(w.message) for w in caught)
    assert not eca_calls
    torch.testing.assert_close(out, reference(input_ids=ids, attention_mask=mask).logits)


def test_unknown_scheme_is_rejected_at_registration():
    with pytest.raises(ValueError, match="unknown scheme"):
        register_eca_attention(scheme="nope")
