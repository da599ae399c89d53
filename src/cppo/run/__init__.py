"""The run's bookkeeping: checkpoints and run state, metrics and trackers, the completions table, callbacks."""
