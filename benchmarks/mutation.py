"""Mutation testing of src/cppo/algorithm/ and config/checks.py against the fast tests (mutmut
3.8.1; issue #54).

    pip install -e ".[mutation]"
    python benchmarks/mutation.py                          # every file: algorithm/, config/checks.py
    python benchmarks/mutation.py --files masks.py loss.py # by file (a bare name is algorithm/'s)
    python benchmarks/mutation.py --files config/checks.py # the config's validation rules
    python benchmarks/mutation.py --files loss.py --survivors  # rerun only its last survivors
    python benchmarks/mutation.py --files skipping.py --tests tests/test_algorithm_*.py tests/test_skipping.py::test_rule
                                 # against these tests (files or test ids) only, e.g. the unit tests
                                 # without the trainer-level ones; in build/mutation-tests/
    python benchmarks/mutation.py --report                 # rewrite the results from the verdicts kept

mutmut's settings are pyproject.toml's [tool.mutmut]; its test selection
(`pytest_add_cli_args_test_selection`) is algorithm/'s, and CONFIG_TESTS below is config/'s.
Each folder runs in its own copy of src/, tests/, docs/, examples/, scripts/, README.md and
pyproject.toml (build/mutation/, build/mutation-config/), so the working tree gets no mutants/
folder and edits made while it runs do not leak in; mutmut keeps its verdicts there between runs,
so runs by file add up. Each file's counts -- killed, survived, equivalent, no tests, timeout --
go to benchmarks/results/mutation/results.json and results.md, keyed by the path under src/cppo; a
file run again replaces its own entry, the others keep theirs (each entry says when and how it
was measured).

Equivalent mutants (surviving mutants that cannot change any result) are listed, each with its
reason, in benchmarks/results/mutation/equivalent.toml: a survivor listed there counts as
equivalent, not survived. An entry names the mutant and its mutated line; an entry whose mutant
no longer has that line (the source moved) is reported as stale and not counted.

Score = killed / (killed + survived + no tests): equivalents and timeouts left out (a timeout is
a mutant that made the tests hang -- detected, but not by an assertion).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "benchmarks" / "results" / "mutation"
EQUIVALENT = OUTPUT / "equivalent.toml"
STATUSES = ("killed", "survived", "equivalent", "no tests", "timeout", "other", "not run")
# The validation rules of a config (checks.py: the declared bounds and the rules of several
# fields), against the tests that state every rule and its message
# (algorithm/'s selection is pyproject.toml's [tool.mutmut]; a package's own folder keeps its verdicts)
CONFIG_TESTS = ["tests/test_config_rules.py", "tests/test_config.py"]


@dataclasses.dataclass(frozen=True)
class Package:
    """A folder of src/cppo mutated as one mutmut run: its files, tests and work folder."""
    folder: str            # under src/cppo
    files: tuple[str, ...]  # empty: every module but __init__.py (re-exports only)
    workdir: str           # under build/
    tests: tuple[str, ...] = ()  # empty: pyproject.toml's [tool.mutmut] test selection

    def modules(self) -> list[str]:
        names = self.files or sorted(p.name for p in (ROOT / "src/cppo" / self.folder).glob("*.py")
                                     if p.name != "__init__.py")
        return [f"{self.folder}/{name}" for name in names]

    def selection(self) -> list[str]:
        return list(self.tests) or mutmut_config().get("pytest_add_cli_args_test_selection", [])


PACKAGES = (Package("algorithm", (), "mutation"),
            Package("config", ("checks.py",), "mutation-config", tuple(CONFIG_TESTS)))
WORKDIRS = {package.folder: ROOT / "build" / package.workdir for package in PACKAGES}


def workdir_of(file: str) -> Path:
    return WORKDIRS[package_of(file).folder]


def package_of(file: str) -> Package:
    return next(p for p in PACKAGES if file.startswith(p.folder + "/"))


def all_files() -> list[str]:
    """Every file mutated, as a path under src/cppo (e.g. algorithm/loss.py)."""
    return [f for package in PACKAGES for f in package.modules()]


def resolve_file(name: str) -> str | None:
    """'loss.py', 'algorithm/loss.py' or 'src/cppo/algorithm/loss.py' -> 'algorithm/loss.py'."""
    name = name.removeprefix("src/cppo/")
    known = all_files()
    if name in known:
        return name
    matches = [f for f in known if f.rsplit("/", 1)[-1] == name]
    return matches[0] if len(matches) == 1 else None


def machine() -> dict:
    """The harness's machine record (benchmarks/common.py) with mutmut's version."""
    from common import machine as harness_machine
    return harness_machine(mutmut=_version("mutmut"))


def _version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def mutmut_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def prepare_workdir(package: Package, tests: list[str]) -> list[str]:
    """Copy src/, tests/, docs/, examples/, scripts/, README.md and pyproject.toml into the
    package's work folder (its mutants/ folder, mutmut's verdicts, stays); the copy's mutmut
    section mutates the package's files, against the listed test files that exist. Returns those."""
    workdir = WORKDIRS[package.folder]
    workdir.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("src", "tests", "docs", "examples", "scripts"):
        shutil.rmtree(workdir / folder, ignore_errors=True)
        shutil.copytree(ROOT / folder, workdir / folder, ignore=ignore)
    shutil.copy2(ROOT / "README.md", workdir / "README.md")
    present = [t for t in tests if (ROOT / t.split("::", 1)[0]).exists()]
    for missing in sorted(set(tests) - set(present)):
        print(f"mutation: {missing} does not exist; left out of the test selection", file=sys.stderr)
    text = (ROOT / "pyproject.toml").read_text()
    head, _, tail = text.partition("[tool.mutmut]")
    rest = tail.split("\n[", 1)   # the sections after [tool.mutmut], if any
    only = [f"src/cppo/{f}" for f in package.modules()] if package.files \
        else [f"src/cppo/{package.folder}/*"]
    section = {**mutmut_config(), "only_mutate": only, "pytest_add_cli_args_test_selection": present,
               "also_copy": ["docs", "examples", "scripts", "README.md"]}   # files tests read
    body = "[tool.mutmut]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in section.items())
    (workdir / "pyproject.toml").write_text(head + body + ("\n[" + rest[1] if len(rest) > 1 else ""))
    return present


def run_mutmut(workdir: Path, files: list[str], max_children: int, survivors_only: bool = False) -> int:
    if not survivors_only:
        return _mutmut(workdir, [f"cppo.{f[:-3].replace('/', '.')}.*" for f in files], max_children)
    # the kept verdicts of the killed stand (tests were added, not removed); mutmut itself resets
    # the verdicts of functions whose tests changed, so run again while some have none
    code, tried = 0, set()
    for _ in range(3):
        names = {name for f in files for name, status in verdicts(f).items()
                 if status in ("survived", "no tests", "not run", "timeout", "other")} - tried
        if not names:
            break
        tried |= names
        code = _mutmut(workdir, sorted(names), max_children)
    return code


def _mutmut(workdir: Path, patterns: list[str], max_children: int) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    command = [mutmut, "run", "--max-children", str(max_children), *patterns]
    print("mutation:", " ".join(command[:6]), f"... ({len(patterns)} patterns, in {workdir})", flush=True)
    return subprocess.run(command, cwd=workdir, env=env).returncode


def verdicts(file: str) -> dict[str, str]:
    """mutant name -> status ("not run": generated, no verdict yet) from mutmut's meta file."""
    from mutmut.stats import status_by_exit_code
    meta = workdir_of(file) / "mutants" / "src" / "cppo" / f"{file}.meta"
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    out = {}
    for name, code in codes.items():
        status = "not run" if code is None else status_by_exit_code[code]
        out[name] = status if status in STATUSES else "other"
    return out


def mutated_line(name: str, file: str) -> str:
    """The first added line of the mutant's diff (stripped), '' when it cannot be read."""
    cwd = os.getcwd()
    try:
        os.chdir(workdir_of(file))
        from mutmut.mutation.diff_apply import get_diff_for_mutant
        diff = get_diff_for_mutant(name, path=f"src/cppo/{file}")
    except Exception as error:   # noqa: BLE001 -- a report line, never a crash
        return f"<diff unavailable: {error}>"
    finally:
        os.chdir(cwd)
    added = [line[1:].strip() for line in diff.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:].strip() for line in diff.splitlines()
               if line.startswith("-") and not line.startswith("---")]
    changed = [a for a in added if a not in removed] or added
    return changed[0] if changed else ""


def load_equivalents() -> dict[str, dict]:
    if not EQUIVALENT.exists():
        return {}
    entries = tomllib.loads(EQUIVALENT.read_text()).get("mutant", [])
    return {entry["name"]: entry for entry in entries}


def summarise(files: list[str], equivalents: dict[str, dict], run: dict) -> tuple[dict, list[str]]:
    """Per-file counts and survivors from the kept verdicts; stale equivalent entries."""
    per_file, stale = {}, []
    for file in files:
        found = verdicts(file)
        if not found or all(s == "not run" for s in found.values()):
            continue
        counts = dict.fromkeys(STATUSES, 0)
        survivors, equivalent = [], []
        for name, status in sorted(found.items(), key=lambda kv: _mutant_order(kv[0])):
            if status == "survived" and name in equivalents:
                line = mutated_line(name, file)
                if line == equivalents[name]["mutated"].strip():
                    status = "equivalent"
                    equivalent.append(name)
                else:
                    stale.append(f"{name}: listed as `{equivalents[name]['mutated']}`, now `{line}`")
            counts[status] += 1
            if status == "survived":
                survivors.append(f"{name}: {mutated_line(name, file)}")
        decided = counts["killed"] + counts["survived"] + counts["no tests"]
        per_file[file] = {"counts": counts, "total": len(found),
                          "score": round(100.0 * counts["killed"] / decided, 1) if decided else None,
                          "survivors": survivors, "equivalent": equivalent, **run}
    return per_file, stale


def _mutant_order(name: str) -> tuple[str, int]:
    base, _, number = name.rpartition("__mutmut_")
    return base, int(number) if number.isdigit() else 0


def write_results(per_file: dict, stale: list[str], tests: dict[str, list[str]],
                  files_run: list[str]) -> None:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    path = OUTPUT / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    previous = old.get("files", {})
    for name, entry in per_file.items():   # a file run again: its earlier results stay as history
        if name in previous and previous[name]["date"] + previous[name]["command"] != "":
            before = previous[name]
            earlier = before.pop("earlier", [])
            if before["counts"] != entry["counts"]:
                earlier = [*earlier, {k: before[k] for k in ("date", "command", "note", "counts", "score")
                                      if k in before}]
            entry["earlier"] = earlier
    files = {**previous, **per_file}
    files = {name: files[name] for name in sorted(files)}
    not_run = [f for f in all_files() if f not in files]
    totals = dict.fromkeys(STATUSES, 0)
    for entry in files.values():
        for key, value in entry["counts"].items():
            totals[key] += value
    decided = totals["killed"] + totals["survived"] + totals["no tests"]
    result = {"description": "mutmut 3.8.1 on src/cppo/algorithm/ and src/cppo/config/checks.py "
                             "against the fast tests, by file (benchmarks/mutation.py)",
              "machine": machine(), "test_files": tests, "files": files,
              "files_not_run": not_run, "totals": totals,
              "score": round(100.0 * totals["killed"] / decided, 1) if decided else None,
              "stale_equivalent_entries": stale}
    path.write_text(json.dumps(result, indent=2) + "\n")

    m = result["machine"]
    lines = [
        "# Mutation testing of src/cppo/algorithm/ and config/checks.py (mutmut 3.8.1, fast tests only)", "",
        f"Machine: {m['cpu']}, torch CPU capability {m['cpu_capability']}, {m['cores']} cores; "
        f"torch {m['torch']}, Python {m['python']}, mutmut {m['mutmut']}.", "",
        "Each file's row records the command and date of its own last run (runs by file add up); "
        "a command with --tests ran the mutants against those tests only (in build/mutation-tests/ "
        "or build/mutation-config-tests/, or the --workdir it names). "
        "Score = killed / (killed + survived + no tests); equivalent mutants (listed with their "
        "reasons in [equivalent.toml](equivalent.toml)) and timeouts are left out.", "",
        "| file | mutants | killed | survived | equivalent | no tests | timeout | not run | score | date | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    earlier_rows = []
    for name, entry in files.items():
        c = entry["counts"]
        score = "-" if entry["score"] is None else f"{entry['score']:.1f} %"
        lines.append(f"| {name} | {entry['total']} | {c['killed']} | {c['survived']} | "
                     f"{c['equivalent']} | {c['no tests']} | {c['timeout']} | {c['not run']} | "
                     f"{score} | {entry['date']} | `{entry['command']}` |")
        for before in entry.get("earlier", []):
            c = before["counts"]
            score = "-" if before["score"] is None else f"{before['score']:.1f} %"
            earlier_rows.append(f"| {name} | {c['killed']} | {c['survived']} | {c['equivalent']} | "
                                f"{c['no tests']} | {c['timeout']} | {score} | {before['date']} | "
                                f"{before.get('note', '')} |")
    t = totals
    lines.append(f"| **all run** | {sum(e['total'] for e in files.values())} | {t['killed']} | "
                 f"{t['survived']} | {t['equivalent']} | {t['no tests']} | {t['timeout']} | "
                 f"{t['not run']} | {'-' if result['score'] is None else str(result['score']) + ' %'} | | |")
    lines += ["", "Files not run: " + (", ".join(not_run) if not_run else "none") + ".", ""]
    for folder, selection in tests.items():
        lines += [f"Test files for {folder}: " + ", ".join(f"`{t}`" for t in selection) + ".", ""]
    notes = [f"- {name}: {entry['note']}" for name, entry in files.items() if entry.get("note")]
    if notes:
        lines += ["Notes on the runs:", "", *notes, ""]
    if earlier_rows:
        lines += ["Earlier runs of the same files (before the tests that kill their mutants):", "",
                  "| file | killed | survived | equivalent | no tests | timeout | score | date | note |",
                  "|---|---|---|---|---|---|---|---|---|", *earlier_rows, ""]
    if stale:
        lines += ["Stale entries of equivalent.toml (not counted):", ""]
        lines += [f"- {s}" for s in stale] + [""]
    lines += ["## Survivors", ""]
    for name, entry in files.items():
        for survivor in entry["survivors"]:
            lines.append("- `" + survivor.replace("`", "'") + "`")
    (OUTPUT / "results.md").write_text("\n".join(lines) + "\n")
    print(f"mutation: wrote {OUTPUT / 'results.json'} and results.md "
          f"({len(files_run)} file(s) this run)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="+", metavar="FILE",
                        help="files to mutate, as algorithm/loss.py, config/checks.py or a file name of "
                             "algorithm/ (default: every one: algorithm/ and config/checks.py)")
    parser.add_argument("--max-children", type=int, default=1,
                        help="mutants tested at once (default 1)")
    parser.add_argument("--note", default="", help="a few words on this run, kept with its results")
    parser.add_argument("--survivors", action="store_true",
                        help="rerun only the files' mutants that survived (or have no tests or no verdict) in "
                             "the kept verdicts; the killed ones keep their verdict")
    parser.add_argument("--tests", nargs="+", metavar="TEST_FILE",
                        help="run the mutants against these files of the selection only (e.g. "
                             "the unit tests, leaving out trainer-level ones); recorded with the "
                             "file's results")
    parser.add_argument("--workdir", metavar="PATH",
                        help="mutmut's work folder, relative to the repository (default "
                             "build/mutation, build/mutation-config for config/, with -tests added "
                             "under --tests): two runs at once need two")
    parser.add_argument("--report", action="store_true",
                        help="write the results from the verdicts kept, without running mutmut")
    args = parser.parse_args(argv)
    files = [resolve_file(f) or f for f in (args.files or all_files())]
    unknown = [f for f in files if f not in all_files()]
    if unknown:
        parser.error(f"not files mutated here: {unknown} (there: {all_files()})")
    packages = [p for p in PACKAGES if any(f.startswith(p.folder + "/") for f in files)]
    if args.workdir and len(packages) > 1:
        parser.error(f"--workdir with files of several folders ({[p.folder for p in packages]}): "
                     f"run them one folder at a time")
    for package in packages:   # another selection: another work folder (mutmut's stats are per selection)
        if args.tests:
            WORKDIRS[package.folder] = ROOT / "build" / f"{package.workdir}-tests"
        if args.workdir:
            WORKDIRS[package.folder] = ROOT / args.workdir
    command = "python benchmarks/mutation.py" + (f" --files {' '.join(files)}" if args.files else "") \
        + (f" --max-children {args.max_children}" if args.max_children != 1 else "") \
        + (" --survivors" if args.survivors else "") \
        + (f" --tests {' '.join(args.tests)}" if args.tests else "") \
        + (f" --workdir {args.workdir}" if args.workdir else "")
    if not args.report:
        for package in packages:
            mine = [f for f in files if package_of(f) is package]
            prepare_workdir(package, list(args.tests) if args.tests else package.selection())
            code = run_mutmut(WORKDIRS[package.folder], mine, args.max_children, args.survivors)
            if code != 0:
                print(f"mutation: mutmut exited {code} on {package.folder}/", file=sys.stderr)
    run = {"date": datetime.date.today().isoformat(), "command": command, "note": args.note}
    equivalents = load_equivalents()
    per_file, stale = summarise(files, equivalents, run)
    if args.report:   # keep each entry's own date and command
        old = OUTPUT / "results.json"
        previous = json.loads(old.read_text())["files"] if old.exists() else {}
        for name, entry in per_file.items():
            if name in previous:
                entry.update(date=previous[name]["date"], command=previous[name]["command"],
                             note=args.note or previous[name].get("note", ""))
    selections = {f"{p.folder}/": [t for t in p.selection() if (ROOT / t).exists()] for p in PACKAGES}
    write_results(per_file, stale, selections, files)
    for name in files:
        entry = per_file.get(name)
        if entry:
            c = entry["counts"]
            print(f"{name}: killed {c['killed']}, survived {c['survived']}, equivalent "
                  f"{c['equivalent']}, no tests {c['no tests']}, timeout {c['timeout']}, "
                  f"not run {c['not run']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
