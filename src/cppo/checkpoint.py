"""Atomic checkpoints: a crash or Ctrl-C at any moment leaves the previous one loadable.

A checkpoint is a directory `checkpoint-<step>` holding the model (safetensors, through
`save_pretrained`), optimizer and scheduler states, RNG states and a JSON trainer state. It is
written into a temporary sibling directory, flushed to disk, and renamed into place; the rename is
atomic, so a reader sees either the whole checkpoint or none of it. Tensors are loaded with
`torch.load(weights_only=True)`: no arbitrary unpickling.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^checkpoint-(\d+)$")
COMPLETE_MARKER = "COMPLETE"


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
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".checkpoint-{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
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
    if final.exists():  # same step saved twice (e.g. interrupt right after a periodic save)
        old = output_dir / f".checkpoint-{step}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(output_dir)
    if keep is not None:
        for stale in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
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
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_tensors(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())


def load_model_weights(model, checkpoint: Path) -> None:
    """Load model.safetensors (or sharded safetensors) from a checkpoint into a model in place."""
    from safetensors.torch import load_file
    checkpoint = Path(checkpoint)
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in checkpoint {checkpoint}")
    state = {}
    for file in files:
        if file.name.startswith("adapter_model"):
            continue
        state.update(load_file(file))
    if state:
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        really_missing = [k for k in missing if k not in tied and "lm_head" not in k]
        if really_missing or unexpected:
            raise RuntimeError(f"checkpoint {checkpoint} does not match the model: missing "
                               f"{really_missing[:5]}, unexpected {list(unexpected)[:5]}")
