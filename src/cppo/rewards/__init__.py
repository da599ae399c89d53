"""Reward functions by name: a registry of import paths, resolved only when asked for.

Every reward has TRL's signature ``f(prompts, completions, completion_ids=None, **columns)``
and returns ``list[float | None]``. Users can name their own as ``"package.module:function"``.
"""

from __future__ import annotations

import importlib

REWARD_FUNCTIONS: dict[str, str] = {
    "arithmetic": "cppo.rewards.arithmetic:arithmetic_accuracy_reward",
    "arithmetic_format": "cppo.rewards.arithmetic:arithmetic_format_reward",
    "arithmetic_digits": "cppo.rewards.arithmetic:arithmetic_digit_reward",
    "gsm8k": "cppo.rewards.math_rewards:gsm8k_accuracy_reward",
    "math": "cppo.rewards.math_rewards:math_accuracy_reward",
    "format": "cppo.rewards.math_rewards:format_reward",
    "boxed_format": "cppo.rewards.math_rewards:boxed_format_reward",
}


def resolve_reward(entry, processing_class=None, device=None, trust_remote_code: bool = False):
    """A reward_funcs entry as a function with TRL's signature: a registry name, a
    'package.module:function' path, a callable, or (as in TRL) a sequence-classification model:
    a model object, a local folder or a hub id, scored with `processing_class` (its tokenizer when
    None; trust_remote_code for loading it and its tokenizer, as TRL)."""
    from cppo.rewards.reward_model import RewardModel, is_reward_model, looks_like_model
    if is_reward_model(entry):
        return RewardModel(entry, processing_class, device, trust_remote_code)
    if isinstance(entry, str) and entry not in REWARD_FUNCTIONS and ":" not in entry \
            and looks_like_model(entry):
        return RewardModel(entry, processing_class, device, trust_remote_code)
    return get_reward_function(entry)


def get_reward_function(name_or_path):
    """The reward function for a registry name or a ``"package.module:function"`` path.

    A callable is returned unchanged, so configs may hold either.
    """
    if callable(name_or_path):
        return name_or_path
    if not isinstance(name_or_path, str):
        raise TypeError(f"reward function must be a name or 'module:function' string, got {name_or_path!r}")
    path = REWARD_FUNCTIONS.get(name_or_path, name_or_path)
    if ":" not in path:
        raise ValueError(
            f"unknown reward function {name_or_path!r}; known: {sorted(REWARD_FUNCTIONS)}, "
            "or give your own as 'package.module:function'"
        )
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {name_or_path!r}: cannot import module {module_name!r} ({e})") from e
    function = getattr(module, attr, None)
    if function is None:
        raise ValueError(f"reward function {name_or_path!r}: module {module_name!r} has no {attr!r}")
    if not callable(function):
        raise TypeError(f"reward function {name_or_path!r} is a {type(function).__name__}, not callable")
    return function
