"""The logit transforms of sampling, as pure tensor functions, in transformers' order.

`model.generate` (TRL's transformers path) applies the repetition penalty to the raw logits, then
divides by the temperature, then keeps the top-k, the top-p nucleus and the min-p set
(RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopK/TopP/MinPLogitsWarper):
`sampling_logits` does the same, so cppo's sampler (and any sampler built on it, e.g. a
speculative one: draft and target distributions alike) draws from TRL's distribution.

The repetition penalty looks at every token already in the sequence: the prompt's and the
completion's so far (transformers penalises its whole `input_ids`; vLLM its prompt and output
tokens). Padding is not a token of the sequence here (transformers would also penalise the pad
token of a left-padded batch).
"""

from __future__ import annotations

import torch
from torch import Tensor


def seen_tokens(ids: Tensor, mask: Tensor, vocab_size: int) -> Tensor:
    """(N, V) bool: True for each token id in row n of ids (N, L) where mask (N, L) is 1; ids
    outside the vocabulary (an embedding larger than the head) are left out."""
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    index = torch.where(mask.bool() & (ids < vocab_size) & (ids >= 0), ids, vocab_size)
    return seen.scatter_(1, index, True)[:, :vocab_size]


def mark_seen(seen: Tensor, tokens: Tensor) -> Tensor:
    """seen (N, V) with tokens (N,) added, in place; returns seen."""
    return seen.scatter_(1, tokens[:, None], True)


def penalize_repetition(logits: Tensor, seen: Tensor | None, penalty: float) -> Tensor:
    """CTRL's repetition penalty on logits (N, V): a seen token's logit is divided by penalty
    when positive, multiplied by it otherwise (penalty > 1 discourages repeats; 1: off)."""
    if penalty == 1.0 or seen is None:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0,
                  min_p: float | None = None) -> Tensor:
    """Mask logits (N, V) outside the top-k set, outside the top-p nucleus (the smallest set
    whose mass reaches top_p) and below min_p x the most likely token's probability with -inf,
    in that order (0 / 1.0 / None or 0: off)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        drop_orig = torch.zeros_like(drop).scatter(-1, order, drop)
        logits = logits.masked_fill(drop_orig, float("-inf"))
    if min_p:
        probs = logits.softmax(-1)
        drop = probs < min_p * probs.amax(-1, keepdim=True)   # the top token always stays
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float | None = None,
                    repetition_penalty: float = 1.0, seen: Tensor | None = None) -> Tensor:
    """The logits (N, V) of the distribution a token is drawn from: repetition penalty over
    `seen` (N, V), temperature, top-k, top-p, min-p, in float32; with every transform off, the
    input itself (in its own dtype: no row-sized copy is made for nothing)."""
    if (repetition_penalty == 1.0 or seen is None) and temperature == 1.0 and not top_k \
            and top_p >= 1.0 and not min_p:
        return logits
    logits = penalize_repetition(logits.float(), seen, repetition_penalty)
    return filter_logits(logits if temperature == 1.0 else logits / temperature, top_k, top_p, min_p)


def replay_logits(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, min_p: float | None = None,
                  repetition_penalty: float = 1.0, seen: Tensor | None = None) -> Tensor:
    """The logits (M, V) of the distribution each of M tokens was drawn from, recomputed from
    the model's logits (M, V) as `sampling_logits` transforms them (penalty over `seen` (M, V),
    temperature, then top-k, top-p and min-p's kept set), with the gradient of the kept logits,
    in float32 (float64 stays float64).
    The kept set is found without gradient (it is piecewise constant in the logits), and each
    drawn token `tokens` (M,) stays in its row's set: a set recomputed from logits that moved
    since sampling may have lost it, and a drawn token must keep a finite log-prob."""
    wide = logits if logits.dtype == torch.float64 else logits.float()   # float32, as sampled
    scaled = penalize_repetition(wide, seen, repetition_penalty)
    scaled = scaled if temperature == 1.0 else scaled / temperature
    with torch.no_grad():
        dropped = torch.isneginf(filter_logits(scaled.detach(), top_k, top_p, min_p))
        dropped.scatter_(1, tokens[:, None], False)
    return scaled.masked_fill(dropped, float("-inf"))


def seen_before(prompt_ids: Tensor, prompt_mask: Tensor, ids: Tensor, mask: Tensor,
                vocab_size: int) -> Tensor:
    """(N, T, V) bool: the tokens the repetition penalty saw before each completion position: the
    prompt's (N, Lp; mask 1) and the completion's earlier ones (ids, mask (N, T))."""
    before = seen_tokens(prompt_ids, prompt_mask, vocab_size)[:, None].repeat(1, ids.shape[1], 1)
    drawn = seen_tokens(ids.reshape(-1, 1), mask.reshape(-1, 1), vocab_size).view(*ids.shape, -1)
    earlier = drawn.to(torch.uint8).cummax(1).values.bool()          # tokens at <= t
    before[:, 1:] |= earlier[:, :-1]
    return before


def greedy_logits(logits: Tensor, *, repetition_penalty: float = 1.0,
                  seen: Tensor | None = None) -> Tensor:
    """The logits (N, V) greedy decoding takes the argmax of: transformers applies the
    repetition penalty (a logits processor) there too, the warpers not."""
    return penalize_repetition(logits, seen, repetition_penalty)


SAMPLING_BLOCK = 256   # vocabularies over 2 blocks are sampled block first, then token


def sample_categorical(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw (N,) from each row of probs (N, V) (non-negative weights, rows need not sum to 1)
    by inverting its cumulative distribution.

    One uniform number per row, against V per row for torch.multinomial (which runs an
    exponential race): far less work for large vocabularies. A large vocabulary is inverted in
    two levels, over the sums of blocks of SAMPLING_BLOCK tokens and then within the chosen
    block, so no cumulative sum runs over the whole row. Tokens of weight 0 are never drawn."""
    n, vocab = probs.shape
    blocked = vocab > 2 * SAMPLING_BLOCK
    if blocked:
        whole = vocab - vocab % SAMPLING_BLOCK              # the last block may be shorter
        sums = probs[:, :whole].view(n, -1, SAMPLING_BLOCK).sum(-1)
        if whole < vocab:
            sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], dim=1)
        cdf = sums.cumsum(-1)                                           # (N, blocks)
    else:
        cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("cannot sample: a row of the sampling distribution is not finite or is "
                         "all zero (the model's logits hold NaN or inf)")
    device = generator.device if generator is not None else probs.device
    u = torch.rand(n, 1, generator=generator, device=device).to(probs.device) * total
    # u < total, so the first entry of cdf above u has nonzero weight
    index = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)
    if not blocked:
        return index.squeeze(-1)
    before = torch.where(index > 0, cdf.gather(1, (index - 1).clamp(min=0)), 0.0)
    columns = index * SAMPLING_BLOCK + torch.arange(SAMPLING_BLOCK, device=probs.device)
    within = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    within = within.cumsum(-1)                                          # (N, block)
    # the mass left inside the block, kept below the block's own (rounded) total
    u = torch.minimum(u - before, torch.nextafter(within[:, -1:], torch.zeros_like(total)))
    token = torch.searchsorted(within, u, right=True).clamp_(max=SAMPLING_BLOCK - 1)
    return (index * SAMPLING_BLOCK + token).squeeze(-1)


def sample_logits(logits: Tensor, generator: torch.Generator | None = None, *,
                  out: Tensor | None = None, logprobs: bool = True) -> tuple[Tensor, Tensor | None]:
    """One draw (N,) from softmax(logits) for logits (N, V) (any float dtype; -inf: never drawn)
    and the draws' log-probs (N,), with no normalised copy of the row: the weights
    exp(logits - max), in float32, are sampled as they are, and log p = log(weight) - log(sum of
    the weights). out (N, V), float32: where the weights are computed (a buffer reused from step
    to step, so no new row-sized tensor is allocated: at a vocabulary of 152k that allocation
    costs more than the arithmetic); None: a new tensor. logprobs=False: None for the
    log-probs, which are then not computed."""
    weights = logits.to(torch.float32, copy=True) if out is None else out.copy_(logits)
    weights.sub_(weights.amax(-1, keepdim=True)).exp_()
    tokens = sample_categorical(weights, generator)
    if not logprobs:
        return tokens, None
    drawn = weights.gather(1, tokens[:, None]).log_() - weights.sum(-1, keepdim=True).log_()
    return tokens, drawn.squeeze(-1)
