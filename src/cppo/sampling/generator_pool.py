"""Several generator processes (`generator_processes: N`, async_rollout without vLLM) seen as one
generator: GeneratorPool cuts each round into N shares, one per process, and merges the sampled
shares back into the round.

A share is a contiguous block of the round's parts, a part being a generation chunk of one
training process's rows (chunk_size // G questions, whole groups: cppo's sampler draws a chunk's
completions from one generator seeded by the chunk's first question, cppo.sampling.backends), or
a training process's rows whole (with tools: the tool loop seeds a process's rollouts together).
Each process samples its parts exactly as the synchronous run samples those questions (padded
as all that process's rows, seeded by their place in the global batch), so the merged round is
the synchronous run's. The N processes share one staging copy of the weights in shared memory
(cppo.sampling.weight_sinks.SharedMemory): a push copies once, and each process takes the newest
version between two of its shares (each keeps its own `taken`)."""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.multiprocessing as mp

from cppo.algorithm.allocation import even_blocks, questions_per_chunk
from cppo.errors import ConfigError, GeneratorError
from cppo.sampling.batches import PromptBatch, concat_completions
from cppo.sampling.generator_process import GeneratorProcess
from cppo.sampling.rollout_messages import RolloutTask, Sampled
from cppo.sampling.weight_sinks import SharedMemory


def blocks(items: list, n: int) -> list[list]:
    """`items` cut into n contiguous blocks in order (even_blocks: the first ones one longer when
    n does not divide them; empty blocks when there are fewer items than n)."""
    return [items[r.start:r.stop] for r in even_blocks(len(items), n)]


def round_parts(questions: list[int], unit: int | None) -> list[tuple[int, int, int]]:
    """A round's parts, (rank, start, stop) each, in rank order then question order: each
    training process's `questions[rank]` rows cut into generation chunks of `unit` questions
    (None: whole)."""
    return [(rank, start, min(start + (unit or q), q))
            for rank, q in enumerate(questions) for start in range(0, q, unit or max(q, 1))]


def split_round(task: RolloutTask, n: int, unit: int | None) -> list[RolloutTask | None]:
    """Each of n processes' share of the task: a contiguous block of its parts (round_parts),
    the same task id and rows; None where a process gets no part."""
    parts = round_parts([len(rows) for rows in task.rows], unit)
    return [RolloutTask(task.task_id, task.round_index, task.rows, spans) if spans else None
            for spans in blocks(parts, n)]


def merge_shares(task_id: int, shares: list[tuple[list, Sampled]], pad_token_id: int) -> Sampled:
    """The round from its sampled shares ((spans, Sampled) each, in process order): each
    training process's prompts and completions, its parts joined in question order; the version
    is the oldest of the shares' (a round is as stale as its stalest part), the seconds the
    longest share's, the idle seconds the mean over the processes."""
    pieces: dict[int, list] = {}
    for spans, got in shares:
        for i, (rank, start, stop) in enumerate(spans):
            turns = None if got.turns is None else got.turns[i]
            pieces.setdefault(rank, []).append((start, stop, got.prompts[i], got.completions[i],
                                                turns))
    prompts, completions, turns = [], [], []
    for rank in sorted(pieces):
        mine = sorted(pieces[rank], key=lambda p: p[0])
        if [p[0] for p in mine] != [0] + [p[1] for p in mine[:-1]]:
            raise GeneratorError(f"the generator processes' parts of training process {rank} "
                                 f"do not join up: {[(p[0], p[1]) for p in mine]}")
        prompts.append(PromptBatch(torch.cat([p[2].ids for p in mine]),
                                   torch.cat([p[2].mask for p in mine])))
        completions.append(concat_completions([p[3] for p in mine], pad_token_id))
        if any(p[4] is not None for p in mine):
            if len(mine) > 1:
                raise GeneratorError(f"training process {rank}'s tool-loop turns came in "
                                     f"{len(mine)} parts; with tools a process's rows are one")
            turns.append(mine[0][4])
    versions = [got.version for _, got in shares]
    return Sampled(task_id, min(versions), prompts, completions,
                   max(got.seconds for _, got in shares),
                   sum(got.idle_seconds for _, got in shares) / len(shares), turns or None)


def check_pool_parts(processes: int, questions: list[int], group: int, chunk_size: int | None,
                     tools: bool) -> None:
    """A round must have at least one part per generator process, else a ConfigError naming
    generator_processes, the parts and the fix (questions: each training process's per round;
    group: G; chunk_size: the sampler's completions per generation chunk, None: all)."""
    unit = None if tools else questions_per_chunk(chunk_size, group, max(questions))
    parts = len(round_parts(questions, unit))
    if parts >= processes:
        return
    if tools:
        why, fix = ("with tools each training process's rollouts are one part (the tool loop "
                    "seeds them together)", "")
    else:
        most = max(1, max(questions) // -(-processes // len(questions)))
        why = (f"a part is a generation chunk of {unit} question(s) ({chunk_size} completions, "
               f"whole groups of num_generations {group}) of one training process's "
               f"{max(questions)} a round")
        fix = f", or generation_chunk_size <= {most * group}"
    raise ConfigError(f"'generator_processes' is {processes}, but a round has only {parts} "
                      f"part(s) to share among them: {why}. Set generator_processes <= {parts}"
                      f"{fix}")


class GeneratorPool:
    """N generator processes as one generator (ProcessShare's and the scheduler's interface:
    submit, receive, push, close, name). A task is split into the processes' shares
    (split_round); each process samples its shares in order, so the pool merges the oldest
    task's shares as they come (merge_shares). A push goes to the shared staging copy, which
    every process takes before its next share. A process that fails, ends or falls silent is a
    GeneratorError naming it (process k of N, its pid); the others are stopped with it.

    generators: the processes (each with submit, receive, close and a `name`); sink: the staging
    copy they share (push); unit: questions per part (None: each training process's rows whole);
    pad_token_id: what the merged completions are padded with."""

    def __init__(self, generators: list, sink, unit: int | None, pad_token_id: int) -> None:
        self.generators, self.sink, self.unit = generators, sink, unit
        self.pad_token_id = pad_token_id
        self.pending: deque = deque()   # (task id, [(process, spans)]), in submission order
        n, pids = len(generators), []
        for k, generator in enumerate(generators):
            pid = getattr(getattr(generator, "process", None), "pid", None)
            generator.name = f"generator process {k + 1} of {n}" + \
                (f" (pid {pid})" if pid is not None else "")
            pids.append(str(pid))
        self.name = f"{n} generator processes (pids {', '.join(pids)})"
        self.closed = False

    def submit(self, task: RolloutTask) -> None:
        shares = split_round(task, len(self.generators), self.unit)
        sent = [(k, share.spans) for k, share in enumerate(shares) if share is not None]
        self.pending.append((task.task_id, sent))
        for k, _ in sent:
            self.generators[k].submit(shares[k])

    def receive(self) -> Sampled:
        """The oldest submitted task, merged from its shares."""
        task_id, sent = self.pending.popleft()
        shares = []
        try:
            for k, spans in sent:
                got = self.generators[k].receive()
                if got.task_id != task_id:
                    raise GeneratorError(f"the {self.generators[k].name} sent task {got.task_id} "
                                         f"where task {task_id} was next")
                shares.append((spans, got))
        except GeneratorError:
            self.close(timeout=0)
            raise
        return merge_shares(task_id, shares, self.pad_token_id)

    @property
    def pushed_bytes(self) -> int:
        """The bytes the last push sent (the shared staging copy's)."""
        return self.sink.pushed_bytes

    def push(self, policy, version: int) -> float:
        """Copy the policy's trainable weights to the shared staging copy as `version`; each
        process takes them before its next share. The seconds it took."""
        return self.sink.push(policy, version)

    def close(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        for generator in self.generators:
            with contextlib.suppress(Exception):
                generator.tasks.put(None)   # all asked first: they end together
        for generator in self.generators:
            generator.close(timeout)


def start_pool(policy, build, *, processes: int, unit: int | None, pad_token_id: int,
               cpus: list[int] | None, threads: int | None, heartbeat_stale_after_s: float,
               tools=None, skeleton=None) -> GeneratorPool:
    """`processes` generator processes (GeneratorProcess, each from `build`) sharing one staging
    copy of `policy`. cpus: dealt in contiguous blocks (blocks: [1, 2] to 2 processes is one core
    each; None: the trainer's); threads: each process's torch threads (None: its cores' count,
    or without cpus the trainer's threads divided among the processes, at least 1)."""
    sink = SharedMemory(policy, mp.get_context("spawn"), skeleton)
    cores = blocks(list(cpus), processes) if cpus else [None] * processes
    generators = []
    try:
        for mine in cores:
            count = threads or (len(mine) if mine else
                                max(1, torch.get_num_threads() // processes))
            generators.append(GeneratorProcess(
                policy, build, threads=count, heartbeat_stale_after_s=heartbeat_stale_after_s,
                cpus=mine, tools=tools, skeleton=skeleton, sink=sink))
    except BaseException:
        for generator in generators:
            generator.close(timeout=0)
        raise
    return GeneratorPool(generators, sink, unit, pad_token_id)
