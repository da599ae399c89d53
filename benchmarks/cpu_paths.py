"""The margin of each numeric comparison in the tests, on every CPU code path this machine can take.

    python benchmarks/cpu_paths.py                 # this CPU's own paths, AVX2, and no vectors
    python benchmarks/cpu_paths.py --paths avx2

Runs the tests marked `cpu_paths` (pytest -m cpu_paths) once per code path, with torch's ATen
kernels and oneDNN held to it (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), each recording the
differences it measured (tests/helpers: note_margin, CPPO_MARGINS). Prints, per check and path,
the largest difference, its bound and the margin (bound / difference), and writes
benchmarks/results/cpu_paths/results.md and results.json with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PATHS = {
    "this_cpu": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "no_vectors": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def run_path(name: str, env: dict, scratch: Path) -> tuple[list[dict], dict]:
    """pytest -m cpu_paths on one code path: the recorded lines and the run's outcome."""
    margins = scratch / f"{name}.jsonl"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:warnings",
               "-m", "cpu_paths", "-rfE", "--basetemp", str(scratch / name)]
    environ = {**os.environ, **env, "CPPO_MARGINS": str(margins)}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu."
                            "get_cpu_capability())"], env=environ, capture_output=True, text=True)
    start = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = [json.loads(x) for x in margins.read_text().splitlines()] if margins.exists() else []
    out = run.stdout.strip().splitlines() or ["(no output)"]
    failed = [x.split(" ", 1)[1].split(" - ")[0] for x in out if x.startswith(("FAILED ", "ERROR "))]
    return lines, {"capability": probe.stdout.strip(), "returncode": run.returncode,
                   "summary": out[-1], "failed": failed, "seconds": round(seconds, 1)}


def worst(lines: list[dict]) -> dict:
    """Per check and quantity: the largest difference, its bound and the case it came from."""
    out = {}
    for line in lines:
        for key, value in line.items():
            if key in ("case", "check") or key.endswith("_bound"):
                continue
            name = f"{line['check']}: {key}"
            bound = line[f"{key}_bound"]
            if name not in out or value > out[name]["difference"]:
                out[name] = {"difference": value, "bound": bound, "case": line["case"]}
    return out


def table(results: dict) -> str:
    paths = list(results["paths"])
    checks = sorted({c for p in paths for c in results["paths"][p]["worst"]})
    head = "| check | bound | " + " | ".join(f"{p} ({results['paths'][p]['run']['capability']})"
                                               for p in paths) + " |"
    rows = [head, "|" + "---|" * (2 + len(paths))]
    for check in checks:
        cells, bound = [], None
        for p in paths:
            w = results["paths"][p]["worst"].get(check)
            if w is None:
                cells.append("n/a")
                continue
            bound = w["bound"]
            margin = w["bound"] / w["difference"] if w["difference"] > 0 else float("inf")
            cells.append(f"{w['difference']:.2e} ({margin:.0f}x)")
        rows.append(f"| {check} | {bound:.0e} | " + " | ".join(cells) + " |")
    runs = ["", "| path | capability | tests | failed | seconds |", "|---|---|---|---|---|"]
    runs += [f"| {p} | {r['run']['capability']} | {r['run']['summary']} | "
             f"{', '.join(r['run']['failed']) or '-'} | {r['run']['seconds']} |"
             for p, r in results["paths"].items()]
    return "\n".join(rows + runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_paths")
    args = parser.parse_args(argv)
    results = {"machine": machine(), "paths": {}}
    with tempfile.TemporaryDirectory(prefix="cppo-cpu-paths-") as scratch:
        for name in args.paths:
            lines, run = run_path(name, PATHS[name], Path(scratch))
            results["paths"][name] = {"env": PATHS[name], "run": run, "worst": worst(lines)}
            print(f"{name}: {run['summary']} ({run['seconds']} s)", flush=True)
    text = table(results)
    m = results["machine"]
    md = (f"# Numeric comparisons per CPU code path\n\n`python benchmarks/cpu_paths.py` on {m['cpu']} "
          f"(torch {m['torch']}, capability {m['cpu_capability']}, AVX512-BF16 {m['avx512_bf16']}, "
          f"AMX-BF16 {m['amx_bf16']}, {m['threads']} threads).\n\nEach cell: the largest difference "
          "a check measured over its tests on that path, and its margin (bound / difference). "
          "trl_twin's gradients are relative to the largest gradient entry; its loss is the "
          "difference over its tolerance; vLLM's log-probs are absolute.\n\n" + text + "\n")
    write_results(args.out, results, md, indent=1, echo=False)
    print(text)
    failed = [p for p, r in results["paths"].items() if r["run"]["returncode"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
