"""The KV-sharing sampler against transformers generate, and log-prob scoring."""

import torch

from cppo.models import load_model, load_tokenizer
from cppo.sampling.logits import filter_logits
from cppo.sampling.logprobs import completion_logprobs
from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions


def _setup(path):
    model = load_model(path).eval()
    tok = load_tokenizer(path)
    return model, tok


def test_greedy_matches_transformers_generate(tiny_model_dir):
    model, tok = _setup(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "1*2=", "12*34+56="])  # different lengths: left pad
    ours = sample_completions(model, prompts, num_generations=2, max_new_tokens=6, greedy=True,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ref = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, do_sample=False,
                         max_new_tokens=6, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, prompts.ids.shape[1]:]
    ref = ref.repeat_interleave(2, 0)
    for row in range(ref.shape[0]):
        expected = ref[row].tolist()          # up to and including the first EOS, as we stop
        if tok.eos_token_id in expected:
            expected = expected[:expected.index(tok.eos_token_id) + 1]
        n = int(ours.mask[row].sum())
        assert ours.ids[row, :n].tolist() == expected   # the same tokens and the same length
        assert (ours.ids[row, n:] == tok.pad_token_id).all()
        assert bool(ours.truncated[row]) == (tok.eos_token_id not in expected)


def test_shared_prefill_gives_the_same_distribution_as_repeating_the_prompt(tiny_model_dir):
    """Sampling with the cache repeated G times equals sampling from G copies of the prompt."""
    model, tok = _setup(tiny_model_dir)
    one = encode_prompts(tok, ["37*42="])
    many = encode_prompts(tok, ["37*42="] * 4)
    kw = dict(max_new_tokens=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    a = sample_completions(model, one, num_generations=4, generator=torch.Generator().manual_seed(3), **kw)
    b = sample_completions(model, many, num_generations=1, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)


def test_mask_stops_after_eos_and_truncation_flag(tiny_model_dir):
    model, tok = _setup(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "11*11="])
    out = sample_completions(model, prompts, num_generations=8, max_new_tokens=4,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             generator=torch.Generator().manual_seed(0))
    for ids, mask, truncated in zip(out.ids, out.mask, out.truncated):
        n = int(mask.sum())
        eos_pos = (ids == tok.eos_token_id).nonzero()
        if truncated:
            assert n == ids.shape[0] and len(eos_pos) == 0
        else:
            assert int(eos_pos[0]) == n - 1
            assert (ids[n:] == tok.pad_token_id).all()


def test_batched_generation_equals_one_batch(tiny_model_dir):
    model, tok = _setup(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "11*11=", "05*07="])
    kw = dict(num_generations=2, max_new_tokens=5, greedy=True, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    whole = sample_completions(model, prompts, **kw)
    chunked = sample_completions(model, prompts, decoding=Decoding(batch_size=2), **kw)
    assert torch.equal(whole.ids, chunked.ids) and torch.equal(whole.mask, chunked.mask)
    assert torch.equal(whole.truncated, chunked.truncated)


def test_logprobs_match_a_direct_forward(tiny_model_dir):
    model, tok = _setup(tiny_model_dir)
    prompts = encode_prompts(tok, ["37*42=", "1*2="])
    out = sample_completions(model, prompts, num_generations=1, max_new_tokens=5,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             generator=torch.Generator().manual_seed(1))
    logps = completion_logprobs(model, prompts.ids, prompts.mask, out.ids, out.mask, temperature=0.7)
    for row in range(2):
        p = prompts.ids[row][prompts.mask[row].bool()]
        n = int(out.mask[row].sum())
        seq = torch.cat([p, out.ids[row, :n]])[None]
        logits = model(input_ids=seq).logits[0, len(p) - 1:-1] / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, out.ids[row, :n, None]).squeeze(-1)
        torch.testing.assert_close(logps[row, :n], expected, atol=1e-4, rtol=1e-4)


def test_filter_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[True, False, False, True]]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = ~torch.isinf(filter_logits(probs, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]


def test_sample_categorical_draws_from_the_given_distribution():
    from cppo.sampling.logits import sample_categorical
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 6.0, 0.0],     # unnormalised rows, zeros inside
                            [5.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    draws = 200_000
    probs = weights.repeat(draws, 1)
    tokens = sample_categorical(probs, torch.Generator().manual_seed(0)).view(draws, 2)
    for row in range(2):
        freq = torch.bincount(tokens[:, row], minlength=6).float() / draws
        expected = weights[row] / weights[row].sum()
        assert (freq[expected == 0] == 0).all()            # weight 0: never drawn
        torch.testing.assert_close(freq, expected, atol=0.005, rtol=0)


def test_a_large_vocabulary_is_sampled_block_by_block_from_the_same_distribution():
    """Over 2 blocks the draw is inverted block first, then token: the frequencies are the
    weights' (zero weights at a block's edges and in the shorter last block never drawn), and
    each draw is the token one inversion of the whole row gives for the same uniform number,
    up to rounding at the boundaries."""
    from cppo.sampling.logits import SAMPLING_BLOCK, sample_categorical
    vocab = 3 * SAMPLING_BLOCK + 40                        # a last block of 40 tokens
    weights = torch.zeros(vocab)
    heavy = [0, SAMPLING_BLOCK - 1, SAMPLING_BLOCK + 1, 2 * SAMPLING_BLOCK + 7, vocab - 1]
    weights[heavy] = torch.tensor([1.0, 4.0, 2.0, 0.5, 2.5])
    weights[SAMPLING_BLOCK + 100] = 1e-3                   # a light one, in a block of its own
    draws = 100_000
    tokens = sample_categorical(weights.repeat(draws, 1), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    assert (freq[weights == 0] == 0).all()
    torch.testing.assert_close(freq, weights / weights.sum(), atol=0.004, rtol=0)
    probs = torch.randn(64, vocab).mul(3).softmax(-1)
    cdf = probs.cumsum(-1)
    same = 0
    for seed in range(20):
        u = torch.rand(64, 1, generator=torch.Generator().manual_seed(seed)) * cdf[:, -1:]
        whole_row = torch.searchsorted(cdf, u, right=True).squeeze(-1)
        same += int((sample_categorical(probs, torch.Generator().manual_seed(seed)) == whole_row).sum())
    assert same >= 64 * 20 - 3


def test_a_uniform_number_at_the_top_of_the_row_still_draws_a_token_of_weight(monkeypatch):
    """With u as close to 1 as float32 goes, rounding between the block sums and the sums within
    a block must not carry the draw past the last token of weight (into a zero, or past the
    vocabulary in the shorter last block)."""
    from cppo.sampling import logits as sampling
    vocab = 3 * sampling.SAMPLING_BLOCK + 40
    weights = torch.rand(4096, vocab, generator=torch.Generator().manual_seed(5)) * 1e3
    weights[:, -20:-1] = 0.0                # tokens of no weight before the last one
    top = 1 - 2.0 ** -24
    monkeypatch.setattr(sampling.torch, "rand", lambda n, one, **kw: torch.full((n, one), top))
    tokens = sampling.sample_categorical(weights)
    assert int(tokens.max()) < vocab
    assert bool((weights.gather(1, tokens[:, None]) > 0).all())


def test_sampled_logprobs_are_the_softmax_logprobs_of_the_drawn_tokens():
    """sample_logits draws from softmax(logits) and returns log_softmax at the drawn tokens,
    from bfloat16 logits too, and the same with a reused buffer as without."""
    from cppo.sampling.logits import sample_logits, sampling_logits
    logits = torch.randn(6, 3 * 256 + 5, generator=torch.Generator().manual_seed(1)) * 4
    logits[:, 7] = float("-inf")                            # masked: never drawn
    for dtype in (torch.float32, torch.bfloat16):
        given = logits.to(dtype)
        tokens, logprobs = sample_logits(given, torch.Generator().manual_seed(2))
        expected = torch.log_softmax(given.float(), -1).gather(1, tokens[:, None]).squeeze(1)
        torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
        again, again_logprobs = sample_logits(given, torch.Generator().manual_seed(2),
                                              out=torch.empty(9, logits.shape[1])[:6])
        assert torch.equal(again, tokens) and torch.equal(again_logprobs, logprobs)
    many = torch.tensor([[0.0, 1.0, 2.0, float("-inf")]]).repeat(200_000, 1)
    drawn, _ = sample_logits(many, torch.Generator().manual_seed(3))
    freq = torch.bincount(drawn, minlength=4).float() / len(many)
    torch.testing.assert_close(freq, torch.softmax(many[0], -1), atol=0.005, rtol=0)
    assert sampling_logits(given) is given                   # no transform: no copy
    assert sampling_logits(given, temperature=0.7).dtype == torch.float32


def test_sample_categorical_refuses_a_broken_distribution():
    import pytest
    from cppo.sampling.logits import sample_categorical
    for bad in (torch.tensor([[0.5, float("nan")]]), torch.tensor([[0.0, 0.0]]),
                torch.tensor([[float("inf"), 1.0]])):
        with pytest.raises(ValueError, match="not finite or is all zero"):
            sample_categorical(bad)


def test_finished_rows_leave_the_decode_batch():
    """Once some completions have ended, the decode steps run on the others only, and the
    completions are the same as decoding every row to the end (greedy, so no randomness)."""
    model, tok = _setup("embedded")   # trained: its answers end, after different lengths
    prompts = encode_prompts(tok, ["37*42=", "1*2=", "12*34+56=", "5*6="])
    kw = dict(num_generations=2, max_new_tokens=12, greedy=True, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    for lean in (True, False):
        from cppo.sampling import sampler as rollout
        rows_seen = []
        original = rollout._decode

        def spy(logits, advance, *args, **kwargs):
            def counted(tokens, rows):
                rows_seen.append(len(tokens))
                return advance(tokens, rows)
            return original(logits, counted, *args, **kwargs)
        rollout._decode = spy
        try:
            out = sample_completions(model, prompts, decoding=Decoding(lean=lean, share_prefixes=False),
                                     **kw)
        finally:
            rollout._decode = original
        lengths = out.mask.sum(1)
        assert lengths.min() < lengths.max()        # the test needs completions of different lengths
        # each decode step runs the rows that have not ended, give or take the one-eighth slack
        for step, rows in enumerate(rows_seen, start=1):
            running = int((lengths > step).sum())
            assert running <= rows < running + max(1, len(lengths) // 8) + 1, (step, rows, running)
        assert rows_seen[-1] < len(lengths)
        ref = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, do_sample=False,
                             max_new_tokens=12, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[:, prompts.ids.shape[1]:].repeat_interleave(2, 0)
        for row in range(len(lengths)):
            n = int(lengths[row])
            assert out.ids[row, :n].tolist() == ref[row, :n].tolist()
            assert (out.ids[row, n:] == tok.pad_token_id).all()


def _decode_batch_sizes(monkeypatch) -> list:
    """The number of sequences each decode step of the sampler runs (recorded into the list)."""
    from cppo.sampling import sampler
    sizes, original = [], sampler._decode

    def spy(logits, advance, *args, **kwargs):
        def counted(tokens, rows):
            sizes.append(len(tokens))
            return advance(tokens, rows)
        return original(logits, counted, *args, **kwargs)
    monkeypatch.setattr(sampler, "_decode", spy)
    return sizes


def test_identical_prefixes_are_decoded_once(monkeypatch):
    """Greedy completions of a question are identical token for token: with share_prefixes each
    decode step runs one sequence per question still decoding (without, every row), and the
    completions are transformers' greedy ones either way."""
    model, tok = _setup("embedded")
    prompts = encode_prompts(tok, ["37*42=", "1*2=", "12*34+56=", "5*6="])
    kw = dict(num_generations=4, max_new_tokens=12, greedy=True, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    ref = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, do_sample=False,
                         max_new_tokens=12, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, prompts.ids.shape[1]:].repeat_interleave(4, 0)
    for lean in (True, False):
        for share in (True, False):
            sizes = _decode_batch_sizes(monkeypatch)
            out = sample_completions(model, prompts, decoding=Decoding(lean=lean, share_prefixes=share),
                                     **kw)
            lengths = out.mask.sum(1)
            per_question = lengths.view(4, 4)[:, 0]
            assert per_question.min() < per_question.max()   # questions end at different steps
            if share:
                assert sizes == [int((per_question > step).sum()) for step in range(1, len(sizes) + 1)]
                # the counts the trainer logs (cppo/decode_rows_saved): every completion's tokens
                # but its last were decoded rows, the sequences are the forwards' rows
                assert (out.decode.rows, out.decode.sequences) == (int((lengths - 1).sum()), sum(sizes))
            else:
                assert sizes[0] == 16 and out.decode is None
            for row in range(16):
                n = int(lengths[row])
                assert out.ids[row, :n].tolist() == ref[row, :n].tolist(), (lean, share, row)


def test_shared_prefixes_sample_each_completion_from_the_policy(monkeypatch):
    """Rows on a shared sequence each draw their own token: per-position token frequencies and
    the number of distinct completions per question match plain sampling's (a rule giving all
    rows of a sequence one draw would make siblings identical), while the decode steps run fewer
    sequences than rows."""
    model, tok = _setup("embedded")
    prompts = encode_prompts(tok, ["37*42=", "12*34+56=", "5*6=", "99*9="] * 50)
    kw = dict(num_generations=8, max_new_tokens=4, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)

    def draws(share: bool, first_seed: int):
        frequencies, distinct = torch.zeros(4, 18), []
        for seed in range(first_seed, first_seed + 3):
            out = sample_completions(model, prompts, decoding=Decoding(share_prefixes=share),
                                     generator=torch.Generator().manual_seed(seed), **kw)
            for position in range(out.ids.shape[1]):
                frequencies[position] += torch.bincount(out.ids[:, position], minlength=18).float()
            distinct += [len({tuple(r) for r in group.tolist()})
                         for group in out.ids.view(-1, 8, out.ids.shape[1])]
        return frequencies / frequencies.sum(1, keepdim=True), sum(distinct) / len(distinct)
    sizes = _decode_batch_sizes(monkeypatch)
    shared = draws(True, 100)
    assert max(sizes) < len(prompts) * 8 * 3 / 4     # sequences were shared
    plain = draws(False, 200)
    total_variation = 0.5 * (shared[0] - plain[0]).abs().sum(1).max()
    assert total_variation < 0.05, total_variation
    assert abs(shared[1] - plain[1]) < 0.25, (shared[1], plain[1])


def test_the_share_prefixes_field_reaches_the_backends_sampler(monkeypatch):
    """`share_prefixes: false` decodes every row from the first step; the default shares."""
    from cppo.assembly.run import backend_settings
    from cppo.config import CPPOConfig
    from cppo.sampling.backends import make_backend
    model, tok = _setup("embedded")
    prompts = encode_prompts(tok, ["37*42=", "5*6="])
    first_steps = {}
    for share in (True, False):
        args = CPPOConfig(num_generations=8, temperature=0.1, share_prefixes=share,
                          generation_dtype=None)
        sizes = _decode_batch_sizes(monkeypatch)
        make_backend(model, tok, backend_settings(args)).generate(prompts, round_index=0)
        first_steps[share] = sizes[0]
    assert first_steps == {True: 2, False: 16}


def test_the_trainer_logs_the_decode_rows_sharing_saved(tiny_model_dir, tmp_path):
    import json
    from helpers import make_trainer
    saved = {}
    for share in (True, False):
        run = tmp_path / f"share_{share}"
        make_trainer(tiny_model_dir, run, share_prefixes=share, temperature=0.05, max_steps=2,
                     save_steps=0).train()
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        saved[share] = [r["cppo/decode_rows_saved"] for r in records if "cppo/decode_rows_saved" in r]
    # near-greedy, a question's G = 4 completions are one sequence: 3 of 4 rows saved
    assert saved[True] and all(0.5 < s < 1 for s in saved[True]), saved
    assert saved[False] == []
