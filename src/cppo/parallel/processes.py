"""Processes and collectives over torch.distributed (gloo on CPU, nccl on GPU), started by torchrun
or `accelerate launch` (both set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR). One process:
every call is a no-op.

The step is cut along questions: all processes walk the same seeded question order and each takes
its own contiguous slice of the global step batch, so N processes x Q/N questions see the same
questions as 1 process x Q. The collectives here are CPPO's own: rewards gathered for
`scale_rewards=batch` and for `selection_scope=global` (the math lives in cppo.algorithm),
sequence and token counts summed for the loss normalisers, metrics, the stop flag. Gradients are
reduced by torch's engines (cppo.parallel.engines: DDP or FSDP2), not here.

Ending: a process group this module started is destroyed by `close()` (the trainer's `close`),
or at the latest by an exit handler while the interpreter is still whole. A gloo group left to
interpreter shutdown can abort the process after a run that finished: its worker threads still
hold finished work whose tensors have Python owners, and releasing them needs the interpreter.
gloo's threads end only in the group's destructor, which runs when the last reference goes:
`destroy_process_group` drops torch's own, but DDP's reducer, FSDP's module states (their mesh
infos) and every DeviceMesh (its `_pg_registry`, reached from each DTensor parameter and
optimizer state) hold the group too. So `close()` first runs the releases registered with
`on_close` (the engine's: cppo.parallel.engines.Engine.release), then destroys the group, and
its threads are joined there and then. One more holder is torch's own:
`torch.distributed.nn.functional` takes `group.WORLD` as the default argument of its functions
when it is imported, which is the group itself if that happens after the group started (FSDP's
import does it), so it is imported before the group starts. Should a gloo thread still be alive
after that (a group held by an object cppo does not know of), `close()` waits a moment with the
interpreter's lock released for it to let go of its last work (`drain_collective_threads`).
"""

from __future__ import annotations

import atexit
import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def check_launcher(environ=os.environ) -> None:
    """Refuse, before any process group starts, an accelerate launch this trainer cannot run
    (DeepSpeed, FSDP version 1), naming the config to use instead (cppo.parallel.engines)."""
    from cppo.parallel.engines import launcher_strategy
    launcher_strategy(environ)


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False   # this object started the process group, so it ends it
    releases: list = field(default_factory=list, repr=False)   # run by close(), before the end

    @classmethod
    def from_environment(cls) -> "Distributed":
        check_launcher()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(device=device)
        owns = not dist.is_initialized()   # a group the caller started stays the caller's
        if owns:
            # its functions' default `group=group.WORLD` is read at import: None now, but the
            # group itself (held until exit, past close()) if FSDP's import came after the start
            importlib.import_module("torch.distributed.nn.functional")
            start_group("nccl" if device.type == "cuda" else "gloo")
        out = cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                  device=device, owns_group=owns)
        if owns:
            atexit.register(out.close)
        return out

    def on_close(self, release: Callable[[], None]) -> None:
        """Have close() call `release` just before it destroys the group this object started:
        it drops the caller's references to the group, so that the group's destructor (which
        joins gloo's worker threads) runs there. Not called for a group the caller started."""
        if self.owns_group:
            self.releases.append(release)

    def close(self) -> None:
        """Destroy the process group this object started (idempotent; a no-op otherwise), after
        the releases registered with `on_close` (latest first). After it, no collective runs:
        call it last, once every process is done with the others."""
        if self.owns_group and dist.is_initialized():
            while self.releases:
                self.releases.pop()()
            gloo = dist.get_backend() == "gloo"
            dist.destroy_process_group()
            if gloo:
                drain_collective_threads()
        self.releases.clear()
        self.owns_group = False

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one writer of the run directory (shared by all nodes)."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the first process on this machine (node)."""
        return self.local_rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def comm_device(self) -> torch.device:
        """Where collective tensors live: nccl needs CUDA tensors, gloo takes CPU ones."""
        return self.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")

    def sum(self, value: int | float) -> int | float:
        if not self.active:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return type(value)(t.item())

    def sum_values(self, values: dict) -> dict:
        """Each number of the dict summed over processes (one collective)."""
        if not self.active:
            return dict(values)
        t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                         device=self.comm_device)
        dist.all_reduce(t)
        return {k: type(v)(x) for (k, v), x in zip(values.items(), t.tolist())}

    def any(self, flag: bool) -> bool:
        """True on every process when the flag is true on at least one."""
        return bool(self.sum(int(bool(flag))) > 0)

    def max(self, value: int) -> int:
        """The largest of the processes' values, on every process."""
        if not self.active:
            return value
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def max_values(self, values: dict) -> dict:
        """Each float of the dict maxed over processes (one collective; negate for a min)."""
        if not self.active:
            return dict(values)
        t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                         device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return dict(zip(values, t.tolist()))

    def all_zero(self, advantages: torch.Tensor) -> bool:
        """True when every process's kept advantages are all zero (all must agree to skip)."""
        local = float(advantages.numel() > 0 and bool((advantages != 0).any()))
        return self.sum(local) == 0

    def broadcast_parameters(self, model) -> None:
        """Make every process start from rank 0's parameters (e.g. randomly initialised LoRA)."""
        if not self.active:
            return
        for p in model.parameters():
            t = p.data.to(self.comm_device)
            dist.broadcast(t, src=0)
            if t is not p.data:
                p.data.copy_(t)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors of all processes along dim 0 (rank order)."""
        if not self.active:
            return tensor
        local = tensor.contiguous().to(self.comm_device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def broadcast_object(self, obj):
        """Rank 0's value of a picklable object, on every process."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj) -> list:
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


RENDEZVOUS_TIMEOUT_ENV = "CPPO_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0


class RendezvousTimeout(TimeoutError):
    """The processes of a launch did not all meet at the rendezvous store in time; the message
    names the store's host:port, the timeout and how many arrived."""


def rendezvous_timeout(environ=os.environ) -> float:
    """Seconds a process waits for the store and for all the others (CPPO_RENDEZVOUS_TIMEOUT,
    default 600)."""
    raw = environ.get(RENDEZVOUS_TIMEOUT_ENV, "").strip()
    try:
        seconds = float(raw) if raw else DEFAULT_RENDEZVOUS_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        from cppo.errors import ConfigError
        raise ConfigError(f"{RENDEZVOUS_TIMEOUT_ENV}={raw!r}: expected a positive number of "
                          f"seconds (the default is {DEFAULT_RENDEZVOUS_TIMEOUT_S:g})")
    return seconds


def start_group(backend: str, environ=os.environ) -> None:
    """init_process_group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher) under
    keys of this start's own, once every process has arrived, within `rendezvous_timeout`.

    torchrun keeps one store for all its restarts (`--max-restarts`: the static rendezvous's, or
    the c10d rendezvous's shared one at the same MASTER_PORT), and a worker's group used to
    write its keys under the same names in each start (`default_pg/...`). A restarted group then
    read the keys the killed one left: gloo's full-mesh connect dialled dead processes'
    addresses (`connectFullMesh`: connection refused) or waited for a peer that would never
    answer (a hang until gloo's 30-minute timeout). Here each rank counts its starts at that
    store, and the group of a start keeps its keys under `cppo/start<n>/`: every start meets
    fresh keys. A start that cannot meet all the others (the store unreachable, a process that
    never comes) raises RendezvousTimeout naming the store's address and the seconds waited."""
    from datetime import timedelta
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    endpoint = f"{host}:{port}"
    seconds = rendezvous_timeout(environ)
    timeout = timedelta(seconds=seconds)
    knob = f"(set {RENDEZVOUS_TIMEOUT_ENV} to wait longer)"
    # as torch's env:// rendezvous: the agent's store under torchrun, else rank 0 hosts one
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    try:
        store = dist.TCPStore(host, port, world, is_master=not agent and rank == 0,
                              timeout=timeout, wait_for_workers=False, multi_tenant=not agent)
    except (RuntimeError, OSError) as err:   # DistNetworkError, DistStoreError
        raise RendezvousTimeout(
            f"rank {rank} of {world} could not reach the rendezvous store at {endpoint} within "
            f"{seconds:g} s {knob}: {err}") from err
    store.set_timeout(timeout)
    start = store.add(f"cppo/starts/rank{rank}", 1)   # 1 on a launch, n + 1 on its n-th restart
    prefix = f"cppo/start{start}/"
    if store.add(prefix + "arrived", 1) == world:
        store.set(prefix + "complete", "1")
    try:
        store.wait([prefix + "complete"])
    except RuntimeError as err:
        arrived = store.add(prefix + "arrived", 0)
        raise RendezvousTimeout(
            f"rendezvous at {endpoint} did not complete within {seconds:g} s: {arrived} of "
            f"{world} processes arrived (rank {rank}, start {start}) {knob}") from err
    dist.init_process_group(backend=backend, store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=world)


GLOO_DRAIN_S = 0.25


def collective_threads() -> int:
    """gloo worker threads alive in this process (read from /proc/self/task; 0 where there is
    no /proc). A destroyed group nothing else holds has joined its threads: 0 after close()."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                count += fh.read().startswith(("pt_gloo", "gloo"))
        except OSError:   # a thread that ended meanwhile
            pass
    return count


def drain_collective_threads() -> None:
    """When gloo worker threads outlive the group's end (something cppo does not know of still
    holds the group, so its destructor has not run), give them time to release their last
    finished work while the interpreter is whole: a worker that releases a tensor whose only
    owner left was Python after interpreter shutdown began aborts the process (`terminate called
    without an active exception`). Sleeping releases the interpreter's lock, which is what the
    release waits for. With no gloo thread left (every holder released first), no wait."""
    if collective_threads():
        time.sleep(GLOO_DRAIN_S)


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous or a server)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_process(environ=os.environ) -> bool:
    """This is the launch's first process (RANK 0, or no launcher), before any group starts."""
    return int(environ.get("RANK", "0")) == 0


def launcher_restarts(environ=os.environ) -> int:
    """How many times torchrun (or `accelerate launch`) has restarted this worker group
    (`--max-restarts`): 0 on the first start."""
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
