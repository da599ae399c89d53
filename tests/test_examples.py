"""Every shipped example config loads: cppo recipes through CPPOConfig.load, accelerate configs
as the launch modes docs/distributed.md describes."""

from pathlib import Path

import pytest
import yaml

from cppo.config import CPPOConfig
from cppo.parallel.engines import launcher_strategy
from cppo.errors import ShardingError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))
ACCELERATE = sorted((EXAMPLES / "accelerate").glob("*.yaml"))


def test_examples_exist():
    assert {p.name for p in RECIPES} >= {"gsm8k_qwen2.5-1.5b.yaml", "math_qwen2.5-7b.yaml"}
    assert {p.name for p in ACCELERATE} == {"ddp.yaml", "fsdp.yaml", "deepspeed_zero3.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_with_the_papers_settings(path):
    cfg = CPPOConfig.load(path)
    assert (cfg.num_generations, cfg.num_iterations, cfg.beta, cfg.epsilon) == (16, 2, 0.04, 0.2)
    assert cfg.completions_per_update == 16 and cfg.max_completion_length == 1024
    assert cfg.dataset_name in ("gsm8k", "math") and cfg.max_steps == -1


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_configs(path):
    config = yaml.safe_load(path.read_text())
    mode = config["distributed_type"]
    assert mode == {"ddp.yaml": "MULTI_GPU", "fsdp.yaml": "FSDP", "deepspeed_zero3.yaml": "DEEPSPEED"}[path.name]
    if mode == "MULTI_GPU":
        assert launcher_strategy({}) is None                        # distributed: ddp (default)
    elif mode == "FSDP":   # what accelerate launch exports for this config
        env = {"ACCELERATE_USE_FSDP": "true",
               "FSDP_VERSION": str(config["fsdp_config"]["fsdp_version"])}
        assert launcher_strategy(env) == "fsdp"
    else:
        with pytest.raises(ShardingError, match="fsdp.yaml"):
            launcher_strategy({"ACCELERATE_USE_DEEPSPEED": "true"})
