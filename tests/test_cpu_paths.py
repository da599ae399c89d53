"""The numerics-sensitive tests also pass on another CPU's code paths.

torch's ATen kernels and oneDNN pick their code by the CPU they run on (AVX512, AMX, AVX2...), so
two float32 computations that take different kernels round differently from one machine to the
next. A test tuned on one machine's rounding then fails on another. Here the tests marked
`cpu_paths` (the comparisons of two code paths: against TRL's trainer, one process against two,
a resumed run against an uninterrupted one, the sampler's log-probs against the policy's, the
bf16 selection) run again in a child pytest with both libraries held to AVX2
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2), so a change made on an AVX512 machine cannot
break an AVX2 one. On a machine whose own code paths are already AVX2 or lower this is the
default run, and it is skipped.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
WIDER_THAN_AVX2 = torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT", "NO AVX")


def child_pytest(args: list[str], env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """`pytest args` in a child process with `env` on top of this one's (never the parent's own
    xdist workers: one process, this file's conftest)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:warnings",
               "--basetemp", str(tmp_path / "basetemp"), *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run(command, cwd=ROOT, env={**environ, **env}, capture_output=True,
                          text=True, timeout=1200)


def test_forcing_avx2_changes_the_kernels_torch_runs():
    """The override is real: the child's torch reports AVX2 kernels and oneDNN without bf16."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu."
                          "get_cpu_capability(), torch.ops.mkldnn._is_mkldnn_bf16_supported())"],
                         env={**os.environ, **AVX2}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AVX2", "False"]


def test_a_differential_case_passes_the_same_bounds_on_avx2_and_on_this_cpu(tmp_path):
    """One TRL comparison (tool_mask_entropy: the case whose float32 tolerance failed on an
    AMX machine) on this CPU's own code paths and on AVX2's: both within the same bounds
    (tests/helpers/trl_twin.py), each path's differences recorded."""
    pytest.importorskip("trl")
    case = "tests/test_trl_differential.py::test_objectives_match_trl[tool_mask_entropy]"
    from helpers import MARGINS_ENV
    from helpers.trl_twin import FIRST_STEP, LATER_STEPS
    for name, env in (("this_cpu", {}), ("avx2", AVX2)):
        margins = tmp_path / f"{name}.jsonl"
        run = child_pytest([case], {**env, MARGINS_ENV: str(margins)}, tmp_path / name)
        assert run.returncode == 0, f"{name}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
        (line,) = [json.loads(x) for x in margins.read_text().splitlines()]
        assert line["first_step"] <= FIRST_STEP and line["later_steps"] <= LATER_STEPS, (name, line)


@pytest.mark.skipif(not WIDER_THAN_AVX2, reason="this CPU's own code paths are AVX2 or narrower: "
                    "the default run already takes them")
def test_the_numerics_sensitive_tests_pass_on_avx2_code_paths(tmp_path):
    run = child_pytest(["-m", "cpu_paths"], AVX2, tmp_path)
    tail = run.stdout[-6000:] + "\n" + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
