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
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
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
from typing import TYPE_CHECKING

import torch
import torch.distributed
import torch.multiprocessing as mp
from safetensors.torch import save_file

from cppo.algorithm.staleness import (is_stale, lookahead_rounds, push_due, rounds_in_flight,
                                      staleness)
from cppo.errors import ConfigError, GeneratorError, VLLMServerError
from cppo.sampling.backends import make_backend
from cppo.sampling.batches import Completions, PromptBatch
from cppo.sampling.generation import Generation
from cppo.sampling.settings import BackendSettings
from cppo.sampling.vllm import server_url, server_weight_metadata, vllm_weights

if TYPE_CHECKING:
    from cppo.config.sections import AsyncSection

HEARTBEAT_EVERY_S = 0.5   # how often the generator process says it is alive
START_S = 600.0           # the longest a generator process may take to start (imports, its model)
POLL_S = 0.2              # how often a waiting trainer checks the generator


@dataclass
class RolloutTask:
    """One round to sample: each training process's rows (its questions, in rank order) and the
    round index that seeds it."""

    task_id: int
    round_index: int
    rows: list[list[dict]]


@dataclass
class Sampled:
    """A round as the generator sampled it: the policy version that sampled it, each process's
    prompts (Q rows) and completions (Q x G rows), in rank order, the seconds it took and the
    seconds the generator waited for the task (Arrival)."""

    task_id: int
    version: int
    prompts: list[PromptBatch]
    completions: list[Completions]
    seconds: float
    idle_seconds: float = 0.0

    def part(self, rank: int) -> "Arrival":
        return Arrival(self.task_id, self.version, self.prompts[rank], self.completions[rank],
                       self.seconds, self.idle_seconds)


@dataclass
class Arrival:
    """This process's part of a sampled round: the policy version that sampled it, the prompts
    (Q rows), completions (Q x G rows), the seconds the sampling took and the seconds the
    generator waited for the task before (idle_seconds: 0 for its first task)."""

    task_id: int
    version: int
    prompts: PromptBatch
    completions: Completions
    seconds: float
    idle_seconds: float = 0.0

    def to(self, device) -> "Arrival":
        return dataclasses.replace(self, prompts=self.prompts.to(device),
                                   completions=self.completions.to(device))


@dataclass
class _Failure:
    text: str


class _WholeModel:
    """The generator's model is never sharded: `gathered()` is a no-op (cppo.parallel.engines)."""

    gathered = staticmethod(contextlib.nullcontext)


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


def sample_round(generation: Generation, task: RolloutTask
                 ) -> tuple[list[PromptBatch], list[Completions]]:
    """Each process's prompts and completions of the task's round, sampled as that process would
    sample them in a synchronous run (its rank's seeds, its own padding)."""
    parts = [dataclasses.replace(generation, rank=rank).sample(rows, task.round_index)
             for rank, rows in enumerate(task.rows)]
    return [p for p, _ in parts], [c for _, c in parts]


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
            prompts, completions = sample_round(generation, task)
            done = time.perf_counter()
            results.put(Sampled(task.task_id, mine, prompts, completions, done - start, idle))
    except Exception:   # the trainer raises it, with the generator's traceback
        results.put(_Failure(traceback.format_exc()))
    finally:
        beating.set()


class _Generator:
    """What the trainer waits on: a queue of results and a side that may end or fall silent.
    Subclasses set self.results, self.stale_after, self.heartbeat (a Value: 0 until started),
    self.started, and define _ended() -> str | None, _stop() and `name`."""

    def receive(self) -> Sampled:
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
        # before multiprocessing's own exit handler, which would wait for a daemon process that
        # ignores its SIGTERM: a script that never calls close() still ends
        atexit.register(self.close)

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


class _Beat:
    """A heartbeat in this process (the server generator's thread), read as mp.Value's .value."""

    value = 0.0


class ServerGenerator(_Generator):
    """async_rollout with a vLLM server (`use_vllm`, `vllm_mode: server`): a thread of the
    trainer process sends each round to the server (cppo.sampling.vllm's server backend) and the
    server generates while the trainer trains. A push hands the policy's weights (LoRA merged,
    vLLM's names) to the thread, which has the server take the newest before its next round
    (never mid-round) and reset its prefix cache. On CUDA they go over NCCL, TRL's `trl
    vllm-serve` protocol (VLLMClient: init_communicator once, then update_named_params per
    push); elsewhere as safetensors in a new folder under `weights_dir`, which the server
    reloads in place (vLLM's `reload_weights` with a `weights_path`, through its
    `/collective_rpc` route: the server runs with VLLM_SERVER_DEV_MODE=1).

    backend: a VLLMBackend in server mode built with push_weights=False (make_backend's under
    async_rollout): the pushes, and the NCCL communicator, are this generator's; the server,
    G, the prompt length and the seed are its settings'."""

    def __init__(self, backend, tokenizer, weights_dir, *, heartbeat_stale_after_s: float) -> None:
        if backend.push_weights:
            raise ValueError("ServerGenerator pushes the weights itself: build its backend with "
                             "push_weights=False")
        self.backend = backend
        settings = backend.settings
        self.generation = Generation(backend, tokenizer, _WholeModel(), torch.device("cpu"), 0,
                                     settings.generation.num_generations,
                                     settings.generation.max_prompt_length, settings.seed)
        if not self._push_over_nccl and getattr(backend.model.config, "tie_word_embeddings", False):
            # (over NCCL the server's tied head shares the embedding's storage, which the push
            # refreshes; vLLM's CPU build keeps a repacked copy of the head that a reload leaves)
            raise ConfigError("'async_rollout' with a vLLM server reloads the weights from files "
                              "off CUDA, which does not refresh a tied LM head "
                              "(tie_word_embeddings: true in the model's config); use "
                              "use_vllm: false (cppo's generator process) for this model")
        self.weights_dir = Path(weights_dir)
        self.url = server_url(settings.vllm)
        # latest: (version, folder or (metadata, tensors)) pushed and not yet sent; loaded: the
        # server's version (-1: the weights it started with)
        self.lock, self.latest, self.loaded, self.communicating = threading.Lock(), None, -1, False
        # the heartbeat: when the round being sampled started (0: idle); no start-up to allow for
        self.heartbeat, self.started, self.stale_after = _Beat(), float("inf"), heartbeat_stale_after_s
        self.tasks, self.results = queue.Queue(), queue.Queue()
        self.name = f"vLLM server generator ({self.url})"
        self.thread = threading.Thread(target=self._run, daemon=True, name="cppo-server-generator")
        self.thread.start()
        atexit.register(self.close)   # a script that never calls close() leaves no weights behind

    @property
    def _push_over_nccl(self) -> bool:
        """Whether pushes go over NCCL (the policy on CUDA) rather than through files."""
        return self.backend.push_device().type == "cuda"

    def push(self, policy, version: int) -> float:
        """Hand the policy's weights to the thread as `version`; the seconds it took. NCCL: a
        snapshot on the policy's device that the trainer's next steps leave as it is:
        (metadata, tensors), metadata a (vLLM name, dtype, shape) per tensor
        (server_weight_metadata), tensors a (vLLM name, clone of the weight, shape as announced)
        per weight vllm_weights yields, in that order. Files: weights_dir/version-<version>/
        model.safetensors."""
        start = time.perf_counter()
        if self._push_over_nccl:
            with vllm_weights(policy) as weights:
                tensors = [(name, t.detach().clone()) for name, t in weights]
            if tensors and tensors[0][1].is_cuda:   # the sender packs on streams of its own
                torch.cuda.current_stream(tensors[0][1].device).synchronize()
            pushed = (server_weight_metadata(policy), tensors)
        else:
            pushed = self.weights_dir / f"version-{version}"
            pushed.mkdir(parents=True, exist_ok=True)
            with vllm_weights(policy) as weights:
                save_file({name: t.detach().contiguous().cpu() for name, t in weights},
                          str(pushed / "model.safetensors"))
        with self.lock:
            self.latest = (version, pushed)   # a push not yet sent is replaced, never sent
        return time.perf_counter() - start

    def submit(self, task: RolloutTask) -> None:
        self.tasks.put(task)

    def _reload(self) -> int:
        """Have the server take the newest pushed weights, if any came since the last; the
        server's version."""
        with self.lock:
            latest, self.latest = self.latest, None
        if latest is None:
            return self.loaded
        version, pushed = latest
        client = self.backend.client
        if self._push_over_nccl:
            if not self.communicating:
                client.init_communicator(device=self.backend.push_device())
                self.communicating = True
            metadata, tensors = pushed
            client.update_named_params(metadata, iter(tensors))
        else:
            import requests   # with trl, which the server's client needs (connect_server)
            reply = requests.post(f"{self.url}/collective_rpc", timeout=self.stale_after, json={
                "method": "reload_weights",
                "kwargs": {"weights_path": str(pushed), "is_checkpoint_format": True}})
            if reply.status_code != 200:
                raise VLLMServerError(f"the vLLM server at {self.url} refused the weights "
                                      f"({reply.status_code}: {reply.text[:300]}); start it with "
                                      f"VLLM_SERVER_DEV_MODE=1 so that /collective_rpc exists")
            for folder in self.weights_dir.glob("version-*"):   # older pushes, loaded or skipped
                if int(folder.name.removeprefix("version-")) < version:
                    shutil.rmtree(folder, ignore_errors=True)
        client.reset_prefix_cache()
        self.loaded = version
        return version

    def _run(self) -> None:
        try:
            while (task := self.tasks.get()) is not None:
                self.heartbeat.value = time.time()
                version = self._reload()
                start = time.perf_counter()
                prompts, completions = sample_round(self.generation, task)
                self.results.put(Sampled(task.task_id, version, prompts, completions,
                                         time.perf_counter() - start))
                self.heartbeat.value = 0.0
        except Exception:
            self.results.put(_Failure(traceback.format_exc()))

    def _ended(self) -> str | None:
        return None if self.thread.is_alive() else "its thread ended"

    def _stop(self) -> None:
        """A thread cannot be stopped: it is left to end with the process (a daemon)."""

    def close(self, timeout: float = 10.0) -> None:
        atexit.unregister(self.close)
        self.tasks.put(None)
        self.thread.join(timeout)
        shutil.rmtree(self.weights_dir, ignore_errors=True)


class ProcessShare:
    """The generator as each training process sees it. Under torchrun the first process holds it
    (`generator`; None on the others): it submits the rounds (every process's rows), pushes the
    weights and scatters each sampled round's parts, and each process receives its own on its
    device. A generator error on the first process reaches every process as the same
    GeneratorError. One process: the round's only part. gathered: the engine's context that
    holds the full weights (fsdp), entered by every process around a push."""

    def __init__(self, generator, dist, device, gathered=contextlib.nullcontext) -> None:
        self.generator, self.dist, self.device, self.gathered = generator, dist, device, gathered
        self.name = generator.name if generator is not None else "generator of the first process"

    def submit(self, task: RolloutTask) -> None:
        if self.generator is not None:
            self.generator.submit(task)

    def receive(self) -> Arrival:
        if not self.dist.active:
            return self.generator.receive().part(0)
        parts = None
        if self.generator is not None:
            try:
                got = self.generator.receive()
            except GeneratorError as error:
                self._scatter([_Failure(str(error))] * self.dist.world_size)
                raise
            parts = [got.part(rank).to("cpu") for rank in range(self.dist.world_size)]
        mine = self._scatter(parts)
        if isinstance(mine, _Failure):
            raise GeneratorError(f"on the first process: {mine.text}")
        return mine.to(self.device)

    def _scatter(self, parts: list | None):
        box = [None]
        torch.distributed.scatter_object_list(box, parts, src=0)
        return box[0]

    def push(self, policy, version: int) -> float:
        """Every process enters (fsdp gathers); the first one pushes. Its seconds (0 elsewhere)."""
        with self.gathered():
            return 0.0 if self.generator is None else self.generator.push(policy, version)

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()


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
        rows, the round's question order, this process's prompts, completions and metrics."""
        self.fill(round_index, last_round, take_questions, questions_state)
        head, arrival, stale, waited = self.take(version)
        rows = head.task.rows[self.rank]
        return (rows, head.order, arrival.prompts, arrival.completions,
                self.metrics(arrival, stale, waited, len(rows)))

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
                   engine) -> RolloutScheduler:
    """The generator (cppo's sampler in its own process, built as the trainer's `backend` is:
    its settings, chunk size and sampling dtype; with use_vllm, the vLLM server that `backend`
    talks to), held by the first training process, on the policy's weights as `version`, and
    this process's scheduler: rounds ahead as max_staleness, max_inflight_tasks and
    queue_maxsize allow (rollout: the config's async section; steps_per_round: optimizer steps
    per generation round; questions_per_round: each process's). engine: the policy's
    (cppo.parallel.engines.Engine; call check_async_launch first)."""
    policy, generator, settings = engine.policy, None, backend.settings
    use_vllm = settings.vllm.use_vllm
    if dist.is_main and use_vllm:
        generator = ServerGenerator(backend, tokenizer, weights_dir,
                                    heartbeat_stale_after_s=rollout.heartbeat_stale_after_s)
    elif dist.is_main:
        build = functools.partial(generator_sampling, tokenizer, settings, backend.chunk_size,
                                  backend.generation_dtype, rollout.max_staleness > 0)
        generator = GeneratorProcess(policy, build,
                                     threads=rollout.generator_threads or torch.get_num_threads(),
                                     heartbeat_stale_after_s=rollout.heartbeat_stale_after_s,
                                     cpus=rollout.generator_cpus)
    share = ProcessShare(generator, dist, dist.device, engine.gathered)
    questions = questions_per_round * dist.world_size
    waiting = rollout.queue_maxsize // (questions * settings.generation.num_generations)
    in_flight = min(rounds_in_flight(rollout.max_inflight_tasks, rollout.max_staleness, questions),
                    1 + waiting)   # + the one trained next
    scheduler = RolloutScheduler(share, lookahead_rounds(rollout.max_staleness, steps_per_round,
                                                         in_flight, rollout.weight_sync_steps),
                                 rollout.max_staleness, rank=dist.rank)
    scheduler.sync(policy, version, rollout.weight_sync_steps)
    if dist.is_main:
        where = "" if use_vllm else f" (cores {rollout.generator_cpus or 'shared'})"
        trainers = f", {dist.world_size} training processes" if dist.active else ""
        print(f"async_rollout: {share.name}{where}{trainers}, {scheduler.lookahead} round(s) "
              f"sampled ahead, max_staleness {rollout.max_staleness}, weights pushed every "
              f"{rollout.weight_sync_steps} step(s)", flush=True)
    return scheduler


def check_async_launch(world_size: int, strategy: str, rollout_func) -> None:
    """What async_rollout cannot run with, known once the launch is: a rollout function (it
    samples inside the trainer) and, under several processes, fsdp (the generator holds a
    whole copy of the policy, made from the first process's)."""
    if rollout_func is not None:
        raise ConfigError("'async_rollout' samples in its generator, so it cannot run a "
                          "rollout_func or tools (they sample inside the trainer); unset them, or "
                          "set async_rollout: false")
    if world_size > 1 and strategy != "ddp":
        raise ConfigError(f"'async_rollout' with {world_size} training processes needs "
                          f"distributed: ddp (the generator copies the first process's whole "
                          f"policy); got distributed: {strategy}. Set distributed: ddp, or "
                          f"async_rollout: false")
