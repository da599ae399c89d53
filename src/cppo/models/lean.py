"""A lean forward pass for Llama-family causal LMs (Llama, Qwen2, Mistral), on the model's own weights.

transformers' forward builds masks, cache objects, rotary tables and output dataclasses on every
call; for a small model or a short decode step that Python work costs more than the arithmetic
(about 3.7 ms per decode call of the 1M-parameter embedded model on a 2-core CPU, against well
under 1 ms of compute). This module computes the same function with plain tensor ops:

    h = embed(ids); for each layer: h += o(attn(rope(q(norm(h))), rope(k(norm(h))), v(norm(h))))
                                    h += down(silu(gate(norm(h))) * up(norm(h)))
    logits = lm_head(norm(h))

reading the parameters from the transformers modules at call time, so gradients reach the model's
own parameters (the optimizer, checkpoints and distributed all-reduce are unchanged) and weight
updates are seen at once. It is exact up to float rounding (tests compare logits with the model's
forward, with and without padding and a KV cache).

`lean_forward_for(model)` returns a LeanForward or None with the reason: anything it does not
reproduce exactly (other architectures, LoRA/PEFT wrappers, quantised or non-Linear layers,
sliding windows, dynamic RoPE, attention implementations other than sdpa/eager, gradient
checkpointing, forward hooks on any module) goes through the model's own forward instead.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq does not depend on the length


@dataclass
class LayerWeights:
    input_norm: Tensor
    qkv: Tensor                  # (H*D + 2*H_kv*D, hidden): q, k, v projections stacked
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor              # (2*intermediate, hidden): gate and up projections stacked
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None


@dataclass
class Weights:
    embed: Tensor
    padding_idx: int | None      # the embedding's (its row gets no gradient, as in nn.Embedding)
    layers: list[LayerWeights]
    norm: Tensor
    head: Tensor
    head_bias: Tensor | None


@dataclass
class KVCache:
    """Per-layer keys and values (N, H_kv, capacity, D), filled up to `length`."""

    keys: list[Tensor]
    values: list[Tensor]
    length: int

    def repeat_interleave(self, times: int, capacity: int) -> "KVCache":
        """Each row repeated `times` times (row q -> rows q*times .. q*times+times-1), in buffers
        with room for `capacity` positions."""
        def grow(t: Tensor) -> Tensor:
            n, h, _, d = t.shape
            out = t.new_zeros((n * times, h, capacity, d))   # unfilled slots: masked zeros
            out[:, :, :self.length] = t[:, :, :self.length].repeat_interleave(times, 0)
            return out
        return KVCache([grow(k) for k in self.keys], [grow(v) for v in self.values], self.length)

    def select_rows(self, rows: Tensor) -> "KVCache":
        """The given rows (n,) of the batch (a row may repeat), in the same capacity."""
        return KVCache([k.index_select(0, rows) for k in self.keys],
                       [v.index_select(0, rows) for v in self.values], self.length)


def unsupported_reason(model) -> str | None:
    """Why the lean forward cannot reproduce `model` exactly, or None when it can."""
    return _architecture_reason(model) or _switch_reason(model, list(model.named_modules()))


def _architecture_reason(model) -> str | None:
    """What about the model's architecture the lean forward does not reproduce (fixed for a model)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    name = type(model).__name__
    if _fsdp(model):   # fully_shard renamed the class FSDP<Name>; its parameters are checked per call
        name = name.removeprefix("FSDP")
    if name not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        return f"wrapped or subclassed model ({type(model).__name__})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(config, "use_sliding_window", False) or (
            model_type == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rope_type {getattr(rotary, 'rope_type', None)!r}"
    for name, module in model.named_modules():
        if name.endswith(("_proj", "lm_head")) and type(module) is not nn.Linear:
            return f"{name} is a {type(module).__name__}, not a plain Linear (LoRA or quantised?)"
    return None


def _switch_reason(model, modules: list) -> str | None:
    """What, among the things that can change on a model after loading, the lean forward does
    not reproduce: forward hooks, gradient checkpointing, the attention implementation, dropout.
    `modules` is the model's named_modules() list."""
    if any(getattr(module, "gradient_checkpointing", False) for _, module in modules):
        return "gradient checkpointing is on"          # (it registers hooks of its own)
    sharded = _fsdp(model)
    if sharded and any(hasattr(w, "to_local") for w in (
            model.model.embed_tokens.weight, *(l.self_attn.q_proj.weight for l in model.model.layers))):
        return "parameters are sharded (FSDP); they are gathered for generation only"
    for name, module in modules:
        if sharded and _fsdp(module):   # FSDP's hooks: no-ops while the weights are gathered
            continue
        if module._forward_hooks or module._forward_pre_hooks:
            return f"module {name or '<model>'!r} has forward hooks (the lean forward would skip them)"
    config = model.config
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return f"attn_implementation {config._attn_implementation!r}"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout in training mode (the lean forward has no dropout)"
    return None


MATMUL_ATTENTION_MAX_SCORES = 8192   # query x key positions per head up to which attention
                                     # runs as two matmuls (_attend_matmul), not the fused kernel


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear; a weight in another dtype than x (a matmul dtype) gets x cast to it, and the
    result cast back to x's dtype. Half-precision matmuls on a CPU get their rows padded to a
    bucket (_bucketed_rows)."""
    if weight.dtype == x.dtype:
        return _bucketed_linear(x, weight, bias)
    return _bucketed_linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def _bucketed_rows(rows: int) -> int:
    """rows rounded up to a multiple of 2^(floor(log2 rows) - 3): at most an eighth more rows,
    and few distinct counts over a run."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def _bucketed_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear over x (..., K). On a CPU, oneDNN runs bfloat16/float16 matmuls and builds a
    kernel for every new row count (its cache keeps them by shape), which costs more than the
    matmul at these sizes, and packed passes and decode steps see a new row count nearly every
    call: the rows are padded with zeros to a bucket (_bucketed_rows) and the padding dropped
    from the result (zero rows add nothing to the weight's gradient)."""
    if x.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    padded = _bucketed_rows(rows)
    if padded == rows:
        return F.linear(x, weight, bias)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    return F.linear(flat, weight, bias)[:rows].view(*x.shape[:-1], weight.shape[0])


def _fsdp(module) -> bool:
    """True for a module that torch's fully_shard (FSDP2) manages."""
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lean_forward_for(model) -> tuple["LeanForward | None", str | None]:
    """(LeanForward, None) when the model is supported, else (None, reason). The architecture
    check runs once per model; the switches that can change later are checked on every call."""
    try:
        lean, reason = _CACHE[model]
    except (KeyError, TypeError):
        reason = _architecture_reason(model)
        lean = None if reason else LeanForward(model)
        try:
            _CACHE[model] = (lean, reason)
        except TypeError:
            pass
    if lean is not None:
        switch = _switch_reason(model, lean.modules)
        if switch is not None:
            return None, switch
    return lean, reason


class LeanForward:
    """The Llama-family forward on `model`'s live parameters. Not an nn.Module: it owns nothing."""

    def __init__(self, model) -> None:
        self.model = model
        self.modules = list(model.named_modules())   # for _switch_reason on every call
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = model.model.layers[0].self_attn.scaling
        self.rotary = model.model.rotary_emb
        self._frozen: Weights | None = None   # the sampling snapshot inside frozen()
        # the per-layer work of the training passes (completion_logits); compile_layers swaps in
        # compiled versions, the sampler's forward (__call__) keeps the eager ones
        self._layer_qkv, self._layer_finish = self._qkv_packed, self._finish
        self.compiled_with = None

    def compile_layers(self, settings) -> None:
        """torch.compile (cppo.models.compiled.CompileSettings) the per-layer work of the
        training passes: norms, q/k/v and RoPE, output projection and MLP; attention stays eager."""
        if settings == self.compiled_with:
            return
        from cppo.models.compiled import compile_fn
        self._layer_qkv = self._qkv_packed if settings is None else compile_fn(self._qkv_packed, settings)
        self._layer_finish = self._finish if settings is None else compile_fn(self._finish, settings)
        self.compiled_with = settings

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    # --- pieces ---------------------------------------------------------------------------------
    def _rope(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin (N, L, 1, D) for integer positions (N, L): the sin's first half
        negated, so that _rotate needs no rotate_half."""
        freqs = positions[..., None].float() * self.rotary.inv_freq.float()
        scaling = self.rotary.attention_scaling
        cos, sin = (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)
        return torch.cat([cos, cos], dim=-1)[:, :, None], torch.cat([-sin, sin], dim=-1)[:, :, None]

    def _rotate(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """RoPE on x (..., D): transformers' x * cos + rotate_half(x) * sin, where
        rotate_half(x) = cat(-x[D/2:], x[:D/2]) = roll(x, D/2) with the first half negated."""
        cos, signed_sin = rope
        return x * cos + x.roll(self.head_dim // 2, -1) * signed_sin

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        dtype = x.dtype                     # half precision: normalise in float32, as transformers
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)

    def _weights(self, dtype=None, matmul_dtype=None) -> "Weights":
        """The model's weights in the layout this forward uses: [q; k; v] and [gate; up] packed
        into one matrix each (one matmul instead of three and two). Built from the live
        parameters, so gradients flow back to them; `dtype` casts all (for a sampling snapshot),
        `matmul_dtype` only the decoder layers' Linear weights and biases (their matmuls then run
        in it; embedding, norms, attention and head stay in the parameters' dtype)."""
        def cast(t):
            return t if t is None or dtype is None else t.to(dtype)

        def cat(*tensors):
            return None if tensors[0] is None else cast(torch.cat(tensors))

        def matrix(t):   # a decoder Linear's weight or bias: in matmul_dtype if given
            return t if t is None or matmul_dtype is None else t.to(matmul_dtype)
        layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                input_norm=cast(layer.input_layernorm.weight),
                qkv=matrix(cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
                qkv_bias=matrix(cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
                o=matrix(cast(attn.o_proj.weight)), o_bias=matrix(cast(attn.o_proj.bias)),
                post_norm=cast(layer.post_attention_layernorm.weight),
                gate_up=matrix(cat(mlp.gate_proj.weight, mlp.up_proj.weight)),
                gate_up_bias=matrix(cat(mlp.gate_proj.bias, mlp.up_proj.bias)),
                down=matrix(cast(mlp.down_proj.weight)), down_bias=matrix(cast(mlp.down_proj.bias))))
        head = self.model.lm_head
        embed = self.model.model.embed_tokens
        return Weights(embed=cast(embed.weight), padding_idx=embed.padding_idx, layers=layers,
                       norm=cast(self.model.model.norm.weight), head=cast(head.weight),
                       head_bias=cast(head.bias))

    @contextmanager
    def frozen(self, dtype=None):
        """Within: a snapshot of the weights (no grad, packed once, cast to `dtype` if given) is
        used instead of the live parameters: for sampling, where weights do not change."""
        with torch.no_grad():
            self._frozen = self._weights(dtype)
        try:
            yield self
        finally:
            self._frozen = None

    def _current_weights(self, matmul_dtype=None) -> "Weights":
        if self._frozen is not None:
            return self._frozen
        return self._weights(matmul_dtype=matmul_dtype)

    def _qkv(self, w: "LayerWeights", h: Tensor, rope: tuple[Tensor, Tensor]):
        """Rotated queries (N, H, L, D), rotated keys and values (N, H_kv, L, D) of a layer."""
        n, length, _ = h.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = _linear(self._norm(h, w.input_norm), w.qkv, w.qkv_bias)
        qkv = qkv.view(n, length, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=2)
        q, k = self._rotate(qk, rope).split([heads, kv_heads], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """Attention (N, L, H*D) of q (N, H, L, D) over k, v (N, H_kv, S, D); allowed (N, 1, L, S).
        Short rows (L x S up to MATMUL_ATTENTION_MAX_SCORES) take two matmuls, longer ones the
        fused kernel."""
        if q.shape[2] * k.shape[2] <= MATMUL_ATTENTION_MAX_SCORES:
            return self._attend_matmul(q, k, v, allowed)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        return a.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def _attend_matmul(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """_attend as softmax(q k^T * scale + mask) v with the scores materialised, the softmax
        in float32. The H / H_kv query heads that share a key/value head are stacked as rows of
        one product, so keys and values are not repeated."""
        n, heads, length, dim = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        group = heads // kv_heads
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill_(~allowed, float("-inf"))                       # (N, 1, L, S)
        if group > 1:
            bias = bias[:, :, None].expand(n, 1, group, length, keys).reshape(n, 1, -1, keys)
        scores = torch.matmul(q.reshape(n, kv_heads, group * length, dim), k.transpose(2, 3))
        weights = (scores * self.scale + bias).softmax(-1, dtype=torch.float32).to(v.dtype)
        out = torch.matmul(weights, v).view(n, heads, length, dim)
        return out.transpose(1, 2).reshape(n, length, heads * dim)

    def _attend_bmm(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """_attend for one query position (L = 1) with an additive mask bias (N*H_kv, 1, S) made
        once per call: for decode steps two batched GEMMs beat the fused kernel's per-call set-up.
        With grouped-query attention the H / H_kv query heads that share a key/value head are the
        rows of one GEMM, so keys and values are read once, not repeated per query head."""
        n, heads, _, dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        scores = torch.baddbmm(bias, q.reshape(n * kv_heads, group, dim),
                               k.reshape(n * kv_heads, -1, dim).transpose(1, 2), alpha=self.scale)
        out = torch.bmm(scores.softmax(-1), v.reshape(n * kv_heads, -1, dim))
        return out.reshape(n, 1, heads * dim)

    def _finish(self, w: "LayerWeights", h: Tensor, attended: Tensor) -> Tensor:
        """The residual stream after a layer's output projection and MLP. With a matmul dtype
        (Linear weights in another dtype than h), the MLP's activation silu(gate) * up runs in
        it too, between its two matmuls, as autocast would run it; the stream stays in h's."""
        h = h + _linear(attended, w.o, w.o_bias)
        x = self._norm(h, w.post_norm)
        gate, up = _bucketed_linear(x.to(w.gate_up.dtype), w.gate_up, w.gate_up_bias).chunk(2, -1)
        return h + _linear(F.silu(gate) * up, w.down, w.down_bias).to(h.dtype)

    def _logits(self, weights: "Weights", h: Tensor) -> Tensor:
        return _bucketed_linear(self._norm(h, weights.norm), weights.head, weights.head_bias)

    @staticmethod
    def _allowed(key_mask: Tensor, query_positions: Tensor) -> Tensor:
        """(N, 1, L, S) bool: key j is visible to query i iff key_mask[n, j] and j <= query index
        i (a query with nothing visible, i.e. left padding, sees itself: finite and unused)."""
        keys = torch.arange(key_mask.shape[1], device=key_mask.device)
        allowed = (keys[None, :] <= query_positions[:, None])[None] & key_mask[:, None, :].bool()
        allowed |= keys[None, :] == query_positions[:, None]
        return allowed[:, None]

    # --- forward --------------------------------------------------------------------------------
    def __call__(self, ids: Tensor, positions: Tensor, key_mask: Tensor, *, cache: KVCache | None = None,
                 logits_to_keep: int = 0, new_cache_capacity: int | None = None) -> tuple[Tensor, KVCache | None]:
        """Logits (N, K, V) of the last K = logits_to_keep positions (0: all) of `ids` (N, L).

        positions (N, L): RoPE positions. key_mask (N, S) bool: which key slots may be attended
        (causal order is added here); S = L without a cache, else at least cache.length + L
        (slots past S count as visible). With `cache` (capacity C), the new
        keys/values are written at slots cache.length.. and S = C: the whole buffer is attended
        (zeros beyond the filled slots, masked), which keeps it contiguous and copy-free. With
        `new_cache_capacity`, a fresh (zeroed) cache of that capacity is filled and returned."""
        weights = self._current_weights()
        n, length = ids.shape
        h = F.embedding(ids, weights.embed, weights.padding_idx)
        rope = self._rope(positions, h.dtype)
        if cache is None and new_cache_capacity is not None:
            shape = (n, self.num_kv_heads, new_cache_capacity, self.head_dim)
            cache = KVCache([h.new_zeros(shape) for _ in weights.layers],
                            [h.new_zeros(shape) for _ in weights.layers], 0)
        past = cache.length if cache is not None else 0
        slots = past + torch.arange(length, device=ids.device)
        if cache is not None:   # slots after the new tokens are hidden by causality anyway
            capacity = cache.keys[0].shape[2]
            key_mask = F.pad(key_mask.bool(), (0, max(0, capacity - key_mask.shape[1])), value=True)
            key_mask = key_mask[:, :capacity]
        allowed = self._allowed(key_mask, slots)
        bias = None
        if length == 1 and not torch.is_grad_enabled():
            bias = h.new_zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
            bias = bias.expand(n, self.num_kv_heads, 1, -1).reshape(n * self.num_kv_heads, 1, -1)
        for index, w in enumerate(weights.layers):
            q, k, v = self._qkv(w, h, rope)
            if cache is not None:
                cache.keys[index][:, :, past:past + length] = k
                cache.values[index][:, :, past:past + length] = v
                k, v = cache.keys[index], cache.values[index]
            attended = self._attend(q, k, v, allowed) if bias is None else self._attend_bmm(q, k, v, bias)
            h = self._finish(w, h, attended)
        if cache is not None:
            cache.length = past + length
        return self._logits(weights, h[:, -logits_to_keep:] if logits_to_keep else h), cache

    def completion_logits(self, prompt_ids: Tensor, prompt_mask: Tensor, question: Tensor,
                          completion_ids: Tensor, completion_mask: Tensor, *, packed: bool = True,
                          head: bool = True, matmul_dtype: torch.dtype | None = None):
        """Logits predicting each real completion token, with each distinct prompt run once.

        prompt_ids, prompt_mask (Q, Lp): the distinct left-padded prompts; question (N,): the
        prompt of each completion; completion_ids, completion_mask (N, T), the mask 1 on a prefix
        of each row. The same function as one forward over [prompt, completion] per row, but the
        prompt's projections and MLPs are computed once per prompt, not once per completion.

        packed (default): padding-free. Embedding, norms, projections, MLPs and the head run on the
        real tokens only (the prompts' real tokens and each completion's real tokens but its last,
        which predicts nothing), as one flat batch; attention runs per part in padded layout, with
        q/k/v scattered there and its output gathered back. Returns (M, V) for the M real
        completion tokens (completion_mask's True entries, row-major).
        packed=False: the padded layout throughout; returns (N, T, V).
        head=False (packed only): the final-normed hidden states (M, d) instead of the logits,
        with the head's weight (V, d) and bias (V,) or None: for cppo.models.head's chunks.
        matmul_dtype: the decoder layers' Linear matmuls run in this dtype (e.g. bfloat16), their
        inputs cast to it and outputs back; the rest stays in the weights' dtype."""
        if not packed:
            return self._completion_logits_padded(prompt_ids, prompt_mask, question,
                                                  completion_ids, completion_mask, matmul_dtype)
        weights = self._current_weights(matmul_dtype)
        prompt_mask, completion_mask = prompt_mask.bool(), completion_mask.bool()
        (num_prompts, q_len), (n, t_len) = prompt_ids.shape, completion_ids.shape
        if num_prompts and not bool(prompt_mask[:, -1].all()):
            raise ValueError("completion_logits needs left-padded prompts of at least one token "
                             "(prompt_mask's last column all 1)")
        inputs = completion_mask[:, 1:]    # (N, T-1): token t is an input iff token t+1 is real
        ids, positions, prompt_slots, completion_slots = _packed_inputs(
            prompt_ids, prompt_mask, question, completion_ids, inputs)
        num_prompt_tokens = len(prompt_slots)
        h = F.embedding(ids, weights.embed, weights.padding_idx)          # (M_in, d)
        cos, signed_sin = self._rope(positions[None], h.dtype)
        rope = (cos[0], signed_sin[0])                                    # (M_in, 1, D)
        allowed_prompt = self._allowed(prompt_mask, torch.arange(q_len, device=h.device))
        allowed = self._allowed(torch.cat([prompt_mask[question], inputs], dim=1),
                                q_len + torch.arange(t_len - 1, device=h.device))
        for w in weights.layers:
            qkv = self._layer_qkv(w, h, rope)                            # (M_in, H + 2 H_kv, D)
            # split, not slices: its backward is one cat, a slice's a zero-filled copy of the whole
            qkv_prompt, qkv_completion = qkv.split([num_prompt_tokens, len(qkv) - num_prompt_tokens])
            qp, kp, vp = self._unpack(qkv_prompt, prompt_slots, num_prompts, q_len)
            attended = [self._attend(qp, kp, vp, allowed_prompt).flatten(0, 1)
                        .index_select(0, prompt_slots)]
            if len(completion_slots):
                qc, kc, vc = self._unpack(qkv_completion, completion_slots, n, t_len - 1)
                # index_select, not x[index]: its backward is an index add, far cheaper on a CPU
                # than indexing's accumulating index put
                attended.append(self._attend(
                    qc, torch.cat([kp.index_select(0, question), kc], dim=2),
                    torch.cat([vp.index_select(0, question), vc], dim=2),
                    allowed).flatten(0, 1).index_select(0, completion_slots))
            h = self._layer_finish(w, h, torch.cat(attended))
        h = h.index_select(0, _predicting_rows(prompt_mask, question, inputs)[completion_mask])
        if not head:
            return self._norm(h, weights.norm), weights.head, weights.head_bias
        return self._logits(weights, h)

    def _qkv_packed(self, w: "LayerWeights", h: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Rotated queries and keys, and values, of packed tokens h (M, d): (M, H + 2*H_kv, D)."""
        rotated = self.num_heads + self.num_kv_heads
        qkv = _linear(self._norm(h, w.input_norm), w.qkv, w.qkv_bias)
        qkv = qkv.view(h.shape[0], rotated + self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([rotated, self.num_kv_heads], dim=1)
        return torch.cat([self._rotate(qk, rope), v], dim=1)

    def _unpack(self, packed: Tensor, slots: Tensor, rows: int, length: int):
        """q (rows, H, L, D), k and v (rows, H_kv, L, D) in padded layout (zeros at padding) from
        packed (M, H + 2*H_kv, D) whose token i sits at flat slot slots[i] of (rows * L)."""
        padded = packed.new_zeros((rows * length, *packed.shape[1:])).index_copy(0, slots, packed)
        padded = padded.view(rows, length, -1, self.head_dim).transpose(1, 2)
        heads, kv_heads = self.num_heads, self.num_kv_heads
        return padded.split([heads, kv_heads, kv_heads], dim=1)

    def _completion_logits_padded(self, prompt_ids: Tensor, prompt_mask: Tensor, question: Tensor,
                                  completion_ids: Tensor, completion_mask: Tensor,
                                  matmul_dtype: torch.dtype | None = None) -> Tensor:
        """completion_logits in padded layout: logits (N, T, V), padding included. The per-token
        work runs on the prompt and completion tokens together, as one flat batch of Q*Lp + N*T
        tokens; only attention is done per part."""
        weights = self._current_weights(matmul_dtype)
        prompt_mask, completion_mask = prompt_mask.bool(), completion_mask.bool()
        (num_prompts, q_len), (n, t_len) = prompt_ids.shape, completion_ids.shape
        split = num_prompts * q_len
        prompt_positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        completion_positions = (prompt_positions[question, -1:] + 1
                                + torch.arange(t_len, device=completion_ids.device))
        ids = torch.cat([prompt_ids.reshape(-1), completion_ids.reshape(-1)])
        h = F.embedding(ids, weights.embed, weights.padding_idx)[None]          # (1, tokens, d)
        positions = torch.cat([prompt_positions.reshape(-1), completion_positions.reshape(-1)])
        rope = self._rope(positions[None], h.dtype)
        allowed_prompt = self._allowed(prompt_mask, torch.arange(q_len, device=h.device))
        allowed = self._allowed(torch.cat([prompt_mask[question], completion_mask], dim=1),
                                q_len + torch.arange(t_len, device=h.device))
        heads, dim = self.num_heads, self.head_dim
        for w in weights.layers:
            q, k, v = self._qkv(w, h, rope)                  # (1, H, tokens, D), (1, H_kv, tokens, D)
            qp, kp, vp = (t[0, :, :split].unflatten(1, (num_prompts, q_len)).transpose(0, 1)
                          for t in (q, k, v))                 # (Q, H, Lp, D)
            qc, kc, vc = (t[0, :, split:].unflatten(1, (n, t_len)).transpose(0, 1)
                          for t in (q, k, v))                 # (N, H, T, D)
            attended_prompt = self._attend(qp, kp, vp, allowed_prompt)              # (Q, Lp, H*D)
            attended = self._attend(qc, torch.cat([kp.index_select(0, question), kc], dim=2),
                                    torch.cat([vp.index_select(0, question), vc], dim=2),
                                    allowed)  # (N, T, H*D)
            h = self._finish(w, h, torch.cat([attended_prompt.reshape(-1, heads * dim),
                                              attended.reshape(-1, heads * dim)])[None])
        h_prompt, h_completion = h[0, :split].view(num_prompts, q_len, -1), h[0, split:].view(n, t_len, -1)
        # token 0 is predicted at the prompt's last position, token t at completion position t-1
        return self._logits(weights, torch.cat([h_prompt[question, -1:], h_completion[:, :-1]], dim=1))


def _packed_inputs(prompt_ids: Tensor, prompt_mask: Tensor, question: Tensor,
                   completion_ids: Tensor, inputs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The packed forward's tokens and RoPE positions (M_in,): the prompts' real tokens, then
    each completion's inputs (inputs (N, T-1): token t is one iff token t+1 is real), and the
    slots they came from in (Q*Lp) and (N*(T-1))."""
    t_len = completion_ids.shape[1]
    prompt_slots = prompt_mask.flatten().nonzero().squeeze(1)         # (Mp,) in (Q*Lp)
    completion_slots = inputs.flatten().nonzero().squeeze(1)          # (Mc,) in (N*(T-1))
    prompt_positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    completion_positions = (prompt_positions[question, -1:] + 1
                            + torch.arange(t_len - 1, device=completion_ids.device))
    ids = torch.cat([prompt_ids.flatten()[prompt_slots],
                     completion_ids[:, :-1].flatten()[completion_slots]])
    positions = torch.cat([prompt_positions.flatten()[prompt_slots],
                           completion_positions.flatten()[completion_slots]])
    return ids, positions, prompt_slots, completion_slots


def _predicting_rows(prompt_mask: Tensor, question: Tensor, inputs: Tensor) -> Tensor:
    """(N, T): the packed row predicting each completion token: token 0 its prompt's last
    position, token t the completion's input t-1."""
    (num_prompts, q_len), (n, t_in) = prompt_mask.shape, inputs.shape
    prompt_rows = prompt_mask.flatten().long().cumsum(0) - 1
    completion_rows = int(prompt_mask.sum()) + inputs.flatten().long().cumsum(0) - 1
    return torch.cat([prompt_rows.view(num_prompts, q_len)[question, -1:],
                      completion_rows.view(n, t_in)], dim=1)

