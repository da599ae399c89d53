"""cppo's own generator process (async_rollout without vLLM): a spawned process holding a private
copy of the policy, which samples whole rounds with the run's backend while the trainer trains.
The trainer pushes its weights through shared memory (cppo.sampling.weight_sinks.SharedMemory);
the process takes the newest between two rounds. A heartbeat says it is alive; an orphaned
process ends itself."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from cppo.sampling.backends import make_backend
from cppo.sampling.generation import Generation
from cppo.sampling.rollout_generator import (Generator, IdleClock, RoundTools, WholeModel,
                                             roll_out_round)
from cppo.sampling.rollout_messages import Failure, RolloutTask, Sampled
from cppo.sampling.settings import BackendSettings
from cppo.sampling.weight_sinks import SharedMemory

HEARTBEAT_EVERY_S = 0.5   # how often the generator process says it is alive


def generator_sampling(tokenizer, settings: BackendSettings, chunk_size: int,
                       generation_dtype: str | None, record_logprobs: bool, model,
                       engine) -> Generation:
    """The generator process's Generation: the run's backend (settings: the trainer's) on its
    own model, recording every token's behaviour log-prob when a round may be stale
    (record_logprobs: max_staleness > 0; at 0 the policy that trains on a round sampled it, as in
    a synchronous run). functools.partial of the first five is GeneratorProcess's build."""
    backend = make_backend(model, tokenizer, settings, chunk_size=chunk_size,
                           generation_dtype=generation_dtype)
    backend.record_logprobs = record_logprobs
    generation = settings.generation
    return Generation(backend, tokenizer, engine, next(model.parameters()).device, 0,
                      generation.num_generations, generation.max_prompt_length, settings.seed)


def generator_main(sink: SharedMemory, heartbeat, tasks, results, build, threads, cpus,
                   tools: RoundTools | None = None) -> None:
    """The generator process: a private copy of the sink's staging model, refreshed from it
    whenever the trainer has pushed a newer version; one round sampled per task until a None
    task (with tools, the round's multi-turn rollouts: the tool loop runs here). Signals are the trainer's to act on (it stops this process); an orphaned generator
    ends itself."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    model = sink.private_copy()   # private: a push never lands mid-round
    beating, parent = threading.Event(), os.getppid()

    def beat() -> None:
        while not beating.wait(HEARTBEAT_EVERY_S):
            if os.getppid() != parent:   # the trainer was killed
                os._exit(0)
            heartbeat.value = time.time()
    heartbeat.value = time.time()
    threading.Thread(target=beat, daemon=True).start()
    generation, clock = build(model, WholeModel()), IdleClock()
    try:
        while (task := tasks.get()) is not None:
            idle = clock.task_arrived()
            mine = sink.take(model)
            start = time.perf_counter()
            prompts, completions, turns = roll_out_round(generation, task, tools)
            done = clock.round_done()
            results.put(Sampled(task.task_id, mine, prompts, completions, done - start, idle,
                                turns))
    except Exception:   # the trainer raises it, with the generator's traceback
        results.put(Failure(traceback.format_exc()))
    finally:
        beating.set()


class GeneratorProcess(Generator):
    """The generator process and what the trainer shares with it: the weight sink (a staging
    copy of the weights in shared memory, its version), a heartbeat, and the task and result
    queues."""

    def __init__(self, policy, build, *, threads: int, heartbeat_stale_after_s: float,
                 cpus: list[int] | None = None, tools: RoundTools | None = None,
                 skeleton=None, sink: SharedMemory | None = None) -> None:
        """build(model, engine) -> a cppo.sampling.generation.Generation sampling with `model`;
        it is pickled to the process (a functools.partial of module-level functions). cpus: the
        cores the process runs on (None: the trainer's). tools: the tool loop the process runs
        each round in (pickled to it: check_picklable_tools first), None to sample single turns.
        skeleton: a sharded policy's unsharded module (fsdp; SharedMemory: the staging copy is
        gathered into it, a collective). sink: a staging copy the process shares with others
        (cppo.sampling.generator_pool; each process keeps its own `taken`); None: its own."""
        ctx = mp.get_context("spawn")
        self.sink = sink if sink is not None else SharedMemory(policy, ctx, skeleton)
        self.heartbeat = ctx.Value("d", 0.0)   # 0: not started yet
        self.started = time.time()
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.stale_after = heartbeat_stale_after_s
        self.process = ctx.Process(
            target=generator_main, daemon=True, name="cppo-generator",
            args=(self.sink, self.heartbeat, self.tasks, self.results, build, threads, cpus,
                  tools))
        self.process.start()
        self.name = f"generator process (pid {self.process.pid})"
        # before multiprocessing's own exit handler, which would wait for a daemon process that
        # ignores its SIGTERM: a script that never calls close() still ends
        atexit.register(self.close)

    def push(self, policy, version: int) -> float:
        """Copy the policy's trainable weights to the staging copy as `version` (the sink); the
        seconds it took."""
        return self.sink.push(policy, version)

    def submit(self, task: RolloutTask) -> None:
        self.tasks.put(task)

    def _ended(self) -> str | None:
        if not multiprocessing.connection.wait([self.process.sentinel], timeout=0):
            return None
        code = self.process.exitcode   # None when someone else reaped it
        return "an unknown status" if code is None else \
            f"signal {-code}" if code < 0 else f"exit code {code}"

    def _stop(self) -> None:
        self.close(timeout=0)   # a hung process is not asked; it is stopped

    def close(self, timeout: float = 10.0) -> None:
        """Ask the process to end after its round (waiting `timeout` s); stop it if it does not."""
        atexit.unregister(self.close)
        if self.process.exitcode is None and timeout > 0:
            with contextlib.suppress(Exception):
                self.tasks.put(None)
            self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10.0)
        for q in (self.tasks, self.results):
            q.cancel_join_thread()
            q.close()
        self.sink.close()
