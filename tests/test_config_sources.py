"""Where a ConfigError comes from: every module that raises one is listed here with why the check
cannot be made on the config alone, and no rule is written in two places (the same refusal of the
same fields, raised from two call sites)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import re
from pathlib import Path

from cppo.config import CPPOConfig

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cppo"

# Outside config/ (which checks the config itself), each module raising ConfigError, and what it
# needs that the config does not have.
LAUNCH_CHECKS = {
    "assembly/run.py": "the rollout_func given to the trainer",
    "cli.py": "the command line's own options (cppo bench, cppo eval's held-out split)",
    "data/sources.py": "the dataset's rows and splits",
    "features/fp16_scaling.py": "the loaded weights' dtype",
    "learning/update.py": "whether the model has a router",
    "models/loading.py": "the loaded model and the quantisation libraries installed",
    "models/lora.py": "peft's own refusal of the adapter settings; a peft_config given to the "
                      "trainer that vLLM cannot serve as an adapter (vllm_push: adapter)",
    "models/tokenizer.py": "the tokenizer's chat template",
    "parallel/engines.py": "the number of processes",
    "parallel/hardware.py": "whether the lean forward runs this model",
    "parallel/memory.py": "the model's size and the device's memory",
    "parallel/processes.py": "the launcher's environment variables",
    "rewards/runner.py": "the reward functions and processing classes given to the trainer",
    "run/optimizer.py": "AdamW's and the schedules' keyword arguments (config/checks.py calls it)",
    "run/tracking.py": "the trackers installed (config/checks.py calls it for the names)",
    "sampling/async_rollout.py": "a rollout_func, tools that cannot be pickled, fsdp with a "
                                 "vLLM server",
    "sampling/generator_pool.py": "generator_processes more than a round's parts (its generation "
                                  "chunks)",
    "sampling/tools.py": "the tools, environment_factory or rollout_func given to the trainer",
    "sampling/vllm.py": "the model's positions, the prompts' lengths, the adapters' kind, a tied "
                        "head reloaded from files",
    "sampling/vllm_server.py": "the server's --max-lora-rank (its /server_info) against the "
                               "adapter's rank",
}


@dataclasses.dataclass(frozen=True)
class Source:
    module: str
    line: int
    message: str   # the message with each formatted value as {}


def _text(node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _text(node.left) + _text(node.right)
    return ""   # built elsewhere: not compared


def error_sources(package: Path = PACKAGE) -> list[Source]:
    """Every `ConfigError(message)` and `check(ok, message)` of the package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id == "ConfigError" and node.args:
                message = node.args[0]
            elif node.func.id == "check" and len(node.args) == 2:
                message = node.args[1]
            else:
                continue
            found.append(Source(str(path.relative_to(package)), node.lineno, _text(message)))
    return found


FIELDS = {f.name for f in dataclasses.fields(CPPOConfig)}


def fields_named(message: str) -> frozenset[str]:
    return frozenset(w for w in re.findall(r"[a-z0-9_]+", message) if w in FIELDS)


def phrases(message: str, n: int = 7) -> set[tuple[str, ...]]:
    words = re.findall(r"[A-Za-z0-9_']+", message.replace("{}", " "))
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def same_rule_twice(sources: list[Source]) -> list[tuple[str, str]]:
    """Pairs of call sites raising the same refusal: messages naming the same config fields that
    share a phrase of seven words."""
    return [(f"{a.module}:{a.line}", f"{b.module}:{b.line}")
            for a, b in itertools.combinations(sources, 2)
            if fields_named(a.message) and fields_named(a.message) == fields_named(b.message)
            and phrases(a.message) & phrases(b.message)]


def test_every_module_raising_a_config_error_is_listed_with_its_reason():
    raising = {s.module for s in error_sources() if not s.module.startswith("config/")}
    assert sorted(raising) == sorted(LAUNCH_CHECKS)


def test_no_rule_has_a_second_home():
    """A refusal needed both when the config is read and at launch (a peft_config given to the
    trainer) is one function that both call, in the lowest module that needs it."""
    assert same_rule_twice(error_sources()) == []


def test_the_scan_finds_a_rule_written_twice(tmp_path):
    (tmp_path / "a.py").write_text(
        "def f(cfg):\n"
        "    check(not cfg.use_dora, \"'use_dora' is true: a DoRA adapter cannot be pushed "
        "to vLLM as a weight delta\")\n")
    (tmp_path / "b.py").write_text(
        "def g(x):\n"
        "    raise ConfigError(f\"'use_dora' is {x}: a DoRA adapter cannot be pushed to vLLM "
        "as a weight delta, use LoRA\")\n"
        "def h(x):\n"
        "    raise ConfigError(f\"'use_vllm' is {x}: a DoRA adapter cannot be pushed to vLLM "
        "as a weight delta, use LoRA\")\n")
    sources = error_sources(tmp_path)
    assert [s.module for s in sources] == ["a.py", "b.py", "b.py"]
    assert same_rule_twice(sources) == [("a.py:2", "b.py:2")]   # not h: another field


# functions of config/checks.py that take the whole config but are not a section's rules
NOT_SECTION_RULES = {
    "check_fields": "every field's declared choices and bounds, for every command's config",
    "validate": "runs check_fields, then the sections' rules",
    "validate_vllm": "check_vllm's, with use_vllm",
    "check_generation_batch_size": "check_generation_round's, and again once the processes are known",
}


def test_each_rule_of_several_fields_belongs_to_one_section():
    import inspect

    from cppo.config import checks
    from cppo.config.fields import SECTIONS
    declared = [rule for section in SECTIONS for rule in vars(section)["rules"]]
    assert len(declared) == len(set(declared))
    taking_the_config = {name for name, f in vars(checks).items() if inspect.isfunction(f)
                         and f.__module__ == checks.__name__
                         and "cfg" in inspect.signature(f).parameters}
    assert {f.__name__ for f in declared} == taking_the_config - set(NOT_SECTION_RULES)
