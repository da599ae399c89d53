"""transformers' speed and precision fields under their names and defaults: torch_compile (+
backend, mode), tf32, fp16, use_liger_kernel (+ liger_kernel_config), gradient_checkpointing_kwargs
and activation_checkpointing. Each value reaches the code that uses it, the defaults are TRL's,
and a bad value is a ConfigError naming the field. (CUDA paths: tests/test_cuda.py.)"""

import dataclasses

import pytest
import torch

from cppo.config import CPPOConfig
from cppo.config.trl_fields import TRL_FIELDS, translate
from cppo.errors import ConfigError
from helpers import make_trainer

SPEED_FIELDS = ("torch_compile", "torch_compile_backend", "torch_compile_mode", "tf32", "fp16",
                "use_liger_kernel", "liger_kernel_config", "gradient_checkpointing_kwargs")
GRAPHS: list[int] = []   # graphs the counting backend compiled


def _counting(gm, example_inputs):
    GRAPHS.append(len(gm.graph.nodes))
    return gm.forward


torch._dynamo.register_backend(_counting, name="cppo_counting")


def test_the_speed_fields_are_honoured_with_trls_defaults():
    trl = pytest.importorskip("trl")
    defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    cfg, own = CPPOConfig(), {f.name for f in dataclasses.fields(CPPOConfig)}
    for name in SPEED_FIELDS:
        assert name in own and name not in TRL_FIELDS, name
        assert getattr(cfg, name) == defaults[name], name


def test_activation_checkpointing_maps_onto_gradient_checkpointing():
    own = {f.name for f in dataclasses.fields(CPPOConfig)}
    out, dropped = translate({"activation_checkpointing": True,
                              "activation_checkpointing_kwargs": {"use_reentrant": True}}, own)
    assert out == {"gradient_checkpointing": True,
                   "gradient_checkpointing_kwargs": {"use_reentrant": True}} and dropped == {}


def test_compile_settings_follow_transformers_rule():
    from cppo.config.sections import PrecisionSection
    from cppo.models.compiled import CompileSettings, compile_settings
    assert compile_settings(PrecisionSection()) is None
    assert compile_settings(PrecisionSection(torch_compile=True)) == CompileSettings("inductor", None)
    assert compile_settings(PrecisionSection(torch_compile_mode="max-autotune")) == \
        CompileSettings("inductor", "max-autotune")   # a mode alone turns it on
    assert compile_settings(PrecisionSection(torch_compile_backend="eager")) == \
        CompileSettings("eager")


@pytest.mark.parametrize("lean", [True, False])
def test_compile_runs_the_training_passes_through_the_backend(tiny_model_dir, lean):
    """Lean forward: its per-layer work is compiled; without it, the model's own forward. The
    log-probs and gradients are the eager pass's."""
    from cppo.models.compiled import CompileSettings
    from cppo.sampling import logprobs
    from helpers import sampled_for_scoring
    model, args = sampled_for_scoring(tiny_model_dir)
    results = []
    for settings in (None, CompileSettings("cppo_counting")):
        torch._dynamo.reset()   # compiled code is cached per function: start afresh
        GRAPHS.clear()
        model.zero_grad()
        logprobs.completion_logprobs(model, *args, forward=logprobs.ForwardSettings(
            lean=lean, compile=settings)).sum().backward()
        results.append(([p.grad.clone() for p in model.parameters()], len(GRAPHS)))
    (eager_grads, eager_graphs), (compiled_grads, compiled_graphs) = results
    assert eager_graphs == 0 and compiled_graphs >= 1
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(a, b)


def test_torch_compile_in_a_run_compiles_and_reports_its_time(tiny_model_dir, tmp_path, capsys):
    torch._dynamo.reset()
    GRAPHS.clear()
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=2,
                           torch_compile_backend="cppo_counting")
    summary = trainer.train()
    assert GRAPHS and summary["status"] == "completed"
    records = [r for r in map(__import__("json").loads,
                              (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert all("timing/compile" in r for r in records)
    assert summary["compile_seconds"] >= 0 and "torch.compile:" in capsys.readouterr().out


def test_tf32_follows_transformers_rule():
    from cppo.config.sections import PrecisionSection
    from cppo.parallel.hardware import apply_tf32, tf32_setting
    rule = lambda tf32, compile_=False, fp16=False, bf16=False, available=True: tf32_setting(  # noqa: E731
        tf32, torch_compile=compile_, fp16=fp16, bf16=bf16, available=available)
    assert rule(True) is True and rule(False) is False and rule(None) is None
    assert rule(None, compile_=True) is True             # compiling turns TF32 on ...
    assert rule(None, compile_=True, fp16=True) is None   # ... unless fp16
    assert rule(True, available=False) is None           # no TF32 here (true is refused earlier)
    if not torch.cuda.is_available():
        assert apply_tf32(PrecisionSection(torch_compile=True), bf16=False) is None


def test_fp16_autocasts_to_float16_with_a_gradient_scaler(tiny_model_dir, tmp_path):
    """fp16 on a CPU runs as documented (float16 autocast, a gradient scaler); tests/test_cuda.py
    runs it on a GPU."""
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=2, fp16=True, matmul_dtype=None)
    with trainer.learner.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert trainer.learner.scaler is not None
    seen = []
    trainer.learner.scaler.scale = lambda loss, f=trainer.learner.scaler.scale: seen.append(1) or f(loss)
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["nonfinite_steps"] == 0 and seen
    records = [r for r in map(__import__("json").loads,
                              (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert all(r["cppo/fp16_loss_scale"] > 0 for r in records)


def test_use_liger_kernel_takes_the_chunked_head(tiny_model_dir, tmp_path, monkeypatch):
    """use_liger_kernel: the training passes never build the full logits (cppo's chunked head,
    what liger's fused linear cross-entropy does); without it, a small micro-batch does."""
    from cppo.models.lean import LeanForward
    calls = []
    original = LeanForward._logits
    monkeypatch.setattr(LeanForward, "_logits", lambda self, w, h: calls.append(1) or original(self, w, h))
    for liger, expect_full_logits in ((False, True), (True, False)):
        trainer = make_trainer(tiny_model_dir, tmp_path / str(liger), max_steps=1,
                               use_liger_kernel=liger)
        batch = _one_batch(trainer)
        calls.clear()   # sampling runs the lean forward's head too: count the update's pass only
        trainer.learner.logprobs(trainer.policy, batch)
        assert bool(calls) == expect_full_logits, liger


def _one_batch(trainer):
    rows, _, _ = trainer.take_questions()
    prompts, completions = trainer.generate(rows)
    scores = trainer.score(rows, completions)
    advantages = trainer.advantages(scores)
    return trainer.build_batch(prompts, completions, advantages, torch.ones_like(advantages).bool())


@pytest.mark.parametrize("kwargs, reentrant", [(None, False), ({"use_reentrant": True}, True)])
def test_gradient_checkpointing_kwargs_reach_the_model(tiny_model_dir, kwargs, reentrant):
    from cppo.models import load_model, load_tokenizer
    from cppo.config.sections import ModelSection, PrecisionSection
    from cppo.models.loading import load_policy
    model, calls = load_model(tiny_model_dir), []
    model.gradient_checkpointing_enable = lambda **kw: calls.append(kw)
    model.enable_input_require_grads = lambda: calls.append("inputs")
    cfg = CPPOConfig(model=tiny_model_dir, gradient_checkpointing=True,
                     gradient_checkpointing_kwargs=kwargs)
    load_policy(model, load_tokenizer(tiny_model_dir), ModelSection.of(cfg),
                PrecisionSection.of(cfg), torch.device("cpu"),
                chat_template_kwargs=cfg.chat_template_kwargs, lora=False)
    assert calls[0] == {"gradient_checkpointing_kwargs": kwargs or {"use_reentrant": False}}
    assert ("inputs" in calls) == reentrant   # reentrant checkpoints need inputs with grad (TRL)


@pytest.mark.parametrize("values, match", [
    ({"fp16": True, "bf16": True}, "'fp16' and 'bf16' are both true"),
    ({"fp16": True, "torch_dtype": "float16"}, "'fp16' is true with 'torch_dtype' float16"),
    ({"fp16": True, "matmul_dtype": "bfloat16"}, "'fp16' is true with 'matmul_dtype' bfloat16"),
    ({"torch_compile_backend": "inductr"}, "'torch_compile_backend' is 'inductr'; .*inductor"),
    ({"torch_compile_mode": "fastest"}, "'torch_compile_mode' is 'fastest'; allowed: default"),
    ({"gradient_checkpointing_kwargs": {"reentrant": True}},
     r"'gradient_checkpointing_kwargs' has \['reentrant'\].*use_reentrant"),
    ({"gradient_checkpointing_kwargs": "true"}, "'gradient_checkpointing_kwargs' expects a mapping"),
    ({"liger_kernel_config": "[1]"}, "'liger_kernel_config' expects a mapping"),
])
def test_bad_speed_values_are_clear_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        CPPOConfig.load(None, values)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine")
def test_tf32_true_without_a_cuda_gpu_is_refused_as_in_transformers():
    with pytest.raises(ConfigError, match="'tf32' is true, but TF32 needs a CUDA GPU.*tf32: null"):
        CPPOConfig(tf32=True)


def test_the_mappings_come_from_the_command_line_as_json():
    from cppo.cli import build_parser, train_config
    args = build_parser().parse_args(["train", "--gradient_checkpointing_kwargs",
                                      '{"use_reentrant": true}', "--liger_kernel_config",
                                      '{"rope": false}', "--torch_compile", "--tf32", "false"])
    cfg = train_config(args)
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": True}
    assert cfg.liger_kernel_config == {"rope": False} and cfg.torch_compile and cfg.tf32 is False


def test_fp16_loss_scale_is_checkpointed_and_resumed(tiny_model_dir, tmp_path):
    first = make_trainer(tiny_model_dir, tmp_path, max_steps=2, save_steps=1, fp16=True,
                         matmul_dtype=None)
    first.learner.scaler._init_scale = 1024.0   # as after a few overflows
    first.train()
    scale = first.learner.scaler.get_scale()
    again = make_trainer(tiny_model_dir, tmp_path, max_steps=3, save_steps=1, fp16=True,
                         matmul_dtype=None, resume=True)
    assert again.learner.scaler.get_scale() != scale   # a fresh scaler starts at 2^16
    assert again._maybe_resume(None) == str(tmp_path / "checkpoint-2")   # as train() resumes
    assert again.learner.scaler.get_scale() == scale
