"""Sampling replay (replay_sampling): with top_k / top_p / min_p / a repetition penalty the
sampler draws from a truncated, renormalised distribution; the training passes replay those
transforms on their own logits, so at the sampler's weights the importance weights are 1 and the
policy gradient is the truncated objective's. Without replay (TRL's behaviour) neither holds."""

import math

import pytest
import torch

from cppo.assembly.run import sampling_replay
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.models import load_model, load_tokenizer
from cppo.sampling.logits import filter_logits, replay_logits, sampling_logits, seen_before
from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions
from cppo.sampling.settings import SamplingSettings
from helpers import ROWS, make_trainer

TRUNCATED = SamplingSettings(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1,
                             repetition_penalty=1.2)


# ----------------------------------------------------------------- the transform, replayed ---
def test_replay_keeps_the_samplers_set_and_every_drawn_token():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=gen, dtype=torch.float64) * 3
    seen = torch.rand(64, 40, generator=gen) < 0.2
    settings = dict(temperature=0.7, top_k=6, top_p=0.8, min_p=0.05, repetition_penalty=1.3)
    sampled = sampling_logits(logits, seen=seen, **settings).double()
    kept = torch.isfinite(sampled)
    inside = torch.multinomial(sampled.softmax(-1), 1, generator=gen).squeeze(1)
    replayed = replay_logits(logits, inside, seen=seen, **settings)
    assert torch.equal(torch.isfinite(replayed), kept)
    torch.testing.assert_close(replayed[kept], sampled[kept], rtol=1e-6, atol=1e-6)
    outside = (~kept).double().argmax(1)   # a token the set dropped: it stays, and only it
    assert (~kept).any(1).all()
    replayed = replay_logits(logits, outside, seen=seen, **settings)
    expected = kept.clone()
    expected[torch.arange(64), outside] = True
    assert torch.equal(torch.isfinite(replayed), expected)


def test_seen_before_holds_the_prompt_and_the_earlier_completion_tokens():
    prompt, prompt_mask = torch.tensor([[0, 2, 3]]), torch.tensor([[0, 1, 1]])  # 0 is padding
    ids, mask = torch.tensor([[4, 5, 4, 1]]), torch.tensor([[1, 1, 1, 0]])
    seen = seen_before(prompt, prompt_mask, ids, mask, 6)
    assert seen[0].int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0],
                                      [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]


def test_the_policy_gradient_is_the_truncated_objectives_only_with_replay():
    """float64, one position: J(theta) = sum over the kept set S of p_S(a) R(a), p_S the
    softmax renormalised over S. The mean of R(a) grad log p(a) over draws a ~ p_S matches grad J
    within 5 standard errors with replay; with the full softmax's log p it does not."""
    theta = torch.tensor([2.0, 1.6, 1.2, 0.9, 0.5, 0.0, -0.5, -1.0], dtype=torch.float64)
    reward = torch.tensor([1.0, -0.5, 2.0, 0.0, 1.5, -1.0, 0.5, 3.0], dtype=torch.float64)
    settings = dict(top_k=6, top_p=0.75, min_p=0.05)
    top = theta.argmax().view(1)
    exact_theta = theta.clone().requires_grad_(True)
    p_s = replay_logits(exact_theta[None], top, **settings).softmax(-1)[0]
    (exact,) = torch.autograd.grad((p_s * reward).sum(), exact_theta)
    kept = torch.isfinite(filter_logits(theta[None], **settings))[0]
    assert 2 <= int(kept.sum()) < len(theta) and float(theta.softmax(-1)[~kept].sum()) > 0.1

    n = 40_000
    draws = torch.multinomial(p_s.detach(), n, replacement=True,
                              generator=torch.Generator().manual_seed(1))

    def per_draw_gradients(replay: bool) -> torch.Tensor:
        rows = theta.expand(n, -1).clone().requires_grad_(True)
        logits = replay_logits(rows, draws, **settings) if replay else rows
        logp = logits.log_softmax(-1).gather(1, draws[:, None]).squeeze(1)
        (grads,) = torch.autograd.grad((reward[draws] * logp).sum(), rows)
        return grads
    for replay, matches in ((True, True), (False, False)):
        grads = per_draw_gradients(replay)
        error = (grads.mean(0) - exact).abs()
        bound = 5 * grads.std(0) / math.sqrt(n) + 1e-12
        assert bool((error <= bound).all()) is matches, (replay, error, bound)


# ----------------------------------------------------------------- the model's passes --------
@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    """The tiny model, prompts and 8 completions each drawn with TRUNCATED, with the sampler's
    own log-probs recorded."""
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    model.eval()
    prompts = encode_prompts(tok, [r["prompt"] for r in ROWS[:4]], None)
    out = sample_completions(model, prompts, num_generations=8, max_new_tokens=8,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             sampling=TRUNCATED, generator=torch.Generator().manual_seed(3),
                             decoding=Decoding(record_logprobs=True))
    return model, (prompts.ids.repeat_interleave(8, 0), prompts.mask.repeat_interleave(8, 0)), out


@pytest.mark.parametrize("lean, packed", [(True, True), (True, False), (False, True)])
def test_importance_weights_are_one_at_the_samplers_weights_only_with_replay(sampled, lean, packed):
    """Same weights, same distribution: with replay the training pass's log-probs equal the
    sampler's to float32 rounding (the bound: 1e-4, far below the truncation's effect, which
    is at least 0.05 here); without replay they are the full softmax's."""
    model, (prompt_ids, prompt_mask), out = sampled
    mask = out.mask.bool()

    def logprobs(replay):
        forward = ForwardSettings(lean=lean, packed=packed, replay=TRUNCATED if replay else None)
        with torch.no_grad():
            return completion_logprobs(model, prompt_ids, prompt_mask, out.ids, out.mask,
                                       temperature=TRUNCATED.temperature, forward=forward)
    replayed, full = logprobs(True), logprobs(False)
    assert float((replayed - out.logprobs)[mask].abs().max()) < 1e-4
    assert float((full - out.logprobs)[mask].abs().max()) > 0.05
    assert bool((full[mask] <= replayed[mask] + 1e-6).all())   # renormalised: never less likely


def test_the_chunked_head_cannot_replay(sampled):
    model, (prompt_ids, prompt_mask), out = sampled
    with pytest.raises(ValueError, match="full logits"):
        completion_logprobs(model, prompt_ids, prompt_mask, out.ids, out.mask,
                            forward=ForwardSettings(chunk_head=True, replay=TRUNCATED))


# ----------------------------------------------------------------- in a run ------------------
def test_a_run_with_top_p_replays_the_policy_and_old_policy_not_the_reference(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, top_p=0.8, top_k=5, beta=0.04,
                           num_iterations=2, importance_sampling_correction=True,
                           generation_dtype="float32", matmul_dtype=None, max_completion_length=6)
    assert trainer.learner.replay == SamplingSettings(top_p=0.8, top_k=5)
    seen = {}
    fill = trainer.fill_old_and_ref_logprobs

    def spy(batch):
        fill(batch)
        seen["batch"] = batch
    trainer.fill_old_and_ref_logprobs = spy
    metrics = trainer.training_round()
    batch = seen["batch"]
    mask = batch.completion_mask.bool()
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-4
    assert float((batch.old_logps - batch.sampler_logps)[mask].abs().max()) < 1e-4
    with torch.no_grad():
        full = completion_logprobs(trainer.reference, batch.prompt_ids, batch.prompt_mask,
                                   batch.completion_ids, batch.completion_mask)
    torch.testing.assert_close(batch.ref_logps, full, rtol=0, atol=1e-5)
    assert float((batch.ref_logps - batch.old_logps)[mask].abs().max()) > 0.05


def test_without_replay_the_weights_are_trls(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, top_p=0.8, top_k=5, replay_sampling=False,
                           importance_sampling_correction=True, generation_dtype="float32",
                           matmul_dtype=None)
    assert trainer.learner.replay is None
    metrics = trainer.training_round()
    assert metrics["sampling/sampling_logp_difference/max"] > 0.05


# ----------------------------------------------------------------- the setting ---------------
@pytest.mark.parametrize("fields, on", [
    ({}, False), ({"temperature": 0.7}, False), ({"top_p": 0.95}, True), ({"top_k": 20}, True),
    ({"min_p": 0.1}, True), ({"repetition_penalty": 1.1}, True),
    ({"top_p": 0.95, "replay_sampling": False}, False), ({"replay_sampling": True}, True)])
def test_replay_is_on_whenever_a_transform_truncates(fields, on):
    assert CPPOConfig(**fields).replays_sampling is on


def test_a_rollout_func_turns_the_automatic_replay_off_and_refuses_an_asked_one():
    def rollout(prompts, trainer):
        return {}
    assert sampling_replay(CPPOConfig(top_p=0.9), rollout) is None
    assert sampling_replay(CPPOConfig(top_p=0.9)) == SamplingSettings(top_p=0.9)
    assert sampling_replay(CPPOConfig(top_p=0.9, replay_sampling=False)) is None
    with pytest.raises(ConfigError, match="'replay_sampling' is true with a rollout_func"):
        sampling_replay(CPPOConfig(top_p=0.9, replay_sampling=True), rollout)


def test_what_replay_cannot_run_with_is_refused():
    with pytest.raises(ConfigError, match="'use_liger_kernel' computes the log-probs in chunks.*"
                                          r"\(on because a truncating transform is set\)"):
        CPPOConfig(top_k=20, use_liger_kernel=True)
    CPPOConfig(top_k=20, use_liger_kernel=True, replay_sampling=False)
    with pytest.raises(ConfigError, match="vLLM applies min_p before top-k and top-p"):
        CPPOConfig(use_vllm=True, min_p=0.1, top_p=0.9)
    CPPOConfig(use_vllm=True, min_p=0.1)   # one truncation: the same set in either order
    CPPOConfig(use_vllm=True, min_p=0.1, top_p=0.9, replay_sampling=False)
