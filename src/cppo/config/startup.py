"""What a run needs from this machine before anything loads: the optional packages its fields
ask for (each named with the extra that installs it) and the paths it writes and reads. Each
failure is one ConfigError naming the field, the value and the fix; nothing here loads a model.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from cppo.errors import ConfigError, MissingExtraError

# field switched on -> (module it imports, the extra that installs it); bitsandbytes is checked
# where the model loads (cppo.models.loading), after the rules of load_in_4bit / 8bit themselves
FIELD_EXTRAS = {"use_peft": ("peft", "peft")}


def require_module(module: str, extra: str, why: str) -> None:
    """MissingExtraError naming `extra` when `module` cannot be imported; `why`: the field."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{why} needs the '{module}' package, which is not installed: "
                                f"pip install \"cppo[{extra}]\"")


def check_extras(cfg) -> None:
    """Every optional package the config's fields ask for is importable (vLLM: checks.py)."""
    from cppo.run.tracking import check_report_to
    for field, (module, extra) in FIELD_EXTRAS.items():
        if getattr(cfg, field):
            require_module(module, extra, f"'{field}' is true, which")
    if cfg.use_vllm and cfg.vllm_mode == "server":
        require_module("trl", "vllm", "vllm_mode: server (TRL's VLLMClient)")
    check_report_to(cfg.report_to)


def check_readable(field: str, name: str) -> None:
    """A path `name` that exists can be read (the loaders say what a missing one should be)."""
    path = Path(name).expanduser()
    if path.exists() and not os.access(path, os.R_OK):
        raise ConfigError(f"'{field}' is {name!r}: cannot be read (permission denied)")


def writable_directory(field: str, name: str, *, keep: bool = True) -> Path:
    """Create directory `name` (and its parents) if missing and show that a file can be written
    in it; ConfigError naming `field`, the path and why not. keep=False removes what it made."""
    path = Path(name).expanduser()
    made = [p for p in [path, *path.parents] if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file, not a directory" if blocker else \
            (err.strerror or type(err).__name__).lower()
        raise ConfigError(f"'{field}' is {name!r}: cannot create or write this directory "
                          f"({reason}); give a directory you can write") from None
    finally:
        if not keep:
            for made_dir in made:
                if made_dir.is_dir():
                    made_dir.rmdir()
    return path


def check_startup(cfg, *, model=None, own_data: bool = False, output_dir: str = "create") -> None:
    """A run's start-up checks, before any loading: extras, the model and dataset paths (model:
    the trainer's model argument; own_data: the trainer was given rows), and the output
    directory: "create" it, "probe" it (made, written and removed again: `--dry_run`), or
    "skip" it (a process other than the first, which writes nothing there)."""
    check_extras(cfg)
    name = cfg.model if model is None else model if isinstance(model, (str, Path)) else None
    if name is not None:
        from cppo.models.loading import resolve_model_path
        check_readable("model", resolve_model_path(str(name)))   # a missing path: ModelLoadError
    if not own_data:
        from cppo.data.sources import check_dataset_source
        check_dataset_source(cfg.dataset_name)
        check_readable("dataset_name", cfg.dataset_name)
    # (an output_dir that is a file is refused with the config: cppo.config.checks)
    if output_dir != "skip":
        writable_directory("output_dir", cfg.output_dir, keep=output_dir == "create")
