"""Numerical faults: a NaN/inf in the loss or the gradients is detected, the step is skipped
(no parameter or optimizer change) and counted; `max_consecutive_nonfinite` of them in a row stop
the run with status 'stopped_nonfinite', a clear message and finite parameters on disk."""

import math

import pytest
import torch

import cppo.algorithm.micro_batch
from cppo.run import checkpoint as ckpt
from helpers import load_weights, make_trainer


def inject(trainer, monkeypatch, where: str, bad_steps):
    """Make the update of the given steps (1-based) non-finite, in the loss or in one gradient."""
    if where == "grad":
        param = next(trainer.policy.parameters())
        param.register_hook(lambda g: g * math.nan if trainer.run_state.step + 1 in bad_steps else g)
    else:
        real = cppo.algorithm.micro_batch.reduce_loss

        def reduce_loss(*args, **kwargs):
            loss = real(*args, **kwargs)
            return loss * math.inf if trainer.run_state.step + 1 in bad_steps else loss
        monkeypatch.setattr(cppo.algorithm.micro_batch, "reduce_loss", reduce_loss)


def finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("where", ["grad", "loss"])
def test_consecutive_nonfinite_steps_stop_the_run(tiny_model_dir, tmp_path, monkeypatch, capsys, where):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=10, save_steps=2,
                           max_consecutive_nonfinite=3, save_total_limit=5)
    inject(trainer, monkeypatch, where, bad_steps=range(3, 11))
    summary = trainer.train()
    assert summary["status"] == "stopped_nonfinite"
    assert summary["steps"] == 5 and summary["nonfinite_steps"] == 3
    assert "3 steps in a row had NaN/inf loss or gradients" in capsys.readouterr().out
    # no NaN update was applied: the parameters stay those of step 2, finite, and so on disk
    # (checkpoint-4 was saved in the middle of the streak, checkpoint-5 at the stop)
    latest = ckpt.latest_checkpoint(tmp_path / "run")
    assert latest.name == "checkpoint-5"
    at_2, at_4 = load_weights(tmp_path / "run" / "checkpoint-2"), load_weights(tmp_path / "run" / "checkpoint-4")
    assert finite(load_weights(latest).values())
    assert finite(at_4.values())
    for name, p in trainer.policy.named_parameters():
        if name in at_4:
            assert torch.equal(p.detach(), at_4[name]) and torch.equal(at_2[name], at_4[name]), name
    state = trainer.optimizer.state_dict()["state"]
    assert finite(v for s in state.values() for v in s.values() if torch.is_tensor(v))


def test_nonfinite_stop_writes_a_checkpoint_of_the_stop_step(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=10, save_steps=100,
                           max_consecutive_nonfinite=2)
    inject(trainer, monkeypatch, "grad", bad_steps=range(2, 11))
    summary = trainer.train()
    assert summary["status"] == "stopped_nonfinite"
    latest = ckpt.latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.name == f"checkpoint-{summary['steps']}"
    assert finite(load_weights(latest).values())


def test_an_isolated_nonfinite_step_is_skipped_and_training_goes_on(tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=4, save_steps=0,
                           max_consecutive_nonfinite=2)
    inject(trainer, monkeypatch, "grad", bad_steps={2})
    seen = []
    real_update = trainer.update

    def update(batch, *rest):
        before = [p.detach().clone() for p in trainer.policy.parameters()]
        metrics = real_update(batch, *rest)
        changed = any(not torch.equal(a, p) for a, p in zip(before, trainer.policy.parameters()))
        seen.append((trainer.run_state.step + 1, metrics.get("nonfinite", False), changed))
        return metrics
    trainer.update = update
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert summary["nonfinite_steps"] == 1
    assert [s for s, bad, _ in seen if bad] == [2]
    assert all(changed != bad for _, bad, changed in seen)   # the bad step changed nothing
    assert finite(trainer.policy.parameters())
