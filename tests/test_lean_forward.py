"""cppo.models.lean computes the model's own forward: same logits (with padding, with a KV cache,
GQA and q/k/v biases), same gradients on the model's parameters, same sampled completions; and
anything it cannot reproduce is refused with a reason."""

import pytest
import torch
from torch import nn

from cppo.models.lean import lean_forward_for, unsupported_reason
from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
from cppo.sampling.sampler import Decoding, encode_prompts, sample_completions
from cppo.sampling.settings import SamplingSettings
from helpers import closeness, note_margin

pytestmark = pytest.mark.cpu_paths   # two code paths compared: tests/test_cpu_paths.py


def _models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    llama = LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, tie_word_embeddings=True, **common))
    qwen = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common))
    with torch.no_grad():   # non-zero biases, so that a forgotten bias would show
        for layer in qwen.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return {"llama": llama.eval(), "qwen2-gqa-bias": qwen.eval()}


MODELS = _models()


@pytest.fixture(params=["matmul", "fused"])
def attention(request, monkeypatch):
    """Run a test through each of the lean forward's attention paths: two matmuls (short rows)
    and the fused kernel (long rows)."""
    import cppo.models.lean as lean
    monkeypatch.setattr(lean, "MATMUL_ATTENTION_MAX_SCORES", 10**9 if request.param == "matmul" else 0)
    return request.param


def _padded_batch(n=4, length=9, vocab=40):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0   # left padding of different widths
    mask[1, :1] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_the_models_forward_with_left_padding(name, attention):
    model = MODELS[name]
    lean, reason = lean_forward_for(model)
    assert reason is None
    ids, mask, pos = _padded_batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got, _ = lean(ids, pos, mask.bool())
        last, _ = lean(ids, pos, mask.bool(), logits_to_keep=3)
    valid = mask.bool()
    note_margin("lean_forward", logits=closeness(got[valid], expected[valid], atol=1e-5, rtol=1e-5),
                logits_bound=1.0)
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, expected[:, -3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_then_cached_decode_matches_one_full_pass(name, attention):
    model = MODELS[name]
    lean, _ = lean_forward_for(model)
    ids, mask, pos = _padded_batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        first, cache = lean(ids[:, :5], pos[:, :5], mask[:, :5].bool(), new_cache_capacity=9)
        steps = [first]
        for t in range(5, 9):
            out, cache = lean(ids[:, t:t + 1], pos[:, t:t + 1], mask[:, :t + 1].bool(), cache=cache)
            steps.append(out)
    assert cache.length == 9
    got = torch.cat(steps, dim=1)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_reach_the_models_parameters_and_match(name, attention):
    model = MODELS[name]
    ids, mask, pos = _padded_batch()
    prompt_ids, prompt_mask = ids[:, :6], mask[:, :6]
    completion_ids, completion_mask = ids[:, 6:], torch.tensor([[1, 1, 0]] * 4)
    grads = {}
    for lean in (False, True):
        model.zero_grad()
        logprobs = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, forward=ForwardSettings(lean=lean))
        (logprobs * completion_mask).sum().backward()
        grads[lean] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert grads[True].keys() == grads[False].keys()
    note_margin("lean_forward", gradients=max(closeness(grads[True][n], grads[False][n], atol=1e-5,
                                                        rtol=1e-4) for n in grads[True]),
                gradients_bound=1.0)
    for n in grads[True]:
        torch.testing.assert_close(grads[True][n], grads[False][n], atol=1e-5, rtol=1e-4, msg=n)


def test_sampled_completions_are_the_same_tokens(tiny_model_dir, tiny_tokenizer):
    from cppo.models import load_model
    model = load_model(tiny_model_dir).eval()
    prompts = encode_prompts(tiny_tokenizer, ["12*34=", "5*6=", "99*01="])
    kwargs = dict(num_generations=8, max_new_tokens=6, eos_token_id=tiny_tokenizer.eos_token_id,
                  pad_token_id=tiny_tokenizer.pad_token_id,
                  sampling=SamplingSettings(temperature=0.9, top_k=10))
    plain = sample_completions(model, prompts, generator=torch.Generator().manual_seed(3),
                               decoding=Decoding(lean=False), **kwargs)
    lean = sample_completions(model, prompts, generator=torch.Generator().manual_seed(3),
                              decoding=Decoding(lean=True), **kwargs)
    assert torch.equal(plain.ids, lean.ids) and torch.equal(plain.mask, lean.mask)
    assert torch.equal(plain.truncated, lean.truncated)


def test_unsupported_models_are_refused_with_a_reason():
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20))
    assert "model_type 'gpt2'" in unsupported_reason(gpt2)

    model = _models()["llama"]
    model.model.layers[0].self_attn.q_proj = nn.Sequential(model.model.layers[0].self_attn.q_proj)
    assert "not a plain Linear" in unsupported_reason(model)

    model = _models()["llama"]
    model.gradient_checkpointing_enable()
    assert lean_forward_for(model) == (None, "gradient checkpointing is on")


def test_lora_models_use_their_own_forward():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_models()["llama"], peft.LoraConfig(r=2, target_modules=["q_proj"]))
    lean, reason = lean_forward_for(model)
    assert lean is None and reason


@pytest.mark.parametrize("name", list(MODELS))
def test_shared_prompts_give_the_same_logprobs_and_gradients(name, attention):
    """Completions of the same prompt (G per question) share one prompt pass in the lean path."""
    model = MODELS[name]
    ids, mask, _ = _padded_batch(n=3, length=6)
    rows = torch.tensor([0, 1, 0, 2, 1, 0])             # 3 distinct prompts, shared by 6 rows
    prompt_ids, prompt_mask = ids[rows], mask[rows]
    g = torch.Generator().manual_seed(5)
    completion_ids = torch.randint(3, 40, (6, 4), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0],
                                    [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    results = {}
    for lean in (False, True):
        model.zero_grad()
        logprobs = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, forward=ForwardSettings(lean=lean),
                                       temperature=0.7)
        (logprobs * completion_mask).sum().backward()
        results[lean] = (logprobs.detach() * completion_mask,
                         [p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    for got, expected in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def _decoder_linears_in_bfloat16(model) -> list:
    """Make the model's own decoder Linear layers compute in bfloat16 (inputs and weights cast,
    outputs back to float32), except that the MLP's gate and up projections hand bfloat16 on, so
    its activation silu(gate) * up runs in bfloat16 (as autocast would); returns the patched
    modules (del their .forward to undo)."""
    patched = []
    for layer in model.model.layers:
        mlp = layer.mlp
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                  layer.self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            out = torch.bfloat16 if m in (mlp.gate_proj, mlp.up_proj) else torch.float32

            def forward(x, m=m, out=out):
                bias = None if m.bias is None else m.bias.bfloat16()
                return torch.nn.functional.linear(x.bfloat16(), m.weight.bfloat16(), bias).to(out)
            m.forward = forward
            patched.append(m)
    return patched


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_matmul_dtype_runs_the_decoder_linears_in_it_and_nothing_else(name, packed):
    """matmul_dtype=bfloat16: the same log-probs as the model's own forward with only its decoder
    Linear layers and the MLP's activation between them in bfloat16 (embedding, norms, attention,
    the residual stream and the head in float32), gradients on the float32 parameters; and not
    the float32 log-probs."""
    model = MODELS[name]
    ids, mask, _ = _padded_batch(n=3, length=6)
    rows = torch.tensor([0, 1, 0, 2, 1, 0])
    g = torch.Generator().manual_seed(5)
    completion_ids = torch.randint(3, 40, (6, 4), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0],
                                    [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    results = {}
    for run in ("float32", "bfloat16", "reference"):
        model.zero_grad()
        patched = _decoder_linears_in_bfloat16(model) if run == "reference" else []
        try:
            logprobs = completion_logprobs(
                model, ids[rows], mask[rows], completion_ids, completion_mask, temperature=0.7,
                forward=ForwardSettings(lean=run != "reference", packed=packed,
                                        matmul_dtype=torch.bfloat16 if run == "bfloat16" else None))
            (logprobs * completion_mask).sum().backward()
        finally:
            for m in patched:
                del m.forward
        results[run] = (logprobs.detach() * completion_mask, [p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    logprobs, grads = results["bfloat16"]
    torch.testing.assert_close(logprobs, results["reference"][0], atol=1e-5, rtol=0)
    assert (logprobs - results["float32"][0]).abs().max() > 1e-4   # bfloat16 did round
    for got, expected in zip(grads, results["reference"][1]):
        assert got.dtype == torch.float32
        assert (got - expected).norm() <= 2e-2 * expected.norm() + 1e-6


def test_matmul_dtype_needs_the_lean_forward():
    with pytest.raises(ValueError, match="matmul_dtype.*lean forward"):
        completion_logprobs(MODELS["llama"], *_padded_batch(n=2, length=3)[:2],
                            torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long),
                            forward=ForwardSettings(lean=False, matmul_dtype=torch.bfloat16))


def test_half_precision_matmuls_on_a_cpu_run_on_bucketed_row_counts():
    """oneDNN builds a kernel per new row count of a bfloat16 matmul: rows are padded to one of
    few buckets (at most an eighth more), and the result and gradients are F.linear's."""
    from cppo.models.lean import _bucketed_linear, _bucketed_rows
    buckets = {_bucketed_rows(r) for r in range(1, 4097)}
    assert all(r <= _bucketed_rows(r) <= r + max(1, r // 8) for r in range(1, 4097))
    assert len(buckets) < 120                      # far fewer shapes than row counts
    torch.manual_seed(0)
    for shape in [(1449, 128), (3, 67, 128), (17, 128)]:
        x = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(96, 128, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(96, dtype=torch.bfloat16, requires_grad=True)
        out = _bucketed_linear(x, w, b)
        ref = torch.nn.functional.linear(x, w, b)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref)
        grad = torch.randn_like(ref)
        got = torch.autograd.grad(out, (x, w, b), grad)
        expected = torch.autograd.grad(ref, (x, w, b), grad)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.float(), e.float(), atol=0.25, rtol=0.02)
