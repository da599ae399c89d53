"""Weight sinks: where the trainer pushes the policy's weights for a sampler, one per transport.

* `EngineReload`: a colocated vLLM engine (`vllm.LLM` in this process; cppo.sampling.vllm's
  engine backend), reloaded in place.
* `ServerNCCL`: `trl vllm-serve` servers over NCCL (TRL's VLLMClient protocol: init_communicator
  once, then update_named_params per push), streaming the live weights (the server backend's
  first process). `StagedServerNCCL`: the same stream from a snapshot, sent by async_rollout's
  server thread before its next round (cppo.sampling.server_generator).
* `ServerFiles`: vLLM servers reloading from files (the policy off CUDA): safetensors in a new
  folder that each server reloads in place (vLLM's `reload_weights` with a `weights_path`,
  through its `/collective_rpc` route: the server runs with VLLM_SERVER_DEV_MODE=1).
* `ServerAdapterFiles`: vLLM servers serving a LoRA run's adapter alone (`vllm_push: adapter`):
  peft's adapter files in a new folder, loaded as a new LoRA adapter through vLLM's runtime LoRA
  routes (`/v1/load_lora_adapter`), which the sampling requests then name as their model.
* `SharedMemory`: cppo's own generator process (cppo.sampling.generator_process): a staging copy
  of the policy in shared memory, copied into the process's private model between two rounds.

Every sink is a `WeightSink`: `push(policy, version)` makes the policy's weights the sampler's as
`version` (the seconds it took on the trainer's side): its next round, never one under way,
samples with them or newer; `pushed_bytes` is what the last push sent (the tensors' bytes, to
one server). A staged sink (`StagedServerNCCL`, `ServerFiles`, `SharedMemory`) keeps the newest
push until the sampler's side takes it (`take`, between two rounds); a push not yet taken is
replaced, never sent. The vLLM sinks send what a `VLLMExport` makes of the policy
(cppo.sampling.vllm's: vLLM's names, LoRA merged), but ServerAdapterFiles, which sends the
LoRA's factors (cppo.models.lora.save_adapter). A server sink takes `servers`, one (client,
url) per server (several: vllm_server_base_url lists them), and a push reaches every server
before any samples with it."""

from __future__ import annotations

import contextlib
import copy
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch
from safetensors.torch import save_file

from cppo.errors import VLLMServerError
from cppo.models.lora import save_adapter
from cppo.sampling.vllm_process import process_state_kept


@runtime_checkable
class WeightSink(Protocol):
    """Where the trainer's pushes go (one per transport)."""

    pushed_bytes: int   # the bytes of the tensors the last push sent (0 before the first)

    def push(self, policy, version: int) -> float:
        """Make the policy's weights the sampler's as `version` (optimizer steps taken; the
        round index for a synchronous backend): its next round samples with them or newer. The
        seconds it took on the trainer's side."""

    def close(self) -> None:
        """Release what the sink holds (files written, ...)."""


@dataclass(frozen=True)
class VLLMExport:
    """What a vLLM sink sends of a policy. weights(policy): a context giving (vLLM name, tensor)
    one at a time (live parameters among them: sent before it exits); metadata(policy): (vLLM
    name, dtype, shape) of each, in that order (what NCCL announces before it streams them)."""

    weights: Callable
    metadata: Callable


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def counted(pairs, sink):
    """(name, tensor) pairs as they are, their bytes summed into sink.pushed_bytes (from 0)."""
    sink.pushed_bytes = 0
    for name, tensor in pairs:
        sink.pushed_bytes += tensor_bytes(tensor)
        yield name, tensor


def refresh_tied_head(model) -> None:
    """(Runs inside vLLM's worker, on vLLM's model.) A tied LM head gets no weights of its own
    in a reload, but vLLM's CPU build keeps a repacked copy of it for the logits GEMM: rebuild
    that copy from the reloaded embedding (a no-op where nothing is repacked)."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(head, "weight"):
        method.process_weights_after_loading(head)


class EngineReload:
    """A colocated vLLM engine: the policy's weights through vLLM's in-place reload
    (`collective_rpc("reload_weights")`, checkpoint-format names, LoRA merged), a tied LM head's
    copy rebuilt from the reloaded embedding (refresh_tied_head), then the prefix cache reset. The
    engine must be awake (its weights held)."""

    pushed_bytes = 0   # the last push's (WeightSink)

    def __init__(self, llm, export: VLLMExport) -> None:
        self.llm, self.export, self.pushed_bytes = llm, export, 0

    def push(self, policy, version: int) -> float:
        start = time.perf_counter()
        with process_state_kept():
            with self.export.weights(policy) as weights:
                self.llm.collective_rpc("reload_weights", kwargs=dict(
                    weights_iterator=counted(weights, self), is_checkpoint_format=True))
            if getattr(policy.config, "tie_word_embeddings", False):
                self.llm.apply_model(refresh_tied_head)
            self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def close(self) -> None:
        """The engine is its backend's to end."""


class ServerNCCL:
    """vLLM servers over NCCL, TRL's `trl vllm-serve` protocol through its VLLMClient, one
    (client, url) per server in `servers`: each server's communicator set up once (connect, from
    `device`), then per push, server after server, the tensors announced (metadata) and streamed
    (update_named_params) and the server's prefix cache reset: every server holds the push when
    it returns. push streams the policy's live weights now."""

    pushed_bytes = 0   # the last push's (WeightSink)

    def __init__(self, servers: list[tuple[object, str]], device: torch.device,
                 export: VLLMExport) -> None:
        self.servers, self.device, self.export = list(servers), device, export
        self.communicating, self.pushed_bytes = False, 0

    def connect(self) -> None:
        """Set up the NCCL communicator with each server (once)."""
        if not self.communicating:
            for client, _ in self.servers:
                client.init_communicator(device=self.device)
            self.communicating = True

    def send(self, metadata, tensors: Callable) -> None:
        """Announce and stream (vLLM name, tensor) pairs to each server (tensors(): a context
        giving them, opened once per server), then reset its prefix cache."""
        self.connect()
        for i, (client, url) in enumerate(self.servers):
            try:
                with tensors() as pairs:   # the bytes: the first server's stream
                    client.update_named_params(metadata, counted(pairs, self) if i == 0 else pairs)
                client.reset_prefix_cache()
            except VLLMServerError:
                raise
            except Exception as err:
                raise VLLMServerError(f"the weight push to the vLLM server at {url} failed "
                                      f"({type(err).__name__}: {err}); check that it still runs, "
                                      f"or remove it from vllm_server_base_url") from err

    def push(self, policy, version: int) -> float:
        start = time.perf_counter()
        self.send(self.export.metadata(policy), lambda: self.export.weights(policy))
        return time.perf_counter() - start

    def close(self) -> None:
        """The communicators live as long as the clients."""


class _Staged:
    """A sink whose push stages the weights (stage(policy, version) -> what to load) for the
    sampler's side to load (load(version, staged)) when it takes them; the newest push only."""

    pushed_bytes = 0   # the last push's (WeightSink)

    def __init__(self) -> None:
        # latest: (version, staged) pushed and not yet taken; loaded: the sampler's version (-1:
        # the weights it started with)
        self.lock, self.latest, self.loaded = threading.Lock(), None, -1
        self.pushed_bytes = 0   # stage's: what the last push staged

    def push(self, policy, version: int) -> float:
        start = time.perf_counter()
        staged = self.stage(policy, version)
        with self.lock:
            self.latest = (version, staged)   # a push not yet taken is replaced, never sent
        return time.perf_counter() - start

    def take(self) -> int:
        """(The sampler's side, between two rounds.) Load the newest push, if any came since the
        last; the sampler's version."""
        with self.lock:
            latest, self.latest = self.latest, None
        if latest is not None:
            version, staged = latest
            self.load(version, staged)
            self.loaded = version
        return self.loaded


class StagedServerNCCL(_Staged):
    """ServerNCCL from a snapshot: a push keeps (metadata, tensors), a clone of each weight in the
    order of the metadata, which the trainer's next steps leave as they are, and take streams the
    newest. The snapshot is on the policy's device, or with offload (fsdp: the weights gathered
    one at a time) in host memory, each tensor moved to the device as it is sent."""

    def __init__(self, servers: list[tuple[object, str]], device: torch.device,
                 export: VLLMExport, *, offload: bool = False) -> None:
        super().__init__()
        self.nccl, self.offload = ServerNCCL(servers, device, export), offload

    def stage(self, policy, version: int):
        export = self.nccl.export
        with export.weights(policy) as weights:
            tensors = [(name, t.detach().to("cpu", copy=True) if self.offload
                        else t.detach().clone()) for name, t in counted(weights, self)]
        if tensors and tensors[0][1].is_cuda:   # the sender packs on streams of its own
            torch.cuda.current_stream(tensors[0][1].device).synchronize()
        return export.metadata(policy), tensors

    def load(self, version: int, staged) -> None:
        metadata, tensors = staged
        device = self.nccl.device
        self.nccl.send(metadata, lambda: contextlib.nullcontext(
            ((name, t.to(device)) for name, t in tensors) if self.offload else iter(tensors)))

    def close(self) -> None:
        self.nccl.close()


def post_to_server(url: str, route: str, body: dict, *, timeout: float, what: str):
    """POST `body` (JSON) to a vLLM server's `route`, waiting at most `timeout` s; its reply. A
    server that cannot be reached, or does not answer in time, is a VLLMServerError naming it and
    `what` it was asked to do."""
    import requests   # with trl, which the server's client needs (cppo.sampling.vllm_server)
    try:
        return requests.post(f"{url}{route}", json=body, timeout=timeout)
    except requests.RequestException as err:
        raise VLLMServerError(f"the vLLM server at {url} did not {what} ({type(err).__name__}: "
                              f"{err}); check that it still runs, or remove it from "
                              f"vllm_server_base_url") from err


class ServerFiles(_Staged):
    """vLLM servers reloading from files, one (client, url) per server in `servers`: a push writes
    weights_dir/version-<version>/model.safetensors; take has each server reload it in place
    (`reload_weights` through `/collective_rpc` at its url, waiting at most `timeout` s) and reset
    its prefix cache -- every server before it returns -- then removes the older folders (loaded
    or skipped). close removes weights_dir."""

    def __init__(self, servers: list[tuple[object, str]], weights_dir, export: VLLMExport, *,
                 timeout: float) -> None:
        super().__init__()
        self.servers, self.export, self.timeout = list(servers), export, timeout
        self.weights_dir = Path(weights_dir)

    def stage(self, policy, version: int) -> Path:
        folder = self.weights_dir / f"version-{version}"
        folder.mkdir(parents=True, exist_ok=True)
        with self.export.weights(policy) as weights:
            save_file({name: t.detach().contiguous().cpu() for name, t in counted(weights, self)},
                      str(folder / "model.safetensors"))
        return folder

    def load(self, version: int, folder: Path) -> None:
        for client, url in self.servers:
            self.reload(client, url, folder)
        for older in self.weights_dir.glob("version-*"):   # older pushes, loaded or skipped
            if int(older.name.removeprefix("version-")) < version:
                shutil.rmtree(older, ignore_errors=True)

    def reload(self, client, url: str, folder: Path) -> None:
        """One server reloads the weights in `folder` and resets its prefix cache."""
        reply = post_to_server(url, "/collective_rpc", {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(folder), "is_checkpoint_format": True}},
            timeout=self.timeout, what="reload the weights")
        if reply.status_code != 200:
            raise VLLMServerError(f"the vLLM server at {url} refused the weights "
                                  f"({reply.status_code}: {reply.text[:300]}); start it with "
                                  f"VLLM_SERVER_DEV_MODE=1 so that /collective_rpc exists")
        client.reset_prefix_cache()

    def close(self) -> None:
        shutil.rmtree(self.weights_dir, ignore_errors=True)


class ServerAdapterFiles(_Staged):
    """A vLLM server serving a LoRA run's adapter alone (vllm_push: adapter): a push writes peft's
    adapter files (adapter_model.safetensors, adapter_config.json: what vLLM's LoRA loader reads)
    to weights_dir/adapter-<version>/; take has each server of `servers` ((TRL's VLLMClient,
    url) pairs) load it as a new LoRA adapter (`/v1/load_lora_adapter`, waiting at most
    `timeout` s), makes the client's requests name it (their model: the client's `model`, which
    the client's user reads between two rounds, as take runs), unloads the one before and removes
    the older folders. The adapter's name is new each version (`<prefix>-<version>`, prefix
    unique to the sink), so no prefix-cache block of an older one is reused. The servers run
    with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (check_serves_adapter) and read
    weights_dir (a filesystem they share). close unloads the adapter, gives the clients their
    base model's name back and removes weights_dir."""

    def __init__(self, servers: list, weights_dir, *, timeout: float) -> None:
        super().__init__()
        self.servers, self.timeout = list(servers), timeout
        self.weights_dir = Path(weights_dir).resolve()   # the servers resolve it, not this process
        self.prefix = f"cppo-adapter-{secrets.token_hex(4)}"
        self.base_models = [client.model for client, _ in self.servers]
        self.served: str | None = None   # the adapter the servers sample with

    def adapter_name(self, version: int) -> str:
        return f"{self.prefix}-{version}"

    def stage(self, policy, version: int) -> Path:
        folder = self.weights_dir / f"adapter-{version}"
        self.pushed_bytes = save_adapter(policy, folder)
        return folder

    def load(self, version: int, folder: Path) -> None:
        name = self.adapter_name(version)
        for client, url in self.servers:
            reply = post_to_server(url, "/v1/load_lora_adapter",
                                   {"lora_name": name, "lora_path": str(folder)},
                                   timeout=self.timeout, what="load the adapter")
            if reply.status_code != 200:
                raise VLLMServerError(
                    f"the vLLM server at {url} refused the adapter {folder} ({reply.status_code}: "
                    f"{reply.text[:300]}); vllm_push: adapter needs a server started with "
                    f"--enable-lora --max-lora-rank >= the LoRA's rank and "
                    f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (else the route "
                    f"is missing: 404 Not Found), reading the trainer's filesystem")
            client.model = name   # the client's next requests sample with the new adapter
        self._unload()
        self.served = name
        for older in self.weights_dir.glob("adapter-*"):   # older pushes, loaded or skipped
            if int(older.name.removeprefix("adapter-")) < version:
                shutil.rmtree(older, ignore_errors=True)

    def _unload(self) -> None:
        """Unload the adapter served before (none: nothing)."""
        if self.served is not None:
            for _, url in self.servers:
                post_to_server(url, "/v1/unload_lora_adapter", {"lora_name": self.served},
                               timeout=self.timeout, what="unload the adapter")

    def close(self) -> None:
        try:
            self._unload()
        except Exception:   # a server already gone has nothing left to unload
            pass
        self.served = None
        for (client, _), base in zip(self.servers, self.base_models):
            client.model = base
        shutil.rmtree(self.weights_dir, ignore_errors=True)


def trainable_names(model) -> list[str]:
    """The parameters an optimizer step changes: the ones a push copies."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def full_parameters(model, names: list[str]):
    """(name, full tensor) of each named parameter of `model`, one at a time: a sharded one's
    (an FSDP2 DTensor: this process holds a shard) gathered over the processes by full_tensor(),
    a collective that every process makes, in the same order; a plain one as it is. Hold each
    only until the next: one parameter's full tensor at a time beyond FSDP's own memory."""
    params = dict(model.named_parameters())
    for name in names:
        param = params[name].detach()
        yield name, param.full_tensor() if hasattr(param, "full_tensor") else param


def drain(pairs) -> None:
    """Take part in full_parameters' gathers and keep nothing (the processes that do not push)."""
    for _ in pairs:
        pass


def copy_parameters(target, source, names: list[str]) -> None:
    """Copy the named parameters of `source` into `target`'s, in place (a sharded source's
    gathered one at a time: full_parameters)."""
    dst = dict(target.named_parameters())
    with torch.no_grad():
        for name, full in full_parameters(source, names):
            dst[name].copy_(full)


def materialised(skeleton, device) -> torch.nn.Module:
    """`skeleton` (its parameters on the meta device, cppo.parallel.engines.unsharded_skeleton)
    with uninitialised parameters of the same shapes and dtypes on `device`, tied ones still
    tied; its buffers as they are."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in skeleton.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device=device),
                        requires_grad=False)
                module._parameters[name] = made[id(param)]
    return skeleton


class SharedMemory:
    """cppo's generator process: a staging copy of the policy in shared memory (made from
    `policy`, without gradients), its version and a lock, made in the multiprocessing context
    `ctx`; the sink is handed to the process whole (it is pickled there, the staging copy shared,
    CUDA tensors through CUDA IPC). A push copies the trainable weights into the staging copy as
    `version`; the process makes its private model from it (private_copy) and takes each newer
    version between two rounds (take).

    A sharded policy (fsdp: each training process holds a shard of each parameter) comes with
    its `skeleton` (the unsharded module, parameters on the meta device): the staging copy is
    made from it and filled parameter by parameter as each is gathered (full_parameters), and
    so is every push; the other processes take part in each gather (drain) at the same time."""

    pushed_bytes = 0   # the last push's (WeightSink)

    def __init__(self, policy, ctx, skeleton=None) -> None:
        if skeleton is None:
            staging = copy.deepcopy(policy)
        else:
            device = next(policy.parameters()).device
            staging = materialised(copy.deepcopy(skeleton), device)
            copy_parameters(staging, policy, [name for name, _ in policy.named_parameters()])
        self.staging = staging.requires_grad_(False).share_memory()
        self.names = trainable_names(policy)
        self.lock, self.version = ctx.Lock(), ctx.Value("q", -1)
        self.taken = -1   # the version the process's model holds (-1: the staging copy's first)
        params = dict(self.staging.named_parameters())
        self.pushed_bytes = 0
        self.copy_bytes = sum(tensor_bytes(params[name]) for name in self.names)

    def push(self, policy, version: int) -> float:
        start = time.perf_counter()
        with self.lock:
            copy_parameters(self.staging, policy, self.names)
            self.version.value = version
        self.pushed_bytes = self.copy_bytes
        return time.perf_counter() - start

    def private_copy(self):
        """(In the generator process.) Its own model: a push never lands mid-round."""
        return copy.deepcopy(self.staging)

    def take(self, model) -> int:
        """(In the generator process, between two rounds.) Copy the staging copy into `model` if
        a newer version was pushed; the version `model` holds."""
        with self.lock:
            if self.version.value != self.taken:
                copy_parameters(model, self.staging, self.names)
                self.taken = self.version.value
        return self.taken

    def close(self) -> None:
        """The staging copy goes with the sink."""
