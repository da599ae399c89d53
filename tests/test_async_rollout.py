"""Asynchronous rollouts (async_rollout): the generator process, staleness, the behaviour
log-probs, a generator that dies or hangs, and the config's checks."""

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from cppo.errors import ConfigError, GeneratorError
from cppo.sampling import async_rollout
from cppo.sampling.async_rollout import Arrival, RolloutScheduler, RolloutTask
from cppo.sampling.batches import Completions, PromptBatch
from cppo.sampling.logprobs import completion_logprobs
from helpers import (assert_config_error_names, PARK_ENV, child_env, make_trainer,
                     step_records, train_args, wait_until, write_jsonl)

FLOAT32 = dict(generation_dtype=None, matmul_dtype=None)   # every pass in float32
ASYNC = dict(async_rollout=True, **FLOAT32)


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in r]


def test_max_staleness_0_is_the_synchronous_run(tiny_model_dir, tmp_path):
    """The generator process at max_staleness 0 samples each round with the weights that train on
    it, from the same seeds: the same completions, losses and weights as sampling in the trainer.
    In float64: the two runs' tensors sit at other addresses, and a CPU GEMM's rounding may
    follow the alignment, so the weights agree to float64 round-off over 3 steps (bound 1e-10;
    a different completion or a skipped push moves them by > 1e-4)."""
    runs = {}
    for name, extra in (("sync", FLOAT32), ("async", dict(ASYNC, max_staleness=0))):
        batches = []
        with make_trainer(tiny_model_dir, tmp_path / name, max_steps=3, torch_dtype="float64",
                          **extra) as trainer:
            step = trainer.learner.step
            trainer.learner.step = lambda batch, *a: batches.append(batch) or step(batch, *a)
            trainer.train()
        runs[name] = (batches, losses(tmp_path / name),
                      load_file(tmp_path / name / "checkpoint-3" / "model.safetensors"))
    for sync, asynchronous in zip(runs["sync"][0], runs["async"][0], strict=True):
        assert torch.equal(sync.completion_ids, asynchronous.completion_ids)
        assert asynchronous.sampler_logps is None   # the policy sampled it: nothing to correct
    assert runs["async"][1] == runs["sync"][1]
    for key, value in runs["sync"][2].items():
        torch.testing.assert_close(runs["async"][2][key], value, atol=1e-10, rtol=0, msg=key)


def test_behaviour_logprobs_are_those_of_the_version_that_sampled(tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    """Each trained batch's sampler log-probs are its tokens' log-probs under the weights pushed
    as the version that sampled it (float32 sampling: equal up to float32 rounding of two
    forwards, bound 1e-4), not under the policy that trains on it (which a round one version
    stale differs from by far more)."""
    pushed, batches, versions = {}, [], []
    push = async_rollout.GeneratorProcess.push

    def recording_push(self, policy, version):
        pushed[version] = copy.deepcopy(policy.state_dict())
        return push(self, policy, version)
    monkeypatch.setattr(async_rollout.GeneratorProcess, "push", recording_push)
    take = RolloutScheduler.take

    def recording_take(self, version):
        head, arrival, stale, waited = take(self, version)
        versions.append((arrival.version, version))
        return head, arrival, stale, waited
    monkeypatch.setattr(RolloutScheduler, "take", recording_take)
    with make_trainer(tiny_model_dir, tmp_path / "run", max_steps=4, max_staleness=1,
                      importance_sampling_correction=False, **ASYNC) as trainer:  # stale: on anyway
        step = trainer.learner.step
        trainer.learner.step = lambda batch, *a: batches.append(batch) or step(batch, *a)
        trainer.train()
        model = copy.deepcopy(trainer.policy)
    assert any(sampled < now for sampled, now in versions), versions   # a stale round was trained
    for batch, (sampled, now) in zip(batches, versions):
        assert batch.sampler_logps is not None
        logps = {}
        for version in (sampled, now):
            model.load_state_dict(pushed[version])
            with torch.no_grad():
                logps[version] = completion_logprobs(
                    model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                    batch.completion_mask) * batch.completion_mask
        torch.testing.assert_close(batch.sampler_logps * batch.completion_mask, logps[sampled],
                                   atol=1e-4, rtol=0)
        if sampled < now:
            assert (logps[now] - logps[sampled]).abs().max() > 1e-2


def test_no_round_staler_than_the_bound_reaches_the_loss(tiny_model_dir, tmp_path):
    """Pushes every 2 steps with max_staleness 1: rounds the generator sampled before a push can
    arrive 2 versions old; each trained round is at most 1 old."""
    with make_trainer(tiny_model_dir, tmp_path / "run", max_steps=6, max_staleness=1,
                      weight_sync_steps=2, **ASYNC) as trainer:
        trainer.train()
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert len(rows) == 6
    assert max(r["sample/staleness_max"] for r in rows) <= 1
    figures = json.load(open(tmp_path / "run" / "summary.json"))["asynchronous"]   # the end line's
    assert figures["staleness_max"] <= 1
    assert figures["dropped_stale"] == rows[-1]["sample/dropped_stale_total"]


class FakeGenerator:
    """ProcessShare's interface (submit, receive, push): each task answered in order with the
    next of `versions` as the version that sampled it."""

    def __init__(self, versions):
        self.versions, self.tasks, self.submitted = iter(versions), deque(), []

    def submit(self, task: RolloutTask) -> None:
        self.tasks.append(task)
        self.submitted.append(task)

    def receive(self) -> Arrival:
        task = self.tasks.popleft()
        completions = Completions(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3),
                                  torch.zeros(2, dtype=torch.bool))
        return Arrival(task.task_id, next(self.versions), PromptBatch(torch.zeros(1, 2), torch.ones(1, 2)),
                       completions, 0.5)

    def push(self, policy, version: int) -> float:
        return 0.0


def test_a_stale_round_is_dropped_and_sampled_again():
    """Round 0 arrives 3 versions behind with max_staleness 2: dropped, counted and submitted again
    (the same round, the same rows); its second arrival (1 behind) is the one trained on."""
    generator = FakeGenerator([2, 4])
    scheduler = RolloutScheduler(generator, lookahead=0, max_staleness=2)
    draws = iter([([[{"q": 0}]], [0])])   # one process's rows
    scheduler.fill(0, 10, lambda: next(draws), lambda: {"epoch": 0, "position": 0})
    head, arrival, stale, _ = scheduler.take(version=5)
    assert (arrival.version, stale, scheduler.dropped_stale) == (4, 1, 1)
    assert [(t.round_index, t.rows) for t in generator.submitted] == [(0, [[{"q": 0}]])] * 2
    assert head.task.task_id == generator.submitted[1].task_id


def test_rounds_are_submitted_ahead_and_the_checkpoint_replays_them():
    """lookahead 2: rounds 0, 1, 2 submitted before round 0 is trained; a checkpoint taken then
    holds the question stream's state before round 1, the oldest round not trained on."""
    generator = FakeGenerator([0, 0, 1])
    scheduler = RolloutScheduler(generator, lookahead=2, max_staleness=2)
    position = iter(range(10))
    state = {}

    def take():
        state["position"] = next(position)
        return [[{"q": state["position"]}]], [state["position"]]
    scheduler.fill(0, 10, take, lambda: dict(state))
    assert [t.round_index for t in generator.submitted] == [0, 1, 2]
    scheduler.take(version=0)
    assert scheduler.questions_state({"position": 99}) == {"position": 0}   # before round 1
    scheduler.fill(1, 10, take, lambda: dict(state))
    assert [t.round_index for t in generator.submitted] == [0, 1, 2, 3]
    scheduler.fill(3, 3, take, lambda: dict(state))   # never past the last round
    assert len(generator.submitted) == 4


def test_a_resumed_run_replays_the_rounds_in_flight(tiny_model_dir, tmp_path):
    """With rounds sampled ahead, checkpoint-2 stores the question stream where the synchronous
    run's checkpoint-2 has it (after two rounds' questions), not where the generator got to."""
    states = {}
    for name, extra in (("sync", FLOAT32), ("async", dict(ASYNC, max_staleness=2))):
        with make_trainer(tiny_model_dir, tmp_path / name, max_steps=4, save_steps=2,
                          save_total_limit=3, **extra) as trainer:
            trainer.train()
        states[name] = json.load(open(tmp_path / name / "checkpoint-2" / "trainer_state.json"))
    assert states["async"]["questions"] == states["sync"]["questions"]


def _generator_pid(trainer) -> int:
    return trainer.rollouts.generator.generator.process.pid


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_generator_that_dies_or_hangs_is_an_error_within_the_heartbeat(tiny_model_dir, tmp_path,
                                                                         how):
    """SIGKILL: GeneratorError naming the signal; SIGSTOP (a hang: no heartbeat): GeneratorError
    once heartbeat_stale_after_s (2 s) passed, the process stopped; never a hang (the suite's
    timeout would fail it). The run's checkpoint stays."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                os.kill(_generator_pid(trainer), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=6, max_staleness=0,
                           heartbeat_stale_after_s=2.0, callbacks=[Stop()], **ASYNC)
    with trainer, pytest.raises(GeneratorError) as err:
        trainer.train()
    assert ("signal 9" if how == "killed" else "no heartbeat") in str(err.value)
    assert trainer.rollouts.generator.generator.process.exitcode is not None   # stopped, not left behind
    assert (tmp_path / "run" / "checkpoint-2" / "COMPLETE").exists()


@pytest.mark.parametrize("values, names", [
    (dict(max_staleness=-1), ["max_staleness", ">= 0"]),
    (dict(weight_sync_steps=0), ["weight_sync_steps", ">= 1"]),
    (dict(queue_maxsize=4, num_generations=8), ["queue_maxsize", "one group", ">= 8"]),
    (dict(max_inflight_tasks=0), ["max_inflight_tasks", "-1"]),
    (dict(heartbeat_stale_after_s=0), ["heartbeat_stale_after_s", "> 0"]),
    (dict(async_rollout=True, max_staleness=1, weight_sync_steps=3),
     ["weight_sync_steps", "max_staleness", "<= 2"]),
    (dict(async_rollout=True, use_vllm=True), ["vllm_mode", "'colocate'", "vllm_mode: server"]),
    (dict(async_rollout=True, two_stage_generations=2), ["two_stage_generations"]),
    (dict(async_rollout=True, skip_zero_variance_prompts=True), ["skip_zero_variance_prompts"]),
    (dict(async_rollout=True, generator_cpus=[4096]), ["generator_cpus", "[4096]", "cores"]),
])
def test_bad_async_settings_name_the_field_and_the_fix(values, names):
    assert_config_error_names(values, names)


def test_async_launches_it_cannot_run_name_the_fix():
    """A rollout function (it samples in the trainer): an error naming the field and the fix;
    without one the launch runs (ddp and fsdp alike: tests/test_distributed.py)."""
    with pytest.raises(ConfigError, match="cannot run a rollout_func.*async_rollout: false"):
        async_rollout.check_async_launch(lambda prompts, trainer: {})
    async_rollout.check_async_launch(None)


def test_a_lora_policy_under_fsdp_with_a_vllm_server_names_the_fix():
    """A vLLM server under fsdp takes each parameter gathered whole, in turn, which cannot merge a
    LoRA layer: an error naming distributed: ddp, on every process, before any generator starts."""
    backend = SimpleNamespace(settings=SimpleNamespace(vllm=SimpleNamespace(use_vllm=True)))
    policy = torch.nn.Module()
    policy.lora_A = torch.nn.Linear(2, 2)
    engine = SimpleNamespace(policy=policy, sharded=True, skeleton=None)
    with pytest.raises(ConfigError, match="LoRA factors.*distributed: ddp"):
        async_rollout.start_rollouts(None, None, version=0, steps_per_round=1,
                                     questions_per_round=1, backend=backend, weights_dir=None,
                                     dist=SimpleNamespace(world_size=2, is_main=True), engine=engine)


@pytest.mark.parametrize("stop", ["ctrl_c", "sigterm"])
def test_ctrl_c_and_sigterm_stop_both_sides_with_a_checkpoint(tiny_model_dir, tmp_path, stop):
    """`cppo train` with async_rollout parked in step 4 of 6: Ctrl-C (SIGINT to the whole process
    group, as a terminal sends it) or SIGTERM twice to the trainer. The step finishes and is saved,
    the generator process is ended (it ignores the signals; the trainer stops it), and --resume
    runs steps 5 and 6."""
    rows, out, log = write_jsonl(tmp_path / "rows.jsonl"), tmp_path / "run", tmp_path / "run.log"
    args = train_args(tiny_model_dir, rows, out, async_rollout="true", max_staleness=2)
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "cppo.cli", *args], stdout=fh,
                                stderr=subprocess.STDOUT, env=child_env(**{PARK_ENV: str(out)}),
                                start_new_session=True)
    try:
        wait_until(lambda: os.path.exists(f"{out}.parked"), proc, log)
        generator = int(re.search(r"generator process \(pid (\d+)\)", log.read_text()).group(1))
        for _ in range(1 if stop == "ctrl_c" else 2):
            if stop == "ctrl_c":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.2)
        open(f"{out}.go", "w").close()
        assert proc.wait(timeout=120) == (0 if stop == "ctrl_c" else 143), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not os.path.exists(f"/proc/{generator}"), "the generator process outlived the run"
    assert "Traceback" not in log.read_text()   # the generator left the signal to the trainer
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["status"] == ("interrupted" if stop == "ctrl_c"
                                                           else "terminated")
    assert (out / "checkpoint-4" / "COMPLETE").exists()
    resumed = subprocess.run([sys.executable, "-m", "cppo.cli", *args, "--resume", "true"],
                             env=child_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [r["step"] for r in step_records(out)] == list(range(1, 7))


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's end is reaped by whoever adopts it)."""
    try:
        return "\nState:\tZ" not in open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return False


def test_a_generator_whose_trainer_was_killed_ends_itself(tiny_model_dir, tmp_path):
    """SIGKILL to the trainer (no handler runs): the orphaned generator notices and exits."""
    rows, out, log = write_jsonl(tmp_path / "rows.jsonl"), tmp_path / "run", tmp_path / "run.log"
    args = train_args(tiny_model_dir, rows, out, async_rollout="true", max_staleness=2)
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "cppo.cli", *args], stdout=fh,
                                stderr=subprocess.STDOUT, env=child_env(**{PARK_ENV: str(out)}))
    try:
        wait_until(lambda: os.path.exists(f"{out}.parked"), proc, log)
        generator = int(re.search(r"generator process \(pid (\d+)\)", log.read_text()).group(1))
        assert _running(generator)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while _running(generator) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(generator)
