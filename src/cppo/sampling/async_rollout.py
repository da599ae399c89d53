"""Asynchronous rollouts (`async_rollout: true`): generation in its own process, never waiting
for training.

A generator process holds its own copy of the policy and samples whole rounds (G completions for
each of a round's questions, seeded by the round exactly as the synchronous backend seeds them)
under the newest weights it has. The trainer pushes its weights through shared memory every
weight_sync_steps optimizer steps; the generator takes them between two rounds. Each round comes
back tagged with the policy version that sampled it (optimizer steps taken) and every token's
behaviour log-prob, so the trainer can drop a round that is too stale
(cppo.algorithm.staleness) and correct the rest by importance sampling.

`RolloutScheduler` is the trainer's side: it submits rounds ahead (as many as keep them within
max_staleness), takes each round's arrival in order, and keeps what a checkpoint needs (the
question stream's state before the oldest round not yet trained on, so a resumed run replays
the in-flight rounds: the same questions, the same seeds).

Under torchrun (N training processes, one generator) the first process holds the generator: a
round's task carries every process's questions, each process's part is sampled as that process
would sample it in a synchronous run, and `ProcessShare` hands each process its part of each
arrival (a scatter). Every process then makes the same decisions (the same arrivals, versions
and drops), so their schedulers stay in step without further messages.

The parts, one job each: the messages (cppo.sampling.rollout_messages), what both generators
share (cppo.sampling.rollout_generator), cppo's generator process
(cppo.sampling.generator_process) and several of them as one (generator_processes:
cppo.sampling.generator_pool), the vLLM server's thread (cppo.sampling.server_generator),
the torchrun scatter (cppo.sampling.process_share) and the weight pushes, one sink per transport
(cppo.sampling.weight_sinks). This module holds the scheduler and the factory, and names every
part for its callers.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cppo.algorithm.allocation import questions_per_chunk
from cppo.algorithm.staleness import (is_stale, lookahead_rounds, push_due, rounds_in_flight,
                                      staleness)
from cppo.errors import ConfigError
from cppo.sampling.generator_pool import GeneratorPool, blocks, check_pool_parts, start_pool
from cppo.sampling.generator_process import GeneratorProcess, generator_main, generator_sampling
from cppo.sampling.process_share import ProcessShare
from cppo.sampling.rollout_generator import RoundTools
from cppo.sampling.rollout_generator import WholeModel as _WholeModel
from cppo.sampling.rollout_generator import sample_round
from cppo.sampling.rollout_messages import Arrival, RolloutTask, Sampled
from cppo.sampling.server_generator import ServerGenerator
from cppo.sampling.tools import ToolLoop
from cppo.sampling.vllm import check_sharded_push
from cppo.sampling.weight_sinks import copy_parameters as _copy_parameters
from cppo.sampling.weight_sinks import trainable_names

if TYPE_CHECKING:
    from cppo.config.sections import AsyncSection

# the parts' names as callers (the trainer, tests, benchmarks) import them from here
__all__ = ["Arrival", "GeneratorPool", "GeneratorProcess", "ProcessShare", "RolloutScheduler",
           "RolloutTask",
           "RoundTools", "Sampled", "ServerGenerator", "check_async_launch",
           "check_picklable_tools", "generator_main",
           "generator_sampling", "sample_round", "start_rollouts", "trainable_names",
           "_WholeModel", "_copy_parameters"]


@dataclass
class _Pending:
    task: RolloutTask
    order: list[int]
    questions_before: dict   # the question stream's state before this round's questions


@dataclass
class RolloutScheduler:
    """The trainer's side of asynchronous rollouts: rounds submitted ahead, their arrivals, the
    dropped stale ones and the counts the metrics report."""

    generator: ProcessShare
    lookahead: int            # rounds submitted beyond the one trained next
    max_staleness: int
    rank: int = 0             # this process's part of each round
    pending: deque = field(default_factory=deque)   # _Pending, in round order
    arrived: dict = field(default_factory=dict)     # task_id -> Arrival
    next_task: int = 0
    last_push: int | None = None   # the version last pushed
    dropped_stale: int = 0
    wait_seconds: float = 0.0
    generator_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    staleness_seen: list = field(default_factory=list)   # each trained round's

    def sync(self, policy, version: int, weight_sync_steps: int) -> float | None:
        """Push the weights if weight_sync_steps optimizer steps have passed since the last push
        (or none was made); the seconds the push took, None when none was due."""
        if self.last_push is not None and not push_due(version, self.last_push, weight_sync_steps):
            return None
        self.last_push = version
        return self.generator.push(policy, version)

    def fill(self, round_index: int, last_round: int, take_questions, questions_state) -> None:
        """Submit rounds round_index .. round_index + lookahead (never past last_round) not yet
        submitted. take_questions() -> (each process's rows, order) draws the next round's
        questions; questions_state() is the stream's state before it."""
        submitted = self.pending[-1].task.round_index if self.pending else round_index - 1
        for r in range(submitted + 1, min(round_index + self.lookahead, last_round) + 1):
            before = questions_state()
            rows, order = take_questions()
            task = RolloutTask(self.next_task, r, rows)
            self.next_task += 1
            self.pending.append(_Pending(task, order, before))
            self.generator.submit(task)

    def take(self, version: int) -> tuple[_Pending, Arrival, int, float]:
        """The oldest pending round's arrival within max_staleness of `version`, its staleness
        and the seconds waited for it; a staler arrival is dropped (counted) and the round
        sampled again."""
        head, waited = self.pending[0], self.wait_seconds
        while True:
            arrival = self._wait_for(head.task.task_id)
            if not is_stale(version, arrival.version, self.max_staleness):
                self.pending.popleft()
                return (head, arrival, staleness(version, arrival.version),
                        self.wait_seconds - waited)
            self.dropped_stale += 1
            head.task = RolloutTask(self.next_task, head.task.round_index, head.task.rows)
            self.next_task += 1
            self.generator.submit(head.task)

    def _wait_for(self, task_id: int) -> Arrival:
        start = time.perf_counter()
        while task_id not in self.arrived:
            got = self.generator.receive()
            self.arrived[got.task_id] = got
            self.generator_seconds += got.seconds
        self.wait_seconds += time.perf_counter() - start
        return self.arrived.pop(task_id)

    def next_round(self, round_index: int, last_round: int, *, version: int, take_questions,
                   questions_state) -> tuple:
        """Submit the rounds ahead (fill), then take round_index's arrival (take): this process's
        rows, the round's question order, this process's prompts, completions, metrics and, with
        tools, the generator's tool-loop turns (Arrival.turns; None without)."""
        self.fill(round_index, last_round, take_questions, questions_state)
        head, arrival, stale, waited = self.take(version)
        rows = head.task.rows[self.rank]
        return (rows, head.order, arrival.prompts, arrival.completions,
                self.metrics(arrival, stale, waited, len(rows)), arrival.turns)

    def questions_state(self, current: dict) -> dict:
        """What a checkpoint stores: the stream's state before the oldest round not trained on
        (`current` when none is pending), so a resumed run replays the in-flight rounds."""
        return self.pending[0].questions_before if self.pending else current

    def metrics(self, arrival: Arrival, stale: int, waited: float, questions_per_round: int) -> dict:
        """TRL's AsyncGRPOTrainer keys for a round that arrived `stale` versions old after the
        trainer waited `waited` s, and the run's busy fractions so far (cppo/)."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.staleness_seen.append(stale)
        return {"sample/staleness_mean": float(stale), "sample/staleness_max": float(stale),
                "rollout/duration_s": arrival.seconds,
                "sample/dropped_stale_total": float(self.dropped_stale),
                "sample/rollout_queue_size": float(sum(len(a.completions.ids)
                                                       for a in self.arrived.values())),
                "rollout/inflight": float(len(self.pending) * questions_per_round),
                "perf/rollout_wait_s": waited, "rollout/generator_idle_s": arrival.idle_seconds,
                "cppo/generator_busy": min(1.0, self.generator_seconds / elapsed),
                "cppo/trainer_busy": max(0.0, 1.0 - self.wait_seconds / elapsed)}

    @property
    def rounds_taken(self) -> int:
        """Rounds handed to the trainer this session."""
        return len(self.staleness_seen)

    def summary(self) -> dict:
        """The session's figures for summary.json: staleness, rounds dropped, busy shares."""
        seen, elapsed = self.staleness_seen or [0], max(time.perf_counter() - self.started, 1e-9)
        return {"staleness_mean": round(sum(seen) / len(seen), 3), "staleness_max": max(seen),
                "dropped_stale": self.dropped_stale,
                "generator_busy": round(min(1.0, self.generator_seconds / elapsed), 4),
                "trainer_busy": round(max(0.0, 1.0 - self.wait_seconds / elapsed), 4)}

    def close(self) -> None:
        self.generator.close()


def start_rollouts(tokenizer, rollout: AsyncSection, *, version: int, steps_per_round: int,
                   questions_per_round: int, backend, weights_dir: Path, dist,
                   engine, tools: ToolLoop | None = None) -> RolloutScheduler:
    """The generator (cppo's sampler in its own process, built as the trainer's `backend` is:
    its settings, chunk size and sampling dtype, or generator_processes of them as one
    GeneratorPool; with use_vllm, the vLLM server that `backend` talks to), held by the first
    training process, on the policy's weights as `version`, and
    this process's scheduler: rounds ahead as max_staleness, max_inflight_tasks and
    queue_maxsize allow (rollout: the config's async section; steps_per_round: optimizer steps
    per generation round; questions_per_round: each process's). engine: the policy's
    (cppo.parallel.engines.Engine; call check_async_launch first). tools: the run's tool loop
    (tools= or environment_factory=), which the generator runs each round in: cppo's generator
    process gets a pickled copy (check_picklable_tools), a vLLM server's thread a copy."""
    policy, generator, settings = engine.policy, None, backend.settings
    use_vllm = settings.vllm.use_vllm
    # fsdp: a vLLM server reloads whole weights (every parameter gathered); cppo's generator
    # process has a staging copy, gathered once at its start, then its trainable parameters
    pushed = [name for name, _ in policy.named_parameters()] if use_vllm else None
    if pushed and engine.sharded:
        check_sharded_push(pushed)   # on every process, before any generator or gather
    if engine.sharded and engine.skeleton is None and not use_vllm:
        raise ConfigError("'async_rollout' under distributed: fsdp makes the generator's copy from "
                          "the unsharded policy's skeleton: build the Engine with "
                          "keep_skeleton=True (cppo.assembly.models does when async_rollout is "
                          "set)")
    round_tools = None if tools is None else RoundTools(tools, steps_per_round)
    if dist.is_main and use_vllm:
        generator = ServerGenerator(backend, tokenizer, weights_dir,
                                    heartbeat_stale_after_s=rollout.heartbeat_stale_after_s,
                                    tools=round_tools, sharded=engine.sharded)
    elif dist.is_main:
        if tools is not None:
            check_picklable_tools(tools)
        build = functools.partial(generator_sampling, tokenizer, settings, backend.chunk_size,
                                  backend.generation_dtype, rollout.max_staleness > 0)
        generator = _own_generator(policy, build, rollout, engine, round_tools, tokenizer,
                                   (backend.chunk_size, settings.generation.num_generations,
                                    [questions_per_round] * dist.world_size))
    share = ProcessShare(generator, dist, dist.device, sharded=engine.sharded, pushed=pushed)
    if not use_vllm:
        share.join_staging(policy)
    questions = questions_per_round * dist.world_size
    waiting = rollout.queue_maxsize // (questions * settings.generation.num_generations)
    in_flight = min(rounds_in_flight(rollout.max_inflight_tasks, rollout.max_staleness, questions),
                    1 + waiting)   # + the one trained next
    scheduler = RolloutScheduler(share, lookahead_rounds(rollout.max_staleness, steps_per_round,
                                                         in_flight, rollout.weight_sync_steps),
                                 rollout.max_staleness, rank=dist.rank)
    scheduler.sync(policy, version, rollout.weight_sync_steps)
    if dist.is_main:
        where = "" if use_vllm else f" (cores {_cores_text(rollout)})"
        trainers = f", {dist.world_size} training processes" if dist.active else ""
        print(f"async_rollout: {share.name}{where}{trainers}, {scheduler.lookahead} round(s) "
              f"sampled ahead, max_staleness {rollout.max_staleness}, weights pushed every "
              f"{rollout.weight_sync_steps} step(s)", flush=True)
    return scheduler


def _own_generator(policy, build, rollout: AsyncSection, engine, tools: RoundTools | None,
                   tokenizer, shape: tuple):
    """cppo's generator: one GeneratorProcess, or with generator_processes > 1 a GeneratorPool
    of them (shape: the sampler's chunk size, G and each training process's questions a
    round)."""
    n = rollout.generator_processes
    if n == 1:
        return GeneratorProcess(policy, build,
                                threads=rollout.generator_threads or torch.get_num_threads(),
                                heartbeat_stale_after_s=rollout.heartbeat_stale_after_s,
                                cpus=rollout.generator_cpus, tools=tools, skeleton=engine.skeleton)
    chunk_size, group, questions = shape
    check_pool_parts(n, questions, group, chunk_size, tools is not None)
    unit = None if tools is not None else questions_per_chunk(chunk_size, group, max(questions))
    return start_pool(policy, build, processes=n, unit=unit, pad_token_id=tokenizer.pad_token_id,
                      cpus=rollout.generator_cpus, threads=rollout.generator_threads,
                      heartbeat_stale_after_s=rollout.heartbeat_stale_after_s, tools=tools,
                      skeleton=engine.skeleton)


def _cores_text(rollout: AsyncSection) -> str:
    """The generator processes' cores, as the start-up line names them."""
    if not rollout.generator_cpus:
        return "shared"
    if rollout.generator_processes == 1:
        return str(rollout.generator_cpus)
    return ", ".join(map(str, blocks(list(rollout.generator_cpus), rollout.generator_processes)))


def check_async_launch(rollout_func) -> None:
    """What async_rollout cannot run with, known once the launch is: a user rollout_func (TRL's
    rollout_func(prompts, trainer) takes the trainer object, which trains while the generator
    samples; cppo's tool loop for tools= and environment_factory= runs in the generator). Under
    fsdp the pushes gather each parameter in turn (ProcessShare); a vLLM server under fsdp is
    refused by start_rollouts."""
    if rollout_func is not None and not isinstance(rollout_func, ToolLoop):
        raise ConfigError("'async_rollout' samples in its generator, so it cannot run a "
                          "rollout_func: TRL's rollout_func(prompts, trainer) takes the trainer, "
                          "which keeps training (its weights and state change) while the "
                          "generator samples, and cppo's generator process cannot hold it. Pass "
                          "tools= or environment_factory= (cppo's tool loop runs in the "
                          "generator), or set async_rollout: false")


def check_picklable_tools(tools: ToolLoop) -> None:
    """cppo's generator process gets the tool loop pickled (a spawned process): each tool, each
    environment_factory and its environments must pickle, else a ConfigError naming it and the
    fix."""
    parts = [(f"the tool {t.__name__!r}", t) for t in tools.tools]
    for name, factory in tools.factories.items():
        label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        parts += [(f"{label} ({getattr(factory, '__qualname__', factory)!r})", factory)]
        parts += [(f"the environment {type(e).__qualname__!r} of {label}", e)
                  for e in tools.pools.get(name, [])]
    parts.append(("the tool loop", tools))
    for what, part in parts:
        try:
            pickle.dumps(part)
        except Exception as err:   # noqa: BLE001 -- pickle raises many kinds
            raise ConfigError(
                f"async_rollout runs the tools in its generator process, which gets them pickled, "
                f"and {what} cannot be pickled ({type(err).__name__}: {err}). Define it at a "
                f"module's top level (a plain function, a class, or a functools.partial of one; "
                f"not a lambda, a nested function or an object holding a lock or a connection), "
                f"or set async_rollout: false (or use a vLLM server: use_vllm with vllm_mode: "
                f"server runs the tools in a thread of the trainer)") from None
