"""The asynchronous lookahead (docs/asynchronous.md, "What happens in a round"): a steady run
at weight_sync_steps 1 keeps the rounds the bound allows in flight (max_staleness ahead, or
fewer where max_inflight_tasks or queue_maxsize say so) and drops no round as stale.

The generator is replaced, in this process, by one that samples each task the moment it is
submitted, with the weights last pushed: a generator that never falls behind, so every round is
as stale as the schedule lets it be, and the run does not depend on the machine's timing. Its
sampling is the generator process's own (the run's backend built by `build`, sample_round).
A trainer that submits one round further ahead than max_staleness allows gets each such round
back one version too stale: dropped and sampled again, which fails here.
"""

import copy
import json
from collections import deque

import pytest

from cppo.sampling import async_rollout
from cppo.sampling.async_rollout import Sampled
from helpers import make_trainer

Q, ROUNDS = 4, 6   # make_trainer: 4 questions x G = 4 per round, one optimizer step per round


class InlineGenerator:
    """GeneratorProcess's interface, in this process: a private copy of the policy, refreshed by
    each push; a task is sampled when submitted, tagged with the version last pushed. `submitted`
    logs (round, version) per task."""

    name = "inline generator"
    pushed_bytes = 0   # the generators' interface: the last push's bytes
    made: list = []

    def __init__(self, policy, build, *, threads, heartbeat_stale_after_s, cpus=None,
                 tools=None, skeleton=None) -> None:
        self.model = copy.deepcopy(policy).requires_grad_(False)
        self.names = async_rollout.trainable_names(policy)
        self.generation = build(self.model, async_rollout._WholeModel())
        self.version, self.results, self.submitted = None, deque(), []
        InlineGenerator.made.append(self)

    def push(self, policy, version: int) -> float:
        async_rollout._copy_parameters(self.model, policy, self.names)
        self.version = version
        return 0.0

    def submit(self, task) -> None:
        prompts, completions = async_rollout.sample_round(self.generation, task)
        self.results.append(Sampled(task.task_id, self.version, prompts, completions, 0.0, 0.0))
        self.submitted.append((task.round_index, self.version))

    def receive(self) -> Sampled:
        return self.results.popleft()

    def close(self, timeout: float = 10.0) -> None:
        pass


@pytest.fixture
def inline_generator(monkeypatch):
    monkeypatch.setattr(InlineGenerator, "made", [])
    monkeypatch.setattr(async_rollout, "GeneratorProcess", InlineGenerator)
    return InlineGenerator


@pytest.mark.parametrize("max_staleness, max_inflight_tasks, queue_maxsize, ahead", [
    (1, -1, 1024, 1),    # auto: max_staleness rounds ahead
    (2, -1, 1024, 2),
    (1, 100, 1024, 1),   # many tasks allowed: max_staleness still bounds the lookahead
    (2, 2 * Q, 1024, 1),  # 2 rounds' groups in flight: the next round and one more
    (2, -1, Q * 4, 1),   # one round's completions may wait in the queue, beside the next one
])
def test_a_steady_run_keeps_the_bounds_rounds_in_flight_and_drops_none(
        tiny_model_dir, tmp_path, inline_generator, max_staleness, max_inflight_tasks,
        queue_maxsize, ahead):
    """Round k is submitted while round k - ahead is trained (after version k - ahead was
    pushed), once; it is trained on at version k, so min(k, ahead) versions stale; after each
    round is taken, `ahead` rounds (fewer at the end) stay in flight; nothing is dropped."""
    with make_trainer(tiny_model_dir, tmp_path / "run", max_steps=ROUNDS, async_rollout=True,
                      max_staleness=max_staleness, weight_sync_steps=1,
                      max_inflight_tasks=max_inflight_tasks, queue_maxsize=queue_maxsize,
                      generation_dtype=None, matmul_dtype=None) as trainer:
        assert trainer.args.steps_per_round == 1
        trainer.train()
    [generator] = inline_generator.made
    assert generator.submitted == [(k, max(0, k - ahead)) for k in range(ROUNDS)]
    records = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert [r["sample/staleness_max"] for r in records] == [min(k, ahead) for k in range(ROUNDS)]
    assert [r["rollout/inflight"] for r in records] == [min(ahead, ROUNDS - 1 - k) * Q
                                                         for k in range(ROUNDS)]
    assert [r["sample/dropped_stale_total"] for r in records] == [0] * ROUNDS
    figures = json.load(open(tmp_path / "run" / "summary.json"))["asynchronous"]
    assert (figures["staleness_max"], figures["dropped_stale"]) == (ahead, 0)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_pushes_every_second_step_drop_nothing(tiny_model_dir, tmp_path, inline_generator,
                                               max_staleness):
    """weight_sync_steps 2: the generator's weights lag up to one version between pushes, and the
    lookahead leaves room for it, so no round comes back too stale to train on (running
    max_staleness rounds ahead regardless dropped and resampled every other round)."""
    with make_trainer(tiny_model_dir, tmp_path / "run", max_steps=ROUNDS, async_rollout=True,
                      max_staleness=max_staleness, weight_sync_steps=2,
                      generation_dtype=None, matmul_dtype=None) as trainer:
        trainer.train()
    [generator] = inline_generator.made
    assert len(generator.submitted) == ROUNDS   # each round sampled once
    records = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert [r["sample/dropped_stale_total"] for r in records] == [0] * ROUNDS
    assert max(r["sample/staleness_max"] for r in records) <= max_staleness
    assert max(r["sample/staleness_max"] for r in records) >= 1   # it did run ahead / lag
