"""Every exception and warning cppo raises, and what error messages share. Imports nothing of cppo.

A `ConfigError` (and each subclass) means bad input: `cppo train` prints its message without a
traceback and exits 2. The others are failures while running.
"""

from __future__ import annotations


def snippet(value, limit: int = 160) -> str:
    """repr(value), cut to `limit` characters with a trailing '...'."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- bad input (exit 2) --------------------------------------------------------------------
class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it and what is allowed."""


class MissingExtraError(ConfigError, ImportError):
    """A field needs an optional package that is not installed; the message names the extra
    (`pip install "cppo[...]"`)."""


class VLLMUnavailableError(MissingExtraError):
    """use_vllm is on but vLLM cannot be imported; the message names the extra to install."""


class ModelLoadError(ConfigError, OSError):
    """The model or tokenizer named by `model` cannot be loaded; the message says why and what
    is accepted. (An OSError too, as transformers' own loading errors are.)"""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used: unsafe content, or it does not match the model."""


class ShardingError(ConfigError):
    """A model or launch that the chosen strategy cannot run; the message names the fix."""


class VLLMServerError(ConfigError, ConnectionError):
    """vllm_mode: server cannot reach its server, or cannot push weights to it from here; the
    message names the address, the fields and the fix."""


class RewardError(RuntimeError):
    """A reward function misbehaved; the message names it and what was wrong."""


class RewardPreflightError(RewardError, ConfigError):
    """A reward function failed on the data before training started (`cppo train` exits 2)."""


# --- failures while running ----------------------------------------------------------------
class RewardModelError(ValueError):
    """A reward model cannot be loaded or returned scores of the wrong shape."""


class RolloutError(ValueError):
    """A rollout function's output is not what TRL's rollout_func contract asks for."""


class GeneratorError(RuntimeError):
    """async_rollout: the generator process ended, failed or stopped sending heartbeats; the
    message says which, and that the last checkpoint resumes."""


class CallbackError(RuntimeError):
    """A callback raised; the message names it and the event."""


class SchemeError(ValueError):
    """A scheme file that cannot be parsed, or a scheme that does not compute O = L V exactly."""


class SlowPrecisionWarning(UserWarning):
    """A run asks for a dtype this device computes far slower than float32."""
