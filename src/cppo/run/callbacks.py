"""transformers callbacks in the CPPO loop: `CPPOTrainer(callbacks=[...])`.

Each `transformers.TrainerCallback` gets the events of `transformers.Trainer` (on_init_end,
on_train_begin, on_step_begin, on_step_end, on_log, on_evaluate, on_save, on_train_end) with
transformers' own `TrainerState` and `TrainerControl`; `args` is the run's `CPPOConfig` (TRL's field
names). A callback may set `control.should_training_stop` (the run stops after this step, with a
checkpoint), `control.should_save` (a checkpoint now) or `control.should_evaluate` (a held-out
evaluation now); the trainer resets the last two once done, as transformers does.

A callback that raises stops the run: the trainer writes a checkpoint and re-raises the error as
`CallbackError`, naming the callback and the event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable
from cppo.errors import CallbackError

if TYPE_CHECKING:
    from cppo.config.sections import OptimizationSection, RunSection


class Callbacks:
    """Holds the callbacks, the TrainerState and the TrainerControl, and calls the events."""

    def __init__(self, callbacks: Iterable | None, run: RunSection,
                 optimization: OptimizationSection, *, event_args, max_steps: int, is_main: bool,
                 is_local_main: bool) -> None:
        """run, optimization: the config's sections (the TrainerState's logging_steps, eval_steps,
        save_steps, train_batch_size, num_train_epochs); event_args: what every event gets as
        `args` (transformers hands callbacks its TrainingArguments: here the run's CPPOConfig),
        passed on and never read here."""
        from transformers import TrainerCallback, TrainerControl, TrainerState
        self.callbacks = []
        for cb in callbacks or []:
            if isinstance(cb, type) and issubclass(cb, TrainerCallback):
                cb = cb()   # transformers also accepts a callback class
            if not isinstance(cb, TrainerCallback):
                raise TypeError(f"callbacks: {cb!r} is not a transformers.TrainerCallback")
            self.callbacks.append(cb)
        self.args = event_args
        self.state = TrainerState(max_steps=max_steps, logging_steps=run.logging_steps,
                                  eval_steps=run.eval_steps, save_steps=run.save_steps,
                                  train_batch_size=optimization.per_device_train_batch_size,
                                  num_train_epochs=optimization.num_train_epochs,
                                  is_local_process_zero=is_local_main,
                                  is_world_process_zero=is_main)
        self.control = TrainerControl()
        self.failed = False   # after a callback raised, no more events (the run is stopping)
        self.objects: dict = {}

    def bind(self, **objects) -> None:
        """model, processing_class, optimizer, lr_scheduler: passed to every event as keywords."""
        self.objects = {"train_dataloader": None, "eval_dataloader": None, **objects}

    def sync(self, *, step: int, epoch: float, num_tokens: int | None = None) -> None:
        self.state.global_step = step
        self.state.epoch = epoch
        if num_tokens is not None:
            self.state.num_input_tokens_seen = num_tokens

    def event(self, name: str, **kwargs):
        """Call `name` on every callback; a returned control replaces the current one."""
        if self.failed:
            return self.control
        for cb in self.callbacks:
            try:
                result = getattr(cb, name)(self.args, self.state, self.control,
                                           **self.objects, **kwargs)
            except Exception as err:  # noqa: BLE001 -- re-raised with the callback's name
                self.failed = True
                raise CallbackError(f"callback {type(cb).__name__}.{name} raised "
                                    f"{type(err).__name__}: {err}") from err
            if result is not None:
                self.control = result
        return self.control

    def log(self, logs: dict) -> None:
        self.state.log_history.append(dict(logs))
        self.event("on_log", logs=logs)

    def take(self, flag: str) -> bool:
        """Read a should_* flag and reset it (should_training_stop stays set)."""
        value = getattr(self.control, flag)
        if flag != "should_training_stop":
            setattr(self.control, flag, False)
        return bool(value)
