"""The rounds of a run (`CPPOTrainer.train`): one `training_round` after another until max_steps;
after each, its metrics into the window (written every logging_steps), evaluation and
checkpoints on their cadence or a callback's ask, and the stops (NaN/inf steps in a row, a
signal, a callback). `trainer` is the CPPOTrainer: the loop reads its run state and calls its
stages; the state stays the trainer's."""

from __future__ import annotations

import signal
import time

from tqdm.auto import tqdm

from cppo.errors import CallbackError
from cppo.run.metrics import crossed


def run_rounds(trainer, log, start_wall: float) -> str:
    """Rounds until max_steps or a stop; returns the run's status ("completed", or why it
    stopped). A callback that raises: this step's parameters are saved, then it is reported."""
    state, status = trainer.run_state, "completed"
    bar = tqdm(total=trainer.total_steps, initial=state.step, desc="cppo train", unit="step",
               disable=not (trainer.args.progress_bar and trainer.dist.is_main), dynamic_ncols=True)
    try:
        while trainer.run_state.step < trainer.total_steps and status == "completed":
            trainer.callbacks.event("on_step_begin")
            round_start = time.perf_counter()
            metrics = trainer.training_round()
            trainer.run_state.train_seconds += time.perf_counter() - round_start
            phases = trainer.timer.pop_last()
            trainer.sync_callbacks()
            log_round(trainer, log, metrics, phases, start_wall)
            trainer.callbacks.event("on_step_end")
            bar.update(trainer.run_state.step - bar.n)
            bar.set_postfix(progress_postfix(metrics, trainer.run_state.history), refresh=False)
            status = after_round(trainer, log, start_wall)
    except CallbackError:
        trainer.save(start_wall)
        raise
    finally:
        bar.close()
    return status


def after_round(trainer, log, start_wall: float) -> str:
    """Stop, evaluate or save after a round: the run's status ("completed": go on)."""
    args, state, dist = trainer.args, trainer.run_state, trainer.dist
    if state.consecutive_nonfinite >= args.max_consecutive_nonfinite:
        print(f"\nstopping: {state.consecutive_nonfinite} steps in a row had NaN/inf "
              f"loss or gradients (max_consecutive_nonfinite={args.max_consecutive_nonfinite}); "
              f"no NaN/inf update was applied, so the checkpoint written now (step "
              f"{state.step}) holds the last good parameters")
        return "stopped_nonfinite"
    asked_eval, asked_save = (dist.any(trainer.callbacks.take(flag))
                              for flag in ("should_evaluate", "should_save"))
    if (args.eval_steps and crossed(state.step, args.eval_steps, args.steps_per_round)) or asked_eval:
        with trainer.engine.gathered():
            trainer.held_out_evaluation(log, start_wall, label=f"step {state.step}")
    stop = dist.max(int(trainer.stop_requested))   # all processes stop together
    if stop:
        return "terminated" if stop == signal.SIGTERM else "interrupted"
    if dist.any(trainer.callbacks.control.should_training_stop):
        return "stopped_by_callback"
    if ((args.save_steps and crossed(state.step, args.save_steps, args.steps_per_round)) or asked_save) \
            and state.step < trainer.total_steps:   # the last step is saved after the loop
        trainer.save(start_wall)
    return "completed"


def log_round(trainer, log, metrics: dict, phases: dict, start_wall: float) -> None:
    """Add the round's metrics to the trainer's window; at a logging step write the window's
    means to the metrics log (rank 0), the completions table and the callbacks."""
    state, every = trainer.run_state, trainer.args.logging_steps
    took = sum(phases.values()) or 1e-9
    trainer.window.add({**metrics, **{f"timing/{k}": v for k, v in phases.items()},
                        "throughput/tokens_per_s": metrics["completions/mean_length"]
                        * metrics["cppo/completions_scored"] / took})
    if not every or not crossed(state.step, every, trainer.args.steps_per_round):
        return
    record = {"step": state.step, "wall_time": round(time.perf_counter() - start_wall, 3),
              **{k: round(v, 6) for k, v in trainer.window.flush().items()},
              "num_tokens": state.counters["num_tokens"],
              "cppo/skipped_steps": state.counters["skipped_steps"]}
    if log is not None:
        log.log(record)
    if trainer.completions_log is not None:
        trainer.completions_log.emit(state.step, log, print_table=True)
    trainer.callbacks.log(record)


def progress_postfix(metrics: dict, history: list[dict]) -> dict:
    """The progress bar's reward, kept completions and last held-out accuracy."""
    post = {"reward": f"{metrics.get('reward', 0):.3f}",
            "kept": metrics.get("cppo/completions_kept", 0)}
    if history:
        post["acc"] = f"{100 * history[-1]['accuracy']:.1f}%"
    return post


def record_evaluation(trainer, log, start_wall: float, label: str, accuracy: float,
                      sampled: dict) -> None:
    """A held-out evaluation into the run's history, the metrics log (rank 0) and the callbacks."""
    state = trainer.run_state
    entry = {"step": state.step, "accuracy": accuracy,
             "wall_time": round(time.perf_counter() - start_wall, 3),
             "train_seconds": round(state.train_seconds, 3), "label": label}
    state.history.append(entry)
    if log is not None:
        log.log({"step": state.step, "wall_time": entry["wall_time"],
                 "train_seconds": entry["train_seconds"], "eval/accuracy": accuracy, **sampled})
    trainer.callbacks.event("on_evaluate", metrics={"eval_accuracy": accuracy, **sampled})
