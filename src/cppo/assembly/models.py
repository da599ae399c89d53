"""The models of a run: the policy, its tokenizer, the frozen reference and the engine (ddp /
fsdp / a single process) that wraps them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cppo.config.checks import check_reference_sync
from cppo.config.sections import ModelSection, PrecisionSection
from cppo.models.loading import frozen_copy, load_policy
from cppo.parallel.engines import Engine, resolve_strategy


@dataclass
class Models:
    """policy: the same on every process; reference: None when beta = 0 or with LoRA (then the
    base, adapters disabled, is the reference); lora: the policy trains LoRA adapters."""

    policy: torch.nn.Module
    tokenizer: object
    reference: torch.nn.Module | None
    engine: Engine
    lora: bool


def build_models(args, dist, model=None, processing_class=None, peft_config=None) -> Models:
    """Load the policy (a name, a path or a model object: `model`; None: the config's), broadcast
    rank 0's weights, copy the reference before sharding, wrap both in the config's engine.
    Seeds: the same LoRA init on every process, then dropout per process."""
    torch.manual_seed(args.seed)
    lora = args.use_peft or peft_config is not None
    check_reference_sync(args.sync_ref_model, lora=lora)   # a peft_config given here
    policy, tokenizer = load_policy(
        model, processing_class, ModelSection.of(args), PrecisionSection.of(args), dist.device,
        chat_template_kwargs=args.chat_template_kwargs, lora=lora, peft_config=peft_config)
    dist.broadcast_parameters(policy)
    reference = None if args.beta == 0 or lora else frozen_copy(policy)
    engine = Engine(resolve_strategy(args.distributed), dist, policy, bf16=args.bf16,
                    block_names=args.fsdp_transformer_layer_cls_to_wrap,
                    keep_skeleton=args.async_rollout)
    reference = engine.shard_reference(reference)   # copied before sharding
    torch.manual_seed(args.seed + dist.rank)
    return Models(policy, tokenizer, reference, engine, lora)
