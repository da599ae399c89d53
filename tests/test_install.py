"""What a plain `pip install cppo` gets works: every module imports with the declared
dependencies alone (an extra's package is imported where it is used, and its absence is one line
naming the extra), the wheel carries the package's data, the version lives in one place, the
dependency floors are the documented ones, and .ci/run runs the README's two commands."""

import ast
import fnmatch
import importlib
import importlib.metadata
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "cppo"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
sys.path.insert(0, str(ROOT / "scripts"))
from readme_commands import readme_commands  # noqa: E402


def distribution(requirement: str) -> str:
    """'math-verify>=0.9' -> 'math_verify' (PEP 503 normalised, underscores)."""
    return re.sub(r"[-_.]+", "_", re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)).lower()


def declared() -> set[str]:
    return {distribution(r) for r in PYPROJECT["project"]["dependencies"]}


def top_level_imports(source: str) -> set[str]:
    """Top-level package names imported when a module is imported: its body's imports, and
    those inside module-level if / try blocks (not function bodies; not `if TYPE_CHECKING`)."""
    names = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
    visit(ast.parse(source).body)
    return names


def undeclared_imports(package: Path, dependencies: set[str]) -> list[str]:
    """'module: name' for each module-level import of a third-party package that no declared
    dependency installs."""
    installs = importlib.metadata.packages_distributions()
    out = []
    for path in sorted(package.rglob("*.py")):
        for name in sorted(top_level_imports(path.read_text())):
            if name in sys.stdlib_module_names or name in ("cppo", "__future__"):
                continue
            owners = {distribution(d) for d in installs.get(name, [name])}
            if not owners & dependencies:
                out.append(f"{path.relative_to(package.parent)}: {name}")
    return out


def test_module_level_imports_are_declared_dependencies():
    assert undeclared_imports(PACKAGE, declared()) == []


def test_the_import_check_finds_an_undeclared_one(tmp_path):
    package = tmp_path / "cppo"
    package.mkdir()
    (package / "a.py").write_text("import os\nimport torch\ntry:\n    import requests\nexcept "
                                  "ImportError:\n    pass\n\ndef f():\n    import vllm\n")
    assert undeclared_imports(package, declared()) == ["cppo/a.py: requests"]
    assert undeclared_imports(package, declared() | {"requests"}) == []


def test_every_module_imports():
    """Run in the plain install too (plain_install): no module needs an extra to import."""
    failed = []
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="cppo."):
        try:
            importlib.import_module(info.name)
        except Exception as err:   # noqa: BLE001 - each failure is named below
            failed.append(f"{info.name}: {type(err).__name__}: {err}")
    assert failed == []


@pytest.mark.parametrize("argv, extra", [
    (["train", "--use_peft", "true", "--dry_run"], "peft"),
    (["train", "--use_vllm", "true", "--dry_run"], "vllm"),
    (["train", "--report_to", "wandb", "--dry_run"], "wandb"),
])
def test_a_missing_extra_is_one_line_naming_it(argv, extra, capsys, tmp_path, monkeypatch):
    """Where the extra's package is missing (the plain install), the run stops before loading
    with exit 2 and one line naming the extra to install."""
    module = {"peft": "peft", "vllm": "vllm", "wandb": "wandb"}[extra]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here; the plain install runs this case")
    from cppo.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("cppo train: error:") and f"cppo[{extra}" in err


def test_a_field_that_needs_an_extra_names_it(monkeypatch, tmp_path):
    """The check behind the missing-extra line, on a package that is surely absent."""
    from cppo.config import CPPOConfig
    from cppo.config import startup
    from cppo.errors import MissingExtraError
    monkeypatch.setitem(startup.FIELD_EXTRAS, "use_peft", ("cppo_no_such_package", "peft"))
    with pytest.raises(MissingExtraError, match=r"'use_peft' is true.*pip install \"cppo\[peft\]\""):
        startup.check_startup(CPPOConfig(use_peft=True, output_dir=str(tmp_path / "o")),
                              output_dir="skip")


# --- the wheel -----------------------------------------------------------------------------

def test_the_package_data_globs_cover_every_data_file():
    """Every file under src/cppo that is not Python (the shipped model and tokenizer, the ECA
    schemes) matches a package-data glob, so the wheel and the sdist carry it."""
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["cppo"]
    data = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.is_file()
            and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in data), data
    assert all(any(fnmatch.fnmatch(f, g) for f in data) for g in globs)   # no stale glob


def test_the_version_lives_in_one_place(capsys):
    import cppo
    from cppo.cli import main
    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cppo.__version__"}
    assert importlib.metadata.version("cppo") == cppo.__version__, "reinstall: pip install -e ."
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"cppo {cppo.__version__}"
    released = [section for section in (ROOT / "CHANGELOG.md").read_text().split("\n## ")[1:]
                if not section.startswith("Unreleased")]   # what main has since the last release
    assert released[0].startswith(cppo.__version__)


# --- the dependency floors -------------------------------------------------------------------

def floors() -> dict[str, str]:
    return {distribution(r): r.split(">=")[1] for r in PYPROJECT["project"]["dependencies"]}


def test_every_dependency_has_a_floor_that_is_installed_or_newer():
    from packaging.version import Version
    assert all(">=" in r for r in PYPROJECT["project"]["dependencies"])
    for name, floor in floors().items():
        installed = importlib.metadata.version(name)
        assert Version(Version(installed).base_version) >= Version(floor), (name, installed, floor)


def test_the_floors_are_the_documented_ones():
    """docs/recipes.md's floor table: each dependency, its floor, and where it ran."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    rows = re.findall(r"^\| `([\w.\-]+)` \| ([\d.]+) \|", text, re.M)
    assert {distribution(n): v for n, v in rows} == floors()


# --- .ci/run runs the README's two commands --------------------------------------------------

def test_ci_runs_both_readme_commands_as_the_readme_writes_them():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands["main"].startswith("python3 -m venv .venv && . .venv/bin/activate && pip "
                                       "install torch==2.13.0") and " -e . " in commands["main"]
    assert "[" not in commands["main"]   # the plain install: no extras
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.count('python3 "$ROOT/scripts/readme_commands.py" main)') == 1
    assert ci.count('-c "$(python3 scripts/readme_commands.py test)"') == 1
    assert ci.index("readme_commands.py\" main") < ci.index("-m plain_install") < \
        ci.index("dist/cppo-*.whl") < ci.index("readme_commands.py test)\"\n")


def test_the_readme_parser_refuses_a_third_command():
    text = (ROOT / "README.md").read_text()
    commands = readme_commands(text)
    with pytest.raises(SystemExit, match="two one-line bash blocks"):
        readme_commands(text.replace("## Two commands", "## Two commands\n```bash\nls\n```", 1))
    changed = text.replace(commands["main"], commands["main"] + " --max_steps 5")
    with pytest.raises(SystemExit, match="must end with `cppo train`"):
        readme_commands(changed)
