"""Atomic checkpoints: a crash or Ctrl-C at any moment leaves the previous one loadable.

A checkpoint is a directory `checkpoint-<step>` holding the model (safetensors, through
`save_pretrained`), optimizer and scheduler states, RNG states and a JSON trainer state. It is
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
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cppo.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint cannot be used: unsafe content, or it does not match the model."""


_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.checkpoint-(\d+)\.(tmp|old|del)-(\d+)$")
COMPLETE_MARKER = "COMPLETE"
PAUSE_ENV = "CPPO_TEST_CHECKPOINT_PAUSE"


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


def save_checkpoint(output_dir: str | Path, step: int, *, model, tokenizer=None, optimizer=None,
                    scheduler=None, rng_states: dict[str, torch.Tensor] | None = None,
                    trainer_state: dict[str, Any] | None = None, keep: int | None = None) -> Path:
    """Write checkpoint-<step> atomically; keep only the newest `keep` checkpoints."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    clean_stale(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".checkpoint-{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    _test_pause("weights", step)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_states or {}, tmp / "rng_state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state or {}, indent=2))
    (tmp / COMPLETE_MARKER).write_text(str(step))
    _fsync_tree(tmp)
    _test_pause("written", step)
    if final.exists():  # same step saved twice (e.g. --resume of a finished run)
        old = output_dir / f".checkpoint-{step}.old-{os.getpid()}"
        final.rename(old)   # a kill between the two renames: clean_stale puts `old` back
        _test_pause("swapped", step)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(output_dir)
    _test_pause("renamed", step)
    if keep is not None:
        for stale in list_checkpoints(output_dir)[:-keep]:
            # hide it first (atomic), so a kill mid-delete leaves a leftover, not a half checkpoint
            hidden = output_dir / f".{stale.name}.del-{os.getpid()}"
            stale.rename(hidden)
            shutil.rmtree(hidden, ignore_errors=True)
    return final


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


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (after `clean_stale`), or None."""
    clean_stale(output_dir)
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_tensors(path: Path) -> Any:
    """Tensors, numbers, strings and containers of them (`weights_only=True`); a file holding any
    other pickled object (which could run code when unpickled) is refused with CheckpointError."""
    import pickle
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"refusing to load {path}: it holds pickled objects other than "
                              f"tensors (only weights_only=True loading is allowed): "
                              f"{str(err).splitlines()[0]}") from None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())


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
