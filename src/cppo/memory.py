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

from cppo.config import ConfigError

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
    def from_config(cls, config) -> "ModelShape":
        """From a transformers config (a multimodal one's text_config is used)."""
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(num_layers=config.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, hidden_size=config.hidden_size,
                   intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
                   vocab_size=config.vocab_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (k and v) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

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


def budget_bytes(memory_budget_gib: float | None, *, device_bytes: int, state_bytes: int) -> int:
    """The user's budget, or USABLE_FRACTION of the device less the model states."""
    if memory_budget_gib is not None:
        return int(memory_budget_gib * GIB)
    left = int(USABLE_FRACTION * device_bytes) - state_bytes
    if left <= 0:
        raise ConfigError(
            f"weights, gradients, optimizer state and reference take {state_bytes / GIB:.1f} GiB, "
            f"more than {USABLE_FRACTION:.0%} of the device's {device_bytes / GIB:.1f} GiB; use "
            f"LoRA (use_peft: true) or more devices, or set 'memory_budget_gib' to the memory "
            f"that is really left for activations (e.g. when weights are sharded)")
    return left


def check_batch_settings(args, sizes: BatchSizes, *, completions_per_round: int) -> None:
    """A batch setting that contradicts the budget or TRL's batch vocabulary: ConfigError naming
    the field, the value that fits and how to fix it."""
    if args.per_device_train_batch_size > sizes.training:
        raise ConfigError(
            f"'per_device_train_batch_size' is {args.per_device_train_batch_size}, but only "
            f"{sizes.training} sequences of {args.max_completion_length} completion tokens fit a "
            f"forward + backward pass in the memory budget; set per_device_train_batch_size <= "
            f"{sizes.training} (raise gradient_accumulation_steps to keep the update size)"
            f"{'' if args.gradient_checkpointing else ', or set gradient_checkpointing: true'}")
    chunk = getattr(args, "generation_chunk_size", None)
    if chunk is not None and not args.use_vllm and chunk > sizes.generation:
        raise ConfigError(
            f"'generation_chunk_size' is {chunk}, but only {sizes.generation} completions fit "
            f"in the memory budget while decoding; set generation_chunk_size <= "
            f"{sizes.generation}, or None to use the largest that fits")
    if args.generation_batch_size is not None and args.generation_batch_size != completions_per_round:
        raise ConfigError(
            f"'generation_batch_size' is {args.generation_batch_size}, but a generation round of "
            f"this run makes {completions_per_round} completions over all processes (questions "
            f"per step x num_generations x processes, set by per_device_train_batch_size, "
            f"gradient_accumulation_steps and pruning_rate with allocation); set it to "
            f"{completions_per_round} or None. To bound how many completions are decoded at "
            f"once, use 'generation_chunk_size'")


def speculation_slots(args) -> int:
    """Extra KV-cache slots per completion the speculative sampler keeps for rejected drafts."""
    from cppo.generation import speculation
    spec = speculation(args)
    return spec.slack if spec is not None else 0


def plan_for_run(args, policy, reference, device, *, tokenizer=None, rows=()) -> BatchSizes:
    """plan_batch_sizes for a run's config and loaded models: the prompt length is
    max_prompt_length (None: the longest of `rows`), the sampler's KV cache is in
    generation_dtype (None: the weights' dtype), activations in bf16 under `bf16`."""
    import torch
    prompt_length = args.max_prompt_length
    if prompt_length is None:
        from cppo.rollout import encode_prompts
        prompt_length = (encode_prompts(tokenizer, [r["prompt"] for r in rows]).ids.shape[1]
                         if rows else 2048)
    weight_bytes = next(policy.parameters()).element_size()
    sampling_bytes = (torch.empty(0, dtype=getattr(torch, args.generation_dtype)).element_size()
                      if args.generation_dtype else weight_bytes)
    budget = budget_bytes(args.memory_budget_gib, device_bytes=device_memory_bytes(device),
                          state_bytes=model_state_bytes(policy, reference))
    return plan_batch_sizes(ModelShape.from_config(policy.config), budget_bytes=budget,
                            prompt_length=prompt_length,
                            completion_length=args.max_completion_length + speculation_slots(args),
                            num_generations=args.num_generations,
                            sampling_dtype_bytes=sampling_bytes,
                            activation_bytes=2 if args.bf16 else weight_bytes,
                            gradient_checkpointing=args.gradient_checkpointing)


def eval_batch_size(model, tokenizer, rows, *, max_new_tokens: int, k: int,
                    memory_budget_gib: float | None, max_prompt_length: int | None = None) -> int:
    """`cppo eval`: completions decoded together so that their KV caches and logits fit in the
    budget (None: 90% of the device less the model's weights), a multiple of k when sampling."""
    from cppo.rollout import encode_prompts
    device = next(model.parameters()).device
    prompt_length = encode_prompts(tokenizer, [r["prompt"] for r in rows], max_prompt_length).ids.shape[1]
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
