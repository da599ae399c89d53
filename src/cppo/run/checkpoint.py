"""Atomic checkpoints: a crash or Ctrl-C at any moment leaves the previous one loadable.

A checkpoint is a directory `checkpoint-<step>` holding the model (safetensors, through
`save_pretrained`), optimizer and scheduler states, RNG states and a JSON trainer state
(`RunState`). Under FSDP the model and optimizer are every process's shards in `sharded/`
(torch.distributed.checkpoint), plus, in the final checkpoint, the consolidated model. It is
written into a temporary sibling directory, flushed to disk, and renamed into place; the rename is
atomic, so a reader sees either the whole checkpoint or none of it. Tensors are loaded with
`torch.load(weights_only=True)`: no arbitrary unpickling.

A process killed at any moment (SIGKILL, power loss) leaves at worst hidden leftovers next to
the checkpoints: `.checkpoint-<step>.tmp-<pid>` (a write that never finished), `.checkpoint-<step>.old-<pid>`
(a same-step checkpoint being replaced) or `.checkpoint-<step>.del-<pid>` (an old one being
pruned). Readers ignore them; `clean_stale` (run on every save and by `latest_checkpoint`, i.e.
on `--resume`) deletes them, first restoring an `.old` one whose replacement never landed.

Test hook: with the environment variable `CPPO_TEST_CHECKPOINT_PAUSE=<stage>:<step>` the writer of
checkpoint-<step> prints `CPPO_TEST_CHECKPOINT_PAUSE <stage> <step>` on stderr and sleeps at that
stage, so a test can SIGKILL it exactly there (tests/test_reliability_crash.py). Stages: `weights`
(model written to the temp dir, nothing else), `written` (all files flushed, not yet renamed),
`swapped` (same-step replace: the old one moved aside, the new one not yet in place), `renamed` (in
place, older checkpoints not yet pruned). Unset in normal use: one dictionary lookup per stage.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from cppo.errors import CheckpointError



_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.checkpoint-(\d+)\.(tmp|old|del)-(\d+)$")
COMPLETE_MARKER = "COMPLETE"
PAUSE_ENV = "CPPO_TEST_CHECKPOINT_PAUSE"
SHARDED_DIR = "sharded"


@dataclass
class RunState:
    """Everything of a run that a checkpoint carries besides model, optimizer, schedule and RNG:
    the trainer creates one (`trainer.run_state`), `save` writes it to trainer_state.json and
    `--resume` reads it back."""

    step: int = 0                       # optimizer steps done
    counters: dict = field(default_factory=lambda: {
        "skipped_steps": 0, "nonfinite_steps": 0, "questions_seen": 0, "completions_scored": 0,
        "completions_trained": 0, "tokens_generated": 0, "num_tokens": 0, "prompts_skipped": 0,
        "two_stage_dropped": 0})
    train_seconds: float = 0.0          # wall time of training phases (excludes eval, checkpoints)
    consecutive_nonfinite: int = 0      # NaN/inf steps in a row (stops the run at a limit)
    history: list = field(default_factory=list)   # held-out evaluations
    wall_offset: float = 0.0            # wall time spent so far (before a resume: earlier sessions)
    questions: dict = field(default_factory=dict)   # the question stream's position (its state())
    features: dict = field(default_factory=dict)    # each optional feature's state, by its name
    #   (cppo.features: adaptive_entropy, auto_pruning, prompt_skipping, fp16_scaling); empty in a
    #   checkpoint written before features were saved by name: their states are flat keys there

    def to_dict(self, **about_run) -> dict[str, Any]:
        """JSON-ready; `about_run` (config, world size, strategy) is written beside it for
        checks on resume and readers of the checkpoint, and is not read back."""
        return {**asdict(self), **about_run}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunState":
        """From a trainer_state.json (unknown keys ignored, missing ones default; counters merged
        into the defaults). An older file's flat feature keys are read by
        cppo.features.states_of_old_checkpoint."""
        state = cls()
        for f in fields(cls):
            if f.name in values:
                setattr(state, f.name, values[f.name])
        if "wall_offset" not in values and "wall_time" in values:   # earlier checkpoints
            state.wall_offset = values["wall_time"]
        state.counters = {**cls().counters, **state.counters}
        return state


def _test_pause(stage: str, step: int) -> None:
    """The SIGKILL test hook (module docstring); a no-op unless PAUSE_ENV names this stage and step."""
    if os.environ.get(PAUSE_ENV) == f"{stage}:{step}":
        print(f"{PAUSE_ENV} {stage} {step}", file=sys.stderr, flush=True)
        time.sleep(600)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else
        return True
    return True


def clean_stale(output_dir: str | Path) -> list[Path]:
    """Delete leftovers of writes killed midway (module docstring); returns what was removed.

    A leftover of a live process (another writer in the same directory) is left alone. An `.old`
    same-step checkpoint whose replacement never landed is renamed back into place first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    removed = []
    for path in sorted(output_dir.iterdir()):
        match = _LEFTOVER.match(path.name)
        if not match or not path.is_dir() or _pid_alive(int(match.group(3))):
            continue
        final = output_dir / f"checkpoint-{match.group(1)}"
        if match.group(2) == "old" and not final.exists() and (path / COMPLETE_MARKER).is_file():
            path.rename(final)
            _fsync_dir(output_dir)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _into_place(tmp: Path, output_dir: Path, step: int) -> Path:
    """Rename a written temporary checkpoint to checkpoint-<step> (replacing one saved at the
    same step, e.g. on --resume of a finished run) and sync the directory."""
    final = output_dir / f"checkpoint-{step}"
    if final.exists():
        old = output_dir / f".checkpoint-{step}.old-{os.getpid()}"
        final.rename(old)   # a kill between the two renames: clean_stale puts `old` back
        _test_pause("swapped", step)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(output_dir)
    _test_pause("renamed", step)
    return final


def _keep_newest(output_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    for stale in list_checkpoints(output_dir)[:-keep]:
        # hide it first (atomic), so a kill mid-delete leaves a leftover, not a half checkpoint
        hidden = output_dir / f".{stale.name}.del-{os.getpid()}"
        stale.rename(hidden)
        shutil.rmtree(hidden, ignore_errors=True)


@dataclass
class CheckpointContents:
    """What checkpoint-<step> holds: the model (or its LoRA adapters) and tokenizer, the
    optimizer and schedule, every rank's RNG states and the run state (trainer_state.json);
    under fsdp, sharded_state (a torch.distributed.checkpoint state dict: every process's shards
    of the model and optimizer) and consolidated (the full model state dict, on rank 0, for the
    final checkpoint's Hugging Face folder)."""

    model: Any = None
    tokenizer: Any = None
    optimizer: Any = None
    scheduler: Any = None
    rng_states: dict[str, torch.Tensor] | None = None
    trainer_state: dict[str, Any] | None = None
    sharded_state: dict | None = None
    consolidated: dict | None = None


def save_checkpoint(output_dir: str | Path, step: int, contents: CheckpointContents, *,
                    keep: int | None = None, dist=None) -> Path | None:
    """Write checkpoint-<step> atomically; keep only the newest `keep` checkpoints.

    One process (dist None): everything is written by this process. Several (dist given): every
    process calls this; rank 0 makes the temporary directory and writes all the files, except
    the sharded state, which all processes write together into `sharded/`; the consolidated
    state is then written as a Hugging Face model folder
    (`model.save_pretrained(..., state_dict=consolidated)`). Returns the path on rank 0."""
    model, tokenizer, optimizer, scheduler = (contents.model, contents.tokenizer,
                                              contents.optimizer, contents.scheduler)
    sharded_state, consolidated = contents.sharded_state, contents.consolidated
    output_dir = Path(output_dir)
    main = dist is None or dist.is_main
    tmp = None
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        clean_stale(output_dir)
        tmp = output_dir / f".checkpoint-{step}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if sharded_state is not None:
        import torch.distributed.checkpoint as dcp
        tmp = output_dir / dist.broadcast_object(tmp.name if main else None)
        dcp.save(sharded_state, checkpoint_id=str(tmp / SHARDED_DIR))
    if not main:
        dist.barrier()   # rank 0 has renamed it into place
        return None
    if consolidated is not None:
        save_pretrained_state(model, consolidated, tmp)
    elif sharded_state is None:
        model.save_pretrained(tmp, safe_serialization=True)
    _test_pause("weights", step)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if optimizer is not None and sharded_state is None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(contents.rng_states or {}, tmp / "rng_state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(contents.trainer_state or {}, indent=2))
    (tmp / COMPLETE_MARKER).write_text(str(step))
    _fsync_tree(tmp)
    _test_pause("written", step)
    final = _into_place(tmp, output_dir, step)
    if keep is not None:
        _keep_newest(output_dir, keep)
    if dist is not None:
        dist.barrier()
    return final


def save_pretrained_state(model, state_dict: dict, directory: Path) -> None:
    """A Hugging Face model folder (config + safetensors; adapters only for a LoRA model) from a
    full state dict, for a model whose own parameters are sharded (FSDP renames its class)."""
    if getattr(model.config, "tie_word_embeddings", False):   # one tensor on disk, as unsharded
        embed = [k for k in state_dict if k.endswith("embed_tokens.weight")]
        state_dict = {k: v for k, v in state_dict.items()
                      if not (k.endswith("lm_head.weight") and embed)}
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    config = directory / "config.json"
    if config.is_file():   # fully_shard made the class FSDP<Name>: record the model's own name
        values = json.loads(config.read_text())
        values["architectures"] = [a[4:] if a.startswith("FSDP") else a
                                   for a in values.get("architectures") or []]
        config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def load_sharded(checkpoint: Path, state: dict) -> None:
    """Fill `state` (a torch.distributed.checkpoint state dict of this process's shards) in place
    from a checkpoint's `sharded/` (every process calls this)."""
    import torch.distributed.checkpoint as dcp
    path = Path(checkpoint) / SHARDED_DIR
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} has no {SHARDED_DIR}/ (it was written "
                              f"without distributed: fsdp); resume it with the strategy and "
                              f"number of processes that wrote it")
    dcp.load(state, checkpoint_id=str(path))


def is_sharded_checkpoint(checkpoint: Path) -> bool:
    return (Path(checkpoint) / SHARDED_DIR).is_dir()


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary or half-written ones are ignored)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir() and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path, say=print) -> Path | None:
    """The newest complete checkpoint that looks loadable (after `clean_stale`), or None.

    A newer `checkpoint-<step>` that cannot be resumed from (no COMPLETE marker, a file missing,
    truncated or unreadable: `checkpoint_problem`) is passed over for the one before it, and
    `say` (print) names it, why, and the one taken instead. It is left in place: a later save of
    the same step replaces it. With no whole one to fall back to, the newest complete one is
    returned (its loading raises CheckpointError naming the problem); one holding pickled objects
    is refused at once (CheckpointError), never passed over."""
    clean_stale(output_dir)
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    named = sorted((int(m.group(1)), path) for path in output_dir.iterdir()
                   if (m := _NAME.match(path.name)) and path.is_dir())
    passed = []
    for _, path in reversed(named):
        problem = checkpoint_problem(path)
        if problem is None:
            for skipped, why in passed:
                say(f"checkpoint {skipped} cannot be resumed from ({why}); falling back to "
                    f"{path.name}", flush=True)
            return path
        passed.append((path.name, problem))
    # none is whole: the newest complete one, whose loading names exactly what is wrong (another
    # model's weights, a missing file), rather than a fresh start the user did not ask for
    complete = list_checkpoints(output_dir)
    return complete[-1] if complete else None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint directory cannot be resumed from, or None when it looks whole: its
    COMPLETE marker, trainer_state.json (JSON), the model (safetensors whose header and size
    agree, or torch.distributed.checkpoint shards whose metadata loads and whose files hold the
    bytes it names) and the torch-saved states (each opens as a whole archive). Reads headers
    and archive directories, not the tensors."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / COMPLETE_MARKER).is_file():
        return f"no {COMPLETE_MARKER} marker"
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        if not isinstance(state, dict):
            return "trainer_state.json is not a JSON object"
    except (OSError, ValueError) as err:
        return f"trainer_state.json: {type(err).__name__}: {err}"
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights and not (checkpoint / SHARDED_DIR).is_dir():
        return f"no model weights (*.safetensors or {SHARDED_DIR}/)"
    for file in weights:
        problem = _safetensors_problem(file)
        if problem:
            return f"{file.name}: {problem}"
    if (checkpoint / SHARDED_DIR).is_dir():
        problem = _sharded_problem(checkpoint / SHARDED_DIR)
        if problem:
            return f"{SHARDED_DIR}/: {problem}"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pt"):
        file = checkpoint / name
        if name == "optimizer.pt" and not file.exists() and (checkpoint / SHARDED_DIR).is_dir():
            continue   # the optimizer state is in the shards
        if not file.is_file():
            return f"{name} is missing"
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:   # whole, but holding code: refused, never passed over
            raise CheckpointError(f"refusing to load {file}: it holds pickled objects other than "
                                  f"tensors (only weights_only=True loading is allowed): "
                                  f"{str(err).splitlines()[0]}") from None
        except Exception as err:   # a truncated or garbled archive: any of torch's errors
            return f"{name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def _safetensors_problem(file: Path) -> str | None:
    """None when the safetensors header parses and the file is exactly as long as it says."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            if length <= 0 or 8 + length > size:
                return f"header of {length} bytes in a file of {size}"
            header = json.loads(fh.read(length))
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        return f"{size} bytes, the header names {8 + length + end}"
    return None


def _sharded_problem(directory: Path) -> str | None:
    """None when the torch.distributed.checkpoint metadata loads and every shard file holds
    the byte ranges it names."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as err:   # missing or unpicklable .metadata
        return f"metadata: {type(err).__name__}: {err}"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            needed[path] = max(needed.get(path, 0), end)
    for path, end in sorted(needed.items()):
        file = directory / path
        size = file.stat().st_size if file.is_file() else -1
        if size < end:
            return f"{path} holds {max(size, 0)} bytes, the metadata names {end}"
    return None


def load_tensors(path: Path) -> Any:
    """Tensors, numbers, strings and containers of them (`weights_only=True`); a file holding any
    other pickled object (which could run code when unpickled) is refused with CheckpointError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"refusing to load {path}: it holds pickled objects other than "
                              f"tensors (only weights_only=True loading is allowed): "
                              f"{str(err).splitlines()[0]}") from None


def load_trainer_state(checkpoint: Path, missing_ok: bool = False) -> dict[str, Any]:
    path = Path(checkpoint) / "trainer_state.json"
    if missing_ok and not path.is_file():
        return {}
    return json.loads(path.read_text())


def load_model_weights(model, checkpoint: Path) -> None:
    """Load model.safetensors (or sharded safetensors) from a checkpoint into a model in place;
    for a LoRA (peft) model, its adapter_model.safetensors."""
    from safetensors.torch import load_file
    checkpoint = Path(checkpoint)
    from cppo.models.lora import is_peft_model, load_adapter_weights
    if is_peft_model(model):
        load_adapter_weights(model, checkpoint)
        return
    if (checkpoint / "adapter_model.safetensors").is_file() and not any(
            not f.name.startswith("adapter_model") for f in checkpoint.glob("*.safetensors")):
        raise RuntimeError(f"checkpoint {checkpoint} holds LoRA adapters only; resume with "
                           f"use_peft: true (the same lora_* settings)")
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in checkpoint {checkpoint} (weights are "
                              f"loaded only from safetensors)")
    state = {}
    for file in files:
        if file.name.startswith("adapter_model"):
            continue
        state.update(load_file(file))
    if state:
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as err:   # shape mismatch: a checkpoint of another architecture
            lines = str(err).splitlines()
            raise CheckpointError(f"checkpoint {checkpoint} does not match the model: "
                                  f"{'; '.join(line.strip() for line in lines[1:3])}"
                                  f"{' ...' if len(lines) > 3 else ''}") from None
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        really_missing = [k for k in missing if k not in tied and "lm_head" not in k]
        if really_missing or unexpected:
            raise CheckpointError(f"checkpoint {checkpoint} does not match the model: missing "
                               f"{really_missing[:5]}, unexpected {list(unexpected)[:5]}")
