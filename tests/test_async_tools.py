"""Tools under async_rollout: cppo's generator process runs the round's multi-turn rollouts (the
tool loop around its own sampler), the tools' tokens stay out of the loss, and at max_staleness
0 the run is the synchronous tool run."""

import json
import os

import pytest
import torch

from cppo.errors import ConfigError
from cppo.sampling import async_rollout
from cppo.sampling.tools import ToolLoop
from helpers.tool_calls import TOOL_LOG, multiply, save_tool_model, script_tool_turns
from test_multi_turn import seen_completions, tool_trainer

FLOAT32 = dict(generation_dtype=None, matmul_dtype=None)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    return save_tool_model(tmp_path_factory.mktemp("tool_model"))


def run_tools(model_dir, run_dir, **overrides):
    """3 steps of tool_trainer with the scripted tool loop: each round's batches and the weights."""
    trainer = tool_trainer(model_dir, run_dir, True, max_steps=3, **FLOAT32, **overrides)
    script_tool_turns(trainer)
    rounds, build = [], trainer.build_batch
    trainer.build_batch = lambda prompts, completions, *a, **kw: \
        rounds.append((prompts, completions, build(prompts, completions, *a, **kw))) or rounds[-1][2]
    trainer.train()
    return trainer, rounds


def test_tools_run_in_the_generator_process_and_leave_the_loss(tool_model_dir, tmp_path,
                                                               monkeypatch):
    """The multiply calls run in the generator process (not the trainer's), every round's tool
    results are in the completions with tool_mask 0 on exactly the tool's tokens, the reward
    functions see TRL's messages and the tools/* metrics arrive; 3 steps train (max_staleness 4,
    the default: the importance-sampling correction gets the behaviour log-probs)."""
    log = tmp_path / "tool_pids"
    monkeypatch.setenv(TOOL_LOG, str(log))
    seen_completions.clear()
    trainer, rounds = run_tools(tool_model_dir, tmp_path, async_rollout=True)
    pids = set(log.read_text().split()) if log.exists() else set()
    assert pids and str(os.getpid()) not in pids       # the tool ran on the generator side
    assert trainer.run_state.step == 3 and len(rounds) == 3
    tok = trainer.tokenizer
    for prompts, completions, batch in rounds:
        assert completions.tool_mask is not None
        texts = tok.batch_decode(completions.ids, skip_special_tokens=False)
        for i, (text, tool_mask, mask) in enumerate(zip(texts, completions.tool_mask,
                                                        completions.mask)):
            if i % 2:
                continue
            question = tok.decode(prompts.ids[i][prompts.mask[i].bool()])
            a, b = map(int, question.split("user\n")[-1].split("=")[0].split("*"))
            assert f"<tool_response>\n{a * b}\n</tool_response>" in text      # the tool ran
            written = tok.decode(completions.ids[i][(tool_mask == 0) & mask.bool()])
            assert written.startswith("\n<|im_start|>user\n<tool_response>") and \
                written.endswith("<|im_start|>assistant\n")                # exactly the tool's
        assert batch.tool_mask is not None and bool((batch.tool_mask == 0).any())
        # max_staleness 4: the behaviour log-probs, recorded on the model's tokens, 0 on a tool's
        tools_wrote = (completions.tool_mask == 0) & completions.mask.bool()
        assert batch.sampler_logps is not None and bool((completions.logprobs[tools_wrote] == 0).all())
        assert bool((completions.logprobs[(completions.tool_mask == 1) & completions.mask.bool()]
                     < 0).any())
    given = [c for c in seen_completions if len(c) == 16][-1]
    assert given[0][1]["role"] == "tool" and given[0][1]["name"] == "multiply"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines() if "loss" in line]
    assert len(records) == 3 and all(r["tools/call_frequency"] == 0.5 for r in records)


def test_max_staleness_0_is_the_synchronous_tool_run(tool_model_dir, tmp_path):
    """At max_staleness 0 the generator's tool loop samples each round with the weights that
    train on it, from the synchronous run's seeds (cppo's sampler seeds a turn by the round's
    first step): the same completions and tool masks, and the same weights to float64
    round-off."""
    runs = {}
    for name, extra in (("sync", {}), ("async", dict(async_rollout=True, max_staleness=0))):
        trainer, rounds = run_tools(tool_model_dir, tmp_path / name, torch_dtype="float64",
                                    **extra)
        runs[name] = rounds, {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    for (_, sync, _), (_, asynchronous, batch) in zip(runs["sync"][0], runs["async"][0],
                                                       strict=True):
        assert torch.equal(sync.ids, asynchronous.ids)
        assert torch.equal(sync.tool_mask, asynchronous.tool_mask)
        assert batch.sampler_logps is None     # the policy sampled it: nothing to correct
    for key, value in runs["sync"][1].items():
        torch.testing.assert_close(runs["async"][1][key], value, atol=1e-10, rtol=0, msg=key)


def test_a_tool_that_cannot_be_pickled_is_named_with_the_fix():
    local = lambda a, b: a * b   # noqa: E731 -- a lambda cannot be pickled
    local.__name__ = "local_multiply"
    with pytest.raises(ConfigError, match="'local_multiply' cannot be pickled.*top level.*"
                                          "async_rollout: false"):
        async_rollout.check_picklable_tools(ToolLoop([multiply, local]))
    async_rollout.check_picklable_tools(ToolLoop([multiply]))


def test_a_rollout_func_is_refused_and_the_tool_loop_is_not():
    with pytest.raises(ConfigError, match="cannot run a rollout_func.*takes the trainer.*"
                                          "tools=.*async_rollout: false"):
        async_rollout.check_async_launch(lambda prompts, trainer: {})
    async_rollout.check_async_launch(ToolLoop([multiply]))


def test_environments_run_in_the_generator_and_their_copies_are_rewarded(tool_model_dir,
                                                                          tmp_path):
    """environment_factory under async_rollout: the generator process resets and serves its own
    environments (the trainer's pool keeps only the instance probed at construction) and sends
    each rollout's environment back, a copy, which the environment's reward scores."""
    from cppo.config import CPPOConfig
    from cppo.models import load_model, load_tokenizer
    from cppo.trainer import CPPOTrainer
    from helpers.tool_calls import CalculatorEnv, tool_rows
    given = []

    def sees_environments(completions, environments=None, **kw):
        if environments is not None:
            given.append([e.get_reward() for e in environments])
        return [0.0] * len(completions)
    args = CPPOConfig(model=tool_model_dir, output_dir=str(tmp_path / "run"), max_steps=2,
                      per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                      max_completion_length=160, eval_steps=0, save_steps=0, progress_bar=False,
                      learning_rate=1e-3, seed=3, reward_weights=[1.0], async_rollout=True,
                      **FLOAT32)
    trainer = CPPOTrainer(model=load_model(tool_model_dir),
                          processing_class=load_tokenizer(tool_model_dir),
                          reward_funcs=[sees_environments], args=args, train_dataset=tool_rows(),
                          environment_factory=CalculatorEnv)
    script_tool_turns(trainer)
    trainer.train()
    assert trainer.run_state.step == 2 and len(trainer.rollout_func.pools[None]) == 1
    assert given[0] == [1.0, 0.0] * 8       # the written calls computed the answer


def test_a_vllm_servers_thread_runs_the_tool_loop(tool_model_dir, tmp_path, monkeypatch):
    """With a vLLM server the generator thread runs a copy of the tool loop (the trainer's is
    left alone): the server samples each turn (TRL's client, a fake with its real signatures),
    the tool's result is in the completion with tool_mask 0, and the turns come back with the
    round."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from cppo.assembly.run import backend_settings
    from cppo.config import CPPOConfig
    from cppo.models import load_model, load_tokenizer
    from cppo.sampling.async_rollout import RolloutTask, RoundTools, ServerGenerator
    from cppo.sampling.vllm import VLLMBackend
    from helpers.tool_calls import ScriptedToolLoop
    from helpers.vllm_client import FakeClient
    monkeypatch.setattr(VLLMBackend, "push_device", lambda self: torch.device("cuda", 0))
    model, tok = load_model(tool_model_dir), load_tokenizer(tool_model_dir)
    settings = backend_settings(CPPOConfig(use_vllm=True, vllm_mode="server", num_generations=2,
                                           max_completion_length=160, max_prompt_length=512))
    backend = VLLMBackend(model, tok, settings, vllm=SimpleNamespace(), client=FakeClient(),
                          push_weights=False)
    loop = ScriptedToolLoop([multiply])
    generator = ServerGenerator(backend, tok, tmp_path, heartbeat_stale_after_s=60.0,
                                tools=RoundTools(loop, 1))
    try:
        generator.push(model, 0)
        generator.submit(RolloutTask(0, 0, [[{"prompt": [{"role": "user", "content": "12*34="}]}]]))
        got = generator.receive()
    finally:
        generator.close()
    completions = got.completions[0]
    text = tok.decode(completions.ids[0][completions.mask[0].bool()], skip_special_tokens=False)
    assert "<tool_response>\n408\n</tool_response>" in text
    written = tok.decode(completions.ids[0][(completions.tool_mask[0] == 0) & completions.mask[0].bool()])
    assert written.startswith("\n<|im_start|>user\n<tool_response>")
    assert bool(completions.tool_mask[1][completions.mask[1].bool()].all())   # no call: no tool
    assert got.turns[0]["metrics"]["tools/call_frequency"] == 0.5
    assert got.turns[0]["messages"][0][1] == {"role": "tool", "name": "multiply", "content": "408"}
    assert loop.messages == [] and generator.tools.loop is not loop    # the thread's own copy
