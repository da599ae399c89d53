"""transformers integration: `attn_implementation="eca"` for Llama/Qwen2-style decoder models.

register_eca_attention() adds "eca" to transformers' AttentionInterface, and to its
AttentionMaskInterface with the sdpa mask builder: a purely causal batch then arrives with
attention_mask=None and runs through eca_attention; a padded batch arrives with a boolean mask.

Where ECA would not be exact, the call goes to transformers' own sdpa attention with the same
arguments (exactness first), with a one-time warning naming the reason:
- an attention mask is present (padding, packed sequences, sliding windows),
- the query is shorter than the keys (generation with a KV cache),
- dropout > 0 (sdpa draws its own dropout mask), or extra terms (softcap, position bias).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .attention import ATTENTION_CUTOFF, eca_attention

NAME = "eca"


@dataclass
class HFOptions:
    """Scheme and cut-off used by the registered attention function (set by register_eca_attention)."""

    scheme: str = "eca"
    cutoff: int = ATTENTION_CUTOFF


options = HFOptions()
_warned: set[str] = set()


def _fallback(reason: str, module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"eca attention: {reason}; using sdpa for these calls (exact, no scheme)", stacklevel=3)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def eca_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (B, H, Lq, d), key/value (B, Hkv, Lk, d) -> ((B, Lq, H, d), None)."""
    call = dict(dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    reason = None
    if attention_mask is not None:
        reason = "an attention mask (padding or packing) is present"
    elif query.shape[2] != key.shape[2]:
        reason = "query and key lengths differ (KV cache)"
    elif dropout:
        reason = f"dropout={dropout} is not supported"
    elif kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        reason = "softcap / position bias is not supported"
    elif not causal:
        reason = "the module is not causal"
    if reason is not None:
        return _fallback(reason, module, query, key, value, attention_mask, **call)
    groups = query.shape[1] // key.shape[1]
    if groups * key.shape[1] != query.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of key/value heads {key.shape[1]}")
    if groups > 1:  # GQA: each key/value head serves `groups` query heads; autograd sums the grads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = eca_attention(query, key, value, scale=scaling, scheme=options.scheme, cutoff=options.cutoff)
    return out.transpose(1, 2).contiguous(), None


def register_eca_attention(scheme: str = "eca", cutoff: int = ATTENTION_CUTOFF) -> None:
    """Make `attn_implementation="eca"` loadable in transformers; safe to call again (updates options)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from .scheme import load_scheme

    load_scheme(scheme)  # fail here, with the scheme's name, rather than inside a forward pass
    options.scheme, options.cutoff = scheme, int(cutoff)
    AttentionInterface.register(NAME, eca_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
