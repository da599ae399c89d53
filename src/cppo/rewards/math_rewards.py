"""Math reward functions with TRL's signature ``f(prompts, completions, completion_ids=None, **columns)``.

Completions are strings or chat messages (the last message's content is scored). Gold answers
arrive as the keyword list ``answer`` (GSM8K ``"... #### 72"`` or a plain answer) or ``solution``
(MATH: its last ``\\boxed{}``). A reward is 1.0 / 0.0, or None where the gold is missing or
unparsable (TRL then leaves the sample out of that function's weighted sum).

``math_accuracy_reward`` runs math-verify in worker processes (:class:`MathVerifier`), never in the
caller: math-verify's own timeouts use ``signal.alarm``, which only works in the main thread, and a
signal cannot stop a long computation inside C code (sympy evaluating ``9^{9^{9^9}}``). Each worker
is a fresh interpreter (``subprocess``, so no fork of a threaded trainer, no re-import of the
user's script) that calls ``verify(parse(gold), parse(answer))`` in its own main thread with
math-verify's soft timeouts; the caller waits at most ``timeout_s`` per pair and otherwise kills the
worker (a new one starts on the next call) and scores the pair 0.0. So the reward is safe from any
thread or process and a batch of n pairs takes at most ``timeout_s * ceil(n / num_workers)``
seconds plus a worker start (~1 s). POSIX only (``select`` on pipes).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import queue
import select
import subprocess
import sys
import threading
from pathlib import Path

from cppo.rewards.answers import (
    completion_text,
    extract_answer_tag,
    extract_gsm8k_gold,
    extract_last_boxed,
    extract_numeric_answer,
    gold_number,
)

DEFAULT_TIMEOUT_S = 10.0        # hard bound per (gold, answer) pair
DEFAULT_MAX_CHARS = 2000        # longer answers are cut to their last MAX chars before parsing
STARTUP_TIMEOUT_S = 120.0       # a worker must import math-verify within this (slow shared CPUs)


# --- simple rewards -------------------------------------------------------------------------------

def gsm8k_accuracy_reward(prompts, completions, completion_ids=None, answer=None, **columns):
    """1.0 when the completion's number equals the gold number exactly, else 0.0; None for bad gold.

    The completion's number comes from its ``<answer>`` block, else its last ``\\boxed{}``, else its
    last number (see :func:`cppo.rewards.answers.extract_numeric_answer`); "5.00" equals "5".
    """
    golds = _column("gsm8k_accuracy_reward", "answer", answer, completions, columns)
    rewards: list[float | None] = []
    for completion, gold in zip(completions, golds):
        gold_value = gold_number(_as_text(gold))
        if gold_value is None:
            rewards.append(None)
            continue
        predicted = extract_numeric_answer(completion_text(completion))
        rewards.append(1.0 if predicted == gold_value else 0.0)
    return rewards


def format_reward(prompts, completions, completion_ids=None, **columns):
    """1.0 when the whole completion is ``<think>...</think> <answer>...</answer>`` (R1 style).

    Each tag appears exactly once, only whitespace sits between ``</think>`` and ``<answer>`` and
    around the whole; the blocks may hold anything else, including nothing. (A chat template that
    already opens ``<think>`` in the prompt needs a reward that accepts its missing opening tag.)
    """
    return [1.0 if _is_r1_format(completion_text(c)) else 0.0 for c in completions]


def boxed_format_reward(prompts, completions, completion_ids=None, **columns):
    """1.0 when the completion has a ``\\boxed{...}`` with balanced braces and non-empty content."""
    return [1.0 if extract_last_boxed(completion_text(c)) else 0.0 for c in completions]


def _is_r1_format(text: str) -> bool:
    s = text.strip()
    if not (s.startswith("<think>") and s.endswith("</answer>")):
        return False
    if any(s.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return False
    think_end, answer_start = s.find("</think>"), s.find("<answer>")
    return think_end < answer_start and not s[think_end + len("</think>") : answer_start].strip()


def _column(reward_name, name, values, completions, columns):
    if values is None:
        raise ValueError(
            f"{reward_name} needs the dataset column {name!r}; got columns {sorted(columns)}"
        )
    if len(values) != len(completions):
        raise ValueError(
            f"{reward_name}: column {name!r} has {len(values)} values for {len(completions)} completions"
        )
    return values


def _as_text(value) -> str | None:
    """A gold value as text: strings as is, ints/floats (typed dataset columns) via str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


# --- math-verify reward ---------------------------------------------------------------------------

def math_gold(answer=None, solution=None) -> str | None:
    """The gold answer of one row: ``answer`` (GSM8K text after ``####`` if present), else the
    last ``\\boxed{}`` of ``solution``; None when neither gives a non-empty answer."""
    text = _as_text(answer)
    if text is not None and "####" in text:
        text = extract_gsm8k_gold(text)
    if text is not None and text.strip():
        return text.strip()
    boxed = extract_last_boxed(solution) if isinstance(solution, str) else None
    return boxed or None


def math_answer_text(completion: str, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """The part of a completion that math-verify should parse: the ``<answer>`` block if any, its
    last ``\\boxed{}`` if any, cut to the last ``max_chars`` characters."""
    candidate = extract_answer_tag(completion)
    if candidate is None:
        candidate = completion
    boxed = extract_last_boxed(candidate)
    if boxed is not None:
        candidate = "\\boxed{" + boxed + "}"
    return candidate[-max_chars:] if len(candidate) > max_chars else candidate


def make_math_accuracy_reward(num_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                              max_chars: int = DEFAULT_MAX_CHARS):
    """A ``math_accuracy_reward`` with its own worker pool, time bound and input cap."""
    verifier = MathVerifier(num_workers=num_workers, timeout_s=timeout_s)

    def math_accuracy_reward(prompts, completions, completion_ids=None, answer=None, solution=None,
                             **columns):
        """1.0 when math-verify finds the completion's answer equal to the gold, else 0.0; None
        when the row has no gold or math-verify cannot parse it. Time-bounded (module docstring)."""
        return _math_rewards(verifier, max_chars, completions, answer, solution, columns)

    math_accuracy_reward.verifier = verifier
    return math_accuracy_reward


def math_accuracy_reward(prompts, completions, completion_ids=None, answer=None, solution=None,
                         **columns):
    """1.0 when math-verify finds the completion's answer equal to the gold, else 0.0; None when
    the row has no gold or math-verify cannot parse it.

    Gold: ``answer`` (GSM8K or plain) or the last ``\\boxed{}`` of ``solution``; answer: the
    ``<answer>`` block / last ``\\boxed{}`` / tail of the completion, at most
    ``DEFAULT_MAX_CHARS`` characters. Each pair takes at most ``DEFAULT_TIMEOUT_S`` seconds, a
    pair that takes longer scores 0.0 (module docstring). Safe from threads and processes.
    """
    return _math_rewards(default_verifier(), DEFAULT_MAX_CHARS, completions, answer, solution, columns)


def _math_rewards(verifier, max_chars, completions, answer, solution, columns):
    if answer is None and solution is None:
        raise ValueError(
            f"math_accuracy_reward needs the dataset column 'answer' or 'solution'; "
            f"got columns {sorted(columns)}"
        )
    for name, values in (("answer", answer), ("solution", solution)):
        if values is not None:
            _column("math_accuracy_reward", name, values, completions, columns)
    rewards: list[float | None] = [None] * len(completions)
    pairs, where = [], []
    for i, completion in enumerate(completions):
        gold = math_gold(answer[i] if answer is not None else None,
                         solution[i] if solution is not None else None)
        if gold is None or len(gold) > max_chars:
            continue
        predicted = math_answer_text(completion_text(completion), max_chars)
        if not predicted.strip():
            rewards[i] = 0.0
            continue
        pairs.append(("\\boxed{" + gold + "}", predicted))
        where.append(i)
    for i, reward in zip(where, verifier.check_many(pairs)):
        rewards[i] = reward
    return rewards


class MathVerifier:
    """A pool of math-verify worker processes; ``check_many`` scores (gold, answer) pairs.

    ``timeout_s`` bounds each pair (hard: the worker is killed); math-verify's own signal timeouts
    run inside the worker at about a third of it. Usable from any thread; after ``os.fork`` the
    child starts its own workers.
    """

    def __init__(self, num_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._soft_timeout = max(1, int(timeout_s // 3))
        self._lock = threading.Lock()
        self._pid = None

    def _reset_if_forked(self) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: never touch the parent's
                self._pid = os.getpid()
                self._idle: queue.Queue = queue.Queue()
                for _ in range(self.num_workers):
                    self._idle.put(None)  # started lazily
                self._executor = None

    def check(self, gold: str, answer: str) -> float | None:
        """1.0 / 0.0 for ``verify(parse(gold), parse(answer))``; None if the gold does not parse."""
        self._reset_if_forked()
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive():
                if worker is not None:
                    worker.kill()  # died by itself: reap it and close its pipes
                worker = None
                worker = _Worker(self._soft_timeout)
            return worker.check(gold, answer, self.timeout_s)
        finally:
            self._idle.put(worker if worker is not None and worker.alive() else None)

    def check_many(self, pairs: list[tuple[str, str]]) -> list[float | None]:
        """``check`` over pairs, ``num_workers`` at a time; results in input order."""
        if len(pairs) <= 1 or self.num_workers == 1:
            return [self.check(g, a) for g, a in pairs]
        self._reset_if_forked()
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self.num_workers, thread_name_prefix="cppo-math-verify")
            executor = self._executor
        return list(executor.map(lambda pair: self.check(*pair), pairs))

    def close(self) -> None:
        """Stop the workers of this process (they also exit by themselves when it exits)."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            while True:
                try:
                    worker = self._idle.get_nowait()
                except queue.Empty:
                    break
                if worker is not None:
                    worker.kill()
            self._pid = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier used by :func:`math_accuracy_reward` (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
            atexit.register(_default.close)
        return _default


def close_default_verifier() -> None:
    """Stop the process-wide verifier's workers, if it has started any (it starts them again on
    its next use)."""
    with _default_lock:
        if _default is not None:
            _default.close()


_WORKER_CMD = "from cppo.rewards.math_rewards import _serve; _serve({soft})"


class _Worker:
    """One math-verify child process speaking JSON lines over its stdin/stdout."""

    def __init__(self, soft_timeout: int):
        package_root = str(Path(__file__).resolve().parents[2])   # the folder holding cppo/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD.format(soft=int(soft_timeout))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            bufsize=0, env=env, close_fds=True,
        )
        if self._read_line(STARTUP_TIMEOUT_S) != b"ready\n":
            self.proc.kill()
            self.proc.wait()
            err = self.proc.stderr.read().decode(errors="replace").strip()[-2000:]
            self.kill()
            raise RuntimeError(
                f"math-verify worker ({sys.executable}) did not start within {STARTUP_TIMEOUT_S:.0f} s "
                f"(exit code {self.proc.returncode}): {err or 'no error output'}"
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read_line(self, timeout_s: float) -> bytes | None:
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if readable else None

    def check(self, gold: str, answer: str, timeout_s: float) -> float | None:
        try:
            self.proc.stdin.write((json.dumps([gold, answer]) + "\n").encode())
            line = self._read_line(timeout_s)
        except OSError:  # the worker died under us (BrokenPipeError)
            line = None
        except BaseException:  # e.g. KeyboardInterrupt mid-wait: its reply would come out of turn
            self.kill()
            raise
        if not line:  # too slow (None) or died (b""): this pair scores 0.0
            self.kill()
            return 0.0
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


def _serve(soft_timeout: int) -> None:
    """Worker main loop: one JSON ``[gold, answer]`` per stdin line -> ``1.0``/``0.0``/``null``."""
    import functools
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; we exit on stdin EOF
    replies = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray prints must not corrupt the protocol
    from math_verify import parse, verify

    logging.disable(logging.CRITICAL)  # math-verify logs every timeout
    os.dup2(devnull, 2)
    parse_gold = functools.lru_cache(maxsize=4096)(lambda g: parse(g, parsing_timeout=soft_timeout))
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin.buffer:
        try:
            gold, answer = json.loads(line)
            parsed_gold = parse_gold(gold)
            if not parsed_gold:
                result = None
            else:
                parsed = parse(answer, parsing_timeout=soft_timeout)
                result = 1.0 if parsed and verify(parsed_gold, parsed, timeout_seconds=soft_timeout) else 0.0
        except Exception:
            result = 0.0
        replies.write(json.dumps(result) + "\n")
        replies.flush()
