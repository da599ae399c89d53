"""The weight sinks (cppo.sampling.weight_sinks): one per transport, each a WeightSink, and every
weight push of the package goes through one. The transports' own tests drive them end to end
(tests/test_vllm_backend.py: the engine reload and the server's NCCL push; tests/
test_async_server_push.py: the server generator's; tests/test_async_rollout.py: the generator
process's shared memory; tests/test_vllm_server.py: the file reload against a real server);
here each sink alone, on fakes."""

import ast
import inspect
import multiprocessing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cppo.models import load_model
from cppo.sampling import weight_sinks
from cppo.sampling.vllm import EXPORT
from cppo.sampling.weight_sinks import (EngineReload, ServerAdapterFiles, ServerFiles, ServerNCCL,
                                        SharedMemory, StagedServerNCCL, WeightSink)
from helpers.weights import change_in_place, weights_of

SAMPLING = Path(__file__).resolve().parents[1] / "src" / "cppo" / "sampling"
SINKS = (EngineReload, ServerNCCL, StagedServerNCCL, ServerFiles, ServerAdapterFiles, SharedMemory)


class Recorder:
    """A vLLM engine or TRL client that records the calls a sink makes (and what it streams)."""

    def __init__(self):
        self.calls, self.streamed = [], []

    def __getattr__(self, method):
        def call(*args, **kwargs):
            self.calls.append(method)
            for value in [*args, *kwargs.values()]:   # a weights iterator, or its kwargs
                if isinstance(value, dict) and "weights_iterator" in value:
                    value = value["weights_iterator"]
                if inspect.isgenerator(value) or type(value).__name__ == "list_iterator":
                    self.streamed = [(n, t.clone()) for n, t in value]
        return call


@pytest.mark.parametrize("sink", SINKS, ids=lambda s: s.__name__)
def test_each_transport_is_a_weight_sink(sink):
    """Each sink takes the protocol's push(policy, version) and close(), and a push returns the
    seconds it took."""
    assert isinstance(sink.__new__(sink), WeightSink)
    protocol = inspect.signature(WeightSink.push).parameters
    assert list(inspect.signature(sink.push).parameters) == list(protocol)
    assert list(inspect.signature(sink.close).parameters) == ["self"]


def calls_of(path: Path, names: set[str]) -> list[str]:
    """'file:line name' for each call of one of `names` (a function or a method) in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in names:
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_every_weight_push_goes_through_a_sink():
    """The calls that move weights to a sampler (vLLM's reload, TRL's NCCL stream and
    communicator, the safetensors written for a server, the copy into the shared staging
    model) are made in cppo.sampling.weight_sinks only; the backends and generators call their
    sink's push."""
    moving = {"collective_rpc", "update_named_params", "init_communicator", "save_file",
              "copy_parameters", "_copy_parameters"}
    elsewhere = [call for path in sorted(SAMPLING.glob("*.py")) if path.name != "weight_sinks.py"
                 for call in calls_of(path, moving)]
    assert elsewhere == []
    assert calls_of(SAMPLING / "weight_sinks.py", moving)   # the scan sees them there
    for name in ("vllm.py", "generator_process.py", "server_generator.py"):
        assert "self.sink.push(" in (SAMPLING / name).read_text(), name


def test_engine_reload_pushes_in_place_and_refreshes_a_tied_head(tiny_model_dir,
                                                                 untied_model_dir):
    for model_dir, tied in [(tiny_model_dir, True), (untied_model_dir, False)]:
        policy, llm = load_model(model_dir), Recorder()
        sink = EngineReload(llm, EXPORT)
        assert sink.push(policy, 3) >= 0.0
        assert llm.calls == ["collective_rpc", *(["apply_model"] if tied else []),
                             "reset_prefix_cache"]
        assert [n for n, _ in llm.streamed] == [n for n, _ in weights_of(policy)]


@pytest.mark.parametrize("offload", [False, True])
def test_the_nccl_sink_streams_now_and_the_staged_one_at_take(tiny_model_dir, offload):
    """ServerNCCL streams the live weights on push; StagedServerNCCL keeps a snapshot that take
    streams (the policy changed since), the newest of two pushes only; the communicator is set
    up once. offload (fsdp): the snapshot is kept in host memory, a copy all the same."""
    policy = load_model(tiny_model_dir)
    now = Recorder()
    ServerNCCL([(now, "http://server:8000")], torch.device("cpu"), EXPORT).push(policy, 0)
    assert now.calls == ["init_communicator", "update_named_params", "reset_prefix_cache"]
    client = Recorder()
    staged = StagedServerNCCL([(client, "http://server:8000")], torch.device("cpu"), EXPORT,
                              offload=offload)
    assert staged.take() == -1 and client.calls == []   # nothing pushed: the server's own
    staged.push(policy, 1)
    change_in_place(policy, 0.5)
    staged.push(policy, 2)
    pushed = weights_of(policy)
    change_in_place(policy, 0.5)
    assert client.calls == []                           # nothing sent before take
    assert staged.take() == 2
    assert client.calls == ["init_communicator", "update_named_params", "reset_prefix_cache"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(client.streamed, pushed))
    assert staged.take() == 2 and len(client.calls) == 3   # no new push: nothing sent


def test_the_file_sink_writes_then_has_the_server_reload(untied_model_dir, tmp_path,
                                                        monkeypatch):
    """A push writes version-<v>/model.safetensors; take posts reload_weights to the server's
    /collective_rpc, removes the older folders and resets the prefix cache; close removes the
    folder. A refusal is a VLLMServerError."""
    pytest.importorskip("requests")
    import requests
    from cppo.errors import VLLMServerError
    posted = []

    def post(url, timeout, json):
        posted.append((url, timeout, json))
        return SimpleNamespace(status_code=200 if len(posted) < 3 else 404, text="no route")
    monkeypatch.setattr(requests, "post", post)
    policy, client = load_model(untied_model_dir), Recorder()
    sink = ServerFiles([(client, "http://server:8000")], tmp_path / "weights", EXPORT,
                       timeout=7.0)
    sink.push(policy, 1)
    sink.push(policy, 2)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["version-1", "version-2"]
    assert sink.take() == 2
    assert posted == [("http://server:8000/collective_rpc", 7.0, {
        "method": "reload_weights", "kwargs": {
            "weights_path": str(tmp_path / "weights" / "version-2"), "is_checkpoint_format": True}})]
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["version-2"]
    assert client.calls == ["reset_prefix_cache"]
    sink.push(policy, 3)
    assert sink.take() == 3 and len(posted) == 2
    sink.push(policy, 4)
    with pytest.raises(VLLMServerError, match="refused the weights"):
        sink.take()
    sink.close()
    assert not (tmp_path / "weights").exists()


def test_shared_memory_copies_trainable_weights_between_rounds(tiny_model_dir):
    """A push copies the trainable weights into the staging copy as a version; take copies them
    into the generator's private model once per new version."""
    policy = load_model(tiny_model_dir)
    sink = SharedMemory(policy, multiprocessing.get_context("spawn"))
    private = sink.private_copy()
    assert sink.take(private) == -1   # nothing pushed: the copy it was made from
    change_in_place(policy, 0.25)
    sink.push(policy, 5)
    assert not torch.equal(next(private.parameters()), next(policy.parameters()))
    assert sink.take(private) == 5
    for (name, mine), (_, theirs) in zip(private.named_parameters(), policy.named_parameters()):
        assert torch.equal(mine, theirs), name
    assert weight_sinks.trainable_names(policy) == sink.names


def test_the_backends_and_generators_hold_their_transports_sink(tiny_model_dir, tmp_path,
                                                                monkeypatch):
    """The server backend that pushes holds a ServerNCCL (a frozen one none); the async server
    generator a StagedServerNCCL on CUDA, ServerFiles elsewhere (an untied model)."""
    pytest.importorskip("trl")
    from helpers.vllm_client import FakeClient
    from cppo.assembly.run import backend_settings
    from cppo.config import CPPOConfig
    from cppo.models import load_tokenizer
    from cppo.sampling.async_rollout import ServerGenerator
    from cppo.sampling.vllm import VLLMBackend, VLLMServerBackend
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    settings = backend_settings(CPPOConfig(use_vllm=True, vllm_mode="server", num_generations=2,
                                           max_completion_length=4))
    monkeypatch.setattr(VLLMBackend, "push_device", lambda self: torch.device("cuda", 0))
    pushing = VLLMBackend(model, tok, settings, vllm=SimpleNamespace(), client=FakeClient())
    assert type(pushing) is VLLMServerBackend and isinstance(pushing.sink, ServerNCCL)
    frozen = VLLMBackend(model, tok, settings, vllm=SimpleNamespace(), client=FakeClient(),
                         push_weights=False)
    assert frozen.sink is None
    generator = ServerGenerator(frozen, tok, tmp_path / "weights", heartbeat_stale_after_s=60.0)
    try:
        assert isinstance(generator.sink, StagedServerNCCL)
    finally:
        generator.close()


def _sharded_push_worker(rank: int, init_file: str, out: str) -> None:
    """One of 2 gloo processes: a 2-layer model sharded by FSDP2 (each process holds half of each
    parameter), the first process's SharedMemory sink made from its skeleton, then a push after
    every weight moved by +1; the first process saves what its staging copy holds."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from cppo.parallel.engines import unsharded_skeleton
    from cppo.sampling.process_share import ProcessShare
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)   # the same model on both processes
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        model[1].weight.requires_grad_(False)   # frozen: staged once, never pushed
        before = {k: v.clone() for k, v in model.state_dict().items()}
        skeleton = unsharded_skeleton(model)
        mesh = init_device_mesh("cpu", (2,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert model[0].weight.to_local().shape == (3, 4)   # a shard, not the parameter
        sink = generator = None
        if rank == 0:
            sink = SharedMemory(model, multiprocessing.get_context("spawn"), skeleton)
            generator = SimpleNamespace(name="fake", push=sink.push)
        share = ProcessShare(generator, SimpleNamespace(active=True), torch.device("cpu"),
                             sharded=True)
        share.join_staging(model)
        staged = None if sink is None else {k: v.clone() for k, v in sink.staging.state_dict().items()}
        change_in_place(model, 1.0)
        share.push(model, 1)
        if rank == 0:
            torch.save({"before": before, "staged": staged, "pushed": sink.staging.state_dict(),
                        "version": sink.version.value, "names": sink.names}, out)
        dist.barrier()   # neither process tears its group down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_a_sharded_push_gathers_every_parameter_whole(tmp_path):
    """fsdp: every process takes part in each parameter's gather, the first one's staging copy
    receives the full tensors (not its shard): the unsharded weights when the sink is made, and
    the trainable ones moved by the push (the frozen one as it was)."""
    out = tmp_path / "staged.pt"
    torch.multiprocessing.spawn(_sharded_push_worker, args=(str(tmp_path / "init"), str(out)),
                                nprocs=2)
    got = torch.load(out)
    assert got["names"] == ["0.weight", "0.bias", "1.bias"] and got["version"] == 1
    for name, value in got["before"].items():
        assert got["staged"][name].shape == value.shape, name
        torch.testing.assert_close(got["staged"][name], value, rtol=0, atol=0, msg=name)
        moved = value if name == "1.weight" else value + 1.0
        torch.testing.assert_close(got["pushed"][name], moved, rtol=0, atol=0, msg=name)


def _sharded_server_push_worker(rank: int, init_file: str, folder: str) -> None:
    """One of 2 gloo processes: a 2-layer model sharded by FSDP2, every weight moved by +1 after
    sharding; the first process's file sink (a vLLM server's, GATHERED_EXPORT) stages a push
    while the other takes part in each gather (ProcessShare with every parameter's name)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from cppo.sampling.process_share import ProcessShare
    from cppo.sampling.vllm import GATHERED_EXPORT
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        model[1].weight.requires_grad_(False)   # frozen: a server reloads it all the same
        mesh = init_device_mesh("cpu", (2,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        change_in_place(model, 1.0)
        generator = None
        if rank == 0:
            sink = ServerFiles([(None, "http://unused")], folder, GATHERED_EXPORT, timeout=1.0)
            generator = SimpleNamespace(name="fake", push=sink.push)
        share = ProcessShare(generator, SimpleNamespace(active=True), torch.device("cpu"),
                             sharded=True, pushed=[name for name, _ in model.named_parameters()])
        share.push(model, 3)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_sharded_push_to_a_vllm_server_writes_every_weight_whole(tmp_path):
    """fsdp with a vLLM server: the file the server reloads holds every weight whole (not the
    first process's shard), the frozen one too, as trained."""
    from safetensors.torch import load_file
    torch.multiprocessing.spawn(_sharded_server_push_worker,
                                args=(str(tmp_path / "init"), str(tmp_path / "weights")), nprocs=2)
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    change_in_place(expected, 1.0)
    got = load_file(tmp_path / "weights" / "version-3" / "model.safetensors")
    assert sorted(got) == sorted(expected.state_dict())
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_a_sharded_push_refuses_lora_factors_naming_the_fix():
    """The gathered push sends parameters one at a time, so it cannot merge a LoRA layer."""
    from cppo.errors import ConfigError
    from cppo.sampling.vllm import check_sharded_push
    check_sharded_push(["model.layers.0.q_proj.weight"])
    with pytest.raises(ConfigError, match="lora_A.*distributed: ddp"):
        check_sharded_push(["model.layers.0.q_proj.lora_A.default.weight"])
