"""async_rollout's vLLM server generator (cppo.sampling.async_rollout.ServerGenerator) pushing the
weights over NCCL, TRL's `trl vllm-serve` protocol, as it does when the policy is on CUDA: here
the push device is made to look like CUDA and TRL's VLLMClient is a fake that takes the real call
signatures (helpers.vllm_client). tests/test_vllm_server.py trains through a real CPU server
(the file push); tests/test_cuda.py runs this push from a real GPU."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cppo.assembly.run import backend_settings
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.models import load_model, load_tokenizer
from cppo.sampling.async_rollout import RolloutTask, ServerGenerator
from cppo.sampling.vllm import VLLMBackend, server_weight_metadata

pytest.importorskip("trl")
from helpers.vllm_client import FakeClient   # noqa: E402  (TRL's real signatures)
from helpers.weights import change_in_place, weights_of   # noqa: E402

ARGS = dict(use_vllm=True, vllm_mode="server", num_generations=2, max_completion_length=4,
            max_prompt_length=16)


@pytest.fixture
def on_cuda(monkeypatch):
    """The policy's push device looks like CUDA (the tensors stay on the CPU)."""
    monkeypatch.setattr(VLLMBackend, "push_device", lambda self: torch.device("cuda", 0))


def server_generator(model_dir, weights_dir, client):
    """A ServerGenerator on the model and its backend (push_weights=False: make_backend's under
    async_rollout), with the fake client's calls from here on."""
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    backend = VLLMBackend(model, tok, backend_settings(CPPOConfig(**ARGS)), vllm=SimpleNamespace(),
                          client=client, push_weights=False)
    client.calls.clear()
    return ServerGenerator(backend, tok, weights_dir, heartbeat_stale_after_s=60.0)


def assert_streamed(client, expected) -> None:
    assert [n for n, _ in client.streamed] == [n for n, _ in expected]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(client.streamed, expected))


def round_of(generator, task_id: int):
    generator.submit(RolloutTask(task_id, task_id, [[{"prompt": "12*34="}, {"prompt": "5+6="}]]))
    return generator.receive()


def test_each_round_streams_the_weights_pushed_before_it(tiny_model_dir, tmp_path, on_cuda):
    """A push keeps a snapshot (no files); the thread streams it before its next round, even after
    the policy changed in place, and the round comes back tagged with the pushed version.
    init_communicator once, update_named_params then reset_prefix_cache, then the round's generate."""
    client = FakeClient()
    generator = server_generator(tiny_model_dir, tmp_path / "weights", client)
    policy = generator.backend.model
    try:
        for version, task_id in [(0, 0), (3, 1)]:
            generator.push(policy, version)
            pushed = weights_of(policy)
            change_in_place(policy, 0.5)   # the trainer's next steps, before the thread sends
            arrival = round_of(generator, task_id)
            assert arrival.version == version
            assert_streamed(client, pushed)
            assert client.metadata == server_weight_metadata(policy)
            assert not torch.equal(client.streamed[0][1], weights_of(policy)[0][1])
        assert round_of(generator, 2).version == 3   # no push since: nothing streamed again
        assert client.calls == ["init_communicator", "update_named_params", "reset_prefix_cache",
                                "generate", "update_named_params", "reset_prefix_cache",
                                "generate", "generate"]
        assert not list(tmp_path.rglob("*"))   # no weights written anywhere
    finally:
        generator.close()


def test_a_push_during_a_round_waits_for_the_next(tiny_model_dir, tmp_path, on_cuda):
    """A push while the server samples a round is streamed before the next round, never into the
    one being sampled, which keeps the version it started with; of two pushes between rounds only
    the newer is streamed."""
    client = FakeClient()
    generator = server_generator(tiny_model_dir, tmp_path / "weights", client)
    policy = generator.backend.model
    sampling, release = threading.Event(), threading.Event()
    generate = client.generate

    def slow_generate(prompts, **kw):
        sampling.set()
        assert release.wait(60)
        return generate(prompts, **kw)
    client.generate = slow_generate
    try:
        generator.push(policy, 0)
        generator.submit(RolloutTask(0, 0, [[{"prompt": "12*34="}]]))
        assert sampling.wait(60)
        change_in_place(policy, 0.5)
        generator.push(policy, 1)
        change_in_place(policy, 0.5)
        generator.push(policy, 2)
        newest = weights_of(policy)
        release.set()
        assert generator.receive().version == 0
        assert client.calls == ["init_communicator", "update_named_params", "reset_prefix_cache",
                                "generate"]
        client.generate = generate
        assert round_of(generator, 1).version == 2
        assert client.calls.count("update_named_params") == 2   # version 1 was never sent
        assert_streamed(client, newest)
    finally:
        release.set()
        generator.close()


def test_each_round_reports_how_long_the_generator_waited_for_its_task(tiny_model_dir, tmp_path,
                                                                      on_cuda):
    """pruning_rate auto reads the generator's wait for its task (rollout/generator_idle_s), as
    cppo's generator process measures it: 0 for the first task; then the seconds from the end of
    the last round until the next task reached the thread, not counting a task that was queued
    before the round ended."""
    generator = server_generator(tiny_model_dir, tmp_path / "weights", FakeClient())
    try:
        generator.push(generator.backend.model, 0)
        first = round_of(generator, 0)
        time.sleep(0.3)   # the trainer's side: the generator waits for its next task
        waited = round_of(generator, 1)
        for task_id in (2, 3):   # both queued at once: the second waits for no one
            generator.submit(RolloutTask(task_id, task_id, [[{"prompt": "5+6="}]]))
        queued = [generator.receive() for _ in range(2)]
        assert first.idle_seconds == 0.0
        assert 0.3 <= waited.idle_seconds < 30.0
        assert queued[1].idle_seconds < 0.25
    finally:
        generator.close()


def test_a_tied_lm_head_is_refused_only_for_the_file_push(tiny_model_dir, tmp_path, monkeypatch):
    """Over NCCL a tied head is pushed with the embedding (one parameter, one name); the file
    reload (off CUDA) is refused for it."""
    assert load_model(tiny_model_dir).config.tie_word_embeddings
    with pytest.raises(ConfigError, match="tied LM head"):
        server_generator(tiny_model_dir, tmp_path / "weights", FakeClient())
    monkeypatch.setattr(VLLMBackend, "push_device", lambda self: torch.device("cuda", 0))
    client = FakeClient()
    generator = server_generator(tiny_model_dir, tmp_path / "weights", client)
    try:
        generator.push(generator.backend.model, 0)
        round_of(generator, 0)
        names = [n for n, _ in client.streamed]
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    finally:
        generator.close()


def test_off_cuda_a_push_writes_files(untied_model_dir, tmp_path):
    """The policy on the CPU: a push writes safetensors for the server to reload; nothing is
    announced or streamed over NCCL."""
    client = FakeClient()
    generator = server_generator(untied_model_dir, tmp_path / "weights", client)
    try:
        generator.push(generator.backend.model, 4)
        assert (tmp_path / "weights" / "version-4" / "model.safetensors").is_file()
        assert client.calls == []
    finally:
        generator.close()


def test_a_backend_that_pushes_itself_is_refused(tiny_model_dir, tmp_path, on_cuda):
    """The generator owns the pushes and the communicator: a backend built to push (it set up a
    communicator of its own and would push the live weights each round) is refused."""
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    backend = VLLMBackend(model, tok, backend_settings(CPPOConfig(**ARGS)), vllm=SimpleNamespace(),
                          client=FakeClient())
    with pytest.raises(ValueError, match="push_weights=False"):
        ServerGenerator(backend, tok, tmp_path, heartbeat_stale_after_s=60.0)
