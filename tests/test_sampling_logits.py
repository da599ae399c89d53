"""The sampler's logit transforms equal transformers' logits processors (what TRL's generate
runs), and the sampler honours min_p and repetition_penalty on the lean and transformers paths."""

import pytest
import torch

from cppo.models import load_model, load_tokenizer
from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions
from cppo.sampling.logits import greedy_logits, sampling_logits, seen_tokens
from cppo.sampling.settings import SamplingSettings

SETTINGS = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7, temperature=0.6),
    dict(min_p=0.05),
    dict(min_p=0.3, temperature=1.7),
    dict(top_k=20, min_p=0.1, repetition_penalty=1.2),
    dict(top_p=0.8, min_p=0.05, repetition_penalty=1.5, temperature=0.8),
    dict(top_k=7, top_p=0.9),
]


def transformers_processors(model, **settings):
    """The processor list transformers' generate builds from TRL's generation kwargs."""
    from transformers import GenerationConfig
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    kw.update(settings)
    config = GenerationConfig(do_sample=True, **kw)
    return model._get_logits_processor(generation_config=config, device="cpu")


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_transforms_equal_transformers_processors(tiny_model_dir, settings):
    model = load_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    logits = torch.randn(6, vocab, generator=gen) * 3
    ids = torch.randint(0, vocab, (6, 12), generator=gen)   # the sequence so far (no padding)
    theirs = transformers_processors(model, **settings)(ids, logits.clone())
    ours = sampling_logits(logits, seen=seen_tokens(ids, torch.ones_like(ids), vocab),
                           **{"temperature": 1.0, **settings})
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))    # the same tokens kept
    kept = torch.isfinite(theirs)
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=1e-6, atol=1e-6)
    assert kept.sum(-1).min() >= 1


def test_seen_tokens_skip_padding_and_ids_beyond_the_head():
    ids = torch.tensor([[0, 0, 5, 9], [3, 12, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    seen = seen_tokens(ids, mask, vocab_size=10)
    assert seen[0].nonzero().flatten().tolist() == [5, 9]       # the pad (0) is not a token seen
    assert seen[1].nonzero().flatten().tolist() == [3, 4]       # 12 is outside the head
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0, -1.0, 0.5, 0, 0, 0, 0]] * 2)
    out = greedy_logits(logits, repetition_penalty=2.0, seen=seen)
    assert out[1, 3] == 2.0 and out[1, 4] == -2.0 and out[1, 0] == 2.0    # / when > 0, * when < 0
    assert out[0, 5] == 0.25 and torch.equal(out[0, :5], logits[0, :5])


def _model(path):
    return load_model(path).eval(), load_tokenizer(path)


@pytest.mark.parametrize("lean", [True, False])
def test_greedy_repetition_penalty_matches_transformers_generate(tiny_model_dir, lean):
    """Equal-length prompts (transformers would penalise the pad token of a padded batch)."""
    model, tok = _model(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "11*11=", "90*12="])
    assert bool(prompts.mask.all())
    kw = dict(max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ours = sample_completions(model, prompts, num_generations=1, greedy=True,
                              decoding=Decoding(lean=lean),
                              sampling=SamplingSettings(repetition_penalty=3.0), **kw)
    plain = sample_completions(model, prompts, num_generations=1, greedy=True,
                               decoding=Decoding(lean=lean), **kw)
    ref = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, do_sample=False,
                         repetition_penalty=3.0, **kw)[:, prompts.ids.shape[1]:]
    assert not torch.equal(ours.ids, plain.ids)     # the penalty changes these completions
    for row in range(ref.shape[0]):
        expected = ref[row].tolist()
        if tok.eos_token_id in expected:
            expected = expected[:expected.index(tok.eos_token_id) + 1]
        assert ours.ids[row, :int(ours.mask[row].sum())].tolist() == expected


@pytest.mark.parametrize("lean", [True, False])
def test_min_p_one_samples_the_most_likely_token(tiny_model_dir, lean):
    """min_p = 1 keeps only the top token: sampling is then greedy decoding, penalty included."""
    model, tok = _model(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "1*2=", "12*34+56="])
    kw = dict(max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              decoding=Decoding(lean=lean))
    greedy = sample_completions(model, prompts, num_generations=2, greedy=True,
                                sampling=SamplingSettings(repetition_penalty=1.5), **kw)
    sampled = sample_completions(model, prompts, num_generations=2,
                                 sampling=SamplingSettings(min_p=1.0, temperature=1.5,
                                                           repetition_penalty=1.5),
                                 generator=torch.Generator().manual_seed(1), **kw)
    free = sample_completions(model, prompts, num_generations=2,
                              sampling=SamplingSettings(temperature=1.5, repetition_penalty=1.5),
                              generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(sampled.ids, greedy.ids) and not torch.equal(free.ids, greedy.ids)


def test_sampler_logprobs_are_of_the_transformed_distribution(tiny_model_dir):
    """generation_dtype records each token's log-prob under the distribution it was drawn from:
    with min_p = 1 that is certainty (0) for every token."""
    model, tok = _model(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "1*2="])
    out = sample_completions(model, prompts, num_generations=3, max_new_tokens=5,
                             sampling=SamplingSettings(min_p=1.0),
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             generator=torch.Generator().manual_seed(0),
                             decoding=Decoding(dtype=torch.bfloat16))
    assert out.logprobs is not None and float(out.logprobs.abs().max()) == 0.0


def test_vllm_sampling_params_take_the_same_settings():
    from cppo.config.sections import SamplingSection
    from cppo.sampling.vllm import sampling_kwargs
    kw = sampling_kwargs(SamplingSection(min_p=0.1, repetition_penalty=1.2, top_k=5))
    assert kw["min_p"] == 0.1 and kw["repetition_penalty"] == 1.2 and kw["top_k"] == 5
    assert sampling_kwargs(SamplingSection())["min_p"] == 0.0      # vLLM's "off"
    vllm = pytest.importorskip("vllm")
    params = vllm.SamplingParams(**kw)
    assert params.min_p == 0.1 and params.repetition_penalty == 1.2
