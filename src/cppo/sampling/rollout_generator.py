"""What both asynchronous generators share (cppo's generator process,
cppo.sampling.generator_process; the vLLM server's thread, cppo.sampling.server_generator): how a
round is sampled (sample_round, on a WholeModel; with tools, roll_out_round runs the tool loop
around it: RoundTools), how long the generator waited for its task
(IdleClock) and how the trainer waits for it (Generator: a
queue of results, a failure raised with its traceback, a generator that ended, never started or
fell silent raised as a GeneratorError, never a hang)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import time
from dataclasses import dataclass

from cppo.errors import GeneratorError
from cppo.sampling.batches import Completions, PromptBatch
from cppo.sampling.generation import Generation
from cppo.sampling.rollout_messages import Failure, RolloutTask, Sampled
from cppo.sampling.settings import SamplingSettings
from cppo.sampling.tools import ToolContext, ToolLoop

START_S = 600.0           # the longest a generator process may take to start (imports, its model)
POLL_S = 0.2              # how often a waiting trainer checks the generator


class WholeModel:
    """The generator's model is never sharded: `gathered()` is a no-op (cppo.parallel.engines)."""

    gathered = staticmethod(contextlib.nullcontext)


def sample_round(generation: Generation, task: RolloutTask
                 ) -> tuple[list[PromptBatch], list[Completions]]:
    """Each process's prompts and completions of the task's round (with spans: each span's),
    sampled as that process would sample them in a synchronous run (its rank's seeds, its own
    padding)."""
    parts = [dataclasses.replace(generation, rank=rank).sample(task.rows[rank], task.round_index,
                                                               start, stop)
             for rank, start, stop in task.parts()]
    return [p for p, _ in parts], [c for _, c in parts]


@dataclass
class RoundTools:
    """Tools (and environment_factory) under async_rollout: the generator runs the round's
    multi-turn rollouts, cppo's tool loop (`loop`, a copy of the trainer's) around its own
    sampler, as the trainer runs it in a synchronous run (the same ToolContext, with the
    generator's model and backend; step: the round's first optimizer step, which seeds cppo's
    sampler's turns)."""

    loop: ToolLoop
    steps_per_round: int

    def context(self, generation: Generation, round_index: int) -> ToolContext:
        backend = generation.backend
        settings = backend.settings
        section = settings.generation
        return ToolContext(generation.tokenizer, backend.model, backend, generation.device,
                           SamplingSettings.of(section), settings.seed, generation.num_generations,
                           generation.max_prompt_length, section.max_completion_length,
                           settings.lean_forward, section.share_prefixes, generation.rank,
                           round_index, round_index * self.steps_per_round)

    def rollout(self, generation: Generation, rows: list[dict], round_index: int
                ) -> tuple[PromptBatch, Completions, dict]:
        """One process's part of a round: its prompts, completions (tool_mask: 0 on the tools'
        tokens) and turns (the rollouts' chat messages, for the reward functions, and the
        tools/* metrics). Environments come back as copies: the loop resets its own for the next
        round while the trainer scores this one."""
        prompts, completions = generation.rollout(self.loop, rows, round_index,
                                                  self.context(generation, round_index))
        if completions.columns and "environments" in completions.columns:
            completions.columns["environments"] = copy.deepcopy(completions.columns["environments"])
        return prompts, completions, {"messages": self.loop.messages,
                                      "metrics": dict(self.loop.metrics)}


def roll_out_round(generation: Generation, task: RolloutTask, tools: RoundTools | None
                   ) -> tuple[list[PromptBatch], list[Completions], list[dict] | None]:
    """A generator's round: sample_round's, or with tools each process's multi-turn rollouts
    (RoundTools) and their turns, in rank order (spans: whole processes' rows only, the tool
    loop seeding a process's rollouts together)."""
    if tools is None:
        return (*sample_round(generation, task), None)
    if any((start, stop) != (0, len(task.rows[rank])) for rank, start, stop in task.parts()):
        raise ValueError(f"with tools a generator samples whole processes' rows; got the spans "
                         f"{task.spans}")
    parts = [tools.rollout(dataclasses.replace(generation, rank=rank), task.rows[rank],
                           task.round_index)
             for rank, _, _ in task.parts()]
    return [p for p, _, _ in parts], [c for _, c, _ in parts], [t for _, _, t in parts]


class IdleClock:
    """A generator's wait for its task (Sampled.idle_seconds, which pruning_rate auto reads): the
    seconds from the end of its last round until the next task arrived; 0 for the first task (a
    start-up is not idling)."""

    def __init__(self) -> None:
        self.done: float | None = None   # when the last round ended

    def task_arrived(self) -> float:
        """The seconds idle before this task (call as it arrives)."""
        return 0.0 if self.done is None else time.perf_counter() - self.done

    def round_done(self) -> float:
        """Now, the end of a round (perf_counter), from which the next task's wait counts."""
        self.done = time.perf_counter()
        return self.done


class Generator:
    """What the trainer waits on: a queue of results and a side that may end or fall silent.
    Subclasses set self.results, self.stale_after, self.heartbeat (a Value: 0 until started),
    self.started, self.sink (their WeightSink), and define _ended() -> str | None, _stop(), close() and `name`."""

    @property
    def pushed_bytes(self) -> int:
        """The bytes the last push sent (its weight sink's)."""
        return self.sink.pushed_bytes

    def receive(self) -> Sampled:
        """The next sampled round. A generator that ended, failed or went heartbeat_stale_after_s
        without a heartbeat raises GeneratorError (never a hang)."""
        while True:
            try:
                got = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                continue
            if isinstance(got, Failure):
                self.close()
                raise GeneratorError(f"the {self.name} failed:\n{got.text}")
            return got

    def _check_alive(self) -> None:
        how = self._ended()
        if how is not None:
            raise GeneratorError(f"the {self.name} ended with {how} while the trainer waited for "
                                 f"a round; the last checkpoint is intact: `cppo train --resume "
                                 f"true` continues the run")
        last = self.heartbeat.value
        if not last and time.time() - self.started > START_S:
            self._stop()
            raise GeneratorError(f"the {self.name} did not start within {START_S:g} s; it was "
                                 f"stopped")
        silent = time.time() - last if last else 0.0
        if silent > self.stale_after:
            self._stop()
            raise GeneratorError(f"the {self.name} sent no heartbeat for {silent:.1f} s "
                                 f"(heartbeat_stale_after_s = {self.stale_after:g}): it hangs, so "
                                 f"it was stopped; the last checkpoint is intact: `cppo train "
                                 f"--resume true` continues")
