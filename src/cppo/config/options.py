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


BOUNDS = ("above", "at_least", "below", "at_most")


def bounds_text(name: str, meta: dict, optional: bool) -> str | None:
    """What a field's declared bounds allow, as its error message says it: "must be >= 1 or None",
    "allowed: 0 < top_p <= 1", ... (None: the field declares no bound)."""
    low = (">=", meta["at_least"]) if meta.get("at_least") is not None else \
        (">", meta["above"]) if meta.get("above") is not None else None
    high = ("<=", meta["at_most"]) if meta.get("at_most") is not None else \
        ("<", meta["below"]) if meta.get("below") is not None else None
    if low is None and high is None:
        return None
    if low and high:
        flipped = {">=": "<=", ">": "<"}[low[0]]
        text = f"allowed: {low[1]} {flipped} {name} {high[0]} {high[1]}"
        alternatives = ", or "
    else:
        sign, value = low or high
        text = f"must be {sign} {value}"
        alternatives = " or "
    extra = [str(v) for v in meta.get("special", ())] + (["None"] if optional else [])
    if extra:
        text += alternatives + ", ".join(extra)
    return text + (f" ({meta['note']})" if meta.get("note") else "")


def within_bounds(value: float, meta: dict) -> bool:
    """A number within a field's declared bounds, or one of its special values."""
    if value in meta.get("special", ()):
        return True
    return ((meta.get("above") is None or value > meta["above"])
            and (meta.get("at_least") is None or value >= meta["at_least"])
            and (meta.get("below") is None or value < meta["below"])
            and (meta.get("at_most") is None or value <= meta["at_most"]))


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
