"""1 process vs 2 processes under `ddp` and `fsdp` on this CPU (gloo), a randomly initialised
Llama of ~58M parameters: per-process bytes of parameters, gradients and AdamW state (counted
from the local tensors and shards), peak resident memory, and seconds per training step
(forward + backward + gradient reduction + AdamW on the same global batch), against the memory
formulas of docs/distributed.md (fp32: weights 4P, gradients 4P, AdamW 8P; divided by N under
fsdp).

    python benchmarks/distributed.py            # a few minutes; writes benchmarks/results/distributed/

The three set-ups run one after the other in each repeat (interleaved), each a fresh torchrun
launch; seconds per step are the median of the measured steps of a launch, reported as the
range over repeats. Threads: 1 per process (2 processes use both cores of a 2-core machine, so
the 2-process times include that the machine's two cores are shared by two processes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, spread, spread_text, write_results

OUT = Path(__file__).resolve().parent / "results" / "distributed"
SETUPS = [("1 process", 1, "ddp"), ("2 x ddp", 2, "ddp"), ("2 x fsdp", 2, "fsdp")]
GLOBAL_BATCH, LENGTH = 8, 32
MEASURED, WARMUP = 3, 1


def model_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32000, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=10, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=256, tie_word_embeddings=True)


def worker(result_file: str) -> None:
    """One process of a set-up (under torchrun, or alone): train MEASURED + WARMUP steps."""
    import torch
    from transformers import LlamaForCausalLM
    from cppo.parallel.processes import Distributed
    from cppo.parallel.engines import Engine, full_parameter_bytes, local_bytes
    torch.set_num_threads(1)
    dist_info = Distributed.from_environment()
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config())
    strategy = os.environ["BENCH_STRATEGY"]
    engine = Engine(strategy, dist_info, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    per_process = GLOBAL_BATCH // dist_info.world_size
    gen = torch.Generator().manual_seed(1 + dist_info.rank)
    times = []

    def lm_loss(policy, ids):
        logits = policy(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 ids[:, 1:].flatten())
    for step in range(WARMUP + MEASURED):
        ids = torch.randint(0, 32000, (per_process, LENGTH), generator=gen)
        dist_info.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for micro in engine.accumulate([ids[: per_process // 2], ids[per_process // 2:]]):
            loss = engine.forward(lm_loss, micro) / 2
            loss.backward()
        engine.clip_grad_norm(list(model.parameters()), 1.0)
        optimizer.step()
        dist_info.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    held = local_bytes(model, optimizer)
    full = full_parameter_bytes(model)
    with engine.gathered():   # what generation holds on top of the shards
        gathered = sum(p.numel() * p.element_size() for p in model.parameters())
        with torch.no_grad():
            model(input_ids=ids[:1, :8])
    result = {"rank": dist_info.rank, "world_size": dist_info.world_size,
              "strategy": engine.strategy, "parameters": sum(p.numel() for p in model.parameters()),
              "bytes": held, "full_parameter_bytes": full, "gathered_parameter_bytes": gathered,
              "seconds_per_step": times, "rss_bytes": current_rss(),
              "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(f"{result_file}.rank{dist_info.rank}").write_text(json.dumps(result))


def current_rss() -> int:
    """Resident memory now (the peak, ru_maxrss, includes the whole model that every process
    builds before sharding it, so it says nothing about the sharded state)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, strategy: str, result_file: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_STRATEGY": strategy}
    env.pop("WORLD_SIZE", None)
    me = str(Path(__file__).resolve())
    if processes == 1:
        command = [sys.executable, me, "--worker", str(result_file)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()), me,
                   "--worker", str(result_file)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-4000:])
    return [json.loads(Path(f"{result_file}.rank{r}").read_text()) for r in range(processes)]


def table(results: dict) -> str:
    first = results["runs"][SETUPS[0][0]][0][0]
    p = first["parameters"]
    mib = 2**20
    lines = [f"Model: Llama, {p / 1e6:.1f}M parameters (fp32), global batch {GLOBAL_BATCH} x "
             f"{LENGTH} tokens in 2 micro-batches; {len(results['runs'][SETUPS[0][0]])} interleaved "
             f"repeats.", "",
             "| set-up | per process: parameters | gradients | AdamW | total | formula 16P/N "
             "| gathered for generation | RSS after the steps | s/step (median, range over repeats) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, processes, strategy in SETUPS:
        repeats = results["runs"][name]
        rank0 = repeats[0][0]
        held = rank0["bytes"]
        total = sum(held.values())
        formula = 16 * p / (processes if strategy == "fsdp" and processes > 1 else 1)
        steps = spread([statistics.median(r[0]["seconds_per_step"]) for r in repeats])
        rss = max(x["rss_bytes"] for r in repeats for x in r)
        # FSDP2 all-gathers into a new buffer of the full size; the shards stay allocated
        gathered = rank0["gathered_parameter_bytes"] if strategy == "fsdp" and processes > 1 else 0
        lines.append(
            f"| {name} | {held['parameters'] / mib:.1f} MiB | {held['gradients'] / mib:.1f} MiB | "
            f"{held['optimizer'] / mib:.1f} MiB | {total / mib:.1f} MiB | {formula / mib:.1f} MiB | "
            f"+{gathered / mib:.1f} MiB | {rss / mib:.0f} MiB | "
            f"{spread_text(steps['median'], steps['min'], steps['max'], 2)} |")
    lines += ["", "Bytes per process are counted from the local tensors (DTensor shards under "
              "fsdp) and match 16P/N exactly. 'Gathered for generation' is the full-size buffer "
              "FSDP2 all-gathers into, next to the shards, for one generation round. RSS is not a "
              "measure of the sharded state: it includes the torch/transformers libraries, "
              "activations, and the whole model every process builds before sharding it (memory "
              "the allocator keeps). Seconds per step: gloo collectives on a CPU shared with "
              "other jobs; on a CPU 2 x fsdp is slower than 1 process (all-gathers and "
              "reduce-scatters of every block each step), which says nothing about GPUs."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    scratch = Path(tempfile.mkdtemp(prefix="cppo-bench-distributed-"))
    runs = {name: [] for name, _, _ in SETUPS}
    for repeat in range(args.repeats):
        for name, processes, strategy in SETUPS:
            runs[name].append(launch(processes, strategy, scratch / f"{repeat}-{processes}-{strategy}"))
            print(f"repeat {repeat + 1}: {name}: "
                  f"{statistics.median(runs[name][-1][0]['seconds_per_step']):.2f} s/step", flush=True)
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()
    results = {"machine": machine(threads_per_process=1, backend="gloo",
                                  note="shared machine: other jobs ran at the same time; times "
                                  "are noisy"), "global_batch": GLOBAL_BATCH, "length": LENGTH,
               "measured_steps": MEASURED, "runs": runs}
    text = table(results)
    print(text)
    write_results(OUT, results, f"# benchmarks/distributed.py\n\nMachine: "
                  f"{json.dumps(results['machine'])}\n\n{text}\n", indent=1, echo=False)


if __name__ == "__main__":
    main()
