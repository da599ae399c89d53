"""Crash safety: `cppo train` killed with SIGKILL at any moment, even halfway through writing a
checkpoint, leaves the previous checkpoint loadable, and `--resume` ends with exactly the
parameters of a run that was never killed.

The killed runs are real child processes (`python -m cppo.cli train ...`); checkpoint.py's test hook
(CPPO_TEST_CHECKPOINT_PAUSE=<stage>:<step>) parks a child at a chosen point of a checkpoint write
so the kill lands exactly there. The runs are 6 steps on a tiny random model, checkpoint every 2
steps, one checkpoint kept; the resumes and the uninterrupted run go through `main([...])` here.
"""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from cppo.run import checkpoint as ckpt
from cppo.cli import main
from helpers import (PARK_ENV, load_weights, start_train, step_records, train_args,
                     wait_until, write_jsonl)

PAUSES = {"mid_write": "weights:4", "after_rename": "renamed:4", "mid_step": None, "ctrl_c": None,
          "sigterm": None}
# signal, how many times it is sent, exit code: SIGTERM twice, as SLURM and then torchrun send it
STOPS = {"ctrl_c": (signal.SIGINT, 1, 0), "sigterm": (signal.SIGTERM, 2, 143)}
COUNTERS = ("questions_seen", "completions_scored", "completions_trained", "tokens_generated",
            "skipped_steps", "nonfinite_steps")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    return root, write_jsonl(root / "rows.jsonl")


@pytest.fixture(scope="module")
def killed(data, tiny_model_dir):
    """Start the children at once, SIGKILL each at its point (SIGINT for ctrl_c, SIGTERM for
    sigterm); {name: dir}."""
    root, rows = data
    children = {}
    for name, pause in PAUSES.items():
        env = {ckpt.PAUSE_ENV: pause} if pause else {}
        if name in STOPS:             # parks inside step 4 until signalled (helpers.park_in_training)
            env = {PARK_ENV: str(root / name)}
        log = root / f"{name}.log"
        children[name] = (root / name, start_train(train_args(tiny_model_dir, rows, root / name),
                                                   log, **env), log, pause)

    def at_kill_point(out, log, pause):
        if out.name in STOPS:
            return Path(f"{out}.parked").exists()
        if pause is None:              # somewhere in step 4 or later (or a checkpoint write)
            return len(step_records(out)) >= 3
        return f"{ckpt.PAUSE_ENV} {pause.replace(':', ' ')}" in log.read_text()

    pending, interrupted = dict(children), []

    def kill_those_at_their_point():
        for name, (out, proc, log, pause) in list(pending.items()):
            if proc.poll() is not None:
                raise AssertionError(f"{name}: child exited ({proc.returncode}) before its kill "
                                     f"point:\n{log.read_text()[-3000:]}")
            if at_kill_point(out, log, pause):
                if name in STOPS:   # a signal in step 4: finish it, save, exit (waited for below)
                    sig, times, code = STOPS[name]
                    for _ in range(times):
                        os.kill(proc.pid, sig)
                        time.sleep(0.2)
                    Path(f"{out}.go").touch()
                    interrupted.append((proc, log, code))
                else:
                    os.kill(proc.pid, signal.SIGKILL)
                    assert proc.wait() == -signal.SIGKILL
                del pending[name]
        return not pending

    deadline = time.monotonic() + 300
    try:
        while not kill_those_at_their_point():   # all three together: the mid-step one won't wait
            assert time.monotonic() < deadline, f"timed out before the kill points of {list(pending)}"
            time.sleep(0.05)
        for proc, log, code in interrupted:
            assert proc.wait(timeout=120) == code, log.read_text()[-3000:]
    finally:
        for proc in [c[1] for c in pending.values()] + [p for p, *_ in interrupted]:
            if proc.poll() is None:   # a failure above: leave no child behind
                proc.kill()
                proc.wait()
    return {name: out for name, (out, *_rest) in children.items()}


@pytest.fixture(scope="module")
def straight(data, tiny_model_dir):
    root, rows = data
    out = root / "straight"
    assert main(train_args(tiny_model_dir, rows, out)) == 0
    return out


def _leftovers(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".checkpoint-"))


def test_kill_mid_checkpoint_write_leaves_the_previous_one_loadable(killed, tiny_model_dir):
    out = killed["mid_write"]
    [stale] = _leftovers(out)
    assert stale.startswith(".checkpoint-4.tmp-")
    assert (out / stale / "model.safetensors").is_file()           # killed between files
    assert not (out / stale / "optimizer.pt").exists()
    assert ckpt.list_checkpoints(out) == [out / "checkpoint-2"]    # the half write is ignored
    from cppo.models import load_model
    model = load_model(tiny_model_dir)
    ckpt.load_model_weights(model, out / "checkpoint-2")
    assert "state" in ckpt.load_tensors(out / "checkpoint-2" / "optimizer.pt")
    assert ckpt.load_trainer_state(out / "checkpoint-2")["step"] == 2


@pytest.mark.parametrize("name, status", [("ctrl_c", "interrupted"), ("sigterm", "terminated")])
def test_ctrl_c_and_sigterm_finish_the_step_and_save(killed, name, status):
    """SIGINT / SIGTERM (sent twice) during step 4 of 6 (exit code 0 / 143: the fixture): the
    step finishes, is saved, and the run stops there."""
    out = killed[name]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == status and summary["steps"] == 4
    assert [r["step"] for r in step_records(out)] == [1, 2, 3, 4]
    assert ckpt.latest_checkpoint(out) == out / "checkpoint-4"


def test_kill_after_rename_before_pruning_keeps_both(killed):
    out = killed["after_rename"]
    assert ckpt.list_checkpoints(out) == [out / "checkpoint-2", out / "checkpoint-4"]
    assert _leftovers(out) == []


@pytest.mark.parametrize("name", list(PAUSES))
def test_resume_after_sigkill_ends_with_the_uninterrupted_parameters(killed, straight, data,
                                                                     tiny_model_dir, name):
    out = killed[name]
    assert ckpt.list_checkpoints(out), "the kill left no loadable checkpoint"
    assert main(train_args(tiny_model_dir, data[1], out, resume="true")) == 0
    assert _leftovers(out) == []                                    # stale temp dirs cleaned
    expected, got = load_weights(straight / "checkpoint-6"), load_weights(out / "checkpoint-6")
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    a = json.loads((straight / "summary.json").read_text())
    b = json.loads((out / "summary.json").read_text())
    assert b["status"] == "completed" and b["steps"] == 6 and b["resumed_from"]
    assert {k: a[k] for k in COUNTERS} == {k: b[k] for k in COUNTERS}
    steps = [r["step"] for r in step_records(out)]
    assert steps == sorted(set(steps)) == list(range(1, 7))         # the log has each step once


def test_kill_between_the_renames_of_a_same_step_save(straight, data, tiny_model_dir):
    """`--resume` of a finished run saves checkpoint-6 again: killed after the old one is moved
    aside and before the new one lands, the old one is put back."""
    root, rows = data
    out = root / "same_step"
    shutil.copytree(straight, out)
    log = root / "same_step.log"
    proc = start_train(train_args(tiny_model_dir, rows, out, resume="true"), log,
                       **{ckpt.PAUSE_ENV: "swapped:6"})
    wait_until(lambda: f"{ckpt.PAUSE_ENV} swapped 6" in log.read_text(), proc, log)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoint-6").exists()
    assert any(n.startswith(".checkpoint-6.old-") for n in _leftovers(out))
    assert ckpt.latest_checkpoint(out) == out / "checkpoint-6"     # restored, leftovers removed
    assert _leftovers(out) == []
    expected, got = load_weights(straight / "checkpoint-6"), load_weights(out / "checkpoint-6")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_leftovers_of_a_live_writer_are_left_alone(tmp_path):
    live = tmp_path / f".checkpoint-3.tmp-{os.getpid()}"
    live.mkdir()
    dead = tmp_path / ".checkpoint-5.del-999999999"
    dead.mkdir()
    (tmp_path / "checkpoint-9").mkdir()                             # no COMPLETE marker
    assert ckpt.clean_stale(tmp_path) == [dead]
    assert live.is_dir() and ckpt.latest_checkpoint(tmp_path) is None


class _Payload:
    """A pickled object that would run a command when unpickled."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_poisoned_newest_checkpoint_is_refused_not_passed_over(straight, tmp_path, capfd):
    """The fallback past a damaged newest checkpoint is for damage (a truncated or missing file):
    a whole checkpoint whose optimizer.pt holds code is refused with CheckpointError even when an
    earlier checkpoint would load, and its payload never runs. With only damaged checkpoints
    left, the newest complete one is returned, so that loading it says what is wrong."""
    from cppo.errors import CheckpointError
    run = tmp_path / "poisoned"
    shutil.copytree(straight, run)
    newest = ckpt.list_checkpoints(run)[-1]
    torch.save({"state": {}, "param_groups": [], "payload": _Payload()}, newest / "optimizer.pt")
    with pytest.raises(CheckpointError, match=f"refusing to load {newest}/optimizer.pt"):
        ckpt.latest_checkpoint(run, say=lambda *a, **k: None)
    assert "pwned" not in capfd.readouterr().out
    shutil.copy(straight / newest.name / "optimizer.pt", newest / "optimizer.pt")
    for checkpoint in ckpt.list_checkpoints(run):   # every one damaged: the newest complete one
        (checkpoint / "rng_state.pt").unlink()
    assert ckpt.latest_checkpoint(run, say=lambda *a, **k: None) == newest
