"""TRL's rollout_func and env_mask: multi-turn completions whose tool-written tokens are in the
context of every forward pass but out of the loss; pruning keeps or drops whole completions.
(The loss with a tool mask is proven equal to TRL's in test_trl_differential.py.)"""

import pytest
import torch

from cppo.sampling.multi_turn import RolloutError, rollout_from_output
from helpers import ROWS, make_trainer

EOS, PAD = 2, 0


def test_rollout_output_is_checked_and_padded():
    out = rollout_from_output({"prompt_ids": [[5, 6], [7]], "completion_ids": [[9, EOS], [9, 9, 9]],
                               "logprobs": [[-0.5, -0.1], [-1.0, None, -2.0]],
                               "env_mask": [[1, 1], [1, 0, 1]], "tool_calls": [0, 1]},
                              2, eos_token_id=EOS, pad_token_id=PAD)
    assert out.prompts.ids.tolist() == [[5, 6], [PAD, 7]] and out.prompts.mask.tolist() == [[1, 1], [0, 1]]
    assert out.completions.ids.tolist() == [[9, EOS, PAD], [9, 9, 9]]
    assert out.completions.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out.completions.truncated.tolist() == [False, True]   # last token not EOS (TRL's rule)
    assert out.completions.tool_mask.tolist() == [[1, 1, 1], [1, 0, 1]]
    assert out.completions.logprobs[1].tolist() == [-1.0, 0.0, -2.0]
    assert out.columns == {"tool_calls": [0, 1]}


@pytest.mark.parametrize("output, message", [
    ([], "expected a dict with keys"),
    ({"prompt_ids": [[1]], "completion_ids": [[1]]}, "must return keys ['logprobs']"),
    ({"prompt_ids": [[1]], "completion_ids": [[1], [2]], "logprobs": None},
     "'completion_ids' with 2 entries for 1 prompts"),
    ({"prompt_ids": [[1]], "completion_ids": [["a"]], "logprobs": None}, "expected a list of token ids"),
    ({"prompt_ids": [[1]], "completion_ids": [[1, 2]], "logprobs": [[0.0]]}, "'logprobs' that do not match"),
    ({"prompt_ids": [[1]], "completion_ids": [[1, 2]], "logprobs": None, "env_mask": [[1, 2]]},
     "'env_mask' that does not match"),
    ({"prompt_ids": [[1]], "completion_ids": [[1]], "logprobs": None, "extra": 3},
     "'extra' that is not a list of 1 values"),
])
def test_bad_rollout_output_is_named(output, message):
    with pytest.raises(RolloutError, match=pytest.importorskip("re").escape(message)):
        rollout_from_output(output, 1, eos_token_id=EOS, pad_token_id=PAD)


def calculator(prompt: str) -> str:
    """The tool: evaluates the task's expression ('12*34=' -> '408')."""
    a, b = prompt.rstrip("=").split("*")
    return str(int(a) * int(b))


def calculator_rollout(prompts, trainer):
    """Two model turns around a calculator call: the model writes 2 tokens, the calculator's
    answer and ';' follow (written by the tool), then the model writes up to 3 more."""
    from cppo.rollout import encode_prompts, sample_completions
    tok, args = trainer.tokenizer, trainer.args
    kw = dict(num_generations=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              lean=args.lean_forward, generator=torch.Generator().manual_seed(trainer.step))
    batch = encode_prompts(tok, prompts)
    first = sample_completions(trainer.policy, batch, max_new_tokens=2, **kw)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": [], "tool_calls": []}
    for i, prompt in enumerate(prompts):
        prompt_ids = batch.ids[i][batch.mask[i].bool()].tolist()
        turn = first.ids[i][first.mask[i].bool()].tolist()
        tool = []
        if turn[-1] != tok.eos_token_id:
            tool = tok(calculator(prompt) + ";", add_special_tokens=False)["input_ids"]
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(turn + tool)
        out["env_mask"].append([1] * len(turn) + [0] * len(tool))
        out["tool_calls"].append(int(bool(tool)))
    context = [p + c for p, c in zip(out["prompt_ids"], out["completion_ids"])]
    from cppo.padding import pad_token_lists
    from cppo.rollout import PromptBatch
    second = sample_completions(trainer.policy, PromptBatch(*pad_token_lists(
        context, tok.pad_token_id, side="left")), max_new_tokens=3, **kw)
    for i in range(len(prompts)):
        if out["tool_calls"][i]:
            turn = second.ids[i][second.mask[i].bool()].tolist()
            out["completion_ids"][i] += turn
            out["env_mask"][i] += [1] * len(turn)
    return out


@pytest.mark.parametrize("lean", [True, False])
def test_calculator_rollouts_train_with_tool_tokens_out_of_the_loss(tiny_model_dir, tmp_path,
                                                                    monkeypatch, lean):
    import cppo.trainer as trainer_module
    seen_columns, rollouts, batches, loss_masks, attended = [], [], [], [], []

    def reward(prompts, completions, tool_calls=None, **kw):
        if tool_calls is not None:   # (the preflight check before training has no rollout)
            seen_columns.append(list(tool_calls))
        return [float(len(c) % 3) for c in completions]
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=reward, rows=ROWS[:16],
                           max_steps=2, lean_forward=lean, pruning_rate=0.5)

    def rollout(prompts, trainer):
        out = calculator_rollout(prompts, trainer)
        rollouts.append(out)
        return out
    trainer.rollout_func = rollout
    build = trainer.build_batch
    trainer.build_batch = lambda *a, **kw: batches.append(build(*a, **kw)) or batches[-1]
    policy_loss, logprobs = trainer_module.per_token_policy_loss, trainer_module.completion_logprobs

    def spy_loss(*a, completion_mask=None, **kw):
        loss_masks.append(completion_mask.clone())
        return policy_loss(*a, completion_mask=completion_mask, **kw)

    def spy_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw):
        attended.append(completion_mask.clone())
        return logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw)
    monkeypatch.setattr(trainer_module, "per_token_policy_loss", spy_loss)
    monkeypatch.setattr(trainer_module, "completion_logprobs", spy_logprobs)
    trainer.train()

    assert len(rollouts) == 2 and all(len(r["prompt_ids"]) == 16 for r in rollouts)  # 4 q x G 4
    assert seen_columns[-2:] == [r["tool_calls"] for r in rollouts]   # extra keys reach rewards
    assert sum(sum(r["tool_calls"]) for r in rollouts) > 0
    batch = batches[0]
    masks = {tuple(c): m for c, m in zip(rollouts[0]["completion_ids"], rollouts[0]["env_mask"])}
    assert len(batch) == 8                        # pruning kept half: whole completions
    prompts = {}
    for c, p in zip(rollouts[0]["completion_ids"], rollouts[0]["prompt_ids"]):
        prompts.setdefault(tuple(c), set()).add(tuple(p))
    for ids, mask, tool, p_ids, p_mask in zip(batch.completion_ids, batch.completion_mask,
                                              batch.tool_mask, batch.prompt_ids, batch.prompt_mask):
        n = int(mask.sum())
        assert tool[:n].tolist() == masks[tuple(ids[:n].tolist())]   # the completion's own mask
        assert tuple(p_ids[p_mask.bool()].tolist()) in prompts[tuple(ids[:n].tolist())]
    # the forward passes attend to every token, tool tokens included; the loss skips them
    assert any(bool((m.bool() & (t == 0)).any()) for m, t in zip(attended[0], batch.tool_mask))
    assert torch.equal(loss_masks[0].bool(), (batch.completion_mask * batch.tool_mask).bool())
    metrics = [r for r in map(__import__("json").loads,
                              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]
    assert len(metrics) == 2 and all(r["completions/mean_length"] > 0 for r in metrics)
