"""async_rollout with vLLM servers (`use_vllm`, `vllm_mode: server`; one or several): a thread
of the trainer process sends each round to the servers, which generate while the trainer trains,
and has every server take the newest pushed weights before each round
(cppo.sampling.weight_sinks: over NCCL on CUDA, from files elsewhere)."""

from __future__ import annotations

import atexit
import copy
import queue
import threading
import time
import traceback

import torch

from cppo.sampling.generation import Generation
from cppo.sampling.rollout_generator import (Generator, IdleClock, RoundTools, WholeModel,
                                             roll_out_round)
from cppo.sampling.rollout_messages import Failure, RolloutTask, Sampled
from cppo.sampling.vllm import EXPORT, GATHERED_EXPORT, check_file_reload
from cppo.sampling.vllm_server import adapter_sink
from cppo.sampling.weight_sinks import ServerFiles, StagedServerNCCL


class ThreadBeat:
    """A heartbeat in this process (the server generator's thread), read as mp.Value's .value."""

    value = 0.0


class ServerGenerator(Generator):
    """async_rollout with vLLM servers: a thread of the trainer process sends each round to the
    servers (cppo.sampling.vllm's server backend: the questions spread over them, each one's G
    completions from one server) and they generate while the trainer trains. A push hands the
    policy's weights (LoRA merged, vLLM's names) to the weight sink, from which the thread has
    every server take the newest before its next round (never mid-round) and reset its prefix
    cache. On CUDA they go over NCCL, TRL's `trl vllm-serve`
    protocol (StagedServerNCCL: a snapshot, streamed by the thread); elsewhere as safetensors in a
    new folder under `weights_dir`, which the server reloads in place (ServerFiles). A LoRA run
    with vllm_push: adapter pushes the adapter alone, on any device: peft's adapter files in a new
    folder under `weights_dir`, which the server loads as a LoRA adapter that the thread's
    requests then name (ServerAdapterFiles).

    backend: a VLLMBackend in server mode built with push_weights=False (make_backend's under
    async_rollout): the pushes, and the NCCL communicator, are this generator's; the server,
    G, the prompt length and the seed are its settings'. tools: the tool loop the thread runs
    each round in (a copy of it: the trainer's is left alone), None to sample single turns.
    sharded: the policy is sharded (fsdp): a push gathers each parameter in turn (GATHERED_EXPORT;
    the other training processes join each gather, ProcessShare), into files, or over NCCL from
    a snapshot in host memory."""

    def __init__(self, backend, tokenizer, weights_dir, *, heartbeat_stale_after_s: float,
                 tools: RoundTools | None = None, sharded: bool = False) -> None:
        if backend.push_weights:
            raise ValueError("ServerGenerator pushes the weights itself: build its backend with "
                             "push_weights=False")
        self.backend = backend
        self.tools = None if tools is None else copy.deepcopy(tools)
        settings = backend.settings
        self.generation = Generation(backend, tokenizer, WholeModel(), torch.device("cpu"), 0,
                                     settings.generation.num_generations,
                                     settings.generation.max_prompt_length, settings.seed)
        self.urls = [url for _, url in backend.servers]
        device, export = backend.push_device(), GATHERED_EXPORT if sharded else EXPORT
        if settings.vllm.vllm_push == "adapter":   # the LoRA alone, from files (any device)
            self.sink = adapter_sink(backend.model, backend.servers, weights_dir,
                                     timeout=heartbeat_stale_after_s)
        elif device.type == "cuda":
            self.sink = StagedServerNCCL(backend.servers, device, export, offload=sharded)
        else:
            check_file_reload(backend.model.config)
            self.sink = ServerFiles(backend.servers, weights_dir, export, timeout=min(
                heartbeat_stale_after_s, backend.request_timeout))
        # the heartbeat: when the round being sampled started (0: idle); no start-up to allow for
        self.heartbeat, self.started = ThreadBeat(), float("inf")
        self.stale_after = heartbeat_stale_after_s
        self.tasks, self.results = queue.Queue(), queue.Queue()
        self.name = f"vLLM server generator ({', '.join(self.urls)})"
        self.thread = threading.Thread(target=self._run, daemon=True, name="cppo-server-generator")
        self.thread.start()
        atexit.register(self.close)   # a script that never calls close() leaves no weights behind

    def push(self, policy, version: int) -> float:
        """Hand the policy's weights to the sink as `version` (a snapshot on the policy's device,
        weights_dir/version-<version>/model.safetensors, or weights_dir/adapter-<version>/); the
        seconds it took. The thread sends the newest before its next round."""
        return self.sink.push(policy, version)

    def submit(self, task: RolloutTask) -> None:
        self.tasks.put(task)

    def _reload(self) -> int:
        """Have the server take the newest pushed weights, if any came since the last (the
        sink's take); the server's version."""
        return self.sink.take()

    def _run(self) -> None:
        clock = IdleClock()   # the generator side's wait for its task, as the process measures it
        try:
            while (task := self.tasks.get()) is not None:
                idle = clock.task_arrived()
                self.heartbeat.value = time.time()
                version = self._reload()
                start = time.perf_counter()
                prompts, completions, turns = roll_out_round(self.generation, task, self.tools)
                done = clock.round_done()
                self.results.put(Sampled(task.task_id, version, prompts, completions,
                                         done - start, idle, turns))
                self.heartbeat.value = 0.0
        except Exception:
            self.results.put(Failure(traceback.format_exc()))

    def _ended(self) -> str | None:
        return None if self.thread.is_alive() else "its thread ended"

    def _stop(self) -> None:
        """A thread cannot be stopped: it is left to end with the process (a daemon)."""

    def close(self, timeout: float = 10.0) -> None:
        atexit.unregister(self.close)
        self.tasks.put(None)
        self.thread.join(timeout)
        self.sink.close()
