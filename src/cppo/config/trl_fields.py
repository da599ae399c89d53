"""TRL's configuration fields in cppo: one table, one rule.

A YAML file (or a set of --name value options) written for TRL's `GRPOConfig` (with the
transformers `TrainingArguments` it extends) and for `trl grpo`'s model and script arguments runs
in `cppo train`:

- a field that `CPPOConfig` has is honoured under its own name;
- a field in `TRL_FIELDS` marked MAPPED is renamed or converted (e.g. model_name_or_path -> model,
  save_strategy: "no" -> save_steps: 0);
- a field marked IGNORED is dropped, and every dropped field is named, with the reason, in one
  message before the run starts (`translate` returns it; `cppo train` prints it). Only a value
  with which TRL does what cppo does (`behaves_as`) is dropped silently: any other value, TRL's
  default included, is named;
- a mapped value that cppo cannot honour is named the same way (e.g. `bf16: null`, which TRL
  turns on);
- any other name is still an error (a typo must not pass unnoticed).
"""

from __future__ import annotations

from typing import Any, Callable

from cppo.config.options import json_mapping

_MISSING = object()

# reasons shared by many fields
TRAINER = "transformers Trainer machinery; cppo runs its own loop"
HUB = "cppo does not push to the Hugging Face Hub; upload the saved folder yourself"
DATA = "cppo feeds the questions itself, in a seeded order (no DataLoader)"
DIST = "process setup comes from the launcher (torchrun / accelerate launch)"
EVAL = "cppo's held-out evaluation is greedy accuracy on eval_dataset_split every eval_steps"
ALGO = "a GRPO variant cppo does not implement; the run uses the clipped GRPO loss of loss_type"
VLLM = "vLLM engine settings: cppo's vLLM backend uses vLLM's defaults"
# honoured under their own names (CPPOConfig fields): vllm_mode, vllm_model_impl,
# vllm_enable_sleep_mode, vllm_gpu_memory_utilization, vllm_max_model_length,
# vllm_tensor_parallel_size, vllm_server_base_url / _host / _port / _timeout, vllm_group_port
SAMPLER = "cppo's samplers take temperature, top_p, top_k, min_p and repetition_penalty only"
EVAL_PRECISION = "the precision of transformers' evaluation loop; " \
    "cppo's held-out evaluation runs the policy in its training precision"
LOAD = ("cppo loads models with torch_dtype, attn_implementation, model_revision, "
        "trust_remote_code and TRL's quantisation fields only")


def ignored(reason: str, behaves_as: Any = _MISSING) -> tuple:
    """Dropped with `reason`; silently only when the value is `behaves_as`, the value with which
    TRL behaves as cppo does (for most fields TRL's default; tests/test_trl_fields.py lists
    those whose TRL default differs)."""
    return ("ignored", reason, behaves_as)


def mapped(convert: Callable[[Any, dict], dict], note: str) -> tuple:
    """`convert(value, all_values)` returns the cppo fields to set ({} when nothing to set); it may
    return {"__ignored__": reason} to drop the value with a reason."""
    return ("mapped", convert, note)


def rename(target: str) -> tuple:
    return mapped(lambda v, _: {} if v is None else {target: v}, f"-> {target}")


def _strategy(steps_field: str) -> Callable:
    def convert(value, _):
        value = str(value).lower()
        if value == "no":
            return {steps_field: 0}
        if value == "steps":
            return {}
        return {"__ignored__": f"{value!r}: cppo counts in steps ({steps_field})"}
    return convert


def _warmup_steps(value, values):
    if not value:
        return {}
    if 0 < float(value) < 1:   # transformers >= 5: a float below 1 is a ratio
        return {"warmup_ratio": float(value)}
    try:
        max_steps = float(values.get("max_steps", -1))
    except (TypeError, ValueError):
        max_steps = -1
    if max_steps > 0:
        return {"warmup_ratio": float(value) / max_steps}
    return {"__ignored__": "a step count needs max_steps to become cppo's warmup_ratio; "
                           "set warmup_ratio"}


def _optim(value, _):
    if str(value).startswith("adamw"):
        return {}
    return {"__ignored__": f"{value!r}: cppo always uses AdamW (torch, fused where possible)"}


def _model_init_kwargs(value, _):
    if not value:
        return {}
    if isinstance(value, str):   # TRL's command line takes it as JSON
        import json
        value = json.loads(value)
    value = dict(value)
    out = {}
    dtype = value.pop("torch_dtype", None) or value.pop("dtype", None)
    value.pop("dtype", None)
    if dtype is not None:
        out["torch_dtype"] = str(dtype).replace("torch.", "")
    for key, target in (("attn_implementation", "attn_implementation"),
                        ("revision", "model_revision"), ("trust_remote_code", "trust_remote_code")):
        if key in value:
            out[target] = value.pop(key)
    if value:
        out["__ignored__"] = f"keys {sorted(value)}: {LOAD}"
    return out


def _bf16(value, _):
    if value is None:   # TRL: None means on unless fp16 is set
        return {"__ignored__": "null: TRL then turns bf16 on; cppo leaves autocast off (slow on most "
                               "CPUs) and runs the Linear matmuls in bfloat16 where that is fast "
                               "(matmul_dtype: auto): set bf16: true for TRL's behaviour"}
    return {"bf16": value}


def _save_total_limit(value, _):
    if value is None:
        return {"__ignored__": "null: TRL then keeps every checkpoint; cppo keeps its default, the "
                               "2 most recent: set a number"}
    return {"save_total_limit": value}


def _clip_max(value, values):
    """null is TRL's "no upper bound" here, so it passes through; TRL's older name
    vllm_importance_sampling_cap, when set, wins (as in TRL)."""
    if values.get("vllm_importance_sampling_cap") is not None:
        return {}
    return {"importance_sampling_clip_max": value}


def _not_none(target: str, transform=lambda v: v) -> Callable:
    return lambda v, _: {} if v is None else {target: transform(v)}


def _reward_model(value, values):
    if not value:
        return {}
    funcs = values.get("reward_funcs") or []
    funcs = [funcs] if isinstance(funcs, str) else list(funcs)
    return {"reward_funcs": funcs + [value]}


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_kwargs keys that change how tokens are produced, not which: dropped with a line
GENERATION_MACHINERY_KEYS = ("use_cache", "cache_implementation", "return_dict_in_generate",
                             "output_scores", "output_logits", "output_attentions",
                             "output_hidden_states", "pad_token_id", "disable_compile",
                             "compile_config", "num_logprobs", "logprobs")


def _generation_kwargs(value, _):
    """TRL passes generation_kwargs over its own sampling settings (GenerationConfig or vLLM's
    SamplingParams): the keys cppo's samplers know set the fields of those names."""
    if not value:
        return {}
    value = json_mapping(value, "generation_kwargs")   # TRL's command line takes it as JSON
    out = {key: value.pop(key) for key in GENERATION_KEYS if key in value}
    if value.get("do_sample", True) is True:   # cppo samples, as TRL's default
        value.pop("do_sample", None)
    changing = sorted(set(value) - set(GENERATION_MACHINERY_KEYS))
    if changing:   # they would change the sampled tokens: refused, not dropped
        from cppo.errors import ConfigError
        raise ConfigError(f"'generation_kwargs' has {changing}, which change the sampled tokens "
                          f"in TRL; {SAMPLER} (set those fields), so remove them")
    if value:
        out["__ignored__"] = f"keys {sorted(value)}: how the sampler runs, not what it samples"
    return out


def _refused(name: str, what: str) -> Callable:
    """A TRL field that changes what is trained and that cppo does not implement: any value but
    TRL's off (None, False, 0) is a ConfigError, not a silent drop."""
    def convert(value, _):
        if value in (None, False, 0):
            return {}
        from cppo.errors import ConfigError
        raise ConfigError(f"'{name}' is {value!r}: {what}; remove it (or set it to null)")
    return convert


def _resume(value, _):
    return {"resume": True} if value not in (None, False, "", "false", "False") else {}


# TRL field -> handling, for every field of trl.GRPOConfig 1.x (TrainingArguments included),
# trl's ModelConfig and the `trl grpo` script arguments that CPPOConfig does not have by name.
TRL_FIELDS: dict[str, tuple] = {
    # --- TrainingArguments: optimisation -----------------------------------------------------
    # honoured under their own names (CPPOConfig fields): lr_scheduler_kwargs, optim_args,
    # data_seed, router_aux_loss_coef, dataset_config, dataset_streaming, steps_per_generation,
    # chat_template_kwargs, vllm_structured_outputs_regex
    "warmup_steps": mapped(_warmup_steps, "-> warmup_ratio (steps / max_steps)"),
    "optim": mapped(_optim, "adamw_* -> AdamW"),
    "optim_target_modules": ignored("read only by GaLore/APOLLO-style optimizers (optim: galore_*, "
                                    "apollo_*), which cppo does not run; with adamw_* transformers "
                                    "does not read it either", None),
    "average_tokens_across_devices": ignored("cppo normalises the loss over all processes' "
                                             "tokens as loss_type says", True),
    "label_smoothing_factor": ignored("no labels in RL", 0.0),
    "auto_find_batch_size": ignored(TRAINER, False),
    # --- precision and memory ------------------------------------------------------------------
    "bf16": mapped(_bf16, "-> bf16 (null, TRL's default, means on in TRL: named, and off)"),
    "bf16_full_eval": ignored(EVAL_PRECISION, False),
    "fp16_full_eval": ignored(EVAL_PRECISION, False),
    "activation_checkpointing": mapped(_not_none("gradient_checkpointing"),
                                       "-> gradient_checkpointing (the same recompute)"),
    "activation_checkpointing_kwargs": mapped(_not_none("gradient_checkpointing_kwargs"),
                                              "-> gradient_checkpointing_kwargs"),
    "use_cache": ignored("the sampler always uses a KV cache; scoring never does", False),
    "neftune_noise_alpha": mapped(_refused("neftune_noise_alpha", "NEFTune noise on the input "
                                           "embeddings changes the policy's log-probs, and cppo "
                                           "does not add it"),
                                  "refused: cppo does not add NEFTune noise"),
    "torch_empty_cache_steps": ignored(TRAINER, None),
    # --- logging -------------------------------------------------------------------------------
    "logging_strategy": mapped(_strategy("logging_steps"), "'no' -> logging_steps: 0"),
    "logging_first_step": ignored("with logging_steps: 1 every step is logged", False),
    "log_on_each_node": ignored("the main process logs", True),
    "logging_nan_inf_filter": ignored("cppo never applies a NaN/inf update and counts them "
                                      "(cppo/nonfinite)", True),
    "include_num_input_tokens_seen": ignored("num_tokens is always logged", "no"),
    "log_level": ignored(TRAINER, "passive"),
    "log_level_replica": ignored(TRAINER, "warning"),
    "disable_tqdm": mapped(_not_none("progress_bar", lambda v: not _truthy(v)),
                           "-> progress_bar: not disable_tqdm"),
    "project": ignored("set WANDB_PROJECT / TRACKIO_PROJECT (cppo's default project: cppo)",
                       "huggingface"),
    "trackio_space_id": ignored("set TRACKIO_SPACE_ID", None),
    "trackio_bucket_id": ignored("trackio buckets are not used; the store is local", None),
    "trackio_static_space_id": ignored("trackio static Spaces are not used", None),
    "log_multimodal": ignored("text models only", True),
    "log_unique_prompts": ignored("cppo's completions table shows whole questions first", False),
    "log_completions_hub_repo": ignored(HUB, None),
    # --- evaluation ----------------------------------------------------------------------------
    "eval_strategy": mapped(_strategy("eval_steps"), "'no' -> eval_steps: 0"),
    "eval_delay": ignored(EVAL, 0),
    "per_device_eval_batch_size": ignored(EVAL, 8),
    "prediction_loss_only": ignored(EVAL, False),
    "eval_on_start": ignored("cppo always evaluates before the first step", False),
    "eval_do_concat_batches": ignored(EVAL, True),
    "eval_use_gather_object": ignored(EVAL, False),
    "eval_accumulation_steps": ignored(EVAL, None),
    "include_for_metrics": ignored(EVAL, []),
    "batch_eval_metrics": ignored(EVAL, False),
    "load_best_model_at_end": ignored("cppo keeps the last checkpoints; each evaluation's "
                                      "accuracy is in metrics.jsonl", False),
    "metric_for_best_model": ignored("no best-model selection", None),
    "greater_is_better": ignored("no best-model selection", None),
    # --- checkpoints ---------------------------------------------------------------------------
    "save_strategy": mapped(_strategy("save_steps"), "'no' -> save_steps: 0 (the final "
                            "checkpoint is still written)"),
    "save_total_limit": mapped(_save_total_limit, "-> save_total_limit (null: named, and 2)"),
    "save_only_model": ignored("checkpoints hold the optimizer so that a run resumes", False),
    "save_on_each_node": ignored("the main process writes checkpoints", False),
    "enable_jit_checkpoint": ignored(TRAINER, False),
    "resume_from_checkpoint": mapped(_resume, "-> resume: true (the latest checkpoint in "
                                     "output_dir)"),
    "restore_callback_states_from_checkpoint": ignored(TRAINER, False),
    "ignore_data_skip": ignored("a resumed run continues the question order exactly", False),
    "push_to_hub": ignored(HUB, False),
    "hub_token": ignored(HUB, None),
    "hub_private_repo": ignored(HUB, None),
    "hub_model_id": ignored(HUB, None),
    "hub_strategy": ignored(HUB, "every_save"),
    "hub_always_push": ignored(HUB, False),
    "hub_revision": ignored(HUB, None),
    # --- data ----------------------------------------------------------------------------------
    "full_determinism": ignored("deterministic kernels are a process setting (call "
                                "torch.use_deterministic_algorithms in your script); cppo seeds "
                                "sampling and selection by seed", False),
    "shuffle_dataset": ignored("questions always come in a seeded random order", True),
    "remove_unused_columns": ignored("every dataset column reaches the reward functions", False),
    "label_names": ignored(DATA, None),
    "train_sampling_strategy": ignored(DATA, "random"),
    "length_column_name": ignored(DATA, "length"),
    "dataloader_drop_last": ignored(DATA, False),
    "dataloader_num_workers": ignored(DATA, 0),
    "dataloader_pin_memory": ignored(DATA, True),
    "dataloader_persistent_workers": ignored(DATA, False),
    "dataloader_prefetch_factor": ignored(DATA, None),
    "dataloader_multiprocessing_context": ignored(DATA, None),
    "dataloader_in_order": ignored(DATA, True),
    "pad_to_multiple_of": ignored("padding is masked out of every pass (it changes shapes, not "
                                  "values); cppo pads to the longest row", "auto"),
    # --- processes and devices -----------------------------------------------------------------
    "use_cpu": ignored("the device follows the launcher and CUDA availability", False),
    "accelerator_config": ignored(DIST, None),
    "parallelism_config": ignored(DIST, None),
    "ddp_find_unused_parameters": ignored(DIST, None),
    "ddp_bucket_cap_mb": ignored(DIST, None),
    "ddp_broadcast_buffers": ignored(DIST, None),
    "ddp_static_graph": ignored(DIST, None),
    "ddp_backend": ignored(DIST, None),
    "ddp_timeout": ignored(DIST, 1800),
    "fsdp": ignored("see docs/distributed.md for cppo's sharding", None),
    "fsdp_config": ignored("see docs/distributed.md for cppo's sharding", None),
    "deepspeed": ignored("DeepSpeed is not supported; see docs/distributed.md", None),
    "ds3_gather_for_generation": ignored("DeepSpeed is not supported", True),
    "local_rank": ignored(DIST, -1),
    "debug": ignored(TRAINER, ""),
    "skip_memory_metrics": ignored(TRAINER, True),
    "do_train": ignored(TRAINER, False),
    "do_eval": ignored(TRAINER, False),
    "do_predict": ignored(TRAINER, False),
    # --- model loading (GRPOConfig and trl's ModelConfig) --------------------------------------
    "model_name_or_path": rename("model"),
    "model_init_kwargs": mapped(_model_init_kwargs, "torch_dtype/dtype -> torch_dtype, "
                                "attn_implementation, revision -> model_revision, "
                                "trust_remote_code"),
    "dtype": mapped(_not_none("torch_dtype", lambda v: str(v).replace("torch.", "")),
                    "-> torch_dtype"),
    # --- data (trl's ScriptArguments) ----------------------------------------------------------
    "dataset_train_split": rename("dataset_split"),
    "dataset_test_split": rename("eval_dataset_split"),
    "ignore_bias_buffers": ignored(TRAINER, False),
    "reward_model_name_or_path": mapped(_reward_model, "appended to reward_funcs (scored as a "
                                        "reward model)"),
    # --- generation ----------------------------------------------------------------------------
    "top_k": mapped(_not_none("top_k"), "-> top_k (None: 0, off)"),
    "generation_kwargs": mapped(_generation_kwargs, "temperature, top_p, top_k, min_p, "
                                "repetition_penalty -> the fields of those names (over them, as "
                                "in TRL); other keys named, and dropped"),
    "cache_implementation": ignored("cppo's sampler keeps its own KV cache", None),
    "use_transformers_continuous_batching": ignored("cppo's own sampler", False),
    "transformers_continuous_batching_config": ignored("cppo's own sampler", None),
    "use_transformers_paged": ignored("cppo's own sampler", False),
    "vllm_importance_sampling_correction": rename("importance_sampling_correction"),
    "vllm_importance_sampling_mode": rename("importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": mapped(_clip_max, "-> importance_sampling_clip_max "
                                                "(null: no bound)"),
    "vllm_importance_sampling_cap": rename("importance_sampling_clip_max"),   # TRL's older name
    "vllm_importance_sampling_clip_min": rename("importance_sampling_clip_min"),
    # --- loss variants -------------------------------------------------------------------------
}


# Every ignored field is machinery: it does not change the model, the loss, the optimizer or
# the sampled tokens. Each has one kind (tests/test_trl_fields.py: an ignored field outside this
# table fails). A TRL field that does change them is honoured, mapped, or refused (_refused).
MACHINERY: dict[str, tuple[str, ...]] = {
    "trainer": ("auto_find_batch_size", "average_tokens_across_devices", "torch_empty_cache_steps",
                "debug", "skip_memory_metrics", "do_train", "do_eval", "do_predict"),
    "hub": ("log_completions_hub_repo", "push_to_hub", "hub_token", "hub_private_repo",
            "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision"),
    "data loading": ("shuffle_dataset", "remove_unused_columns", "label_names",
                     "train_sampling_strategy", "length_column_name", "dataloader_drop_last",
                     "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor",
                     "dataloader_multiprocessing_context", "dataloader_in_order",
                     "pad_to_multiple_of"),
    "process setup": ("use_cpu", "accelerator_config", "parallelism_config",
                      "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
                      "ddp_static_graph", "ddp_backend", "ddp_timeout", "fsdp", "fsdp_config",
                      "deepspeed", "ds3_gather_for_generation", "local_rank", "full_determinism",
                      "ignore_bias_buffers"),
    "logging": ("logging_first_step", "log_on_each_node", "logging_nan_inf_filter",
                "include_num_input_tokens_seen", "log_level", "log_level_replica", "project",
                "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
                "log_unique_prompts"),
    "evaluation": ("eval_delay", "per_device_eval_batch_size", "prediction_loss_only",
                   "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object",
                   "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
                   "bf16_full_eval", "fp16_full_eval", "load_best_model_at_end",
                   "metric_for_best_model", "greater_is_better"),
    "checkpoints": ("save_only_model", "save_on_each_node", "enable_jit_checkpoint",
                    "restore_callback_states_from_checkpoint", "ignore_data_skip"),
    "generation engine": ("use_cache", "cache_implementation",
                          "use_transformers_continuous_batching",
                          "transformers_continuous_batching_config", "use_transformers_paged"),
    "not applicable": ("label_smoothing_factor", "log_multimodal", "optim_target_modules"),
}


def machinery_kind(name: str) -> str | None:
    """The machinery kind of an ignored TRL field (None: not listed)."""
    return next((kind for kind, names in MACHINERY.items() if name in names), None)


# CPPOConfig fields with TRL's names whose default differs from TRL 1.16's, and why; the
# migration guide lists each (tests/test_trl_fields.py checks both)
DEFAULTS_DIFFER: dict[str, str] = {
    "output_dir": "runs/cppo",
    "per_device_train_batch_size": "sized for the embedded task",
    "num_train_epochs": "the embedded recipe runs max_steps",
    "max_steps": "the embedded recipe: 600 steps",
    "learning_rate": "the embedded recipe's tiny model",
    "lr_scheduler_type": "the embedded recipe decays with cosine",
    "adam_beta2": "0.99, as the embedded recipe was tuned; TRL's is 0.999",
    "bf16": "off: bfloat16 autocast is slow on most CPUs (matmul_dtype: auto runs the Linear "
            "matmuls in bfloat16 where that is fast); TRL's null turns it on",
    "gradient_checkpointing": "off; TRL turns it on",
    "logging_steps": "every step",
    "report_to": "metrics.jsonl",
    "eval_steps": "held-out accuracy every 75 steps",
    "save_steps": "100",
    "save_total_limit": "the 2 most recent checkpoints; TRL keeps every one",
    "max_completion_length": "the embedded task's answers are short",
    "vllm_enable_sleep_mode": "vLLM sleeps between rounds, freeing its memory for the update",
    "lora_target_modules": "the attention projections",
    "dataset_name": "the embedded task",
    "reward_funcs": "the embedded task's reward",
    "num_generations_eval": "0: cppo's held-out greedy accuracy only; TRL's null samples "
                            "num_generations completions per question (null does so in cppo too)",
}

# TRL fields mapped onto a cppo field whose default differs from what TRL's default maps to (the
# migration guide lists each with the others; tests/test_trl_fields.py checks both)
MAPPED_DEFAULTS_DIFFER: dict[str, str] = {
    "vllm_importance_sampling_mode": "token_truncate: a weight per token never drops a whole "
                                     "completion, which a pruned batch, a few kept per question, "
                                     "can least afford",
}

MERGED = {"reward_model_name_or_path"}   # mapped onto a field it extends, not replaces
OVERRIDES = {"generation_kwargs"}   # mapped over the fields it names, as TRL applies it


def _truthy(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


def translate(values: dict[str, Any], known: set[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """TRL-named values -> (cppo values, {ignored field: reason}). `known` are CPPOConfig's
    fields: they pass through (a TRL conversion still applies to TRL-only values such as None);
    names in neither table pass through too, for build_dataclass to name as unknown."""
    def passes(key):
        entry = TRL_FIELDS.get(key)
        return entry is None or (key in known and entry[0] == "ignored")
    out = {key: value for key, value in values.items() if passes(key)}
    dropped: dict[str, str] = {}
    for key, value in values.items():
        if passes(key):
            continue
        kind, detail, default = TRL_FIELDS[key]
        if kind == "ignored":
            if default is _MISSING or value != default:   # default: the behaves_as value
                dropped[key] = detail
            continue
        converted = dict(detail(value, values))
        reason = converted.pop("__ignored__", None)
        if reason:
            dropped[key] = reason
        for target, v in converted.items():
            # a cppo name given explicitly wins (a reward model joins the given reward_funcs)
            if target == key or target not in values or key in MERGED | OVERRIDES:
                out[target] = v
    return out, dropped


def ignored_message(dropped: dict[str, str], source: str) -> str:
    """One message naming every ignored TRL field and why."""
    width = max(map(len, dropped))
    lines = [f"{source}: {len(dropped)} TRL field(s) ignored (the run goes on without them):"]
    lines += [f"  {key:<{width}}  {reason}" for key, reason in sorted(dropped.items())]
    return "\n".join(lines)
