"""Load the policy: 'embedded' (shipped in the package) or any transformers causal LM."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel

EMBEDDED_DIR = Path(__file__).parent / "embedded"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_model_config(vocab_size: int, *, bos_token_id: int, eos_token_id: int, pad_token_id: int,
                      hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                      intermediate_size: int = 512, max_positions: int = 64) -> LlamaConfig:
    """The embedded architecture: a ~0.8M-parameter Llama with tied embeddings."""
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
    return name


def load_tokenizer(name: str = "embedded"):
    tok = AutoTokenizer.from_pretrained(resolve_model_path(name))
    if tok.pad_token is None:  # many causal LMs ship without one; generation needs it
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(name: str = "embedded", *, torch_dtype: str = "float32",
               attn_implementation: str | None = None) -> PreTrainedModel:
    """Any AutoModelForCausalLM; weights only through safetensors."""
    if attn_implementation == "eca":
        from cppo.eca import register_eca_attention
        register_eca_attention()
    kwargs = {"use_safetensors": True}
    if torch_dtype != "auto":
        kwargs["dtype"] = _DTYPES[torch_dtype]
    else:
        kwargs["dtype"] = "auto"
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    path = resolve_model_path(name)
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        raise OSError(f"could not load model '{name}': {err}. Give 'embedded', a local directory "
                      f"with config.json and *.safetensors, or a hub id (needs network).") from err
