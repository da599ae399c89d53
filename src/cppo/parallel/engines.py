"""How the policy is spread over processes, through torch's own engines.

* `ddp`: every process holds the whole model; torch's DistributedDataParallel all-reduces the
  mean gradient in buckets while backward still runs (one reduction per optimizer step: the
  micro-batches before the last run under `no_sync`).
* `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) on every transformer decoder block, then
  on the root: each process holds 1/N of the parameters, gradients and AdamW moments (ZeRO-3).
  A block's parameters are all-gathered just before its forward and backward and freed after;
  gradients are reduce-scattered (averaged) in backward, once per optimizer step
  (`set_requires_gradient_sync(False)` on the earlier micro-batches). With `bf16` the
  all-gathered weights are bfloat16 and gradients are reduced in float32 (MixedPrecisionPolicy).

The loss of each process is multiplied by the number of processes before backward, because both
engines average gradients while cppo's loss normalisers already count every process's sequences
and tokens: N processes then make exactly the update 1 process makes on the same global batch.

Generation under `fsdp` gathers the full weights once per generation round (`Engine.gathered`):
the sampler (and the lean forward) then run on plain tensors, with no communication per token,
and the weights are resharded afterwards. Peak memory during a round: the full weights in the
sampling dtype plus this process's shards, gradients and optimizer state, plus the KV cache.

Every process must make the same sequence of collective calls. Under global selection the kept
rows per process differ, so `pad_rows` appends filler rows (loss mask 0, advantage 0) until
every process has as many rows as the largest: the same number of forward passes and
micro-batches everywhere, and no change to the loss.

Ending: both engines hold the process group (DDP's reducer; FSDP's module states and the device
mesh of every DTensor), which would keep gloo's worker threads alive past the group's end.
`Engine.release` drops those references; cppo.parallel.processes.Distributed.close() calls it
just before it destroys the group (registered with `on_close`). After it, the models take no
collective: their local tensors stay readable, a sharded forward or a DDP step does not run.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch import nn
from cppo.algorithm.allocation import questions_per_chunk
from cppo.errors import ConfigError, ShardingError


STRATEGIES = ("ddp", "fsdp")
_TRUE = ("1", "true", "yes")


def launcher_strategy(environ=os.environ) -> str | None:
    """The strategy an `accelerate launch` config asks for ('fsdp'), None for plain launches.
    DeepSpeed and FSDP version 1 are refused with the config that works instead."""
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in _TRUE:
        raise ShardingError(
            "accelerate launch with DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) is not supported: "
            "cppo shards through torch's FSDP2. Launch with examples/accelerate/fsdp.yaml (ZeRO-3 "
            "equivalent: parameters, gradients and optimizer state sharded) or "
            "examples/accelerate/ddp.yaml; see docs/distributed.md")
    if environ.get("ACCELERATE_USE_FSDP", "").lower() in _TRUE:
        version = environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ShardingError(
                f"accelerate launch with FSDP version {version} (fsdp_version in the accelerate "
                f"config): cppo runs FSDP2 only; set fsdp_version: 2, as in "
                f"examples/accelerate/fsdp.yaml")
        return "fsdp"
    return None


def resolve_strategy(configured: str, environ=os.environ) -> str:
    """The `distributed` field, unless an accelerate FSDP launch asks for fsdp."""
    return launcher_strategy(environ) or configured


def block_classes(model, names: list[str] | None = None) -> list[type]:
    """The transformer block classes to shard one by one: `names` if given, else the model's
    `_no_split_modules` (what transformers lists for every decoder architecture)."""
    wanted = set(names or [])
    if not wanted:
        for module in model.modules():
            wanted |= set(getattr(module, "_no_split_modules", None) or [])
    found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
    if not found:
        kinds = sorted({type(m).__name__ for m in model.modules() if len(list(m.children())) > 1})
        raise ShardingError(
            f"distributed: fsdp shards each transformer block, but no module of "
            f"{type(model).__name__} is a block class "
            f"({sorted(wanted) if wanted else 'the model lists no _no_split_modules'}). Name the "
            f"block class in fsdp_transformer_layer_cls_to_wrap (modules with children here: "
            f"{kinds[:8]}), or use distributed: ddp")
    return sorted(found, key=lambda c: c.__name__)


def shard_model(model, *, device: torch.device, bf16: bool, block_names: list[str] | None = None,
                world_size: int) -> list[nn.Module]:
    """fully_shard every block, then the root (in place); returns the sharded blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    classes = tuple(block_classes(model, block_names))
    mesh = init_device_mesh(device.type, (world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return blocks


def unsharded_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` before sharding whose parameters are on the meta device (shapes, dtypes
    and ties kept, no memory; buffers copied): what cppo.sampling.weight_sinks.materialised makes
    an unsharded model of, for async_rollout's generator under fsdp."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def release_group_references(model) -> None:
    """Drop the references to process groups that fully_shard left on `model`: the process
    groups of its FSDP states' mesh infos (FSDPMeshInfo.shard_process_group and the like, set
    to None) and the group registry of every device mesh they and the DTensor parameters use
    (DeviceMesh._pg_registry, emptied; the optimizer's DTensor states share those meshes)."""
    from torch.distributed import ProcessGroup
    seen: set[int] = set()

    def scrub(obj, depth: int = 0) -> None:
        if obj is None or id(obj) in seen or depth > 3 or not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        for name, value in list(vars(obj).items()):
            if isinstance(value, ProcessGroup):
                setattr(obj, name, None)
            elif isinstance(value, dict) and any(isinstance(v, ProcessGroup) for v in value.values()):
                value.clear()   # DeviceMesh._pg_registry: {group name: group}
            elif name == "_root_mesh" or "mesh" in name and not isinstance(value, (int, bool, str)):
                scrub(value, depth + 1)   # mesh infos, meshes and their root mesh
            elif isinstance(value, (list, tuple)) and name in ("fsdp_params",):
                for item in value:
                    scrub(item, depth + 1)

    for module in fsdp_modules(model):
        state = module._get_fsdp_state()
        scrub(state)
        scrub(getattr(state, "_fsdp_param_group", None))
    for p in model.parameters():
        scrub(getattr(p, "device_mesh", None))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter or gradient (the shard of a DTensor, else itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(model, optimizer=None) -> dict[str, int]:
    """Bytes this process holds of the parameters, gradients and optimizer state."""
    params = list(model.parameters())
    out = {"parameters": sum(local_tensor(p).nbytes for p in params),
           "gradients": sum(local_tensor(p.grad).nbytes for p in params if p.grad is not None),
           "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(local_tensor(v).nbytes for v in state.values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def full_parameter_bytes(model, dtype: torch.dtype | None = None) -> int:
    """Bytes of the whole (gathered) model's parameters, in `dtype` if given."""
    total = 0
    for p in model.parameters():
        size = dtype.itemsize if dtype is not None else p.element_size()
        total += p.numel() * size   # a DTensor's numel is the full parameter's
    return total


class _Logprobs(nn.Module):
    """The training forward as a module, so DDP sees it: forward(fn, *args) = fn(policy, *args)
    (fn may take the lean forward, which reads the policy's weights directly)."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, fn, *args):
        return fn(self.policy, *args)


class Engine:
    """The policy (and reference) under one strategy; the trainer calls it at five places:
    `forward` (training log-probs), `sync_gradients` (micro-batch loop), `clip_grad_norm`,
    `gathered` (generation and evaluation), and the checkpoint helpers."""

    def __init__(self, strategy: str, dist_info, policy: nn.Module, *, bf16: bool = False,
                 block_names: list[str] | None = None, keep_skeleton: bool = False) -> None:
        """keep_skeleton: under fsdp, keep the unsharded policy's skeleton (async_rollout's
        generator is made from it)."""
        self.world_size = dist_info.world_size
        self.strategy = strategy if self.world_size > 1 else "single"
        self.policy, self.bf16, self.block_names = policy, bf16, block_names
        self.device = dist_info.device
        self.ddp = None
        self.sharded_models: list[nn.Module] = []   # the models fully_shard changed (release)
        self.skeleton = None   # fsdp: the unsharded policy, parameters on meta (async_rollout)
        if strategy == "fsdp":
            block_classes(policy, block_names)   # a model fsdp cannot shard fails on 1 process too
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            # broadcasts rank 0's parameters at construction; buffers (rotary tables) are equal
            self.ddp = DistributedDataParallel(_Logprobs(policy), broadcast_buffers=False)
        elif self.strategy == "fsdp":
            self.skeleton = unsharded_skeleton(policy) if keep_skeleton else None
            shard_model(policy, device=self.device, bf16=bf16, block_names=block_names,
                        world_size=self.world_size)
            self.sharded_models.append(policy)
        if self.strategy != "single" and hasattr(dist_info, "on_close"):
            dist_info.on_close(self.release)

    def release(self) -> None:
        """Drop every reference this engine's objects hold to the process group (DDP's wrapper
        and its reducer; FSDP's mesh infos and the device meshes of the sharded parameters),
        so that destroying the group ends its worker threads (idempotent). Called by
        Distributed.close() right before the group is destroyed: no collective runs after it."""
        self.ddp = None
        for model in self.sharded_models:
            release_group_references(model)
        self.sharded_models = []

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def shard_reference(self, reference: nn.Module | None) -> nn.Module | None:
        """The frozen reference model, sharded like the policy under fsdp."""
        if reference is not None and self.sharded:
            shard_model(reference, device=self.device, bf16=self.bf16,
                        block_names=self.block_names, world_size=self.world_size)
            self.sharded_models.append(reference)
        return reference

    def forward(self, fn, *args):
        """fn(policy, *args) with the engine's gradient hooks armed (DDP needs its own forward)."""
        return self.ddp(fn, *args) if self.ddp is not None else fn(self.policy, *args)

    @contextlib.contextmanager
    def sync_gradients(self, sync: bool):
        """Within: a backward that reduces gradients over processes only when `sync` (the last
        micro-batch of an optimizer step); the earlier ones accumulate locally."""
        if self.ddp is not None and not sync:
            with self.ddp.no_sync():
                yield
        elif self.sharded:
            self.policy.set_requires_gradient_sync(sync)
            try:
                yield
            finally:
                self.policy.set_requires_gradient_sync(True)
        else:
            yield

    def accumulate(self, micro_batches):
        """Yield the micro-batches, each inside `sync_gradients` (True for the last only)."""
        items = list(micro_batches)
        for index, item in enumerate(items):
            with self.sync_gradients(index == len(items) - 1):
                yield item

    def clip_grad_norm(self, parameters: list, max_norm: float) -> float:
        """Total gradient norm over all processes' shards (clipped to max_norm)."""
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    @contextlib.contextmanager
    def gathered(self, *models):
        """Within: the full weights of the policy (and the given models) on every process, for
        sampling and evaluation; one all-gather on entry, freed on exit. No-op unless fsdp."""
        if not self.sharded:
            yield
            return
        modules = [m for model in (self.policy, *models) if model is not None
                   for m in fsdp_modules(model)]
        check_gather_fits(self.policy, self.device, torch.bfloat16 if self.bf16 else None)
        for module in modules:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)  # forwards keep them gathered
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
                module.set_reshard_after_forward(module is not self.policy, recurse=False)


    # --- checkpoints (fsdp): every process writes and reads its own shards ---------------------
    def sharded_state(self, optimizer) -> dict:
        """This process's shards of the model and optimizer, for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)
        return {"model": get_model_state_dict(self.policy),
                "optimizer": get_optimizer_state_dict(self.policy, optimizer)}

    def load_sharded_state(self, checkpoint, optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                             set_optimizer_state_dict)
        from cppo.run.checkpoint import load_sharded
        state = self.sharded_state(optimizer)
        load_sharded(checkpoint, state)
        set_model_state_dict(self.policy, state["model"])
        set_optimizer_state_dict(self.policy, optimizer, state["optimizer"])

    def full_model_state(self) -> dict:
        """The whole model's state dict on rank 0 (in CPU memory; empty elsewhere): a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(self.policy, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    def check_resume(self, state: dict, checkpoint) -> None:
        """A checkpoint resumes only under the strategy and process count that wrote it (the
        sharded files and the per-process question slices and RNG states depend on both)."""
        written = state.get("distributed", "single" if state.get("world_size", 1) == 1 else "ddp")
        sharded = written == "fsdp"
        if sharded != self.sharded or state.get("world_size", 1) != self.world_size and sharded:
            raise ShardingError(
                f"checkpoint {checkpoint} was written by {state.get('world_size', 1)} process(es) "
                f"with distributed: {written}; this run has {self.world_size} with "
                f"distributed: {self.strategy}. Resume with the same launch (set distributed and "
                f"the process count as before)")


def check_layout(*, generation_chunk_size: int | None, num_generations: int,
                 questions_per_step: int, world_size: int) -> None:
    """Raise ConfigError before training when the step cannot be cut into equal per-process
    parts that sample exactly what one process would (the generation chunks of
    generation_chunk_size completions must not straddle two processes)."""
    if world_size <= 1 or generation_chunk_size is None:
        return
    per_process = questions_per_step * num_generations
    chunk = questions_per_chunk(generation_chunk_size, num_generations,
                                questions_per_step) * num_generations
    if per_process % chunk:
        raise ConfigError(
            f"'generation_chunk_size' is {generation_chunk_size}: each of the {world_size} "
            f"processes generates {per_process} completions a step ({questions_per_step} "
            f"questions x {num_generations}), which is not a whole number of generation "
            f"batches of {chunk}, so the global batch cannot be cut evenly across processes. "
            f"Set generation_chunk_size to a divisor of {per_process} (or None), or change "
            f"per_device_train_batch_size")


def check_gather_fits(model, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """On a GPU: raise ShardingError when the gathered weights (a new buffer of the full size,
    in `dtype` if the all-gather casts) would not fit next to what the device already holds,
    naming the ways out (before the all-gather runs out of memory)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    needed = full_parameter_bytes(model, dtype)
    if needed > free:
        raise ShardingError(
            f"distributed: fsdp gathers the full weights for generation ({needed / 2**30:.1f} GiB "
            f"more on {device}), but only {free / 2**30:.1f} GiB are free. Generate with vLLM "
            f"(use_vllm: true), lower generation_chunk_size to shrink the KV cache, or train "
            f"LoRA adapters (use_peft: true) on a bfloat16 base; see docs/distributed.md")


def pad_rows(batch, dist_info):
    """The StepBatch with filler rows appended (prompt all attended, completion mask 0,
    advantage 0) up to the largest row count of any process; `filler_rows` counts them."""
    rows = len(batch)
    most = int(dist_info.gather(torch.tensor([rows])).max()) if dist_info.active else rows
    return batch.with_filler_rows(most - rows)
