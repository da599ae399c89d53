"""Scoring completions: each token's log-probability (and entropy) under a model, the passes the
trainer runs on the kept completions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cppo.models.compiled import CompileSettings, compiled_model
from cppo.models.head import chunked_logprobs_and_entropy
from cppo.models.lean import lean_forward_for
from cppo.sampling.logits import replay_logits, seen_before
from cppo.sampling.settings import SamplingSettings

LOGITS_CHUNK = 1024   # half-precision rows upcast to float32 at a time
# above this many logits (tokens x vocabulary) in a micro-batch, the lean packed scoring pass
# computes log-probs and entropies over the head in chunks of tokens (cppo.models.head): the full
# logits tensor is never built, forward or backward
HEAD_CHUNK_ABOVE = 1 << 26


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log_softmax(logits)[..., index] (shape of index) without materialising the full
    log-probs: logits (..., V), e.g. (N, T, V) or packed (M, V)."""
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    flat, flat_index = logits.reshape(-1, logits.shape[-1]), index.reshape(-1, 1)
    rows = [F.log_softmax(lg.float(), -1).gather(-1, ix).squeeze(-1)
            for lg, ix in zip(flat.split(LOGITS_CHUNK), flat_index.split(LOGITS_CHUNK))]
    return torch.cat(rows).view(index.shape) if rows else flat.new_zeros(index.shape, dtype=torch.float32)


@dataclass(frozen=True)
class ForwardSettings:
    """How completion_logprobs runs the model. batch_size: rows per forward (None: all at once).
    lean: use cppo.models.lean's forward when it supports the model: each distinct prompt of a
    micro-batch is run once, and with `packed` (the default) every pass but attention, the head
    and the log-softmax run on real tokens only; packed=False: the padded layout (for
    comparison). matmul_dtype (lean forward only): the dtype of the decoder layers' Linear
    matmuls (cppo.models.lean). compile: a cppo.models.compiled.CompileSettings (torch_compile)
    or None. chunk_head (use_liger_kernel): the head in chunks of tokens at every size on the
    lean packed pass, never the full logits. replay: the sampler's transforms (SamplingSettings:
    repetition penalty, temperature, top-k, top-p, min-p; cppo.sampling.logits.replay_logits)
    applied to every position's logits, so the log-probs are of the distribution the tokens were
    drawn from (it needs the full logits: no chunked head); None: the full softmax at the
    temperature (TRL's)."""

    batch_size: int | None = None
    lean: bool = True
    packed: bool = True
    matmul_dtype: torch.dtype | None = None
    compile: CompileSettings | None = None
    chunk_head: bool = False
    replay: SamplingSettings | None = None


def completion_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, *, temperature: float = 1.0,
                        forward: ForwardSettings = ForwardSettings(),
                        entropies: list | None = None, entropy_grad: bool = False,
                        aux_losses: list | None = None) -> Tensor:
    """Per-token log-probs (N, T) of completion tokens given their prompts (N, Lp), of logits
    divided by the sampling temperature (as TRL), with grad if enabled; `forward` says how the
    model runs (ForwardSettings). On the lean packed pass, log-probs and entropies are 0 where
    completion_mask (N, T) is 0, which must be 1 on a prefix of each row. Without the lean
    forward, the model's own forward on padded rows (log-probs and entropies are 0 at padding
    there too). entropies: each chunk's entropies (rows, T) are appended to it; entropy_grad:
    they carry the gradient (an entropy bonus in the loss), else they are detached. aux_losses:
    mixture-of-experts models (the model's own forward) are asked for their router logits and
    each chunk's load-balancing aux_loss (a scalar) is appended to it."""
    lean, packed, matmul_dtype, chunk_head = (forward.lean, forward.packed, forward.matmul_dtype,
                                              forward.chunk_head)
    replay = forward.replay
    if replay is not None and chunk_head:
        raise ValueError("replaying the sampler's transforms needs each position's full logits, "
                         "which the chunked head (chunk_head, use_liger_kernel) never forms")
    entropy_of = differentiable_entropy if entropy_grad else (lambda lg: token_entropy(lg.detach()))
    n, out = completion_ids.shape[0], []
    step = n if forward.batch_size is None else forward.batch_size
    lean_forward = lean_forward_for(model)[0] if lean and aux_losses is None else None
    own_forward = model
    if lean_forward is not None:
        lean_forward.compile_layers(forward.compile)   # None: the eager layers
    elif forward.compile is not None:
        own_forward = compiled_model(model, forward.compile)
    if matmul_dtype is not None and lean_forward is None:
        raise ValueError(f"matmul_dtype {matmul_dtype} needs the lean forward, which does not support "
                         f"this model: {lean_forward_for(model)[1] if lean else 'lean=False'}")
    for s in range(0, n, step):
        rows = slice(s, s + step)
        ids = completion_ids[rows]
        if lean_forward is not None:
            prompts, question = torch.unique(torch.cat([prompt_ids[rows], prompt_mask[rows]], dim=1),
                                             dim=0, return_inverse=True)
            width = prompt_ids.shape[1]
            real = completion_mask[rows].bool()
            if packed and replay is None and \
                    (chunk_head or int(real.sum()) * _vocab_size(model) > HEAD_CHUNK_ABOVE):
                logps, entropy = _chunked_head(lean_forward, prompts, width, question, ids, real,
                                               temperature, matmul_dtype, entropy_grad)
                out.append(logps)
                if entropies is not None:
                    entropies.append(entropy)
                continue
            logits = lean_forward.completion_logits(prompts[:, :width], prompts[:, width:], question,
                                                    ids, completion_mask[rows], packed=packed,
                                                    matmul_dtype=matmul_dtype)
        else:
            logits = _model_logits(own_forward, prompt_ids[rows], prompt_mask[rows], ids,
                                   completion_mask[rows], aux_losses)
        if replay is not None:   # entropies stay the full softmax's at the temperature (TRL's)
            drawn = _replayed(logits, replay, prompt_ids[rows], prompt_mask[rows], ids,
                              completion_mask[rows], packed=lean_forward is not None and packed)
        if temperature != 1.0:
            logits = logits / temperature
        if lean_forward is not None and packed:   # logits (M, V) of the real tokens
            real = completion_mask[rows].bool()
            logps = selective_log_softmax(logits if replay is None else drawn, ids[real])
            out.append(logps.new_zeros(ids.shape).masked_scatter(real, logps))
            if entropies is not None:
                entropy = entropy_of(logits)
                entropies.append(entropy.new_zeros(ids.shape).masked_scatter(real, entropy))
            continue
        real = completion_mask[rows].to(logits.dtype)   # 0 at padding, as on the packed path
        out.append(selective_log_softmax(logits if replay is None else drawn, ids) * real)
        if entropies is not None:   # TRL's entropy metric: (rows, T) of the same logits
            entropies.append(entropy_of(logits) * real)
    return torch.cat(out)


def _replayed(logits: Tensor, replay: SamplingSettings, prompt_ids: Tensor, prompt_mask: Tensor,
              ids: Tensor, mask: Tensor, *, packed: bool) -> Tensor:
    """The sampler's logits, replayed (cppo.sampling.logits.replay_logits), for logits (M, V) of
    the real tokens (packed) or (N, T, V) of every position of ids, mask (N, T)."""
    vocab = logits.shape[-1]
    seen = None
    if replay.repetition_penalty != 1.0:
        seen = seen_before(prompt_ids, prompt_mask, ids, mask, vocab)
        seen = seen[mask.bool()] if packed else seen.view(-1, vocab)
    tokens = ids[mask.bool()] if packed else ids.reshape(-1)
    flat = replay_logits(logits.reshape(-1, vocab), tokens.clamp(0, vocab - 1), seen=seen,
                         **replay.kwargs())
    return flat.view(logits.shape)


def _model_logits(model, prompt_ids: Tensor, prompt_mask: Tensor, ids: Tensor,
                  completion_mask: Tensor, aux_losses: list | None) -> Tensor:
    """(N, T, V) logits of the completion tokens (N, T) through the model's own forward on padded
    rows; with `aux_losses`, the router's load-balancing aux_loss is appended to it."""
    full = torch.cat([prompt_ids, ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    router = {} if aux_losses is None else {"output_router_logits": True}
    output = model(input_ids=full, attention_mask=mask, position_ids=positions, use_cache=False,
                   logits_to_keep=ids.shape[1] + 1, **router)
    if aux_losses is not None:
        aux_losses.append(output.aux_loss)
    return output.logits[:, :-1]


def _chunked_head(lean_forward, prompts: Tensor, width: int, question: Tensor, ids: Tensor,
                  real: Tensor, temperature: float, matmul_dtype: torch.dtype | None,
                  entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies (N, T), 0 where `real` is not, through the packed lean forward
    with the head in chunks of tokens (cppo.models.head): prompts (Q, 2 Lp) the distinct
    prompts' ids and masks side by side (Lp = width), question (N,) each row's prompt."""
    hidden, weight, bias = lean_forward.completion_logits(
        prompts[:, :width], prompts[:, width:], question, ids, real, packed=True,
        head=False, matmul_dtype=matmul_dtype)
    logps, entropy = chunked_logprobs_and_entropy(hidden, weight, bias, ids[real], temperature)
    entropy = entropy if entropy_grad else entropy.detach()
    return (logps.new_zeros(ids.shape).masked_scatter(real, logps),
            entropy.new_zeros(ids.shape).masked_scatter(real, entropy))


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def differentiable_entropy(logits: Tensor) -> Tensor:
    """Entropy (...) of the distributions of logits (..., V), with its gradient, in float32."""
    lg = logits.float()
    return torch.logsumexp(lg, -1) - (lg.softmax(-1) * lg).sum(-1)


@torch.no_grad()
def token_entropy(logits: Tensor) -> Tensor:
    """Entropy (...) of the distributions of logits (..., V), e.g. (N, T, V) or packed (M, V),
    LOGITS_CHUNK rows at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = []
    for lg in flat.split(LOGITS_CHUNK):
        lg = lg.float()
        rows.append(torch.logsumexp(lg, -1) - (lg.softmax(-1) * lg).sum(-1))
    return torch.cat(rows).view(logits.shape[:-1]) if rows else flat.new_zeros(logits.shape[:-1], dtype=torch.float32)
