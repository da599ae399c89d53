"""Speculative sampling: the n-gram drafter, the accept / resample rule, and that the sampled
distribution is exactly plain sampling's (a biased rule is caught), greedy equal to plain greedy."""


import pytest
import torch

from cppo.algorithm.speculative import accepted_drafts, residual_weights
from cppo.models import load_model, load_tokenizer
from cppo.sampling.batches import PromptBatch
from cppo.sampling.logits import sampling_logits
from cppo.sampling.logprobs import completion_logprobs
from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions
from cppo.sampling.settings import SamplingSettings
from cppo.sampling.speculative import Speculation
from cppo.sampling import speculative
from cppo.sampling.speculative import ngram_drafts

VOCAB, EOS, PAD, LENGTH = 5, 4, 0, 3
PROMPT = [1, 2, 3, 1, 2, 3, 2]
SAMPLING = dict(temperature=0.8, top_k=4, top_p=1.0)


def _tiny_model():
    from transformers import LlamaForCausalLM
    from cppo.models.loading import tiny_model_config
    torch.manual_seed(1)
    model = LlamaForCausalLM(tiny_model_config(VOCAB, bos_token_id=1, eos_token_id=EOS,
                                               pad_token_id=PAD, hidden_size=16, num_layers=1,
                                               num_heads=2, intermediate_size=32))
    with torch.no_grad():   # a peaked distribution: drafts are often accepted, often not
        model.model.embed_tokens.weight.mul_(6.0)
    return model.eval()


def _exact_distribution(model) -> dict:
    """P(completion) for every completion of at most LENGTH tokens (ending at EOS or the limit)."""
    probs = {}

    def walk(prefix, p):
        if len(prefix) == LENGTH or (prefix and prefix[-1] == EOS):
            probs[tuple(prefix)] = p
            return
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + prefix])).logits[:, -1]
        step = sampling_logits(logits, **SAMPLING).softmax(-1)[0]
        for token in range(VOCAB):
            if step[token] > 0:
                walk(prefix + [token], p * float(step[token]))
    walk([], 1.0)
    return probs


def _chi_square_pvalue(draws, probs: dict) -> float:
    """Pearson's test of sampled completions against their exact probabilities (cells with an
    expected count under 5 pooled)."""
    counts = {}
    for ids, mask in zip(draws.ids.tolist(), draws.mask.tolist()):
        key = tuple(t for t, m in zip(ids, mask) if m)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(probs), set(counts) - set(probs)
    n = len(draws.ids)
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for key, p in probs.items():
        if n * p < 5:
            pooled_o, pooled_e = pooled_o + counts.get(key, 0), pooled_e + n * p
        else:
            observed.append(counts.get(key, 0))
            expected.append(n * p)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    df = torch.tensor((len(o) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def _draw(model, speculation, questions=1500, group=8, seed=0):
    prompts = PromptBatch(torch.tensor([PROMPT] * questions), torch.ones(questions, len(PROMPT),
                                                                         dtype=torch.long))
    return sample_completions(model, prompts, num_generations=group, max_new_tokens=LENGTH,
                              eos_token_id=EOS, pad_token_id=PAD,
                              decoding=Decoding(speculative=speculation),
                              generator=torch.Generator().manual_seed(seed),
                              sampling=SamplingSettings(**SAMPLING))


@pytest.fixture(scope="module")
def tiny():
    model = _tiny_model()
    return model, _exact_distribution(model)


def test_speculative_sampling_draws_the_policys_distribution(tiny):
    model, probs = tiny
    plain = _draw(model, None)
    spec = _draw(model, Speculation(num_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1))
    stats = spec.speculation
    # the test means something only if drafts were proposed, accepted and rejected
    assert stats.drafted > 1000 and 0.1 < stats.acceptance_rate < 0.9, stats
    assert _chi_square_pvalue(plain, probs) > 1e-3
    assert _chi_square_pvalue(spec, probs) > 1e-3


def test_a_biased_acceptance_rule_is_caught(tiny, monkeypatch):
    """The same check fails when every draft is accepted (q's point mass taken for p)."""
    model, probs = tiny
    monkeypatch.setattr(speculative, "accepted_drafts",
                        lambda draft_probs, num_drafts, uniforms: num_drafts)
    spec = _draw(model, Speculation(num_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1))
    assert _chi_square_pvalue(spec, probs) < 1e-6


def test_greedy_equals_plain_greedy_with_cache_repacking(tiny_model_dir, monkeypatch):
    """Any drafter keeps the tokens: one that drafts at random gets most drafts rejected, so the
    KV cache fills with holes and is repacked; the tokens stay plain greedy's."""
    model, tok = load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "1*2=", "12*34+56="])
    kw = dict(num_generations=3, max_new_tokens=40, greedy=True, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    plain = sample_completions(model, prompts, **kw)
    gen = torch.Generator().manual_seed(0)
    draft_real = speculative.ngram_drafts

    def random_drafts(context, real, ends, rows, group_size, num_tokens, budget, *args):
        drafts, counts = draft_real(context, real, ends, rows, group_size, num_tokens, budget, *args)
        noise = torch.randint(0, len(tok), drafts.shape, generator=gen)
        odd = torch.rand(len(rows), generator=gen) < 0.5      # half the rows: random drafts
        counts = torch.where(odd, torch.minimum(budget, torch.tensor(num_tokens)), counts)
        return torch.where(odd[:, None], noise, drafts), counts
    monkeypatch.setattr(speculative, "ngram_drafts", random_drafts)
    packed = []
    original = speculative.pack_cache

    def spy(cache, keys):
        packed.append(cache.length)
        return original(cache, keys)
    monkeypatch.setattr(speculative, "pack_cache", spy)
    spec = sample_completions(model, prompts, decoding=Decoding(speculative=Speculation(3)), **kw)
    stats = spec.speculation
    assert packed, "the test needs the cache to be repacked"
    assert 0 < stats.accepted < stats.drafted, stats
    assert torch.equal(plain.ids, spec.ids) and torch.equal(plain.mask, spec.mask)
    assert torch.equal(plain.truncated, spec.truncated)


def test_greedy_equals_plain_greedy_as_rows_finish():
    """The trained embedded model: answers end after different lengths, finished rows leave."""
    model, tok = load_model("embedded").eval(), load_tokenizer("embedded")
    prompts = encode_prompts(tok, ["37*42=", "1*2=", "12*34+56=", "5*6=", "99*99="])
    kw = dict(num_generations=4, max_new_tokens=12, greedy=True, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    plain = sample_completions(model, prompts, decoding=Decoding(batch_size=8), **kw)
    spec = sample_completions(model, prompts,
                              decoding=Decoding(batch_size=8, speculative=Speculation(4)), **kw)
    assert plain.lengths.min() < plain.lengths.max()
    assert torch.equal(plain.ids, spec.ids) and torch.equal(plain.mask, spec.mask)


def test_recorded_logprobs_are_the_sampling_distributions(tiny_model_dir):
    """With a sampling dtype each emitted token's log-prob is recorded, drafted or not."""
    model, tok = load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "1*2="])
    out = sample_completions(model, prompts, num_generations=4, max_new_tokens=10,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             sampling=SamplingSettings(temperature=0.7),
                             decoding=Decoding(dtype=torch.float32, speculative=Speculation(3)),
                             generator=torch.Generator().manual_seed(0))
    assert out.speculation.accepted > 0
    expected = completion_logprobs(model, prompts.ids.repeat_interleave(4, 0),
                                   prompts.mask.repeat_interleave(4, 0), out.ids, out.mask,
                                   temperature=0.7)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-4, rtol=1e-4)


def test_accept_rule_and_residual():
    probs = torch.tensor([[0.2, 0.5, 0.3]])
    drafts_p = torch.tensor([[0.5, 0.9, 0.9]])
    u = torch.tensor([[0.4, 0.95, 0.1]])
    assert accepted_drafts(drafts_p, torch.tensor([3]), u).tolist() == [1]   # stops at the first no
    assert accepted_drafts(drafts_p, torch.tensor([0]), u).tolist() == [0]   # no drafts: none
    rest = residual_weights(probs, torch.tensor([1]), torch.tensor([True]))
    assert torch.equal(rest, torch.tensor([[0.2, 0.0, 0.3]]))
    assert torch.equal(residual_weights(probs, torch.tensor([1]), torch.tensor([False])), probs)


def test_one_step_marginal_is_p_for_any_draft():
    """Accept x with p(x), else draw from p without x: the emitted token is distributed as p."""
    from cppo.sampling.logits import sample_categorical
    p = torch.tensor([0.1, 0.6, 0.25, 0.05])
    n = 200_000
    gen = torch.Generator().manual_seed(0)
    for draft in range(4):
        x = torch.full((n,), draft)
        accepted = accepted_drafts(p[x][:, None], torch.ones(n, dtype=torch.long),
                                   torch.rand(n, 1, generator=gen)).bool()
        redraw = sample_categorical(residual_weights(p.repeat(n, 1), x, ~accepted), gen)
        token = torch.where(accepted, x, redraw)
        freq = torch.bincount(token, minlength=4).double() / n
        torch.testing.assert_close(freq, p.double(), atol=4e-3, rtol=0)


def test_ngram_drafts_from_own_text_and_siblings():
    pad = 0
    # two siblings of one question: row 0 "5 6 7 8 | 5 6", row 1 "5 6 7 8 | 9 9 5 6 1 2"
    context = torch.tensor([[5, 6, 7, 8, 5, 6, pad, pad, pad, pad],
                            [5, 6, 7, 8, 9, 9, 5, 6, 1, 2]])
    ends = torch.tensor([6, 10])
    real = torch.arange(10)[None] < ends[:, None]
    drafts, counts = ngram_drafts(context, real, ends, torch.tensor([0]), 2, 3,
                                  torch.tensor([5]), max_ngram=3, min_ngram=1)
    # longest n first: "8 5 6" is nowhere before, so n=2 "5 6": a full draft (3 tokens) first,
    # then the row's own text ("5 6" -> "7 8 5" over the sibling's "7 8 9"), not the sibling's
    # latest "5 6" -> "1 2" (only 2 tokens follow it)
    assert counts.tolist() == [3] and drafts.tolist() == [[7, 8, 5]]
    drafts, counts = ngram_drafts(context, real, ends, torch.tensor([0]), 2, 3,
                                  torch.tensor([1]), max_ngram=3, min_ngram=1)
    assert counts.tolist() == [1] and drafts.tolist() == [[7, 0, 0]]      # the budget caps it
    # row 0 "9 9 5" -> only its sibling has "9 9 5" followed by "6 1 2"
    context[0, 4:7] = torch.tensor([9, 9, 5])
    ends = torch.tensor([7, 10])
    real = torch.arange(10)[None] < ends[:, None]
    drafts, counts = ngram_drafts(context, real, ends, torch.tensor([0]), 2, 4,
                                  torch.tensor([9]), max_ngram=3, min_ngram=1)
    assert counts.tolist() == [3] and drafts.tolist() == [[6, 1, 2, 0]]
    # a suffix that would reach into left padding (pad id 9 here) does not count: "9 5" in the
    # sibling is no match for row 0's "<pad> 5"; its "5" is (latest: followed by 8)
    context = torch.tensor([[9, 9, 5, 9, 9, 9], [3, 9, 5, 7, 5, 8]])
    real = torch.tensor([[False, False, True, False, False, False], [True] * 6])
    drafts, counts = ngram_drafts(context, real, torch.tensor([3, 6]), torch.tensor([0]), 2, 1,
                                  torch.tensor([5]), max_ngram=2, min_ngram=1)
    assert counts.tolist() == [1] and drafts.tolist() == [[8]]
    # in repetitive text the match with the longest continuation wins over the latest
    context = torch.tensor([[3, 3, 3, 3, 3, 3]])
    drafts, counts = ngram_drafts(context, torch.ones(1, 6, dtype=torch.bool), torch.tensor([6]),
                                  torch.tensor([0]), 1, 3, torch.tensor([9]), max_ngram=2,
                                  min_ngram=1)
    assert counts.tolist() == [3] and drafts.tolist() == [[3, 3, 3]]
    # no match at all
    drafts, counts = ngram_drafts(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.bool),
                                  torch.tensor([3]), torch.tensor([0]), 1, 2, torch.tensor([5]),
                                  max_ngram=2, min_ngram=1)
    assert counts.tolist() == [0]


def test_speculation_needs_the_lean_forward(tiny_model_dir):
    model, tok = load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    prompts = encode_prompts(tok, ["1*2="])
    with pytest.raises(ValueError, match="num_speculative_tokens=2.*lean forward"):
        sample_completions(model, prompts, num_generations=2, max_new_tokens=3,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           decoding=Decoding(lean=False, speculative=Speculation(2)))
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        Speculation(2, prompt_lookup_max=1, prompt_lookup_min=2)


def test_trainer_samples_speculatively_and_logs_it(tiny_model_dir, tmp_path):
    import json
    from helpers import make_trainer
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", num_speculative_tokens=3,
                           max_completion_length=12, max_steps=2, save_steps=0)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "speculative/acceptance_rate" in r]
    assert steps and all(r["speculative/tokens_per_forward"] >= 1 for r in steps)
    assert any(r["speculative/draft_tokens"] > 0 for r in steps)


def test_speculation_config_errors(tiny_model_dir, tmp_path):
    from cppo.config import CPPOConfig
    from cppo.errors import ConfigError
    from cppo.trainer import CPPOTrainer
    from helpers import ROWS, odd_length_reward
    with pytest.raises(ConfigError, match="'num_speculative_tokens' is 2 but 'lean_forward' is false"):
        CPPOConfig(num_speculative_tokens=2, lean_forward=False)
    with pytest.raises(ConfigError, match="'num_speculative_tokens' is 2, which applies to the "
                                          "built-in sampler; with use_vllm"):
        CPPOConfig(num_speculative_tokens=2, use_vllm=True)
    with pytest.raises(ConfigError, match="'num_speculative_tokens' is -1"):
        CPPOConfig(num_speculative_tokens=-1)
    with pytest.raises(ConfigError, match="'prompt_lookup_min' is 3 and 'prompt_lookup_max' is 2"):
        CPPOConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    model = load_model(tiny_model_dir)
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    with pytest.raises(ConfigError, match="'num_speculative_tokens' is 2, which needs the lean "
                                          "forward.*forward hooks"):
        CPPOTrainer(model=model, processing_class=load_tokenizer(tiny_model_dir),
                    reward_funcs=[odd_length_reward], train_dataset=ROWS,
                    args=CPPOConfig(output_dir=str(tmp_path / "run"), num_speculative_tokens=2,
                                    max_steps=1, per_device_train_batch_size=8, num_generations=4))


def test_a_draft_position_is_verified_when_half_the_rows_have_a_draft_there():
    from cppo.sampling.speculative import quorum_width
    assert quorum_width(torch.tensor([0, 0, 3, 4])) == 3
    assert quorum_width(torch.tensor([0, 0, 0, 5])) == 0       # one row's draft: not worth the batch
    assert quorum_width(torch.tensor([2, 2, 1])) == 2
    assert quorum_width(torch.tensor([], dtype=torch.long)) == 0


def test_bfloat16_sampling_in_chunks(tiny_model_dir):
    """Speculation composes with a sampling dtype and with chunked decoding: the counts add up
    over the chunks and every token's sampler log-prob is recorded."""
    model, tok = load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "1*2=", "12*34+56="])
    out = sample_completions(model, prompts, num_generations=4, max_new_tokens=12,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             decoding=Decoding(dtype=torch.bfloat16, batch_size=4,
                                               speculative=Speculation(3)),
                             generator=torch.Generator().manual_seed(0))
    stats = out.speculation
    assert out.ids.shape[0] == 12 and stats.forwards >= 3 and stats.tokens > 0
    assert stats.tokens + 12 == int(out.lengths.sum())     # the first tokens come from the prefill
    assert (out.logprobs[out.mask.bool()] < 0).all() and (out.logprobs[~out.mask.bool()] == 0).all()
