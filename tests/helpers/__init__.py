"""What the tests share: the tiny arithmetic rows, a reward that varies on a random model, a
trainer on the tiny model, and `cppo train` run in a child process that a test can signal.

Children find this package through PYTHONPATH, so `--reward_funcs helpers:odd_length_reward` works
in them exactly as in the test process. helpers.tiny_hf builds tiny Llama/Qwen2 models and
GSM8K/MATH-format rows; helpers/dist_worker.py is the torchrun script of test_distributed.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent   # tests/: children import helpers from it
ROWS = [{"prompt": f"{a:02d}*{b:02d}=", "answer": f"{a * b:04d}"} for a in range(10) for b in range(3, 9)]


PARK_ENV = "CPPO_TEST_PARK_RUN"   # see park_in_training
MARGINS_ENV = "CPPO_MARGINS"       # see note_margin


def assert_config_error_names(values: dict, names: list[str]) -> None:
    """CPPOConfig(**values) raises a ConfigError whose text holds each of `names`."""
    import pytest
    from cppo.config import CPPOConfig
    from cppo.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        CPPOConfig(**values)
    for name in names:
        assert name in str(err.value), name


def closeness(got, expected, *, atol: float, rtol: float) -> float:
    """max |got - expected| / (atol + rtol |expected|): torch.testing.assert_close passes at <= 1."""
    diff = (got.double() - expected.double()).abs()
    return float((diff / (atol + rtol * expected.double().abs())).max()) if diff.numel() else 0.0


def note_margin(check: str, **differences: float) -> None:
    """With CPPO_MARGINS=path set, append one JSON line: the current test, `check` and the
    differences it measured against its bounds (benchmarks/cpu_paths.py reads them to report each
    bound's margin per CPU code path). A no-op otherwise."""
    path = os.environ.get(MARGINS_ENV)
    if not path:
        return
    case = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    with open(path, "a") as f:
        f.write(json.dumps({"case": case, "check": check, **differences}) + "\n")


def odd_length_reward(prompts, completions, completion_ids=None, **columns):
    """Varied rewards on a random model: 1 for completions with an odd number of characters
    (of the last message's content for chat completions), 0 otherwise."""
    park_in_training()
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 2) for t in texts]


def park_in_training() -> None:
    """Test hook for a child run: with PARK_ENV=<output_dir> set, the first reward call after 3
    logged steps (so inside step 4) creates <output_dir>.parked and waits for <output_dir>.go, so
    that a test can signal the child at a known point in the middle of training. A no-op otherwise."""
    run = os.environ.get(PARK_ENV)
    if not run or Path(run + ".parked").exists() or len(step_records(Path(run))) < 3:
        return
    Path(run + ".parked").touch()
    deadline = time.monotonic() + 300
    while not Path(run + ".go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def write_jsonl(path: Path, rows=ROWS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_args(model_dir: str, data: Path, output_dir: Path, **overrides) -> list[str]:
    """`cppo train` arguments for a 6-step run on the tiny model, checkpoint every 2 steps."""
    values = dict(model=model_dir, dataset_name=str(data), output_dir=str(output_dir),
                  reward_funcs="helpers:odd_length_reward", max_steps=6,
                  per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                  max_completion_length=5, eval_steps=0, save_steps=2, save_total_limit=1,
                  progress_bar="false", eval_num_questions=4, learning_rate=1e-3, seed=3,
                  log_completions="false")
    values.update(overrides)
    return ["train"] + [a for k, v in values.items() for a in (f"--{k}", str(v))]


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"          # as the tests in this process (conftest.py)
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def start_train(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """`python -m cppo.cli train ...` in a child process; stdout and stderr go to `log`."""
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "cppo.cli", *args], stdout=fh,
                                stderr=subprocess.STDOUT, env=child_env(**env))


def wait_until(condition, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    """Poll `condition()` until true; fail with the child's output if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) early:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting; child output:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def step_records(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:   # a line being written right now
            pass
    return [r for r in records if "reward" in r]


def load_weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(checkpoint / "model.safetensors")


def make_trainer(model_dir: str, output_dir: Path, reward=odd_length_reward, rows=ROWS,
                 callbacks=None, **overrides):
    """A CPPOTrainer on the tiny model in this process: 4 steps of B = 8 kept of Q = 4 x G = 4."""
    from cppo.config import CPPOConfig
    from cppo.models import load_model, load_tokenizer
    from cppo.trainer import CPPOTrainer
    values = dict(model=model_dir, output_dir=str(output_dir), max_steps=4,
                  per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                  max_completion_length=5, eval_steps=0, save_steps=2, progress_bar=False,
                  eval_num_questions=4, learning_rate=1e-3, seed=3, log_completions=False)
    values.update(overrides)
    rewards = reward if isinstance(reward, list) else [reward]
    return CPPOTrainer(model=load_model(model_dir), processing_class=load_tokenizer(model_dir),
                       reward_funcs=rewards, args=CPPOConfig(**values), train_dataset=rows,
                       eval_dataset=rows[:4], callbacks=callbacks)


def raising_reward(prompts, completions, completion_ids=None, **kw):
    """A broken user reward: raises on any input."""
    return [1 / 0 for _ in completions]


def nan_reward(prompts, completions, completion_ids=None, **kw):
    """A broken user reward: NaN for every completion."""
    return [float("nan") for _ in completions]


def sampled_for_scoring(model_dir: str):
    """The tiny model and completion_logprobs' arguments (prompt ids, prompt mask, completion
    ids, completion mask) for 3 sampled completions of each of two prompts (seed 0)."""
    import torch
    from cppo.models import load_model, load_tokenizer
    from cppo.sampling import sampler
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    prompts = sampler.encode_prompts(tok, ["37*42=", "1*2="])
    out = sampler.sample_completions(model, prompts, num_generations=3, max_new_tokens=6,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                     generator=torch.Generator().manual_seed(0))
    return model, (prompts.ids.repeat_interleave(3, 0), prompts.mask.repeat_interleave(3, 0),
                   out.ids, out.mask)
