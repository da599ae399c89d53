"""The house's layout holds: no import circles, at the top of the package only what a user
calls, exceptions in one module that imports nothing of cppo, and README's Layout equal to the
tree."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "cppo"
USER_MODULES = {"__init__", "cli", "trainer", "evaluate", "pretrain", "errors"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """cppo module -> the cppo modules it imports (anywhere in it, functions included). Imports
    under `if TYPE_CHECKING:` are left out: they only name types for annotations and never run
    (a stage may annotate its parameter with a config section of a floor above it)."""
    files = {module_name(p, package): p for p in package.rglob("*.py")}

    def known(name: str) -> str:
        while name not in files and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {}
    for name, path in files.items():
        package_name = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package_name.split(".")[: len(package_name.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] == "cppo":
                    targets |= {known(f"{base}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names if a.name.split(".")[0] == "cppo"}
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_circle_finder_finds_one(tmp_path):
    package = tmp_path / "cppo"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from cppo.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from cppo import a\n")
    assert cycles(import_graph(package)) == [["cppo.a", "cppo.sub.b"]]


# The floors, bottom up: a room imports only rooms on lower floors (and itself), so no import
# runs back up. errors imports nothing; algorithm and eca are pure; the user's modules on top.
FLOORS = [{"errors"}, {"algorithm", "eca"}, {"models"}, {"run"}, {"parallel"}, {"sampling"},
          {"rewards"}, {"data"}, {"config"}, {"features"}, {"learning"}, {"assembly"}, {"evaluate"}, {"pretrain", "trainer"}, {"cli"},
          {"cppo"}]


def room(module: str) -> str:
    """cppo.sampling.tools -> sampling; cppo.trainer -> trainer; cppo -> cppo."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], floors: list[set[str]] = FLOORS) -> list[str]:
    """Every import of a module in another room that is not on a lower floor, as 'a -> b'."""
    floor = {r: i for i, rooms in enumerate(floors) for r in rooms}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if room(a) != room(b) and floor[room(a)] <= floor[room(b)])


def test_imports_only_look_down_the_floors():
    graph = import_graph()
    assert {room(m) for m in graph} == set().union(*FLOORS)   # every room has its floor
    assert upward_imports(graph) == []


def test_the_floor_check_finds_an_upward_import(tmp_path):
    package = tmp_path / "cppo"
    for name in ("algorithm", "sampling"):
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "sampling" / "tools.py").write_text("from cppo.algorithm import loss\n")
    (package / "algorithm" / "loss.py").write_text("def f():\n    from cppo.sampling import tools\n")
    graph = import_graph(package)
    assert upward_imports(graph) == ["cppo.algorithm.loss -> cppo.sampling.tools"]
    (package / "algorithm" / "loss.py").write_text("import math\n")
    assert upward_imports(import_graph(package)) == []
    (package / "algorithm" / "loss.py").write_text(   # an annotation's type only: never runs
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cppo.sampling import tools\n")
    assert upward_imports(import_graph(package)) == []


def test_top_of_the_package_holds_what_a_user_calls():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == USER_MODULES


def test_errors_import_nothing_of_cppo():
    assert import_graph()["cppo.errors"] == set()


def layout_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    return section.split("```")[1].strip("\n").splitlines()


def test_readme_layout_lists_the_package_tree():
    listed, room = set(), None
    lines = layout_block()
    assert lines[0] == "src/cppo/"
    for line in lines[1:]:
        match = re.match(r"^( {2}| {4})(\S+)\s", line + " ")
        if not match:
            break   # the folders after src/cppo/
        indent, name = match.groups()
        if len(indent) == 2:
            room = name.rstrip("/") if name.endswith("/") else None
            listed.add(name)
        else:
            listed.add(f"{room}/{name}")
    tree = {p.name for p in PACKAGE.glob("*.py")}
    for room_dir in (d for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()):
        tree.add(room_dir.name + "/")
        tree |= {f"{room_dir.name}/{p.name}" for p in room_dir.glob("*.py") if p.name != "__init__.py"}
    assert listed == tree


def layout_folders(lines: list[str]) -> dict[str, str]:
    """The entries after the package tree: each top-level folder ("benchmarks/") and its
    description, continuation lines joined."""
    entries, name = {}, None
    for line in lines:
        match = re.match(r"^(\S+/)\s+(.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name is not None and line.startswith(" "):
            entries[name] += " " + line.strip()
    return entries


def named_files(text: str) -> set[str]:
    """The file names a description lists (not those inside another folder's path)."""
    return set(re.findall(r"(?<![/\w])([\w-]+\.(?:py|sh))\b", text))


def git_ignored(path: Path) -> bool:
    """True when git ignores `path` in this checkout (False outside a git checkout)."""
    import subprocess
    try:
        return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0
    except OSError:
        return False


def test_readme_layout_names_every_folder_benchmark_doc_and_script():
    """After the package tree the layout lists the repository's folders, and for benchmarks/,
    docs/ and scripts/ exactly the programs, pages and scripts there: no name missing, none
    extra."""
    entries = layout_folders(layout_block())
    folders = {f"{p.name}/" for p in ROOT.iterdir()
               if p.is_dir() and not p.name.startswith(".") and p.name != "src"
               and not git_ignored(p)}   # runs/, gpu_wheels/: a user's, not the layout's
    assert set(entries) == folders
    bench = ROOT / "benchmarks"
    assert named_files(entries["benchmarks/"]) == {p.name for p in bench.iterdir()
                                                   if p.suffix in (".py", ".sh")}
    subfolders = {p.name for p in bench.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert {f for f in subfolders if f"{f}/" in entries["benchmarks/"]} == subfolders
    docs = entries["docs/"].replace(",", " ").split()
    assert sorted(docs) == sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert named_files(entries["scripts/"]) == {p.name for p in (ROOT / "scripts").iterdir()
                                                if p.suffix in (".py", ".sh")}


def test_cppo_bench_from_an_installed_wheel_says_it_needs_a_checkout(tmp_path, monkeypatch, capsys):
    import cppo.cli as cli
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "cppo" / "cli.py"))
    assert cli.main(["bench", "--quick"]) == 2
    assert "runs benchmarks/cppo_table.py of a source checkout" in capsys.readouterr().err
    monkeypatch.chdir(ROOT)
    assert cli.bench_script() == ROOT / "benchmarks" / "cppo_table.py"


@pytest.mark.parametrize("script", ["update_docs.py"])
def test_scripts_check_mode_agrees_with_the_docs(script):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def cppo_imports(text: str, suffix: str) -> list[tuple[str, str | None]]:
    """(module, name) for every `from cppo... import name` and `import cppo...` in a file's text
    (Python source, or the code in a markdown page or shell script)."""
    found = []
    if suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and \
                    (node.module or "").split(".")[0] == "cppo":
                found += [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "cppo"]
        return found
    for module, names in re.findall(r"from (cppo[\w.]*) import \(?([\w, ]+)", text):
        found += [(module, n.split(" as ")[0].strip()) for n in names.split(",") if n.strip()]
    found += [(m, None) for m in re.findall(r"^\s*import (cppo[\w.]*)", text, re.M)]
    return found


def test_every_cppo_import_in_the_tree_resolves():
    """After modules move, an import left at an old path fails here, in a benchmark, a script,
    a test helper or a page of the docs as much as in the package."""
    import importlib
    files = [p for folder in ("src", "tests", "benchmarks", "scripts", "docs", "examples")
             for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    files.append(ROOT / "README.md")
    broken = []
    for path in files:
        for module, name in cppo_imports(path.read_text(), path.suffix):
            try:
                imported = importlib.import_module(module)
            except ImportError as err:
                broken.append(f"{path.relative_to(ROOT)}: {module} ({err})")
                continue
            if name and name != "*" and not hasattr(imported, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    broken.append(f"{path.relative_to(ROOT)}: {module} has no {name}")
    assert broken == []


def test_every_source_path_the_docs_name_exists():
    """`src/cppo/...py` and room-relative paths such as `run/checkpoint.py` in README and docs/
    name files that exist (after a move, the docs must follow)."""
    missing = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for path in re.findall(r"`((?:src/cppo/)?[a-z_]+(?:/[a-z_]+)*\.py)`", page.read_text()):
            candidates = [ROOT / path, PACKAGE / path, ROOT / "benchmarks" / path,
                          ROOT / "tests" / path, ROOT / "scripts" / path]
            if "/" not in path:
                candidates += list(PACKAGE.rglob(path))
            if not any(c.is_file() for c in candidates):
                missing.append(f"{page.name}: {path}")
    assert missing == []


CONFIG_PARAMETERS = ("args", "cfg", "config")
# Where a function may take the whole run config: config/ reads and checks it, the builders
# (assembly/) turn it into a run's parts, and the commands' facades (the trainer, the command
# line, pretraining) take it from the user. Every other stage takes its section
# (cppo.config.sections) or plain values.
CONFIG_EDGES = ("config/", "assembly/", "trainer.py", "cli.py", "pretrain.py")


def config_takers(package: Path = PACKAGE) -> dict[str, int]:
    """module (under the package) -> how many of its functions take a parameter named args,
    cfg or config."""
    counts = {}
    for path in sorted(package.rglob("*.py")):
        n = sum(1 for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and any(a.arg in CONFIG_PARAMETERS for a in node.args.args + node.args.kwonlyargs))
        if n:
            counts[str(path.relative_to(package))] = n
    return counts


def test_the_algorithm_takes_no_config():
    """algorithm/ is pure math on plain values and small settings objects (LossSettings):
    no function of it takes the run's config, and it imports nothing of cppo.config."""
    takers = config_takers()
    assert [m for m in takers if m.startswith("algorithm/")] == []
    graph = import_graph()
    assert [f"{m} -> {t}" for m, targets in graph.items() if m.startswith("cppo.algorithm")
            for t in targets if t.startswith("cppo.config")] == []


def test_only_the_edges_take_the_whole_config():
    takers = config_takers()
    assert sorted(m for m in takers if not m.startswith(CONFIG_EDGES)) == [], \
        "pass a config section or plain values instead of the whole config"
    assert "assembly/run.py" in takers and "trainer.py" in takers   # the scan sees the edges


def test_the_config_scan_counts_parameters(tmp_path):
    (tmp_path / "m.py").write_text("def f(args): ...\ndef g(x, *, cfg): ...\ndef h(conf): ...\n")
    assert config_takers(tmp_path) == {"m.py": 2}


# Functions that may take more than MOST_PARAMETERS, each with its reason: none may be added.
WIDE_SIGNATURES = {
    "trainer.py:__init__": "TRL's GRPOTrainer signature (model, reward_funcs, args, datasets, ...)",
}
MOST_PARAMETERS = 10


def wide_signatures(package: Path = PACKAGE) -> dict[str, int]:
    """'module:function' -> its parameter count (self and cls not counted), for every function of
    the package that takes more than MOST_PARAMETERS."""
    wide = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                count = len(names) - (names[:1] in (["self"], ["cls"]))
                if count > MOST_PARAMETERS:
                    wide[f"{path.relative_to(package)}:{node.name}"] = count
    return wide


def test_no_function_takes_more_than_ten_parameters():
    """A stage takes its settings object or plain values; a long list of loose values is a
    settings object that is missing."""
    assert sorted(wide_signatures()) == sorted(WIDE_SIGNATURES)


def test_the_signature_scan_counts_parameters(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(a, b, c, d, e, f, g, h, i, j, *, k): ...\n"
        "class C:\n    def m(self, a, b, c, d, e, f, g, h, i, j): ...\n"
        "def g(a, b, c, d, e, f, g, h, i, j): ...\n")
    assert wide_signatures(tmp_path) == {"m.py:f": 11}
