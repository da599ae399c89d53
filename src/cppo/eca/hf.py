"""transformers integration: `attn_implementation="eca"` for Llama/Qwen2-style decoder models.

register_eca_attention() adds "eca" to transformers' AttentionInterface, and to its
AttentionMaskInterface with the sdpa mask builder: a purely causal batch then arrives with
attention_mask=None and runs through eca_attention; a padded batch arrives with a boolean mask.
A padded batch whose mask is causal with one contiguous run of real tokens per row (left and/or
right padding, as in training batches) runs each row's run through eca_attention; the query rows
outside the run (padding: their outputs feed nothing real) go through torch's sdpa with their mask.

Where ECA would not be exact, the call goes to transformers' own sdpa attention with the same
arguments (exactness first), with a one-time warning naming the reason:
- any other attention mask (packed sequences, sliding windows, a padding hole inside a row),
- the query is shorter than the keys (generation with a KV cache),
- dropout > 0 (sdpa draws its own dropout mask), or extra terms (softcap, position bias).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .attention import ATTENTION_CUTOFF, check_cutoff, eca_attention

NAME = "eca"


@dataclass
class HFOptions:
    """Scheme and cut-off used by the registered attention function (set by register_eca_attention)."""

    scheme: str = "eca"
    cutoff: int | tuple[int, int] = ATTENTION_CUTOFF


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
    runs = None if attention_mask is None else padding_runs(attention_mask, query.shape[2], key.shape[2])
    reason = None
    if attention_mask is not None and runs is None:
        reason = "an attention mask other than causal + padding (packing, windows) is present"
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
    run = dict(scale=scaling, scheme=options.scheme, cutoff=options.cutoff)
    if runs is None:
        out = eca_attention(query, key, value, **run)
    else:
        out = torch.cat([_padded_row(query[b : b + 1], key[b : b + 1], value[b : b + 1], attention_mask[b : b + 1],
                                     start, stop, run) for b, (start, stop) in enumerate(runs)])
    return out.transpose(1, 2).contiguous(), None


def padding_runs(mask: torch.Tensor, query_length: int, key_length: int) -> list[tuple[int, int]] | None:
    """Per row, the run [start, stop) of real tokens when `mask` (B, 1, L, L) bool is exactly
    causal AND (key in its row's run); None for any other mask."""
    if (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or query_length != key_length
            or mask.shape[-2:] != (query_length, key_length)):
        return None
    valid = mask[:, 0, -1, :]  # the last query sees every real key
    causal = torch.ones(query_length, key_length, dtype=torch.bool, device=mask.device).tril_()
    if not torch.equal(mask[:, 0], causal & valid[:, None, :]):
        return None
    runs = []
    for row in valid:
        where = row.nonzero().flatten()
        if len(where) == 0 or int(where[-1]) - int(where[0]) + 1 != len(where):
            return None  # an empty row, or a hole inside the run
        runs.append((int(where[0]), int(where[-1]) + 1))
    return runs


def _padded_row(query, key, value, mask, start: int, stop: int, run: dict) -> torch.Tensor:
    """(1, H, L, d): eca_attention on the run of real tokens, sdpa (with the mask) on padding rows."""
    parts, length = [], query.shape[2]
    if start > 0:
        parts.append(_sdpa_rows(query, key, value, mask, 0, start, run["scale"]))
    parts.append(eca_attention(query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], **run))
    if stop < length:
        parts.append(_sdpa_rows(query, key, value, mask, stop, length, run["scale"]))
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def _sdpa_rows(query, key, value, mask, first: int, last: int, scale) -> torch.Tensor:
    rows = mask[:, :, first:last]
    out = torch.nn.functional.scaled_dot_product_attention(query[:, :, first:last], key, value, attn_mask=rows,
                                                           scale=scale)
    return torch.where(rows.any(dim=-1, keepdim=True), out, torch.zeros_like(out))  # rows that see no key: 0


def register_eca_attention(scheme: str | None = None, cutoff: int | tuple[int, int] | None = None) -> None:
    """Make `attn_implementation="eca"` loadable in transformers; safe to call again.

    scheme / cutoff: set the options the registered function uses (eca_attention's); None keeps
    the current value (at first "eca" and ATTENTION_CUTOFF), so loading a model does not undo them.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from .scheme import load_scheme

    if scheme is not None:
        load_scheme(scheme)  # fail here, with the scheme's name, rather than inside a forward pass
        options.scheme = scheme
    if cutoff is not None:
        check_cutoff(cutoff)
        options.cutoff = cutoff
    AttentionInterface.register(NAME, eca_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
