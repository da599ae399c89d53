"""On a CUDA GPU: training steps, sampling and the lean forward run there and agree with the CPU.
Marked `cuda`; skipped where torch sees no CUDA device (run them with `pytest -m cuda`)."""

import pytest
import torch

from cppo.parallel import hardware
from cppo.config import CPPOConfig
from cppo.models import load_model, load_tokenizer
from helpers import ROWS, odd_length_reward

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]



@pytest.mark.parametrize("bf16", [False, True])
def test_training_steps_on_the_gpu(tiny_model_dir, tmp_path, bf16):
    from cppo.trainer import CPPOTrainer
    if bf16 and not hardware.has_fast_dtype("bfloat16", "cuda"):
        pytest.skip("this GPU has no native bf16")
    cfg = CPPOConfig(model=tiny_model_dir, output_dir=str(tmp_path), max_steps=3, num_generations=4,
                     per_device_train_batch_size=8, pruning_rate=0.5, max_completion_length=5,
                     eval_steps=0, progress_bar=False, bf16=bf16, learning_rate=1e-3)
    trainer = CPPOTrainer(model=load_model(tiny_model_dir), processing_class=load_tokenizer(tiny_model_dir),
                          reward_funcs=[odd_length_reward], args=cfg, train_dataset=ROWS, eval_dataset=ROWS[:8])
    assert trainer.device.type == "cuda"
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert all(p.device.type == "cuda" for p in trainer.policy.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_lean_forward_on_the_gpu_matches_the_model(tiny_model_dir):
    from cppo.models.lean import lean_forward_for
    model = load_model(tiny_model_dir).cuda().eval()
    ids = torch.randint(3, model.config.vocab_size, (4, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    lean, reason = lean_forward_for(model)
    assert lean is not None, reason
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = lean(ids, positions, mask.bool())[0]
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=1e-4, atol=1e-4)


def test_sampling_on_the_gpu_is_seeded(tiny_model_dir):
    from cppo.sampling.sampler import encode_prompts, sample_completions
    model = load_model(tiny_model_dir).cuda().eval()
    tok = load_tokenizer(tiny_model_dir)
    prompts = encode_prompts(tok, [r["prompt"] for r in ROWS[:4]])

    def sample():
        gen = torch.Generator(device="cuda").manual_seed(7)
        return sample_completions(model, prompts, num_generations=4, max_new_tokens=5,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  generator=gen)
    a, b = sample(), sample()
    assert a.ids.device.type == "cuda" and a.ids.shape[0] == 16
    assert torch.equal(a.ids, b.ids)


def test_hardware_describes_the_gpu():
    info = hardware.describe("cuda")
    assert info["gpu"] == torch.cuda.get_device_name(0)
    major, _ = torch.cuda.get_device_capability()
    assert info["fast_bfloat16"] == (major >= 8)


# --- transformers' speed fields on CUDA (tests/test_trl_speed.py: the CPU side) -------------------
def test_fp16_training_steps_on_the_gpu(tiny_model_dir, tmp_path):
    from helpers import make_trainer
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=3, fp16=True)
    assert trainer.device.type == "cuda" and trainer.learner.scaler is not None
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["nonfinite_steps"] == 0
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())   # float32 weights
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_tf32_is_set_as_transformers_sets_it():
    if not hardware.cuda_tf32_available():
        pytest.skip("no TF32 on this GPU (before Ampere)")
    from cppo.config.sections import PrecisionSection
    try:
        assert hardware.apply_tf32(PrecisionSection(tf32=True), bf16=False) is True
        assert torch.backends.cuda.matmul.allow_tf32
        assert hardware.apply_tf32(PrecisionSection(tf32=False), bf16=False) is False
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        hardware.apply_tf32(PrecisionSection(tf32=False), bf16=False)


@pytest.mark.parametrize("lean", [True, False])
def test_torch_compile_inductor_on_the_gpu_matches_eager(tiny_model_dir, lean):
    from cppo.models.compiled import CompileSettings, compile_seconds
    from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
    model = load_model(tiny_model_dir).cuda().train()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (8, 6), generator=gen).cuda()
    ids = torch.randint(3, model.config.vocab_size, (8, 7), generator=gen).cuda()
    mask = (torch.arange(7)[None] < torch.randint(1, 8, (8, 1), generator=gen)).long().cuda()
    grads = []
    for settings in (None, CompileSettings("inductor")):
        torch._dynamo.reset()
        model.zero_grad()
        start = compile_seconds()
        completion_logprobs(model, prompts, torch.ones_like(prompts), ids, mask,
                            forward=ForwardSettings(lean=lean, compile=settings)).sum().backward()
        assert (compile_seconds() > start) == (settings is not None)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_liger_kernels_are_applied_on_the_gpu(tiny_model_dir):
    pytest.importorskip("liger_kernel")
    from cppo.config.sections import PrecisionSection
    from cppo.models.loading import apply_liger_kernels
    from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
    model = load_model(tiny_model_dir).cuda()
    ids = torch.randint(3, model.config.vocab_size, (4, 6), device="cuda")
    prompts = torch.randint(3, model.config.vocab_size, (4, 5), device="cuda")
    ones = torch.ones_like
    with torch.no_grad():
        lean = completion_logprobs(model, prompts, ones(prompts), ids, ones(ids))
        assert apply_liger_kernels(model, PrecisionSection(use_liger_kernel=True),
                                   torch.device("cuda"))
        own = completion_logprobs(model, prompts, ones(prompts), ids, ones(ids),
                                  forward=ForwardSettings(lean=False))
    torch.testing.assert_close(own, lean, atol=1e-4, rtol=1e-4)


def test_qlora_trains_on_the_gpu(untied_model_dir, tmp_path):
    """load_in_4bit on bitsandbytes' CUDA kernels: the 4-bit base on the GPU and unchanged, every
    adapter with a gradient in step 2 (B is 0 at step 1), and the dequantised merged weights
    (what vLLM gets) giving the policy's logits."""
    bnb = pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from cppo.trainer import CPPOTrainer
    from cppo.sampling.vllm import vllm_weights
    cfg = CPPOConfig(model=untied_model_dir, output_dir=str(tmp_path), max_steps=2, num_generations=4,
                     per_device_train_batch_size=8, pruning_rate=0.5, max_completion_length=5,
                     eval_steps=0, progress_bar=False, learning_rate=1e-2, use_peft=True,
                     lora_dropout=0.0, load_in_4bit=True, use_bnb_nested_quant=True)
    trainer = CPPOTrainer(model=None, reward_funcs=[odd_length_reward], args=cfg,
                          train_dataset=ROWS, eval_dataset=ROWS[:8])
    policy = trainer.policy
    layers = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.device.type == "cuda" for m in layers)
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    adapters = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    grads, step = [], trainer.optimizer.step

    def spy(*a, **kw):
        grads.append([p.grad is not None and bool(p.grad.abs().max() > 0) for p in adapters.values()])
        return step(*a, **kw)
    trainer.optimizer.step = spy
    assert trainer.train()["status"] == "completed"
    assert len(grads) == 2 and all(grads[1])
    assert all(torch.equal(p, frozen[n]) for n, p in policy.named_parameters() if n in frozen)
    merged = load_model(untied_model_dir).cuda().eval()
    with vllm_weights(policy) as weights:
        merged.load_state_dict(dict(weights))
    ids = torch.tensor([[5, 6, 7, 8, 9]], device="cuda")
    with torch.no_grad():
        assert (merged(ids).logits - policy.eval()(ids).logits).abs().max() < 1e-3


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_async_rollout_generator_process_on_the_gpu(tiny_model_dir, tmp_path, max_staleness):
    """async_rollout on CUDA: the generator process receives the staging copy through CUDA IPC
    (torch.multiprocessing), samples on the GPU and takes the pushed weights; the run trains and
    every trained round is within max_staleness."""
    import json
    from cppo.trainer import CPPOTrainer
    cfg = CPPOConfig(model=tiny_model_dir, output_dir=str(tmp_path), max_steps=3, num_generations=4,
                     per_device_train_batch_size=8, pruning_rate=0.5, max_completion_length=5,
                     eval_steps=0, progress_bar=False, learning_rate=1e-3, async_rollout=True,
                     max_staleness=max_staleness)
    with CPPOTrainer(model=load_model(tiny_model_dir), processing_class=load_tokenizer(tiny_model_dir),
                     reward_funcs=[odd_length_reward], args=cfg, train_dataset=ROWS,
                     eval_dataset=ROWS[:8]) as trainer:
        assert trainer.device.type == "cuda"
        summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps"] == 3
    rows = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
    assert max(r["sample/staleness_max"] for r in rows) <= max_staleness


def test_async_server_generator_pushes_a_gpu_snapshot_over_nccl(tiny_model_dir, tmp_path):
    """async_rollout's vLLM server generator with the policy on the GPU: a push keeps a snapshot
    on the GPU (no files) and the thread streams it before its next round, through TRL's
    VLLMClient protocol (a fake with the real signatures: no vLLM server here), even after the
    policy changed in place; the round is tagged with the pushed version."""
    pytest.importorskip("trl")
    from types import SimpleNamespace
    from cppo.assembly.run import backend_settings
    from cppo.sampling.async_rollout import RolloutTask, ServerGenerator
    from cppo.sampling.vllm import VLLMBackend, vllm_weights
    from helpers.vllm_client import FakeClient
    model, tok, client = load_model(tiny_model_dir).cuda(), load_tokenizer(tiny_model_dir), FakeClient()
    args = CPPOConfig(use_vllm=True, vllm_mode="server", num_generations=2, max_completion_length=4)
    backend = VLLMBackend(model, tok, backend_settings(args), vllm=SimpleNamespace(), client=client,
                          push_weights=False)
    generator = ServerGenerator(backend, tok, tmp_path / "weights", heartbeat_stale_after_s=60.0)
    try:
        generator.push(model, 2)
        with vllm_weights(model) as weights:
            pushed = [(name, t.detach().clone()) for name, t in weights]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        generator.submit(RolloutTask(0, 0, [[{"prompt": "12*34="}]]))
        assert generator.receive().version == 2
        assert client.calls[-4:] == ["init_communicator", "update_named_params",
                                     "reset_prefix_cache", "generate"]
        assert all(t.device.type == "cuda" for _, t in client.streamed)
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(client.streamed, pushed))
        assert [n for n, _ in client.streamed] == [n for n, _ in pushed]
        assert not list(tmp_path.rglob("*"))
    finally:
        generator.close()
