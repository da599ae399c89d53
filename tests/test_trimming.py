"""The kept batch is trimmed: the old-policy, reference and policy passes run on the columns the
kept completions use (not the width of the longest scored one), with the same results."""

import pytest
import torch

from cppo.models.lean import LeanForward
from cppo.sampling.batches import Completions
from cppo.sampling.sampler import encode_prompts
from cppo.run.batch import StepBatch
import helpers

G = 4
PROMPTS = ["1*2=", "12*34=", "12*34=", "123*456="]   # the longest prompt's question is all pruned
LENGTHS = [[2, 3, 9, 9],        # completion lengths (tokens, EOS included) per question
           [3, 2, 9, 9],
           [6, 4, 5, 1],
           [12, 12, 12, 12]]
KEEP = [[1, 1, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 1],
        [0, 0, 0, 0]]
MICRO = 4                       # kept rows per micro-batch: lengths (2, 3, 3, 2) and (6, 4, 5, 1)


def reward(completions, **kw):
    return [0.0] * len(completions)


def make_trainer(model_dir, tmp_path, lean_forward):
    return helpers.make_trainer(
        model_dir, tmp_path, reward=reward, rows=[{"prompt": p, "answer": "0"} for p in PROMPTS],
        max_steps=2, num_generations=G, pruning_rate=0.5, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=2, max_completion_length=12, beta=0.04, num_iterations=2,
        learning_rate=1e-2, lean_forward=lean_forward, seed=5)


def step_inputs(trainer):
    """Hand-made prompts, completions (with sampler log-probs), advantages and keep_mask."""
    tok = trainer.tokenizer
    prompts = encode_prompts(tok, PROMPTS)
    gen = torch.Generator().manual_seed(0)
    digits = torch.tensor(tok.convert_tokens_to_ids(list("0123456789")))
    width = max(max(r) for r in LENGTHS)
    ids = digits[torch.randint(0, 10, (len(PROMPTS) * G, width), generator=gen)]
    lengths = torch.tensor(LENGTHS).flatten()
    column = torch.arange(width)
    ids[column == (lengths - 1)[:, None]] = tok.eos_token_id
    ids[column >= lengths[:, None]] = tok.pad_token_id
    mask = (column < lengths[:, None]).long()
    logprobs = -torch.rand(ids.shape, generator=gen) * mask
    completions = Completions(ids=ids, mask=mask, truncated=torch.zeros(len(ids), dtype=torch.bool),
                              logprobs=logprobs)
    advantages = torch.randn(len(PROMPTS), G, generator=gen)
    return prompts, completions, advantages, torch.tensor(KEEP, dtype=torch.bool)


def record_widths(trainer, monkeypatch):
    """Columns (prompt + completion) of every forward pass the models receive. For the lean
    passes that is the padded layout attention runs in (the per-token work runs on real tokens
    only, counted in tests/test_padding_free.py)."""
    widths = []
    if trainer.args.lean_forward:
        call, scoring = LeanForward.__call__, LeanForward.completion_logits

        def counted_call(self, ids, *args, **kwargs):
            widths.append(ids.shape[1])
            return call(self, ids, *args, **kwargs)

        def counted_scoring(self, prompt_ids, prompt_mask, question, completion_ids, completion_mask, **kw):
            widths.append(prompt_ids.shape[1] + completion_ids.shape[1])
            return scoring(self, prompt_ids, prompt_mask, question, completion_ids, completion_mask, **kw)
        monkeypatch.setattr(LeanForward, "__call__", counted_call)
        monkeypatch.setattr(LeanForward, "completion_logits", counted_scoring)
    else:
        for model in (trainer.policy, trainer.reference):
            model.register_forward_pre_hook(
                lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                with_kwargs=True)
    return widths


@pytest.mark.parametrize("lean_forward", [True, False])
def test_passes_see_the_width_of_the_longest_kept_completion(tiny_model_dir, tmp_path, monkeypatch,
                                                              lean_forward):
    trainer = make_trainer(tiny_model_dir, tmp_path, lean_forward)
    prompts, completions, advantages, keep = step_inputs(trainer)
    widths = record_widths(trainer, monkeypatch)
    batch = trainer.build_batch(prompts, completions, advantages, keep)
    trainer.fill_old_and_ref_logprobs(batch)
    trainer.update(batch)

    tok = trainer.tokenizer
    prompt_len = [len(tok(p)["input_ids"]) for p in PROMPTS]
    kept_prompt = max(prompt_len[q] for q in range(len(PROMPTS)) if any(KEEP[q]))
    kept_lengths = [n for q in range(len(PROMPTS)) for n, k in zip(LENGTHS[q], KEEP[q]) if k]
    whole = kept_prompt + max(kept_lengths)    # old-policy and reference passes (chunks of MICRO)
    micro = [kept_prompt + max(kept_lengths[s:s + MICRO]) for s in range(0, len(kept_lengths), MICRO)]
    assert whole < max(prompt_len) + max(max(r) for r in LENGTHS)  # there is padding to trim
    assert micro[0] < whole
    assert batch.completion_ids.shape[1] == max(kept_lengths)
    assert widths == [whole] * 4 + micro       # old, reference (2 chunks each), 2 micro-batches


@pytest.mark.parametrize("lean_forward", [True, False])
def test_trimming_leaves_losses_and_updates_unchanged(tiny_model_dir, tmp_path, monkeypatch,
                                                      lean_forward):
    results = []
    for trim in (True, False):
        with monkeypatch.context() as patch:
            if not trim:
                patch.setattr(StepBatch, "trimmed", lambda self: self)
            trainer = make_trainer(tiny_model_dir, tmp_path / str(trim), lean_forward)
            batch = trainer.build_batch(*step_inputs(trainer))
            trainer.fill_old_and_ref_logprobs(batch)
            width = batch.completion_ids.shape[1]
            losses = [trainer.update(batch)["loss"] for _ in range(2)]
            results.append((width, batch.old_logps, batch.ref_logps, losses,
                            [p.detach().clone() for p in trainer.policy.parameters()]))
    (w_trim, old_t, ref_t, loss_t, params_t), (w_full, old_f, ref_f, loss_f, params_f) = results
    assert w_trim < w_full
    torch.testing.assert_close(old_t, old_f[:, :w_trim], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_t, ref_f[:, :w_trim], rtol=1e-5, atol=1e-5)
    assert loss_t == pytest.approx(loss_f, rel=1e-5, abs=1e-6)
    for a, b in zip(params_t, params_f):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
