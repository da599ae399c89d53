"""ECA inside training: one CPPO step with attn_implementation="eca" runs scheme products (not only
sdpa fallbacks) and gives the loss, gradients and parameters of attn_implementation="sdpa"."""

import warnings

import pytest
import torch

import cppo.eca.executor as executor
from cppo.config import CPPOConfig
from cppo.eca import ATTENTION_CUTOFF, register_eca_attention
from cppo.eca.plan import recurses
from cppo.models import load_model, load_tokenizer
from cppo.trainer import CPPOTrainer
from helpers import ROWS, odd_length_reward


@pytest.fixture
def scheme_levels(monkeypatch):
    """Count scheme levels that really run (a product split by the scheme, not a base case)."""
    runs = {"masked": 0, "triangular": 0}
    for name, key in (("masked_level", "masked"), ("triangular_level", "triangular")):
        original = getattr(executor, name)

        def counted(*args, original=original, key=key, **kwargs):
            n, inner = args[0].shape[-2], args[1].shape[-1]
            if recurses(n, inner, args[3].cutoff):
                runs[key] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(executor, name, counted)
    yield runs
    register_eca_attention(cutoff=ATTENTION_CUTOFF)  # later tests see the default again


def one_step(model_dir, tmp_path, impl):
    cfg = CPPOConfig(model=model_dir, output_dir=str(tmp_path / impl), max_steps=1,
                     per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                     max_completion_length=5, eval_steps=0, progress_bar=False,
                     learning_rate=1e-3, seed=3, attn_implementation=impl,
                     generation_dtype=None)   # both sample with the policy (eca has no lean forward)
    trainer = CPPOTrainer(model=load_model(model_dir, attn_implementation=impl),
                          processing_class=load_tokenizer(model_dir),
                          reward_funcs=[odd_length_reward], args=cfg, train_dataset=ROWS)
    assert trainer.policy.config._attn_implementation == impl
    grads = {}
    for name, p in trainer.policy.named_parameters():   # keep the step's gradients before the update
        p.register_hook(lambda g, name=name: grads.__setitem__(name, g.detach().clone()))
    metrics = trainer.training_round()
    return metrics, grads, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}


def test_training_step_runs_schemes_and_matches_sdpa(tiny_model_dir, tmp_path, scheme_levels):
    m_sdpa, g_sdpa, p_sdpa = one_step(tiny_model_dir, tmp_path, "sdpa")
    assert scheme_levels == {"masked": 0, "triangular": 0}
    register_eca_attention(cutoff=2)  # head dim 16: recurse while min(L, d) > 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m_eca, g_eca, p_eca = one_step(tiny_model_dir, tmp_path, "eca")
    # forward S = QK^T and backward dP: masked; forward PV and backward dV, dQ, dK: triangular
    assert scheme_levels["masked"] > 0 and scheme_levels["triangular"] > 0
    assert m_sdpa["reward"] == m_eca["reward"]             # the same completions were sampled
    assert m_sdpa["loss"] == pytest.approx(m_eca["loss"], rel=1e-4, abs=1e-6)
    assert g_sdpa.keys() == g_eca.keys() and len(g_eca) > 0
    attention = [n for n in g_eca if "self_attn" in n]
    assert attention and any(g_eca[n].abs().max() > 0 for n in attention)
    for name in g_sdpa:
        torch.testing.assert_close(g_eca[name], g_sdpa[name], rtol=1e-4, atol=1e-6, msg=name)
    for name in p_sdpa:
        torch.testing.assert_close(p_eca[name], p_sdpa[name], rtol=1e-4, atol=1e-5, msg=name)
