"""The vLLM backend against a fake engine (no vLLM, no GPU here): weight names, in-place weight
sync once per round, sleep mode, request building, and the sampler log-probs reaching the
importance-sampling correction. What a real engine does with these calls is not tested here."""

import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from cppo.config import CPPOConfig, VLLMUnavailableError
from cppo.generation import (VLLMBackend, chunk_seed, completions_with_logprobs, sampled_logprobs,
                             vllm_weight_name, vllm_weights)
from cppo.models import load_model, load_tokenizer
from cppo.rollout import encode_prompts


class FakeLLM:
    """Records what the backend asks of vllm.LLM; generates fixed tokens with known log-probs."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        self.model = SimpleNamespace(load_weights=self._load)
        FakeLLM.instances.append(self)

    def _load(self, weights):
        self.loaded.append({name: tensor.clone() for name, tensor in weights})

    def apply_model(self, func):
        self.calls.append("apply_model")
        return [func(self.model)]

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up{tags}")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append("generate")
        self.requests = (prompts, params)
        results = []
        for p, sp in zip(prompts, params):
            outs = []
            for g in range(sp["n"]):
                tokens = [5, 6, 2] if g % 2 == 0 else [7, 8, 9, 10, 11, 12]   # 2 = EOS
                logprobs = [{t: SimpleNamespace(logprob=-0.1 * (i + 1) - g)} for i, t in enumerate(tokens)]
                outs.append(SimpleNamespace(token_ids=tokens, logprobs=logprobs))
            results.append(SimpleNamespace(outputs=outs))
        return results


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances = []
    return module


def test_weight_names_match_what_vllm_loads():
    assert vllm_weight_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert vllm_weight_name("model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.1.mlp.up_proj.weight"
    assert vllm_weight_name("_orig_mod.lm_head.weight") == "lm_head.weight"
    assert vllm_weight_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert vllm_weight_name("base_model.model.lm_head.original_module.weight") is None


def test_lora_weights_are_pushed_merged_under_the_base_names(tiny_model_dir):
    pytest.importorskip("peft")
    from cppo.models.lora import wrap_with_lora
    base = load_model(tiny_model_dir)
    names = {n for n, _ in base.named_parameters()}
    model = wrap_with_lora(load_model(tiny_model_dir), CPPOConfig(use_peft=True, lora_r=2))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)       # nonzero adapters: merging changes q/k/v/o
    merged = {n: p.detach().clone() for n, p in
              __import__("copy").deepcopy(model).merge_and_unload().named_parameters()}
    with vllm_weights(model) as weights:
        pushed = {n: t.clone() for n, t in weights}
    assert set(pushed) == names == set(merged)
    for n in names:
        torch.testing.assert_close(pushed[n], merged[n])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[q], dict(base.named_parameters())[q])
    unmerged = dict(model.named_parameters())["base_model.model." + q.replace(".weight", ".base_layer.weight")]
    torch.testing.assert_close(unmerged, dict(base.named_parameters())[q])   # unmerged after


def small_args(**kw):
    values = dict(use_vllm=True, num_generations=2, max_completion_length=4, seed=7,
                  max_prompt_length=16)
    values.update(kw)
    return CPPOConfig(**values)


def test_colocate_round_syncs_in_place_sleeps_and_returns_sampler_logprobs(fake_vllm, tiny_model_dir):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    backend = VLLMBackend(model, tok, small_args())
    (llm,) = FakeLLM.instances
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["enable_sleep_mode"] is True
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.kwargs["gpu_memory_utilization"] == 0.3
    prompts = encode_prompts(tok, ["12*34=", "5*6="])          # left-padded to one width
    out = backend.generate(prompts, round_index=3, question_offset=10)
    assert llm.calls == ["sleep2", "wake_up['weights']", "apply_model", "reset_prefix_cache",
                         "wake_up['kv_cache']", "generate", "sleep2"]
    (loaded,) = llm.loaded
    assert set(loaded) == {n for n, _ in model.named_parameters()}
    # requests: unpadded prompt ids, G per prompt, logprobs=0, per-question seeds
    sent, params = llm.requests
    assert [p["prompt_token_ids"] for p in sent] == [tok("12*34=").input_ids, tok("5*6=").input_ids]
    assert [p["seed"] for p in params] == [chunk_seed(7, 3, 10), chunk_seed(7, 3, 11)]
    assert all(p["n"] == 2 and p["logprobs"] == 0 and p["max_tokens"] == 4 for p in params)
    # completions: cut at EOS / max_completion_length, sampler log-probs aligned, 0 after the end
    assert out.ids.tolist()[:2] == [[5, 6, 2, 0], [7, 8, 9, 10]]
    assert out.truncated.tolist()[:2] == [False, True]
    torch.testing.assert_close(out.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0.0]))
    torch.testing.assert_close(out.logprobs[1], torch.tensor([-1.1, -1.2, -1.3, -1.4]))
    # same round again: no second weight push
    llm.calls.clear()
    backend.generate(prompts, round_index=3, question_offset=10)
    assert "apply_model" not in llm.calls and len(llm.loaded) == 1
    backend.generate(prompts, round_index=4, question_offset=10)
    assert len(llm.loaded) == 2


def test_without_sleep_mode_the_engine_stays_awake(fake_vllm, tiny_model_dir):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    backend = VLLMBackend(model, tok, small_args(vllm_enable_sleep_mode=False,
                                                 importance_sampling_correction=False))
    out = backend.generate(encode_prompts(tok, ["12*34="]), round_index=0)
    (llm,) = FakeLLM.instances
    assert llm.calls == ["apply_model", "reset_prefix_cache", "generate"]
    assert out.logprobs is None and llm.requests[1][0]["logprobs"] is None


def test_server_mode_pushes_named_weights_and_reads_logprobs(tiny_model_dir):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    pushed, asked = [], {}

    class Client:   # TRL's VLLMClient surface
        def update_named_param(self, name, tensor):
            pushed.append(name)

        def reset_prefix_cache(self):
            pushed.append("reset")

        def generate(self, prompts, **kw):
            asked.update(kw, prompts=prompts)
            return {"completion_ids": [[5, 2], [6, 7, 2]] * len(prompts),
                    "logprobs": [[[-0.5], [-0.25]], [[-1.0], [-2.0], [-3.0]]] * len(prompts)}
    args = CPPOConfig(num_generations=2, max_completion_length=4, vllm_mode="server")
    backend = VLLMBackend(model, tok, args, vllm=SimpleNamespace(), client=Client())
    out = backend.generate(encode_prompts(tok, ["12*34="]), round_index=0)
    assert pushed[-1] == "reset" and set(pushed[:-1]) == {n for n, _ in model.named_parameters()}
    assert asked["prompts"] == [tok("12*34=").input_ids] and asked["logprobs"] == 0 and asked["n"] == 2
    torch.testing.assert_close(out.logprobs, torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]))


def test_logprob_helpers():
    steps = [{4: SimpleNamespace(logprob=-0.5)}, {9: SimpleNamespace(logprob=-1.5), 3: SimpleNamespace(logprob=-0.1)}]
    assert sampled_logprobs([4, 9], steps) == [-0.5, -1.5]
    with pytest.raises(ValueError, match="1 log-probs for a completion of 2 tokens"):
        completions_with_logprobs([[4, 9]], [[-0.5]], eos_token_id=2, pad_token_id=0, max_new_tokens=4)


def test_trainer_step_with_fake_vllm_applies_the_importance_correction(fake_vllm, tiny_model_dir,
                                                                       tmp_path):
    from tests.test_trainer import make_trainer
    def by_index(prompts, completions, **kw):
        return [float(i % 3 == 0) for i in range(len(completions))]
    trainer = make_trainer(tiny_model_dir, tmp_path, reward=by_index, use_vllm=True, max_steps=1,
                           max_completion_length=6, eval_num_questions=1, save_steps=0)
    metrics = trainer.training_round()
    assert "sampling/importance_sampling_ratio/mean" in metrics
    assert metrics["sampling/sampling_logp_difference/mean"] > 0


def test_vllm_not_installed_fails_at_the_config(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VLLMUnavailableError, match=r"'use_vllm' is true.*pip install 'cppo\[vllm\]'"):
        CPPOConfig(use_vllm=True)
