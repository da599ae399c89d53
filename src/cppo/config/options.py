"""A config dataclass field: its default, help text, allowed choices and bounds in one place.

Every config dataclass of the command line (CPPOConfig, EvalConfig, PretrainConfig, ...) is
built from `option(...)`; a command's field that means the same as one of CPPOConfig's is
declared with `same_as(...)`, so its default, help and rules are written once.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any


def option(default, help: str, choices: typing.Collection | None = None, *,
           above: float | None = None, at_least: float | None = None,
           below: float | None = None, at_most: float | None = None,
           special: tuple = (), note: str | None = None, **kw):
    """A dataclass field carrying its help text, allowed choices and bounds in metadata (checked
    by `cppo.config.checks.check_fields`). `choices` may be a registry (a dict): it is read when a
    value is checked, so names registered later are allowed. A number must lie within the bounds
    given (None passes them, for an Optional field), or be one of `special` (e.g. -1: auto);
    `note` says what the special values mean, in the message of a value out of bounds."""
    meta = {"help": help, "choices": choices, "above": above, "at_least": at_least,
            "below": below, "at_most": at_most, "special": tuple(special), "note": note}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def same_as(cls, name: str, default: Any = dataclasses.MISSING, help: str | None = None):
    """A field meaning the same as `cls`'s field `name`: its choices and bounds, and its default
    and help unless given (e.g. `cppo eval`'s temperature is `cppo train`'s)."""
    source = next(f for f in dataclasses.fields(cls) if f.name == name)
    if default is dataclasses.MISSING:
        default = (source.default if source.default is not dataclasses.MISSING
                   else source.default_factory())
    meta = dict(source.metadata)
    text, choices = meta.pop("help"), meta.pop("choices")
    return option(default, text if help is None else help, choices, **meta)


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def unwrap_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def json_mapping(raw, key: str, source: str | None = None) -> dict:
    """A mapping field's value: a dict, or its JSON (or YAML flow) text (the command line's form;
    a one-item list of it too); anything else is a ConfigError naming `key` (and `source`)."""
    from cppo.errors import ConfigError
    where = f"{source}: " if source else ""
    if isinstance(raw, (list, tuple)) and len(raw) == 1:   # `--name '{...}'`
        raw = raw[0]
    if isinstance(raw, str):   # JSON, or YAML's flow form as the help shows it: {a: 1}
        import yaml
        try:
            raw = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"{where}'{key}' is {raw!r}, not a JSON object: "
                              f"{str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}'{key}' expects a mapping (JSON on the command line), "
                          f"got {raw!r}")
    return dict(raw)
