"""Several generator processes (generator_processes: N): the round shared among them by whole
generation chunks and merged back in order, every push seen by every process, a dead one named,
the config's checks, and the run with two processes at max_staleness 0 equal to the synchronous
run."""

import copy
import functools
import inspect
import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from cppo.assembly.run import backend_settings
from cppo.config import CPPOConfig
from cppo.errors import ConfigError, GeneratorError
from cppo.models import load_model, load_tokenizer
from cppo.sampling import generator_pool
from cppo.sampling.generator_pool import (GeneratorPool, blocks, check_pool_parts, round_parts,
                                          split_round, start_pool)
from cppo.sampling.generator_process import GeneratorProcess, generator_sampling
from cppo.sampling.rollout_generator import WholeModel, roll_out_round
from cppo.sampling.rollout_messages import RolloutTask, Sampled
from helpers import ROWS, assert_config_error_names, make_trainer
from helpers.weights import change_in_place

G = 4
FLOAT32 = dict(generation_dtype=None, matmul_dtype=None)


def _build(tiny_model_dir, chunk_size: int):
    """GeneratorProcess's build (G = 4, 5 tokens, seed 3, float32 sampling) and the tokenizer."""
    settings = backend_settings(CPPOConfig(num_generations=G, max_completion_length=5, seed=3,
                                           generation_dtype=None))
    tokenizer = load_tokenizer(tiny_model_dir)
    return functools.partial(generator_sampling, tokenizer, settings, chunk_size, None,
                             False), tokenizer


class InlineGenerator:
    """A generator process's side in this process: each share sampled as it is submitted (the
    same roll_out_round on its own model), tagged with `version`."""

    def __init__(self, model, build, version: int = 0):
        self.generation, self.version, self.done = build(model, WholeModel()), version, []
        self.shares = []

    def submit(self, task: RolloutTask) -> None:
        self.shares.append(task.spans)
        prompts, completions, turns = roll_out_round(self.generation, task, None)
        self.done.append(Sampled(task.task_id, self.version, prompts, completions,
                                 1.0 + self.version, float(self.version), turns))

    def receive(self) -> Sampled:
        return self.done.pop(0)

    def close(self, timeout: float = 0) -> None:
        pass


def _task(task_id: int, ranks: int, questions: int) -> RolloutTask:
    rows = [ROWS[r * questions:(r + 1) * questions] for r in range(ranks)]
    return RolloutTask(task_id, 2, rows)


def _assert_same_round(got: Sampled, whole: Sampled) -> None:
    for mine, theirs in zip(got.prompts, whole.prompts, strict=True):
        assert torch.equal(mine.ids, theirs.ids) and torch.equal(mine.mask, theirs.mask)
    for mine, theirs in zip(got.completions, whole.completions, strict=True):
        assert torch.equal(mine.ids, theirs.ids) and torch.equal(mine.mask, theirs.mask)


def test_the_round_is_shared_by_whole_chunks_and_merged_in_order(tiny_model_dir):
    """Two training processes' 6 questions each in chunks of 2 (generation_chunk_size 8 = 2
    groups) shared by 4 processes: each share a contiguous block of whole chunks (one spans the
    two training processes), every question's group in one share; merged, the round is the one
    process's round (the same prompts and completions, in rank and question order), its version
    the oldest share's, its seconds the longest's, its idle seconds their mean. With 3 chunks
    for 2 processes the blocks are 2 + 1 chunks: a split by questions (3 + 3) would cut a chunk,
    whose completions are then seeded otherwise."""
    build, tokenizer = _build(tiny_model_dir, chunk_size=2 * G)
    model = load_model(tiny_model_dir)
    for ranks, processes, versions in ((2, 4, [3, 1, 2, 3]), (1, 2, [0, 0])):
        whole = InlineGenerator(model, build)
        whole.submit(_task(7, ranks, 6))
        expected = whole.receive()
        generators = [InlineGenerator(model, build, v) for v in versions]
        pool = GeneratorPool(generators, sink=None, unit=2, pad_token_id=tokenizer.pad_token_id)
        pool.submit(_task(7, ranks, 6))
        got = pool.receive()
        _assert_same_round(got, expected)
        shares = [g.shares[0] for g in generators]
        assert [span for share in shares for span in share] == round_parts([6] * ranks, 2)
        for share in shares:
            assert all(start % 2 == 0 and stop - start == 2 for _, start, stop in share)
        assert (got.version, got.seconds, got.idle_seconds) == \
            (min(versions), 1.0 + max(versions), sum(versions) / len(versions))
    assert shares == [[(0, 0, 2), (0, 2, 4)], [(0, 4, 6)]]
    assert [len(b) for b in blocks(list(range(6)), 4)] == [2, 2, 1, 1]
    assert [s.spans for s in split_round(_task(0, 2, 6), 4, 2)][1] == [(0, 4, 6), (1, 0, 2)]


def test_a_round_needs_a_part_per_process():
    """Fewer parts (chunks, or with tools training processes) than processes: a ConfigError
    naming generator_processes, the parts and the fix; as many: accepted."""
    check_pool_parts(2, [4], G, 2 * G, tools=False)
    with pytest.raises(ConfigError, match=r"'generator_processes' is 3, but a round has only 2 "
                       r"part\(s\).*generator_processes <= 2, or generation_chunk_size <= 4"):
        check_pool_parts(3, [4], G, 2 * G, tools=False)
    with pytest.raises(ConfigError, match="with tools each training process's rollouts are one"):
        check_pool_parts(2, [4], G, G, tools=True)
    check_pool_parts(2, [4, 4], G, None, tools=True)


def test_the_cores_are_dealt_in_blocks_and_the_threads_follow_them(tiny_model_dir, monkeypatch):
    """generator_cpus dealt in contiguous blocks, the first processes one more ([1, 2, 3] to 2:
    [1, 2] and [3]; [1, 2]: one core each); threads: generator_threads, else each process's cores'
    count, else the trainer's threads divided among the processes; one shared staging copy."""
    made = []

    def recording(*args, **kw):   # GeneratorProcess's signature, enforced
        inspect.signature(GeneratorProcess).bind(*args, **kw)
        made.append(kw)
        return SimpleNamespace(name="", process=SimpleNamespace(pid=len(made)))
    monkeypatch.setattr(generator_pool, "GeneratorProcess", recording)
    monkeypatch.setattr(generator_pool.torch, "get_num_threads", lambda: 5)
    policy = load_model(tiny_model_dir)
    for cpus, threads, expected in (([1, 2, 3], None, [([1, 2], 2), ([3], 1)]),
                                    ([1, 2], 3, [([1], 3), ([2], 3)]),
                                    (None, None, [(None, 2), (None, 2)])):
        made.clear()
        pool = start_pool(policy, None, processes=2, unit=1, pad_token_id=0, cpus=cpus,
                          threads=threads, heartbeat_stale_after_s=1.0)
        assert [(kw["cpus"], kw["threads"]) for kw in made] == expected
        assert all(kw["sink"] is pool.sink for kw in made)
    assert pool.name == "2 generator processes (pids 1, 2)"


@pytest.fixture
def pool(tiny_model_dir):
    """Two real generator processes on the tiny model, chunks of one question."""
    build, tokenizer = _build(tiny_model_dir, chunk_size=G)
    policy = load_model(tiny_model_dir)
    pool = start_pool(policy, build, processes=2, unit=1, pad_token_id=tokenizer.pad_token_id,
                      cpus=None, threads=1, heartbeat_stale_after_s=5.0)
    yield pool, policy, build
    pool.close()


def test_every_process_samples_with_every_push(pool):
    """A push between two rounds reaches both processes: the next round, merged, is what one
    process samples with the pushed weights (and tagged with the push's version), in both
    processes' halves; the first round is the start weights'."""
    pool, policy, build = pool
    start = copy.deepcopy(policy)
    pool.push(policy, 0)
    pool.submit(_task(0, 1, 4))
    first = pool.receive()
    change_in_place(policy, 0.5)
    pool.push(policy, 1)
    pool.submit(_task(1, 1, 4))
    second = pool.receive()
    assert (first.version, second.version) == (0, 1)
    for model, got in ((start, first), (policy, second)):
        whole = InlineGenerator(model, build)
        whole.submit(RolloutTask(got.task_id, 2, _task(0, 1, 4).rows))
        _assert_same_round(got, whole.receive())


@pytest.mark.parametrize("k, how", [(1, "killed"), (0, "hung")])
def test_a_killed_or_hung_process_is_an_error_naming_it(pool, k, how):
    """SIGKILL to the second of two processes, or SIGSTOP to the first (no heartbeat for
    heartbeat_stale_after_s, 5 s): the next round is a GeneratorError naming it (process k of 2,
    its pid, the signal or the silence), not a hang; both processes are stopped."""
    pool, _, _ = pool
    pool.submit(_task(0, 1, 4))
    pool.receive()
    victim = pool.generators[k].process
    os.kill(victim.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    pool.submit(_task(1, 1, 4))
    what = "ended with signal 9" if how == "killed" else "sent no heartbeat"
    with pytest.raises(GeneratorError, match=rf"generator process {k + 1} of 2 "
                       rf"\(pid {victim.pid}\) {what}"):
        pool.receive()
    assert all(g.process.exitcode is not None for g in pool.generators)


@pytest.mark.parametrize("values, names", [
    (dict(generator_processes=0), ["generator_processes", ">= 1"]),
    (dict(generator_processes=(os.cpu_count() or 1) + 1),
     ["generator_processes", f"{(os.cpu_count() or 1) + 1}", f"{os.cpu_count() or 1} cores",
      f"generator_processes <= {os.cpu_count() or 1}"]),
    (dict(async_rollout=True, use_vllm=True, vllm_mode="server", generator_processes=2),
     ["generator_processes", "use_vllm", "vllm_server_base_url", "generator_processes: 1"]),
    (dict(generator_processes=2, generator_cpus=[0]),
     ["generator_cpus", "[0]", "generator_processes 2", "at least 2 cores"]),
])
def test_bad_generator_process_settings_name_the_field_and_the_fix(values, names):
    assert_config_error_names(values, names)


def test_two_processes_on_this_machine_are_accepted():
    """The machine's cores bound the processes: as many as it has are accepted (2 here)."""
    CPPOConfig(async_rollout=True, generator_processes=os.cpu_count() or 1)


def test_two_generator_processes_at_max_staleness_0_are_the_synchronous_run(tiny_model_dir,
                                                                           tmp_path):
    """Two generator processes at max_staleness 0, chunks of one question (each process two of
    a round's four): the same completions, losses and weights as sampling in the trainer
    (float64, the bound of test_async_rollout's one-process test)."""
    runs = {}
    for name, extra in (("sync", FLOAT32),
                        ("async", dict(FLOAT32, async_rollout=True, max_staleness=0,
                                       generator_processes=2, generator_threads=1))):
        batches = []
        with make_trainer(tiny_model_dir, tmp_path / name, max_steps=2, torch_dtype="float64",
                          generation_chunk_size=G, **extra) as trainer:
            step = trainer.learner.step
            trainer.learner.step = lambda batch, *a: batches.append(batch) or step(batch, *a)
            trainer.train()
            if name == "async":
                assert isinstance(trainer.rollouts.generator.generator, GeneratorPool)
        metrics = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        runs[name] = (batches, [r["loss"] for r in metrics if "loss" in r],
                      load_file(tmp_path / name / "checkpoint-2" / "model.safetensors"))
    for sync, asynchronous in zip(runs["sync"][0], runs["async"][0], strict=True):
        assert torch.equal(sync.completion_ids, asynchronous.completion_ids)
    assert runs["async"][1] == runs["sync"][1]
    for key, value in runs["sync"][2].items():
        torch.testing.assert_close(runs["async"][2][key], value, atol=1e-10, rtol=0, msg=key)
