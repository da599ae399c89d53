"""LoRA through peft: the policy is the base model plus adapters; the reference model is the same
base with the adapters disabled (`policy.disable_adapter()`), so no second copy is held.

Checkpoints of a LoRA policy hold only the adapters (adapter_model.safetensors +
adapter_config.json, peft's format), loadable with `PeftModel.from_pretrained(base, path)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cppo.errors import ConfigError, MissingExtraError

if TYPE_CHECKING:
    from cppo.config.sections import ModelSection

PEFT_MISSING = "use_peft needs peft: pip install 'cppo[peft]'"


def check_lm_head_cast(cast_lm_head_to_fp32: bool, lora_on_head: bool) -> None:
    """A float32 head cannot carry a LoRA adapter: checked on the config (lora_target_modules)
    and on the loaded model (a peft_config given to the trainer; cppo.models.loading)."""
    if cast_lm_head_to_fp32 and lora_on_head:
        raise ConfigError("'cast_lm_head_to_fp32' is true but lora_target_modules puts a LoRA "
                          "adapter on lm_head: remove lm_head from lora_target_modules, or set "
                          "cast_lm_head_to_fp32: false (TRL refuses this too)")


def check_dora_push(dora: bool, vllm: bool) -> None:
    """A DoRA adapter has no weight delta to push to vLLM, nor a place in the LoRA adapters vLLM
    serves (vllm_push: adapter): checked on the config (use_dora) and on the adapters pushed (a
    DoRA peft_config given to the trainer; cppo.sampling.vllm, check_adapter_push)."""
    if dora and vllm:
        raise ConfigError("'use_dora' is true with use_vllm: a DoRA adapter cannot be pushed to "
                          "vLLM, neither as a weight delta (vllm_push: merged) nor as an adapter "
                          "(vllm_push: adapter: vLLM serves LoRA, not DoRA, whose magnitude has no "
                          "place in its adapters); set use_dora: false, or use_vllm: false")


# what vLLM's LoRA loader cannot serve as an adapter: the modules it restricts or drops deltas of
UNSERVED_LORA_MODULES = ("lm_head", "embed_tokens")


def check_adapter_push(*, dora: bool, modules_to_save, target_modules, target_parameters,
                       bias: str = "none") -> None:
    """vllm_push: adapter sends vLLM the LoRA factors alone, which it serves as a LoRA adapter:
    only a plain LoRA on its linear layers (the rules TRL's AsyncGRPOTrainer applies before its
    adapter sync). Checked on the config (the lora_* fields) and at launch on the policy's peft
    config (one given to the trainer); a ConfigError naming the field and the fix."""
    check_dora_push(dora, vllm=True)
    fix = "or set vllm_push: merged (the LoRA merged into the weights, any adapter)"
    if modules_to_save:
        raise ConfigError(f"'lora_modules_to_save' is {list(modules_to_save)} with vllm_push: "
                          f"adapter: those modules train whole, which no LoRA adapter carries (the "
                          f"server would keep its own copy); set lora_modules_to_save: null, {fix}")
    if target_parameters:
        raise ConfigError(f"'lora_target_parameters' is {list(target_parameters)} with vllm_push: "
                          f"adapter: vLLM serves LoRA on modules, not on parameters; set "
                          f"lora_target_parameters: null, {fix}")
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    unserved = [t for t in targets if any(m in t for m in UNSERVED_LORA_MODULES)]
    if unserved:
        raise ConfigError(f"'lora_target_modules' is {targets} with vllm_push: adapter: vLLM does "
                          f"not serve a LoRA on {unserved} (it restricts LoRA on the head and the "
                          f"embeddings); remove them from lora_target_modules, {fix}")
    if bias != "none":
        raise ConfigError(f"the LoRA's bias is {bias!r} with vllm_push: adapter: trained biases "
                          f"are no part of a LoRA adapter; use bias 'none', {fix}")


def adapter_rank(peft_config) -> int:
    """The largest rank of a peft LoraConfig's adapters (r, or a larger one in rank_pattern)."""
    return max([peft_config.r, *(getattr(peft_config, "rank_pattern", None) or {}).values()])


def check_adapter_model(policy) -> None:
    """At launch, vllm_push: adapter on the policy itself: a peft model with one active LoRA
    adapter that vLLM serves (check_adapter_push on its config)."""
    if not is_peft_model(policy):
        raise ConfigError("'vllm_push' is 'adapter' but the policy has no LoRA adapter: set "
                          "use_peft: true (or give the trainer a peft_config), or vllm_push: merged")
    if len(policy.active_adapters) != 1:
        raise ConfigError(f"'vllm_push' is 'adapter' with {len(policy.active_adapters)} active "
                          f"adapters ({policy.active_adapters}): vLLM serves one; activate one, or "
                          f"set vllm_push: merged")
    config = policy.peft_config[policy.active_adapters[0]]
    if type(config).__name__ != "LoraConfig":
        raise ConfigError(f"'vllm_push' is 'adapter' with a {type(config).__name__} adapter: vLLM "
                          f"serves LoRA adapters only; set vllm_push: merged")
    check_adapter_push(dora=bool(config.use_dora), modules_to_save=config.modules_to_save,
                       target_modules=config.target_modules,
                       target_parameters=getattr(config, "target_parameters", None),
                       bias=config.bias)


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


def lora_config(model: ModelSection):
    """peft LoraConfig from the LoRA fields of the run's `model` section, as trl.get_peft_config
    builds it from TRL's (target_parameters passed only when set)."""
    peft = _peft()
    extra = {} if model.lora_target_parameters is None else \
        {"target_parameters": list(model.lora_target_parameters)}
    return peft.LoraConfig(r=model.lora_r, lora_alpha=model.lora_alpha,
                           lora_dropout=model.lora_dropout,
                           target_modules=list(model.lora_target_modules), bias="none",
                           task_type=model.lora_task_type, use_rslora=model.use_rslora,
                           use_dora=model.use_dora, modules_to_save=model.lora_modules_to_save,
                           **extra)


def wrap_with_lora(policy, model: ModelSection, peft_config=None):
    """The policy with LoRA adapters (peft_config, else one built from the run's `model`
    section); only adapters train."""
    peft = _peft()
    if is_peft_model(policy):
        return policy                                   # already wrapped by the caller
    config = peft_config if peft_config is not None else lora_config(model)
    names = {name.rsplit(".", 1)[-1] for name, _ in policy.named_modules()}
    targets = config.target_modules
    if isinstance(targets, (list, set, tuple)):
        missing = sorted(set(targets) - names)
        if len(missing) == len(set(targets)):
            raise ValueError(f"lora_target_modules {sorted(targets)} match no module of "
                             f"{type(policy).__name__}; its linear layers include "
                             f"{sorted(n for n in names if n.endswith('proj'))[:12]}")
    if model.gradient_checkpointing:
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


def save_adapter(policy, folder: Path) -> int:
    """Write the policy's active LoRA adapter to `folder` in peft's format, which vLLM's LoRA
    loader reads: adapter_model.safetensors (peft's names, e.g. base_model.model.model.layers.0.
    self_attn.q_proj.lora_A.weight; A: (r, in), B: (out, r)) and adapter_config.json. The bytes of
    its tensors."""
    peft = _peft()
    from safetensors.torch import save_file
    name = policy.active_adapters[0]
    state = {key: t.detach().contiguous().cpu()
             for key, t in peft.get_peft_model_state_dict(policy, adapter_name=name).items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "adapter_model.safetensors"))
    policy.peft_config[name].save_pretrained(str(folder))   # adapter_config.json
    return sum(t.numel() * t.element_size() for t in state.values())
