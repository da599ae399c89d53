"""Precision by CPU: bf16/fp16 requested on a device without native support warns."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

from cppo.parallel import hardware
from cppo.config import CPPOConfig


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_fast_dtype", lambda dtype: dtype not in hardware.LOW_PRECISION)


@pytest.fixture
def cpu_with_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_fast_dtype", lambda dtype: dtype != "float16")


@pytest.mark.parametrize("overrides, named", [
    ({"bf16": True}, "bf16=true"),
    ({"generation_dtype": "bfloat16"}, "generation_dtype=bfloat16"),
    ({"torch_dtype": "bfloat16"}, "torch_dtype=bfloat16"),
    ({"torch_dtype": "float16", "bf16": True}, "bf16=true, torch_dtype=float16"),
])
def test_low_precision_on_a_cpu_without_it_warns_naming_the_field(cpu_without_bf16, overrides, named):
    with pytest.warns(hardware.SlowPrecisionWarning, match=named):
        hardware.warn_slow_precision("cpu", **overrides)


def test_float32_never_warns(cpu_without_bf16):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = CPPOConfig()
        hardware.warn_slow_precision("cpu", bf16=cfg.bf16, fp16=cfg.fp16, torch_dtype=cfg.torch_dtype,
                                     generation_dtype=cfg.generation_dtype,
                                     matmul_dtype=cfg.matmul_dtype)


def test_bf16_on_a_cpu_with_it_does_not_warn(cpu_with_bf16):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hardware.warn_slow_precision("cpu", bf16=True, generation_dtype="bfloat16")
    assert hardware.slow_precision_requests("cpu", torch_dtype="float16") == \
        ["torch_dtype=float16"]


def test_the_trainer_warns_before_training(cpu_without_bf16, tiny_model_dir, tmp_path):
    from cppo.models import load_model, load_tokenizer
    from cppo.trainer import CPPOTrainer
    rows = [{"prompt": f"{a:02d}*11=", "answer": f"{a * 11:04d}"} for a in range(8)]
    cfg = CPPOConfig(model=tiny_model_dir, output_dir=str(tmp_path), bf16=True, max_steps=1,
                     num_generations=4, per_device_train_batch_size=8, progress_bar=False)
    with pytest.warns(hardware.SlowPrecisionWarning, match="bf16=true"):
        CPPOTrainer(model=load_model(tiny_model_dir), processing_class=load_tokenizer(tiny_model_dir),
                    args=cfg, train_dataset=rows)


def test_a_cpu_limited_to_avx2_has_no_fast_bf16():
    """The same limit the benchmarks use to emulate an AVX2-only CPU (torch's kernels and
    oneDNN both held to AVX2) makes bf16 count as slow, whatever this CPU has."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", "from cppo.parallel import hardware as h; "
                          "print(h.cpu_capability(), h.has_fast_dtype('bfloat16'))"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["AVX2", "False"]


def test_describe_records_what_benchmarks_need():
    info = hardware.describe()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {"torch", "threads", "avx512_bf16", "fast_bfloat16"} <= set(info)
    assert hardware.has_fast_dtype("float32") and hardware.has_fast_dtype("float32", "cuda")
