"""LoRA through peft: the policy is the base model plus adapters; the reference model is the same
base with the adapters disabled (`policy.disable_adapter()`), so no second copy is held.

Checkpoints of a LoRA policy hold only the adapters (adapter_model.safetensors +
adapter_config.json, peft's format), loadable with `PeftModel.from_pretrained(base, path)`.
"""

from __future__ import annotations

from pathlib import Path

from cppo.errors import ConfigError, MissingExtraError

PEFT_MISSING = "use_peft needs peft: pip install 'cppo[peft]'"


def _peft():
    try:
        import peft
    except ImportError as err:
        raise MissingExtraError(f"{PEFT_MISSING} (import failed: {err})") from err
    return peft


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def lora_config(args):
    """peft LoraConfig from CPPOConfig's LoRA fields, as trl.get_peft_config builds it from
    TRL's (target_parameters passed only when set)."""
    peft = _peft()
    extra = {} if args.lora_target_parameters is None else \
        {"target_parameters": list(args.lora_target_parameters)}
    return peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                           target_modules=list(args.lora_target_modules), bias="none",
                           task_type=args.lora_task_type, use_rslora=args.use_rslora,
                           use_dora=args.use_dora, modules_to_save=args.lora_modules_to_save,
                           **extra)


def wrap_with_lora(policy, args, peft_config=None):
    """The policy with LoRA adapters (peft_config, else one built from args); only adapters train."""
    peft = _peft()
    if is_peft_model(policy):
        return policy                                   # already wrapped by the caller
    config = peft_config if peft_config is not None else lora_config(args)
    names = {name.rsplit(".", 1)[-1] for name, _ in policy.named_modules()}
    targets = config.target_modules
    if isinstance(targets, (list, set, tuple)):
        missing = sorted(set(targets) - names)
        if len(missing) == len(set(targets)):
            raise ValueError(f"lora_target_modules {sorted(targets)} match no module of "
                             f"{type(policy).__name__}; its linear layers include "
                             f"{sorted(n for n in names if n.endswith('proj'))[:12]}")
    if getattr(args, "gradient_checkpointing", False):
        # frozen embeddings give inputs without grad: checkpointed blocks would see no grad path
        policy.enable_input_require_grads()
    try:
        return peft.get_peft_model(policy, config)
    except ValueError as err:   # e.g. DoRA where peft has no DoRA for the layer
        raise ConfigError(f"peft refuses the LoRA settings (use_dora {config.use_dora}, "
                          f"use_rslora {config.use_rslora}, lora_dropout {config.lora_dropout}, "
                          f"lora_target_modules, lora_target_parameters): {err}. Change the field "
                          f"it names (use_dora: false where DoRA is refused)") from err


def load_adapter_weights(model, checkpoint: Path) -> None:
    """Load a checkpoint's adapter_model.safetensors into a peft model in place."""
    peft = _peft()
    from safetensors.torch import load_file
    file = Path(checkpoint) / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} has no adapter_model.safetensors, but the "
                                f"policy is a LoRA (peft) model; was it saved with use_peft: false?")
    result = peft.set_peft_model_state_dict(model, load_file(file))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise RuntimeError(f"checkpoint {checkpoint} adapters do not match the model: unexpected "
                           f"{unexpected[:5]}")
