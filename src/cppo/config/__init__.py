"""Configuration: the CPPOConfig dataclass (TRL's GRPOConfig names plus the CPPO fields), reading
it from YAML and the command line, TRL's field table, and validation."""

from cppo.config.checks import (check, check_fields, installed_vllm_version,
                                validate, validate_vllm)
from cppo.config.fields import CPPOConfig
from cppo.rewards.runner import check_reward_weights
from cppo.config.options import option, same_as
from cppo.config.reading import build_dataclass, coerce, from_trl_names, read_yaml
from cppo.errors import ConfigError

__all__ = ["CPPOConfig", "ConfigError", "build_dataclass", "check", "check_fields", "check_reward_weights", "coerce",
           "from_trl_names", "installed_vllm_version", "option", "read_yaml", "same_as", "validate",
           "validate_vllm"]
