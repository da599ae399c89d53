"""TRL's rollout_func and env_mask: multi-turn completions whose tool-written tokens are in the
context of every forward pass but out of the loss; pruning keeps or drops whole completions.
(The loss with a tool mask is proven equal to TRL's in test_trl_differential.py.)"""

import pytest
import torch

from cppo.errors import RolloutError
from cppo.sampling.multi_turn import rollout_from_output
from helpers import ROWS, make_trainer
from helpers.tool_calls import (CalculatorEnv, multiply, save_tool_model, script_first_turn,
                                tool_rows)

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
    from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions
    tok, args = trainer.tokenizer, trainer.args
    kw = dict(num_generations=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              decoding=Decoding(lean=args.lean_forward), generator=torch.Generator().manual_seed(trainer.run_state.step))
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
    from cppo.sampling.padding import pad_token_lists
    from cppo.sampling.batches import PromptBatch
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
    import cppo.learning.update as update_module
    import cppo.algorithm.micro_batch as micro_batch
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
    policy_loss, logprobs = micro_batch.per_token_policy_loss, update_module.completion_logprobs

    def spy_loss(*a, completion_mask=None, **kw):
        loss_masks.append(completion_mask.clone())
        return policy_loss(*a, completion_mask=completion_mask, **kw)

    def spy_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw):
        attended.append(completion_mask.clone())
        return logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw)
    monkeypatch.setattr(micro_batch, "per_token_policy_loss", spy_loss)
    monkeypatch.setattr(update_module, "completion_logprobs", spy_logprobs)
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


# ---------------------------------------------------------------- tools= (TRL's tool loop) ----
@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """helpers.tool_calls' tiny Qwen2: a byte-level tokenizer and a Qwen-style chat template that
    renders tools, tool calls and tool results."""
    return save_tool_model(tmp_path_factory.mktemp("tool_model"))


def test_tool_calls_are_parsed_run_and_rendered(tool_model_dir):
    from cppo.models import load_tokenizer
    from cppo.sampling.tools import parse_tool_calls, run_tool_calls, tool_suffix_ids
    tok = load_tokenizer(tool_model_dir)
    ids = tok('<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
              '<tool_call>{"name": "divide", "arguments": {}}</tool_call><tool_call>{bad</tool_call>'
              )["input_ids"]
    calls = parse_tool_calls(tok, ids)
    assert [c["function"]["name"] for c in calls] == ["multiply", "divide"]   # {bad: not a call
    messages, failures = run_tool_calls(calls, {"multiply": multiply})
    assert messages[0] == {"role": "tool", "name": "multiply", "content": "408"}
    assert failures == 1 and "Tool divide not found" in messages[1]["content"]
    suffix = tok.decode(tool_suffix_ids(tok, messages[:1]))
    assert suffix == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" \
                     "<|im_start|>assistant\n"


seen_completions = []   # what the reward function of tool_trainer was given


def tool_trainer(model_dir, tmp_path, lean, **overrides):
    from cppo.config import CPPOConfig
    from cppo.models import load_model, load_tokenizer
    from cppo.trainer import CPPOTrainer
    rows = tool_rows()
    values = dict(model=model_dir, output_dir=str(tmp_path / "run"), max_steps=1,
                  per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                  max_completion_length=160, eval_steps=0, save_steps=0, progress_bar=False,
                  eval_num_questions=1, learning_rate=1e-3, seed=3, lean_forward=lean)
    values.update(overrides)

    def reward(prompts, completions, **kw):
        seen_completions.append(completions)
        return [float(len(c[-1]["content"]) % 3) for c in completions]
    return CPPOTrainer(model=load_model(model_dir), processing_class=load_tokenizer(model_dir),
                       reward_funcs=[reward], args=CPPOConfig(**values), train_dataset=rows,
                       tools=[multiply])


@pytest.mark.parametrize("lean", [True, False])
def test_tools_run_between_turns_and_their_results_leave_the_loss(tool_model_dir, tmp_path, lean):
    import json
    trainer = tool_trainer(tool_model_dir, tmp_path, lean)
    calls = script_first_turn(trainer)
    batches, generated = [], []
    build, generate = trainer.build_batch, trainer.generate
    trainer.build_batch = lambda *a, **kw: batches.append(build(*a, **kw)) or batches[-1]
    trainer.generate = lambda rows: generated.append(generate(rows)) or generated[-1]
    trainer.train()
    assert calls == [4, 8]      # 4 prompts x G 4, then one more turn for the 8 that called
    prompts, completions = generated[0]
    given = [c for c in seen_completions if len(c) == 16][-1]   # the reward function's completions
    texts = trainer.tokenizer.batch_decode(completions.ids, skip_special_tokens=False)
    for i, (text, tool_mask, mask) in enumerate(zip(texts, completions.tool_mask, completions.mask)):
        if i % 2:
            assert "<tool_response>" not in text and bool(tool_mask[mask.bool()].all())
            assert [m["role"] for m in given[i]] == ["assistant"]
            continue
        question = trainer.tokenizer.decode(prompts.ids[i][prompts.mask[i].bool()])
        a, b = map(int, question.split("user\n")[-1].split("=")[0].split("*"))
        assert f"<tool_response>\n{a * b}\n</tool_response>" in text     # the tool ran
        # the reward functions see TRL's messages: the call, the tool's result, the next turn
        assert given[i][0]["tool_calls"][0]["function"] == {"name": "multiply",
                                                            "arguments": {"a": a, "b": b}}
        assert given[i][1] == {"role": "tool", "name": "multiply", "content": str(a * b)}
        written = trainer.tokenizer.decode(completions.ids[i][(tool_mask == 0) & mask.bool()])
        assert written.startswith("\n<|im_start|>user\n<tool_response>") and \
            written.endswith("<|im_start|>assistant\n")                  # exactly the tool's part
    assert all(n <= 160 for n in completions.mask.sum(1).tolist())
    batch = batches[0]
    assert len(batch) == 8 and batch.tool_mask is not None
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in line][0]
    assert record["tools/call_frequency"] == 0.5 and record["tools/failure_frequency"] == 0.0


def test_max_tool_calling_iterations_zero_runs_no_tool(tool_model_dir, tmp_path):
    trainer = tool_trainer(tool_model_dir, tmp_path, True, max_tool_calling_iterations=0)
    calls = script_first_turn(trainer)
    generated, generate = [], trainer.generate
    trainer.generate = lambda rows: generated.append(generate(rows)) or generated[-1]
    trainer.train()
    assert calls == [4] and bool(generated[0][1].tool_mask[generated[0][1].mask.bool()].all())


def test_multi_turn_options_are_checked(tool_model_dir, tmp_path):
    from cppo.errors import ConfigError
    from cppo.trainer import CPPOTrainer
    with pytest.raises(ConfigError, match="environment_factory\\['a'\\] is 3; expected a callable"):
        CPPOTrainer(environment_factory={"a": 3})
    with pytest.raises(ConfigError, match="must define a callable `reset`"):
        CPPOTrainer(environment_factory=dict)
    with pytest.raises(ConfigError, match="or rollout_func, not both"):
        CPPOTrainer(tools=[multiply], rollout_func=calculator_rollout)
    with pytest.raises(ConfigError, match="rollout_func is 3"):
        CPPOTrainer(rollout_func=3)


def test_tool_results_that_would_not_fit_end_the_completion(tool_model_dir, tmp_path):
    """TRL: a round of tool results that would pass max_completion_length is dropped and the
    completion ends with the call."""
    trainer = tool_trainer(tool_model_dir, tmp_path, True, max_completion_length=100)
    calls = script_first_turn(trainer)
    generated, generate = [], trainer.generate
    trainer.generate = lambda rows: generated.append(generate(rows)) or generated[-1]
    trainer.train()
    completions = generated[0][1]
    texts = trainer.tokenizer.batch_decode(completions.ids, skip_special_tokens=False)
    assert calls == [4] and not any("<tool_response>" in t for t in texts)
    assert trainer.rollout_func.metrics["tools/call_frequency"] == 0.5


def test_environment_factory_resets_serves_tools_and_rewards(tool_model_dir, tmp_path):
    import json
    from cppo.config import CPPOConfig
    from cppo.models import load_model, load_tokenizer
    from cppo.trainer import CPPOTrainer
    rows = tool_rows()
    given = []

    def sees_environments(completions, environments=None, **kw):
        if environments is not None:
            given.append((list(environments), [e.get_reward() for e in environments]))
        return [0.0] * len(completions)
    args = CPPOConfig(model=tool_model_dir, output_dir=str(tmp_path / "run"), max_steps=2,
                      per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                      max_completion_length=160, eval_steps=0, save_steps=0, progress_bar=False,
                      learning_rate=1e-3, seed=3, reward_weights=[1.0])
    trainer = CPPOTrainer(model=load_model(tool_model_dir), processing_class=load_tokenizer(tool_model_dir),
                          reward_funcs=[sees_environments], args=args, train_dataset=rows,
                          environment_factory=CalculatorEnv)
    assert trainer.rewards.names == ["sees_environments", "CalculatorEnv"]
    assert trainer.rewards.weights.tolist() == [1.0, 1.0]
    calls = script_first_turn(trainer)
    generated, generate = [], trainer.generate
    trainer.generate = lambda rows: generated.append(generate(rows)) or generated[-1]
    trainer.train()
    assert calls[:2] == [16, 8]   # one environment per rollout: each prompt sampled on its own
    prompts, completions = generated[0]
    assert "(a calculator is available)" in trainer.tokenizer.decode(prompts.ids[0])
    texts = trainer.tokenizer.batch_decode(completions.ids, skip_special_tokens=False)
    assert all(("<tool_response>" in t) == (i % 2 == 0) for i, t in enumerate(texts))
    envs, env_rewards = given[0]
    assert len(envs) == 16 and len({id(e) for e in envs}) == 16
    assert env_rewards == [1.0, 0.0] * 8                       # the calls computed the answer
    assert [id(e) for e in given[1][0]] == [id(e) for e in envs]   # reused in the second step
    assert len(trainer.rollout_func.pools[None]) == 16
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rewards/CalculatorEnv/mean"] for r in records if "loss" in r or "cppo/skipped" in r][0] == 0.5


class AdderEnv:
    """A second environment: adds, and is rewarded when the sum is the answer."""

    def __init__(self):
        self.answer, self.result = None, None

    def reset(self, **row):
        assert "environment" not in row   # TRL: the routing column is not a reset argument
        self.answer, self.result = row.get("answer"), None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first term.
            b: The second term.
        """
        self.result = a + b
        return self.result

    def get_reward(self) -> float:
        return 1.0 if str(self.result) == self.answer else 0.0


def test_several_environments_are_picked_by_each_rows_environment(tool_model_dir, tmp_path):
    """TRL's dict of factories: each row's `environment` picks one; only its tools are served, and
    each environment class is a reward source of its own."""
    from cppo.config import CPPOConfig
    from cppo.models import load_model, load_tokenizer
    from cppo.trainer import CPPOTrainer
    rows = [{"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b),
             "environment": env} for (a, b), env in [((12, 34), "calc"), ((5, 6), "add"),
                                                      ((7, 8), "calc"), ((21, 3), "add")]]
    args = CPPOConfig(model=tool_model_dir, output_dir=str(tmp_path / "run"), max_steps=1,
                      per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                      max_completion_length=160, eval_steps=0, save_steps=0, progress_bar=False,
                      learning_rate=1e-3, seed=3)
    trainer = CPPOTrainer(model=load_model(tool_model_dir), processing_class=load_tokenizer(tool_model_dir),
                          args=args, train_dataset=rows,
                          environment_factory={"calc": CalculatorEnv, "add": AdderEnv})
    assert trainer.rewards.names == ["CalculatorEnv", "AdderEnv"]   # reward_funcs may be left out
    script_first_turn(trainer)   # every other completion calls multiply
    scored = []
    score = trainer.score
    trainer.score = lambda rows, completions: scored.append((rows, score(rows, completions))) or scored[-1][1]
    trainer.train()
    per_function = scored[0][1].per_function.reshape(-1, 2)
    environments = [r["environment"] for r in scored[0][0] for _ in range(4)]
    for i, env in enumerate(environments):
        calc, add = per_function[i].tolist()
        if env == "calc":   # multiply is served: the even completions compute the answer
            assert calc == float(i % 2 == 0) and add != add          # NaN: not its environment
        else:               # multiply is not one of AdderEnv's tools: the call fails
            assert add == 0.0 and calc != calc
    assert trainer.rollout_func.metrics["tools/failure_frequency"] == 0.5
