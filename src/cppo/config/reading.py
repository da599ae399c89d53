"""Raw values -> a config dataclass: YAML files, command-line strings, TRL's field names.

A value is parsed into its field's type where it enters; an unknown key or a bad value raises
ConfigError naming it (with the closest known key).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from cppo.config.options import field_types, json_mapping, unwrap_optional
from cppo.errors import ConfigError


def from_trl_names(values: dict[str, Any], cls, source: str, announce=print) -> dict[str, Any]:
    """Values written with TRL's GRPOConfig names -> CPPOConfig's (cppo.config.trl_fields); the TRL
    fields cppo ignores are named, with the reason, in one message."""
    from cppo.config.trl_fields import ignored_message, translate
    values, dropped = translate(values, {f.name for f in dataclasses.fields(cls)})
    if dropped and announce is not None:
        announce(ignored_message(dropped, source))
    return values


def build_dataclass(cls, values: dict[str, Any], *, source: str = "config", command: str = "train"):
    """Instantiate a config dataclass from raw values, naming unknown keys and bad values."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, raw in values.items():
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else ""
            raise ConfigError(f"{source}: unknown key '{key}'{extra} "
                              f"(run `cppo {command} --help` for the list)")
        kwargs[key] = coerce(known[key], raw, source=source, cls=cls)
    return cls(**kwargs)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a directory; give a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file '{path}' is not text: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file '{path}' is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of key: value, "
                          f"got {type(data).__name__}")
    return data


_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


def _scalar(base, raw, key: str, source: str):
    expected = base.__name__
    if isinstance(raw, str):
        text = raw.strip()
        if base is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
        elif base is int:
            try:
                return int(text)
            except ValueError:
                pass
        elif base is float:
            try:
                return float(text)
            except ValueError:
                pass
        elif base is str:
            return text
    else:
        if base is bool and isinstance(raw, bool):
            return raw
        if base is int and isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if base is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if base is str and isinstance(raw, str):
            return raw
    raise ConfigError(f"{source}: '{key}' expects {expected}, got {raw!r}")


def _unbracketed(text: str) -> str:
    """`--generator_cpus '[1, 2]'`: YAML's flow list, quoted on the command line -> '1, 2'."""
    text = text.strip()
    return text[1:-1] if text[:1] == "[" and text[-1:] == "]" else text


def coerce(fld: dataclasses.Field, raw: Any, *, cls, source: str = "config") -> Any:
    """Parse a YAML or command-line value into the field's type, or raise ConfigError."""
    tp, optional = unwrap_optional(field_types(cls)[fld.name])
    if optional and isinstance(raw, (list, tuple)) and len(raw) == 1 and isinstance(raw[0], str) \
            and raw[0].strip().lower() in ("none", "null"):   # `--reward_weights none`
        raw = None
    if raw is None or (optional and isinstance(raw, str) and raw.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{source}: '{fld.name}' may not be None")
    if tp is dict or typing.get_origin(tp) is dict:   # TRL's command line takes a dict as JSON
        return json_mapping(raw, fld.name, source)
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        items = raw   # a list, or "a,b", or "[a, b]", or (command line) ["a", "b"] / ["a,b"]
        if isinstance(raw, str):
            items = [raw]
        if isinstance(items, (list, tuple)):
            items = [s for v in items for s in ((p.strip() for p in _unbracketed(v).split(","))
                                                if isinstance(v, str) else [v]) if s != ""]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{source}: '{fld.name}' expects a list of {item.__name__}, got {raw!r}")
        return [_scalar(item, v, fld.name, source) for v in items]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):   # e.g. a number or 'auto'
        for member in typing.get_args(tp):
            try:
                return _scalar(member, raw, fld.name, source)
            except ConfigError:
                continue
        names = " or ".join(t.__name__ for t in typing.get_args(tp))
        raise ConfigError(f"{source}: '{fld.name}' expects {names}, got {raw!r}")
    return _scalar(tp, raw, fld.name, source)
