"""Stopping a run on a signal: Ctrl-C (SIGINT) or a scheduler's SIGTERM only asks to stop (the
loop finishes its step, then the final checkpoint, evaluation and summary complete; a second
Ctrl-C aborts), and `cppo train`'s exit code for each way a run ends."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# `cppo train`'s exit code for each end of a run (summary["status"]); 143 = 128 + SIGTERM, the
# shell's code for a terminated process, so a scheduler sees a preempted run as not finished
EXIT_CODES = {"completed": 0, "interrupted": 0, "stopped_by_callback": 0,
              "stopped_nonfinite": 1, "terminated": 143}


@contextmanager
def stop_handlers(handler):
    """`handler` on SIGINT and SIGTERM inside the block (main thread only: signals reach no
    other), the previous handlers restored after it."""
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS} if main else {}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_request(requested, signum):
    """The stop request after signal `signum` arrives while `requested` (False, or the signal
    that asked first) stands: the first asks (said in one line); a second Ctrl-C stops at once,
    without saving (KeyboardInterrupt); a repeated SIGTERM changes nothing (SLURM signals every
    process of a job step, and torchrun passes its own SIGTERM on again)."""
    if requested:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        return requested
    if signum == signal.SIGINT:
        print("\nCtrl-C: finishing this step, saving a checkpoint and exiting "
              "(press again to abort without saving)", flush=True)
    else:
        print("\nSIGTERM: finishing this step, saving a checkpoint and exiting with code "
              f"{EXIT_CODES['terminated']}", flush=True)
    return signum
