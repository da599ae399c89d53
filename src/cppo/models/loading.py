"""Load the policy: 'embedded' (shipped in the package) or any transformers causal LM."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel
from cppo.errors import ConfigError, ModelLoadError
from cppo.models.lora import check_lm_head_cast

if TYPE_CHECKING:
    from cppo.config.sections import ModelSection, PrecisionSection

PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
                  "model.ckpt")

EMBEDDED_DIR = Path(__file__).parent / "embedded"
# the dtype names a config may give, and their torch dtypes: the one table
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a config's dtype name (None stays None)."""
    return None if name is None else TORCH_DTYPES[name]


def tiny_model_config(vocab_size: int, *, bos_token_id: int, eos_token_id: int, pad_token_id: int,
                      hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                      intermediate_size: int = 512, max_positions: int = 64) -> LlamaConfig:
    """The embedded architecture: a 1.05M-parameter Llama with tied embeddings."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, rms_norm_eps=1e-5, rope_theta=10000.0)


def resolve_model_path(name: str) -> str:
    """'embedded' -> the shipped directory; anything else is passed to transformers as is."""
    if name == "embedded":
        if not (EMBEDDED_DIR / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"the embedded model is missing from {EMBEDDED_DIR}; reinstall cppo or run "
                f"`cppo pretrain --output_dir {EMBEDDED_DIR}`")
        return str(EMBEDDED_DIR)
    _check_local_path(name)
    return name


def _check_local_path(name: str) -> None:
    """A name that is a path must be a directory with safetensors weights: pickle files (.bin,
    .pt) can run code when loaded and are refused; a missing path is reported without asking the
    hub (which, offline, retries for a minute)."""
    path = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or path.exists()
    if not looks_local:
        return
    if not path.is_dir():
        raise ModelLoadError(f"could not load model '{name}': "
                             f"{'not a directory' if path.exists() else 'no such directory'}. "
                             f"Give 'embedded', a local directory with config.json and "
                             f"*.safetensors, or a hub id")
    if not any(path.glob("*.safetensors")) and not (path / "adapter_config.json").is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.name in PICKLE_WEIGHTS
                         or p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise ModelLoadError(
                f"could not load model '{name}': it holds only PyTorch pickle weights "
                f"({', '.join(pickles)}), which can run arbitrary code when loaded; cppo loads "
                f"weights only from safetensors. Convert them once in a trusted environment "
                f"(model.save_pretrained(dir, safe_serialization=True)) and point 'model' at that")


def load_tokenizer(name: str = "embedded", *, revision: str = "main",
                   trust_remote_code: bool = False):
    path = resolve_model_path(name)
    try:
        tok = AutoTokenizer.from_pretrained(path, revision=revision,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load the tokenizer of model '{name}': {err}. The model "
                             f"directory needs tokenizer files (tokenizer.json, "
                             f"tokenizer_config.json)") from err
    return ready_for_generation(tok)


def ready_for_generation(tokenizer):
    """Give the tokenizer a pad token (its EOS, where it ships none: many causal LMs) and pad on
    the left, as batched generation needs; returns it."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(name: str = "embedded", *, torch_dtype: str = "float32",
               attn_implementation: str | None = None, revision: str = "main",
               trust_remote_code: bool = False, quantization=None,
               device: torch.device | str | None = None) -> PreTrainedModel:
    """Any AutoModelForCausalLM; weights only through safetensors. `quantization`: a
    BitsAndBytesConfig (quantization_config), the model then loaded straight onto `device`."""
    if attn_implementation == "eca":
        from cppo.eca import register_eca_attention
        register_eca_attention()
    kwargs = {"use_safetensors": True, "revision": revision, "trust_remote_code": trust_remote_code}
    if torch_dtype != "auto":
        kwargs["dtype"] = TORCH_DTYPES[torch_dtype]
    else:
        kwargs["dtype"] = "auto"
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if quantization is not None:   # bitsandbytes quantises as it places the weights
        kwargs.update(quantization_config=quantization, device_map={"": str(device or "cpu")})
    path = resolve_model_path(name)
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:   # ValueError: e.g. an unknown attn_implementation
        raise ModelLoadError(f"could not load model '{name}': {err}. Give 'embedded', a local "
                             f"directory with config.json and *.safetensors, or a hub id (needs "
                             f"network).") from err


# --- quantised loading (TRL's load_in_4bit / load_in_8bit) ---------------------------------
QLORA_MISSING = ("needs bitsandbytes: pip install 'cppo[qlora]' (or set load_in_4bit and "
                 "load_in_8bit to false)")


def quantization_config(model: ModelSection):
    """A transformers BitsAndBytesConfig from TRL's fields of the run's `model` section, as
    trl.get_quantization_config maps them (4-bit computes in torch_dtype; 'auto' leaves
    bitsandbytes' default), or None when neither load_in_4bit nor load_in_8bit is set."""
    if not (model.load_in_4bit or model.load_in_8bit):
        return None
    field = "load_in_4bit" if model.load_in_4bit else "load_in_8bit"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"'{field}' is true, which {QLORA_MISSING} (import failed: {err})") from None
    from transformers import BitsAndBytesConfig
    if not model.load_in_4bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = None if model.torch_dtype == "auto" else model.torch_dtype
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_type=model.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=model.use_bnb_nested_quant,
                              bnb_4bit_quant_storage=model.bnb_4bit_quant_storage)


def keep_4bit_layers_trainable(model) -> int:
    """Stop bitsandbytes from repacking a 4-bit layer for its AVX512-BF16 CPU kernel: it does so
    on the first forward in eval mode without grad (sampling), and that kernel has no backward,
    so every later backward would pass no gradient through the layer to the adapters below it.
    Returns how many layers were told."""
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def _int8_scales(param: torch.Tensor, owner) -> torch.Tensor | None:
    """The row scales (out,) of a bitsandbytes 8-bit weight: on the parameter until the layer's
    first forward moves them to the layer's state; None for any other tensor."""
    if param.dtype != torch.int8:
        return None
    scales = getattr(param, "SCB", None)
    return scales if scales is not None else getattr(getattr(owner, "state", None), "SCB", None)


def dense_weight(param: torch.Tensor, owner=None) -> torch.Tensor:
    """A parameter as a plain float tensor: a bitsandbytes 4-bit (Params4bit) or 8-bit
    (Int8Params, `owner` the layer holding it) weight dequantised, (out, in); any other
    returned as it is."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        import bitsandbytes.functional as bnb_functional
        return bnb_functional.dequantize_4bit(param.data, state)
    scales = _int8_scales(param, owner)
    if scales is not None:
        return param.data.float() * (scales.float()[:, None] / 127.0)
    return param


def dense_dtype_and_shape(param: torch.Tensor, owner=None) -> tuple[torch.dtype, list[int]]:
    """The dtype and shape dense_weight(param, owner) has, without dequantising."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        return state.dtype, list(state.shape)
    if _int8_scales(param, owner) is not None:
        return torch.float32, list(param.shape)
    return param.dtype, list(param.shape)


# --- TRL's model switches ------------------------------------------------------------------
def disable_dropout(model) -> None:
    """Every dropout off, as trl.trainer.utils.disable_dropout_in_model (nn.Dropout p = 0, LoRA's
    included), and the attention dropout Llama-family attention modules keep as a number."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for config in {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
                   if c is not None and hasattr(c, "attention_dropout")}.values():
        config.attention_dropout = 0.0


class Float32Head(nn.Linear):
    """An LM head held and computed in float32, outside autocast (TRL's cast_lm_head_to_fp32):
    hidden states (..., d) in any dtype -> float32 logits (..., V)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(hidden.float(), self.weight.float(), bias)


def cast_lm_head_to_fp32(model) -> None:
    """TRL's cast_lm_head_to_fp32 on `model` (a transformers causal LM or a peft model around
    one): the head's weight becomes float32 and its logits float32; with tied embeddings the
    embedding's output keeps the model's dtype. A LoRA adapter on the head is refused, as in TRL."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    check_lm_head_cast(True, lora_on_head=hasattr(head, "lora_A"))
    if type(head) is not nn.Linear:
        raise ConfigError(f"'cast_lm_head_to_fp32' is true but lm_head is a {type(head).__name__}, "
                          f"not a Linear (lm_head in lora_modules_to_save?): leave lm_head out of "
                          f"lora_modules_to_save, or set cast_lm_head_to_fp32: false")
    original = head.weight.dtype
    head.__class__ = Float32Head   # same parameters (a tied embedding stays tied)
    head.float()
    embed = base.get_input_embeddings()
    if embed.weight is head.weight and original != torch.float32:
        embed.register_forward_hook(lambda module, inputs, output: output.to(original))


def load_policy(model, processing_class, settings: ModelSection, precision: PrecisionSection,
                device, *, chat_template_kwargs: dict | None, lora: bool, peft_config=None):
    """The policy and its tokenizer: `model` a name (None: settings.model) or a loaded model, the
    tokenizer the processing_class or the model's (chat_template_kwargs bound to its
    apply_chat_template); on `device`, gradient checkpointing, LoRA, quantisation, dropout and
    the float32 head as the run's `settings` say, liger's kernels and the checkpointing
    arguments as its `precision` says, in training mode."""
    name = model if isinstance(model, str) else (settings.model if model is None else None)
    quantised = (settings.load_in_4bit or settings.load_in_8bit) if name is not None else \
        getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if quantised and not lora:
        four_bit = settings.load_in_4bit or getattr(model, "is_loaded_in_4bit", False)
        field = "load_in_4bit" if four_bit else "load_in_8bit"
        raise ConfigError(f"'{field}' is true but no LoRA adapters train on the quantised base "
                          f"(its weights are frozen): set use_peft: true (QLoRA), or "
                          f"{field}: false")
    quantization = quantization_config(settings) if name is not None else None
    policy = model if name is None else load_model(
        name, torch_dtype=settings.torch_dtype, attn_implementation=settings.attn_implementation,
        revision=settings.model_revision, trust_remote_code=settings.trust_remote_code,
        quantization=quantization, device=device)
    tokenizer = ready_for_generation(processing_class or load_tokenizer(
        name or getattr(policy.config, "_name_or_path", None) or settings.model,
        revision=settings.model_revision if name else "main",
        trust_remote_code=settings.trust_remote_code))
    if not quantised:   # bitsandbytes placed a quantised base when it loaded it
        policy.to(device)
    keep_4bit_layers_trainable(policy)
    if settings.gradient_checkpointing:
        # the sampler passes use_cache explicitly, so generation keeps its KV cache
        kwargs = checkpointing_kwargs(precision.gradient_checkpointing_kwargs)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if kwargs.get("use_reentrant"):   # reentrant checkpoints pass gradients only to inputs
            policy.enable_input_require_grads()   # that need them (as TRL does)
    apply_liger_kernels(policy, precision, device)
    if lora:
        from cppo.models.lora import wrap_with_lora
        policy = wrap_with_lora(policy, settings, peft_config)
    if settings.disable_dropout:   # after LoRA, so that its dropout is off too (as in TRL)
        disable_dropout(policy)
    if settings.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(policy)
    policy.train()
    from cppo.models.tokenizer import with_chat_template_kwargs
    return policy, with_chat_template_kwargs(tokenizer, chat_template_kwargs)


def checkpointing_kwargs(gradient_checkpointing_kwargs: dict | None) -> dict:
    """gradient_checkpointing_enable's keyword arguments: gradient_checkpointing_kwargs, or
    (None) non-reentrant checkpoints."""
    if gradient_checkpointing_kwargs is None:
        return {"use_reentrant": False}
    return dict(gradient_checkpointing_kwargs)


def apply_liger_kernels(policy, precision: PrecisionSection, device) -> bool:
    """use_liger_kernel on CUDA with liger-kernel installed: liger's kernels patched into the
    model (they run where its own forward runs), with liger_kernel_config as arguments. True
    when applied. The chunked head (cppo.models.head) is cppo's part and needs nothing here."""
    if not precision.use_liger_kernel or torch.device(device).type != "cuda":
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        import warnings
        warnings.warn("use_liger_kernel: liger-kernel is not installed, so only cppo's chunked "
                      "head applies; `pip install liger-kernel` for liger's kernels", stacklevel=2)
        return False
    _apply_liger_kernel_to_instance(model=policy, **(precision.liger_kernel_config or {}))
    return True


def frozen_copy(model):
    """A copy of the model in eval mode without gradients (the reference policy)."""
    import copy
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference
