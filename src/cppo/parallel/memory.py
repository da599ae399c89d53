"""Memory budget -> batch sizes: how many completions fit on a device at once.

Pure functions of a model's shape, the sequence lengths and a byte budget (the memory left for
KV caches, activations and logits once weights, gradients, optimizer state and the reference
model are resident). Byte counts per completion:

* decoding (generation, evaluation): its KV cache over prompt + completion,
  2 (k, v) x layers x kv_heads x head_dim x dtype bytes per token, plus the float32 logits of
  one decode step (a few copies: logits, filtered logits, probabilities); each question's
  prompt prefill (one layer's activations and its attention scores) is shared by its G rows;
* scoring (log-probs without gradients: old policy, reference): one decoder layer's activations
  over the sequence plus the float32 logits of the completion positions (logits and the
  log-softmax's temporary);
* training (log-probs with gradients): every layer's saved activations (with gradient
  checkpointing only each layer's input, plus one layer recomputed) plus the completion logits,
  their log-softmax and their gradient.

These are estimates meant to pick safe batch sizes, not to predict the allocator to the byte.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING
import torch

from cppo.errors import ConfigError
from cppo.models.loading import torch_dtype

if TYPE_CHECKING:
    from cppo.config.sections import SamplingSection


GIB = 2**30
LOGIT_BYTES = 4                 # logits are handled in float32 for sampling and log-softmax
DECODE_LOGIT_COPIES = 3         # logits, temperature/top-k/top-p filtered logits, probabilities
SCORING_LOGIT_COPIES = 2        # logits and log-softmax's temporary
TRAINING_LOGIT_COPIES = 3       # logits, log-softmax saved for backward, their gradient
USABLE_FRACTION = 0.9           # of device memory: CUDA context and allocator fragmentation


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder-only transformer's config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, model_config) -> "ModelShape":
        """From a transformers model config (a multimodal one's text_config is used)."""
        c = getattr(model_config, "text_config", None) or model_config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(num_layers=c.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, hidden_size=c.hidden_size,
                   intermediate_size=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
                   vocab_size=c.vocab_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (k and v) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def layer_linear_weights(self) -> int:
        """Weights of one decoder layer's Linear layers: q, k, v, o and the MLP's gate, up, down."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * i

    def multiply_adds_per_token(self) -> int:
        """Multiply-adds of the linear layers for one token: q, k, v, o, the MLP's gate, up and
        down in every layer, and the LM head (attention over the context not counted)."""
        return self.num_layers * self.layer_linear_weights() + self.hidden_size * self.vocab_size

    def layer_activation_values(self) -> int:
        """Values per token that one decoder layer keeps for its backward pass: two norms' inputs
        and outputs (4h), q, k, v, attention and o_proj outputs, the MLP's gate, up, act(gate)
        and act(gate) x up (4 I) and its output (h)."""
        h, i = self.hidden_size, self.intermediate_size
        qkv = self.num_heads * self.head_dim + 2 * self.num_kv_heads * self.head_dim
        return 4 * h + qkv + 2 * h + 4 * i + h


@dataclass(frozen=True)
class BatchSizes:
    """Completions (or sequences) that fit together in the budget, per process."""

    generation: int   # completions decoded together while sampling (a multiple of G)
    evaluation: int   # completions decoded together in held-out evaluation
    scoring: int      # sequences per log-prob pass without gradients (old policy, reference)
    training: int     # sequences per forward + backward micro-batch


def decode_bytes(shape: ModelShape, *, prompt_length: int, completion_length: int,
                 dtype_bytes: int, group: int = 1) -> int:
    """Bytes one completion needs while decoded in a group of `group` sharing one prompt."""
    kv = shape.kv_bytes_per_token(dtype_bytes) * (prompt_length + completion_length)
    logits = DECODE_LOGIT_COPIES * shape.vocab_size * LOGIT_BYTES
    prefill = (prompt_length * shape.layer_activation_values() * dtype_bytes
               + shape.num_heads * prompt_length ** 2 * 4)   # attention scores (math kernel)
    return kv + logits + math.ceil(prefill / group)


def scoring_bytes(shape: ModelShape, *, prompt_length: int, completion_length: int,
                  activation_bytes: int) -> int:
    """Bytes one sequence needs in a log-prob pass without gradients."""
    length = prompt_length + completion_length
    layer = length * shape.layer_activation_values() * activation_bytes
    residual = length * shape.hidden_size * 4
    logits = SCORING_LOGIT_COPIES * (completion_length + 1) * shape.vocab_size * LOGIT_BYTES
    return layer + residual + logits


def training_bytes(shape: ModelShape, *, prompt_length: int, completion_length: int,
                   activation_bytes: int, gradient_checkpointing: bool) -> int:
    """Bytes one sequence needs in a forward + backward pass."""
    length = prompt_length + completion_length
    layer = length * shape.layer_activation_values() * activation_bytes
    if gradient_checkpointing:   # each layer's input kept, one layer's activations recomputed
        saved = shape.num_layers * length * shape.hidden_size * 4 + layer
    else:
        saved = shape.num_layers * layer
    logits = TRAINING_LOGIT_COPIES * (completion_length + 1) * shape.vocab_size * LOGIT_BYTES
    return saved + logits


def plan_batch_sizes(shape: ModelShape, *, budget_bytes: int, prompt_length: int,
                     completion_length: int, num_generations: int, sampling_dtype_bytes: int,
                     activation_bytes: int, gradient_checkpointing: bool) -> BatchSizes:
    """The largest batches that fit in budget_bytes; ConfigError (naming the fields to change)
    when not even one question's G completions, or one sequence, fits."""
    decode = decode_bytes(shape, prompt_length=prompt_length, completion_length=completion_length,
                          dtype_bytes=sampling_dtype_bytes, group=num_generations)
    greedy = decode_bytes(shape, prompt_length=prompt_length, completion_length=completion_length,
                          dtype_bytes=sampling_dtype_bytes, group=1)
    score = scoring_bytes(shape, prompt_length=prompt_length, completion_length=completion_length,
                          activation_bytes=activation_bytes)
    train = training_bytes(shape, prompt_length=prompt_length, completion_length=completion_length,
                           activation_bytes=activation_bytes,
                           gradient_checkpointing=gradient_checkpointing)
    need = {"one training sequence": train, "one scoring sequence": score,
            f"one question's {num_generations} completions": decode * num_generations}
    for what, size in need.items():
        if size > budget_bytes:
            raise ConfigError(
                f"the memory budget of {budget_bytes / GIB:.2f} GiB per device is too small for "
                f"{what} of {prompt_length} prompt + {completion_length} completion tokens "
                f"({size / GIB:.2f} GiB); lower 'max_completion_length' or 'max_prompt_length'"
                f"{'' if gradient_checkpointing else ', set gradient_checkpointing: true'}, or "
                f"raise 'memory_budget_gib' (None: derived from the device's memory)")
    return BatchSizes(generation=budget_bytes // decode // num_generations * num_generations,
                      evaluation=budget_bytes // greedy, scoring=budget_bytes // score,
                      training=budget_bytes // train)


def device_memory_bytes(device) -> int:
    """Total memory of a CUDA device, or this machine's RAM shared by its local processes."""
    import torch
    if getattr(device, "type", device) == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GIB
    return ram // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def model_state_bytes(policy, reference=None) -> int:
    """Weights of the policy (and reference), plus a gradient and two AdamW moments for every
    trainable parameter (in the parameter's dtype), on this device: a sharded parameter (a
    DTensor, under FSDP) counts its local shard only."""
    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p
    total = 0
    for p in policy.parameters():
        total += local(p).numel() * p.element_size() * (4 if p.requires_grad else 1)
    if reference is not None:
        total += sum(local(p).numel() * p.element_size() for p in reference.parameters())
    return total


def budget_bytes(memory_budget_gib: float | None, *, device_bytes: int, state_bytes: int,
                 engine_bytes: int = 0) -> int:
    """The user's budget, or USABLE_FRACTION of the device less the model states and a colocated
    vLLM engine's share (`vllm_engine_bytes`)."""
    if memory_budget_gib is not None:
        return int(memory_budget_gib * GIB)
    left = int(USABLE_FRACTION * device_bytes) - state_bytes - engine_bytes
    if left <= 0:
        engine = (f" and the colocated vLLM engine {engine_bytes / GIB:.1f} GiB (lower "
                  f"vllm_gpu_memory_utilization, or use vllm_mode: server)" if engine_bytes else "")
        raise ConfigError(
            f"weights, gradients, optimizer state and reference take {state_bytes / GIB:.1f} GiB"
            f"{engine}, more than {USABLE_FRACTION:.0%} of the device's "
            f"{device_bytes / GIB:.1f} GiB; use LoRA (use_peft: true) or more devices, or set "
            f"'memory_budget_gib' to the memory that is really left for activations (e.g. when "
            f"weights are sharded)")
    return left


def kv_cache_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Key + value bytes one token takes in every layer's KV cache."""
    c = getattr(model_config, "text_config", None) or model_config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * (torch.finfo(dtype).bits // 8)


CPU_BLOCK_SIZE = 128   # tokens per KV-cache block in vLLM's CPU build (its default there)


def round_kv_cache_bytes(model_config, dtype: torch.dtype, *, max_model_len: int, sequences: int,
                         ram_bytes: int, ram_fraction: float, max_num_seqs: int = 256) -> int:
    """KV cache for vLLM's CPU build, whose gpu_memory_utilization is a fraction of the RAM that
    must be free at start-up beside the trainer: the cache one generation round of `sequences`
    completions needs (at max_model_len in whole blocks, at most max_num_seqs at once, plus 10 %),
    at least one whole sequence, at most ram_fraction of the RAM."""
    rows = min(sequences, max_num_seqs)
    sequence = -(-max_model_len // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
    per_token = kv_cache_bytes_per_token(model_config, dtype)
    need = int(rows * sequence * per_token * 1.1)
    return max(sequence * per_token, min(need, int(ram_fraction * ram_bytes)))


def check_batch_settings(sizes: BatchSizes, *, per_device_train_batch_size: int,
                         max_completion_length: int, gradient_checkpointing: bool,
                         generation_chunk_size: int | None) -> None:
    """A batch setting larger than the budget allows: ConfigError naming the field, the value
    that fits and how to fix it. (generation_chunk_size: None, or vLLM's, is not checked.)"""
    if per_device_train_batch_size > sizes.training:
        raise ConfigError(
            f"'per_device_train_batch_size' is {per_device_train_batch_size}, but only "
            f"{sizes.training} sequences of {max_completion_length} completion tokens fit a "
            f"forward + backward pass in the memory budget; set per_device_train_batch_size <= "
            f"{sizes.training} (raise gradient_accumulation_steps to keep the update size)"
            f"{'' if gradient_checkpointing else ', or set gradient_checkpointing: true'}")
    if generation_chunk_size is not None and generation_chunk_size > sizes.generation:
        raise ConfigError(
            f"'generation_chunk_size' is {generation_chunk_size}, but only {sizes.generation} "
            f"completions fit in the memory budget while decoding; set generation_chunk_size <= "
            f"{sizes.generation}, or None to use the largest that fits")


def check_run_batches(sizes: BatchSizes, sampling: SamplingSection, questions_per_step: int,
                      world_size: int, check_generation_batch_size, *,
                      per_device_train_batch_size: int, gradient_checkpointing: bool,
                      use_vllm: bool) -> None:
    """A run's batch settings (its `sampling` section and the fields given) against what fits
    (check_batch_settings), the config's generation batch against the round's completions
    (`check_generation_batch_size(completions_per_round)`, the config's check) and the chunks
    against the processes' questions (cppo.parallel.engines.check_layout)."""
    from cppo.parallel.engines import check_layout
    check_batch_settings(sizes, per_device_train_batch_size=per_device_train_batch_size,
                         max_completion_length=sampling.max_completion_length,
                         gradient_checkpointing=gradient_checkpointing,
                         generation_chunk_size=None if use_vllm else sampling.generation_chunk_size)
    check_generation_batch_size(questions_per_step * sampling.num_generations * world_size)
    check_layout(generation_chunk_size=sampling.generation_chunk_size,
                 num_generations=sampling.num_generations, questions_per_step=questions_per_step,
                 world_size=world_size)


@dataclass(frozen=True)
class RunShape:
    """What a run's passes hold per completion: prompts of prompt_length tokens and up to
    max_completion_length new ones (plus speculation_slots KV-cache slots kept for rejected
    drafts), G = num_generations per question, the sampler's KV cache in generation_dtype (None:
    the weights' dtype), activations in bf16 under `bf16`, and with `matmul_dtype` the training
    passes' copy of the decoder layers' Linear weights in it (kept for the backward)."""

    prompt_length: int
    max_completion_length: int
    num_generations: int
    generation_dtype: str | None = None
    bf16: bool = False
    gradient_checkpointing: bool = False
    speculation_slots: int = 0
    matmul_dtype: str | None = None


def plan_for_run(policy, reference, device, run: RunShape, *, memory_budget_gib: float | None,
                 engine_bytes: int = 0) -> BatchSizes:
    """plan_batch_sizes for a run's loaded models and its RunShape, in memory_budget_gib (None:
    90% of the device); `engine_bytes` (a colocated vLLM engine's share) and the matmul copy come
    off the device's memory."""
    generation_dtype, matmul_dtype = run.generation_dtype, run.matmul_dtype
    weight_bytes = next(policy.parameters()).element_size()
    sampling_bytes = (torch.empty(0, dtype=torch_dtype(generation_dtype)).element_size()
                      if generation_dtype else weight_bytes)
    shape = ModelShape.from_config(policy.config)
    matmul_copy = (shape.num_layers * shape.layer_linear_weights()
                   * torch.empty(0, dtype=torch_dtype(matmul_dtype)).element_size()
                   if matmul_dtype else 0)
    budget = budget_bytes(memory_budget_gib, device_bytes=device_memory_bytes(device),
                          state_bytes=model_state_bytes(policy, reference) + matmul_copy,
                          engine_bytes=engine_bytes)
    return plan_batch_sizes(shape, budget_bytes=budget,
                            prompt_length=run.prompt_length,
                            completion_length=run.max_completion_length + run.speculation_slots,
                            num_generations=run.num_generations,
                            sampling_dtype_bytes=sampling_bytes,
                            activation_bytes=2 if run.bf16 else weight_bytes,
                            gradient_checkpointing=run.gradient_checkpointing)


def eval_batch_size(model, prompt_length: int, *, max_new_tokens: int, k: int,
                    memory_budget_gib: float | None) -> int:
    """`cppo eval`: completions of prompts of prompt_length tokens decoded together so that their
    KV caches and logits fit in the budget (None: 90% of the device less the model's weights), a
    multiple of k when sampling."""
    device = next(model.parameters()).device
    budget = budget_bytes(memory_budget_gib, device_bytes=device_memory_bytes(device),
                          state_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    group = max(k, 1)
    per = decode_bytes(ModelShape.from_config(model.config), prompt_length=prompt_length,
                       completion_length=max_new_tokens,
                       dtype_bytes=next(model.parameters()).element_size(), group=group)
    fit = budget // per // group * group
    if fit < group:
        raise ConfigError(
            f"the memory budget of {budget / GIB:.2f} GiB is too small to decode "
            f"{group} completion(s) of {prompt_length} prompt + {max_new_tokens} new tokens "
            f"({group * per / GIB:.2f} GiB); lower 'max_completion_length' or 'k', or raise "
            f"'memory_budget_gib'")
    return fit
