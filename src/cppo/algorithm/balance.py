"""`pruning_rate: auto`: the pruning rate that keeps the trainer and the generator both busy.

With asynchronous rollouts a round's generation is fixed by the step plan (its questions, planned
for pruning_rate_start), while its training is the kept completions, a share 1 - P of them.
After each round arrives the kept share moves by the imbalance the round showed:

    w: seconds the trainer waited for the round (it idled: it could train on more)
    i: seconds the generator waited for a task before sampling it (the trainer stalled it)
    s: seconds the generator took to sample the round

    error = clamp((w - i) / s, -1, 1)
    keep' = clamp(keep x (1 + gain x error), 1 - P_max, 1 - P_min),   P' = 1 - keep'

Balanced, each round's training takes what its sampling takes: the trainer waits as long as
the generator idles, the error is 0 and P stays. The clamp bounds one round's move to `gain`
(a long evaluation or checkpoint stalls the generator as training does); the generator's idle
time is seen up to the rounds sampled ahead late, so the gain is small.
"""

from __future__ import annotations

AUTO = "auto"   # pruning_rate's value that turns this on
GAIN = 0.2      # the kept share's relative move per round at an error of 1


def balanced_pruning_rate(pruning_rate: float, *, trainer_wait: float, generator_idle: float,
                          round_seconds: float, low: float, high: float,
                          gain: float = GAIN) -> float:
    """The next round's pruning rate in [low, high] from this one's (module doc): lower when the
    trainer waited, higher when the generator idled; unchanged when neither did (or the round
    took no sampling time)."""
    keep = 1.0 - pruning_rate
    if round_seconds > 0:
        error = max(-1.0, min(1.0, (trainer_wait - generator_idle) / round_seconds))
        keep *= 1.0 + gain * error
    return 1.0 - max(1.0 - high, min(1.0 - low, keep))
