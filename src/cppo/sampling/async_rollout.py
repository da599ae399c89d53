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
"""

from __future__ import annotations

import contextlib
import copy
import functools
import multiprocessing.connection
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from cppo.algorithm.staleness import (is_stale, lookahead_rounds, push_due, rounds_in_flight,
                                      staleness)
from cppo.errors import ConfigError, GeneratorError, VLLMServerError
from cppo.sampling.backends import make_backend
from cppo.sampling.batches import Completions, PromptBatch
from cppo.sampling.generation import Generation
from cppo.sampling.sampler import encode_prompts
from cppo.sampling.vllm import server_url, vllm_weights

HEARTBEAT_EVERY_S = 0.5   # how often the generator process says it is alive
START_S = 600.0           # the longest a generator process may take to start (imports, its model)
POLL_S = 0.2              # how often a waiting trainer checks the generator


@dataclass
class RolloutTask:
    """One round to sample: its rows (this process's questions) and the round index that seeds it."""

    task_id: int
    round_index: int
    rows: list[dict]


@dataclass
class Arrival:
    """A sampled round: the policy version that sampled it, the seconds the sampling took and
    the seconds the generator waited for the task before (idle_seconds: 0 for its first task)."""

    task_id: int
    version: int
    prompts: PromptBatch
    completions: Completions
    seconds: float
    idle_seconds: float = 0.0


@dataclass
class _Failure:
    text: str


class _WholeModel:
    """The generator's model is never sharded: `gathered()` is a no-op (cppo.parallel.engines)."""

    gathered = staticmethod(contextlib.nullcontext)


def generator_sampling(tokenizer, args, chunk_size: int, generation_dtype: str | None, model,
                       engine) -> Generation:
    """The generator process's Generation: the run's backend on its own model, recording every
    token's behaviour log-prob when a round may be stale (max_staleness > 0; at 0 the policy that
    trains on a round sampled it, as in a synchronous run). functools.partial of the first four
    is GeneratorProcess's build."""
    backend = make_backend(model, tokenizer, args, chunk_size=chunk_size,
                           generation_dtype=generation_dtype)
    backend.record_logprobs = args.max_staleness > 0
    return Generation(backend, tokenizer, engine, next(model.parameters()).device, 0,
                      args.num_generations, args.max_prompt_length, args.seed)


def trainable_names(model) -> list[str]:
    """The parameters an optimizer step changes: the ones a push copies."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _copy_parameters(target, source, names: list[str]) -> None:
    dst, src = dict(target.named_parameters()), dict(source.named_parameters())
    with torch.no_grad():
        for name in names:
            dst[name].copy_(src[name].detach())


def generator_main(staging, names, lock, version, heartbeat, tasks, results, build, threads,
                   cpus) -> None:
    """The generator process: a private copy of the staging model, refreshed from it whenever the
    trainer has pushed a newer version; one round sampled per task until a None task. Signals
    are the trainer's to act on (it stops this process); an orphaned generator ends itself."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    model = copy.deepcopy(staging)   # private: a push never lands mid-round
    beating, parent = threading.Event(), os.getppid()

    def beat() -> None:
        while not beating.wait(HEARTBEAT_EVERY_S):
            if os.getppid() != parent:   # the trainer was killed
                os._exit(0)
            heartbeat.value = time.time()
    heartbeat.value = time.time()
    threading.Thread(target=beat, daemon=True).start()
    generation, mine, done = build(model, _WholeModel()), -1, None   # done: the last round's end
    try:
        while (task := tasks.get()) is not None:
            idle = 0.0 if done is None else time.perf_counter() - done
            with lock:
                if version.value != mine:
                    _copy_parameters(model, staging, names)
                    mine = version.value
            start = time.perf_counter()
            prompts, completions = generation.sample(task.rows, task.round_index)
            done = time.perf_counter()
            results.put(Arrival(task.task_id, mine, prompts, completions, done - start, idle))
    except Exception:   # the trainer raises it, with the generator's traceback
        results.put(_Failure(traceback.format_exc()))
    finally:
        beating.set()


class _Generator:
    """What the trainer waits on: a queue of results and a side that may end or fall silent.
    Subclasses set self.results, self.stale_after, self.heartbeat (a Value: 0 until started),
    self.started, and define _ended() -> str | None, _stop() and `name`."""

    def receive(self) -> Arrival:
        """The next sampled round. A generator that ended, failed or went heartbeat_stale_after_s
        without a heartbeat raises GeneratorError (never a hang)."""
        while True:
            try:
                got = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                continue
            if isinstance(got, _Failure):
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


class GeneratorProcess(_Generator):
    """The generator process and what the trainer shares with it: the staging copy of the
    weights (shared memory), its version, a heartbeat, and the task and result queues."""

    def __init__(self, policy, build, *, threads: int, heartbeat_stale_after_s: float,
                 cpus: list[int] | None = None) -> None:
        """build(model, engine) -> a cppo.sampling.generation.Generation sampling with `model`;
        it is pickled to the process (a functools.partial of module-level functions). cpus: the
        cores the process runs on (None: the trainer's)."""
        ctx = mp.get_context("spawn")
        self.staging = copy.deepcopy(policy).requires_grad_(False).share_memory()
        self.names = trainable_names(policy)
        self.lock, self.version = ctx.Lock(), ctx.Value("q", -1)
        self.heartbeat = ctx.Value("d", 0.0)   # 0: not started yet
        self.started = time.time()
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.stale_after = heartbeat_stale_after_s
        self.process = ctx.Process(
            target=generator_main, daemon=True, name="cppo-generator",
            args=(self.staging, self.names, self.lock, self.version, self.heartbeat, self.tasks,
                  self.results, build, threads, cpus))
        self.process.start()
        self.name = f"generator process (pid {self.process.pid})"

    def push(self, policy, version: int) -> float:
        """Copy the policy's trainable weights to the staging copy as `version`; the seconds it took."""
        start = time.perf_counter()
        with self.lock:
            _copy_parameters(self.staging, policy, self.names)
            self.version.value = version
        return time.perf_counter() - start

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


class _Beat:
    """A heartbeat in this process (the server generator's thread), read as mp.Value's .value."""

    value = 0.0


class ServerGenerator(_Generator):
    """async_rollout with a vLLM server (`use_vllm`, `vllm_mode: server`): a thread of the
    trainer process sends each round to the server (cppo.sampling.vllm's server backend, no NCCL)
    and the server generates while the trainer trains. A push writes the policy's weights (LoRA
    merged, vLLM's names) as safetensors to a new folder under `weights_dir`; before its next
    round the thread has the server reload them in place (vLLM's `reload_weights` with a
    `weights_path`, through its `/collective_rpc` route: the server runs with
    VLLM_SERVER_DEV_MODE=1) and reset its prefix cache. A round is never sampled across a push."""

    def __init__(self, backend, tokenizer, args, weights_dir, *, heartbeat_stale_after_s: float) -> None:
        if getattr(backend.model.config, "tie_word_embeddings", False):
            raise ConfigError("'async_rollout' with a vLLM server reloads the weights from files, "
                              "which does not refresh a tied LM head (tie_word_embeddings: true "
                              "in the model's config); use use_vllm: false (cppo's generator "
                              "process) for this model")
        self.backend, self.tokenizer, self.args = backend, tokenizer, args
        self.weights_dir = Path(weights_dir)
        self.url = server_url(args)
        self.lock, self.latest, self.loaded = threading.Lock(), None, None   # (version, folder)
        # the heartbeat: when the round being sampled started (0: idle); no start-up to allow for
        self.heartbeat, self.started, self.stale_after = _Beat(), float("inf"), heartbeat_stale_after_s
        self.tasks, self.results = queue.Queue(), queue.Queue()
        self.name = f"vLLM server generator ({self.url})"
        self.thread = threading.Thread(target=self._run, daemon=True, name="cppo-server-generator")
        self.thread.start()

    def push(self, policy, version: int) -> float:
        """Write the policy's weights for the server as `version`; the seconds it took."""
        start = time.perf_counter()
        folder = self.weights_dir / f"version-{version}"
        folder.mkdir(parents=True, exist_ok=True)
        with vllm_weights(policy) as weights:
            save_file({name: t.detach().contiguous().cpu() for name, t in weights},
                      str(folder / "model.safetensors"))
        with self.lock:
            self.latest = (version, folder)
        return time.perf_counter() - start

    def submit(self, task: RolloutTask) -> None:
        self.tasks.put(task)

    def _reload(self) -> int:
        """Have the server take the newest pushed weights (if newer than its own); their version."""
        with self.lock:
            latest = self.latest
        if latest is not None and latest != self.loaded:
            reply = requests.post(f"{self.url}/collective_rpc", timeout=self.stale_after, json={
                "method": "reload_weights",
                "kwargs": {"weights_path": str(latest[1]), "is_checkpoint_format": True}})
            if reply.status_code != 200:
                raise VLLMServerError(f"the vLLM server at {self.url} refused the weights "
                                      f"({reply.status_code}: {reply.text[:300]}); start it with "
                                      f"VLLM_SERVER_DEV_MODE=1 so that /collective_rpc exists")
            self.backend.client.reset_prefix_cache()
            self.loaded = latest
            for folder in self.weights_dir.glob("version-*"):   # older pushes, loaded or skipped
                if int(folder.name.removeprefix("version-")) < latest[0]:
                    shutil.rmtree(folder, ignore_errors=True)
        return self.loaded[0] if self.loaded is not None else -1

    def _run(self) -> None:
        try:
            while (task := self.tasks.get()) is not None:
                self.heartbeat.value = time.time()
                version = self._reload()
                start = time.perf_counter()
                prompts = encode_prompts(self.tokenizer, [r["prompt"] for r in task.rows],
                                         self.args.max_prompt_length)
                completions = self.backend.generate(prompts, round_index=task.round_index)
                self.results.put(Arrival(task.task_id, version, prompts, completions,
                                         time.perf_counter() - start))
                self.heartbeat.value = 0.0
        except Exception:
            self.results.put(_Failure(traceback.format_exc()))

    def _ended(self) -> str | None:
        return None if self.thread.is_alive() else "its thread ended"

    def _stop(self) -> None:
        """A thread cannot be stopped: it is left to end with the process (a daemon)."""

    def close(self, timeout: float = 10.0) -> None:
        self.tasks.put(None)
        self.thread.join(timeout)
        shutil.rmtree(self.weights_dir, ignore_errors=True)


@dataclass
class _Pending:
    task: RolloutTask
    order: list[int]
    questions_before: dict   # the question stream's state before this round's questions


@dataclass
class RolloutScheduler:
    """The trainer's side of asynchronous rollouts: rounds submitted ahead, their arrivals, the
    dropped stale ones and the counts the metrics report."""

    generator: GeneratorProcess
    lookahead: int            # rounds submitted beyond the one trained next
    max_staleness: int
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
        submitted. take_questions() -> (rows, order) draws the next round's questions;
        questions_state() is the stream's state before it."""
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
        """Submit the rounds ahead (fill), then take round_index's arrival (take): its rows,
        question order, prompts, completions and metrics."""
        self.fill(round_index, last_round, take_questions, questions_state)
        head, arrival, stale, waited = self.take(version)
        return (head.task.rows, head.order, arrival.prompts, arrival.completions,
                self.metrics(arrival, stale, waited, len(head.task.rows)))

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


def start_rollouts(policy, tokenizer, args, *, version: int, chunk_size: int,
                   generation_dtype: str | None, questions_per_round: int, backend,
                   weights_dir: Path, world_size: int, rollout_func) -> RolloutScheduler:
    """The generator (cppo's sampler in its own process; with use_vllm, the vLLM server that
    `backend` talks to) on the policy's weights as `version`, and the trainer's scheduler: rounds
    ahead as max_staleness, max_inflight_tasks and queue_maxsize allow."""
    if world_size > 1 or rollout_func is not None:
        raise ConfigError("'async_rollout' runs one training process with its generator: got "
                          f"{world_size} processes and rollout_func/tools "
                          f"{'set' if rollout_func is not None else 'unset'}; launch one process "
                          "without rollout_func, or set async_rollout: false")
    if args.use_vllm:
        generator = ServerGenerator(backend, tokenizer, args, weights_dir,
                                    heartbeat_stale_after_s=args.heartbeat_stale_after_s)
    else:
        build = functools.partial(generator_sampling, tokenizer, args, chunk_size, generation_dtype)
        generator = GeneratorProcess(policy, build,
                                     threads=args.generator_threads or torch.get_num_threads(),
                                     heartbeat_stale_after_s=args.heartbeat_stale_after_s,
                                     cpus=args.generator_cpus)
    waiting = args.queue_maxsize // (questions_per_round * args.num_generations)
    in_flight = min(rounds_in_flight(args.max_inflight_tasks, args.max_staleness,
                                     questions_per_round), 1 + waiting)   # + the one trained next
    scheduler = RolloutScheduler(generator, lookahead_rounds(args.max_staleness,
                                                             args.steps_per_round, in_flight),
                                 args.max_staleness)
    scheduler.sync(policy, version, args.weight_sync_steps)
    where = "" if args.use_vllm else f" (cores {args.generator_cpus or 'shared'})"
    print(f"async_rollout: {generator.name}{where}, {scheduler.lookahead} round(s) sampled "
          f"ahead, max_staleness {args.max_staleness}, weights pushed every "
          f"{args.weight_sync_steps} step(s)", flush=True)
    return scheduler
