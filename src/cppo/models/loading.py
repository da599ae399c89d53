"""Load the policy: 'embedded' (shipped in the package) or any transformers causal LM."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel
from cppo.errors import ModelLoadError



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


def load_tokenizer(name: str = "embedded"):
    path = resolve_model_path(name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
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
               attn_implementation: str | None = None) -> PreTrainedModel:
    """Any AutoModelForCausalLM; weights only through safetensors."""
    if attn_implementation == "eca":
        from cppo.eca import register_eca_attention
        register_eca_attention()
    kwargs = {"use_safetensors": True}
    if torch_dtype != "auto":
        kwargs["dtype"] = TORCH_DTYPES[torch_dtype]
    else:
        kwargs["dtype"] = "auto"
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    path = resolve_model_path(name)
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:   # ValueError: e.g. an unknown attn_implementation
        raise ModelLoadError(f"could not load model '{name}': {err}. Give 'embedded', a local "
                             f"directory with config.json and *.safetensors, or a hub id (needs "
                             f"network).") from err


def load_policy(model, processing_class, args, device, *, lora: bool, peft_config=None):
    """The policy and its tokenizer: `model` a name (None: the config's) or a loaded model, the
    tokenizer the processing_class or the model's; on `device`, gradient checkpointing and LoRA
    as the config says, in training mode."""
    name = model if isinstance(model, str) else (args.model if model is None else None)
    policy = model if name is None else load_model(
        name, torch_dtype=args.torch_dtype, attn_implementation=args.attn_implementation)
    tokenizer = ready_for_generation(processing_class or load_tokenizer(
        name or getattr(policy.config, "_name_or_path", None) or args.model))
    policy.to(device)
    if args.gradient_checkpointing:
        # the sampler passes use_cache explicitly, so generation keeps its KV cache
        kwargs = checkpointing_kwargs(args)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if kwargs.get("use_reentrant"):   # reentrant checkpoints pass gradients only to inputs
            policy.enable_input_require_grads()   # that need them (as TRL does)
    apply_liger_kernels(policy, args, device)
    if lora:
        from cppo.models.lora import wrap_with_lora
        policy = wrap_with_lora(policy, args, peft_config)
    policy.train()
    return policy, tokenizer


def checkpointing_kwargs(args) -> dict:
    """gradient_checkpointing_enable's keyword arguments: gradient_checkpointing_kwargs, or
    (None) non-reentrant checkpoints."""
    kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
    return dict(kwargs) if kwargs is not None else {"use_reentrant": False}


def apply_liger_kernels(policy, args, device) -> bool:
    """use_liger_kernel on CUDA with liger-kernel installed: liger's kernels patched into the
    model (they run where its own forward runs), with liger_kernel_config as arguments. True when
    applied. The chunked head (cppo.models.head) is cppo's part and needs nothing here."""
    if not getattr(args, "use_liger_kernel", False) or torch.device(device).type != "cuda":
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        import warnings
        warnings.warn("use_liger_kernel: liger-kernel is not installed, so only cppo's chunked "
                      "head applies; `pip install liger-kernel` for liger's kernels", stacklevel=2)
        return False
    _apply_liger_kernel_to_instance(model=policy, **(args.liger_kernel_config or {}))
    return True


def frozen_copy(model):
    """A copy of the model in eval mode without gradients (the reference policy)."""
    import copy
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference
