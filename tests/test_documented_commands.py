"""Every command line that README.md and docs/*.md show runs: each at least through argument
parsing and the config's checks (`--dry_run`), and whole (two steps) where that is cheap: the
embedded model and task, no vLLM, no launcher. A doc line with a wrong flag or value turns red."""

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from cppo.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"", "bash", "sh", "shell", "console"}
LAUNCHERS = ("cppo", "torchrun", "accelerate", "srun", "taskset", "python", "python3")
PLACEHOLDERS = ("<", "...", "error:")   # `cppo eval --model <merged dir>`, `cppo train: error: ...`
WHOLE = ["--max_steps", "2", "--eval_num_questions", "16", "--progress_bar", "false"]

# files the documented lines name but leave to the reader; the test writes them
RUN_YAML = "max_steps: 2\nlearning_rate: 1.0e-5\n"
GRPO_YAML = ("# a YAML written for `trl grpo` (TRL's names)\nmodel_name_or_path: embedded\n"
             "dataset_name: embedded\nper_device_train_batch_size: 16\nnum_generations: 8\n"
             "learning_rate: 1.0e-5\nmax_steps: 2\nlogging_steps: 1\nsave_strategy: steps\n"
             "report_to: none\n")
FIXTURE_FILES = {"run.yaml": RUN_YAML, "grpo.yaml": GRPO_YAML}


def command_lines(markdown: str) -> list[str]:
    """The shell command lines of a markdown text: fenced shell blocks (continuations joined,
    comments dropped) and inline code spans that are whole `cppo ...` commands."""
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", markdown, re.S):
        if lang in SHELLS:
            body = re.sub(r"\\\n\s*", " ", body)
            found += [line for line in body.splitlines() if line.strip()]
    outside = re.sub(r"```.*?```", "", markdown, flags=re.S)
    found += [span for span in re.findall(r"`([^`\n]+)`", outside)
              if re.match(r"(cppo|torchrun|accelerate launch) ", span)]
    return found


def cppo_argv(line: str) -> list[str] | None:
    """`cppo`'s own arguments in a documented line (env assignments, taskset, srun, torchrun's
    and accelerate's options dropped), or None for a line that does not run cppo."""
    if any(mark in line for mark in PLACEHOLDERS):
        return None
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if not words or words[0] not in LAUNCHERS:
        return None
    if words[0] == "taskset":
        words = words[3:] if words[1].startswith("-") else words[2:]
    if words[0] == "srun":
        words = words[1:]
    if "cppo.cli" in words:
        return words[words.index("cppo.cli") + 1:]
    return words[1:] if words[0] == "cppo" else None


def ends_in_a_bare_option(argv: list[str]) -> bool:
    """`cppo eval --batch_size`: prose naming an option, not a command (a flag that takes no
    value, or a bool, may end a command)."""
    return len(argv) > 1 and argv[-1].startswith("--") and argv[-1] not in (
        "--help", "--version", "--dry_run", "--resume", "--use_peft")


def documented() -> list[tuple[str, list[str]]]:
    """(where and what, cppo's argv) of each documented line; a launcher's line kept apart from
    the same arguments run plainly, repeats of a line run once."""
    out, seen = [], set()
    for doc in DOCS:
        for line in command_lines(doc.read_text()):
            argv = cppo_argv(line.split(" && ")[-1])
            launcher = next((w for w in ("torchrun", "accelerate") if w in line), "")
            if argv is None or ends_in_a_bare_option(argv) or (launcher, *argv) in seen:
                continue
            seen.add((launcher, *argv))
            out.append((f"{doc.name}: {line.split('#')[0].strip()}", argv))
    return out


COMMANDS = documented()


def test_the_docs_show_command_lines_of_every_kind():
    kinds = {argv[0] for _, argv in COMMANDS if argv and not argv[0].startswith("-")}
    assert {"train", "eval", "pretrain", "export-data"} <= kinds
    lines = [line for line, _ in COMMANDS]
    assert any("torchrun" in line for line in lines) and any("accelerate launch" in line
                                                            for line in lines)
    assert len(COMMANDS) >= 25


def test_the_collector_reads_blocks_spans_continuations_and_launchers():
    text = ("Run `cppo train --seed 2` or `cppo eval --batch_size` or `cppo eval --model <dir>`.\n"
            "```bash\nFOO=1 taskset -c 0 cppo train --a 1 \\\n    --b 2   # note\n"
            "torchrun --nproc_per_node 2 -m cppo.cli train --c 3\npip install x\n```\n"
            "```python\ncppo.train()\n```\n")
    argvs = [cppo_argv(line) for line in command_lines(text)]
    argvs = [a for a in argvs if a is not None and not ends_in_a_bare_option(a)]
    assert argvs == [["train", "--a", "1", "--b", "2"], ["train", "--c", "3"],
                     ["train", "--seed", "2"]]


@pytest.fixture(scope="module")
def a_checkpoint(tmp_path_factory):
    """A checkpoint directory as `cppo train` writes it (two steps of the embedded default)."""
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "--output_dir", str(out), *WHOLE]) == 0
    return out / "checkpoint-2"


def workspace(tmp_path: Path, monkeypatch, argv: list[str], checkpoint) -> None:
    """A directory to run a documented line in, holding the files it names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")   # the recipes the docs run
    for name, text in FIXTURE_FILES.items():
        (tmp_path / name).write_text(text)
    for word in argv:
        if re.fullmatch(r"runs/\w+/checkpoint-\d+", word):
            shutil.copytree(checkpoint, tmp_path / word)


def is_cheap(printed: str, argv: list[str], line: str) -> bool:
    """Whole runs: the embedded model and task on this process, no vLLM, no launcher."""
    if argv[0] == "export-data":
        return True
    if argv[0] not in ("train", "eval") or "torchrun" in line or "accelerate" in line:
        return False
    cfg = yaml.safe_load(printed)
    here = cfg["model"] == "embedded" or Path(cfg["model"]).is_dir()   # a checkpoint made above
    return here and cfg["dataset_name"] == "embedded" and not cfg.get("use_vllm")


@pytest.mark.parametrize("line, argv", COMMANDS, ids=[line for line, _ in COMMANDS])
def test_documented_line_runs(line, argv, tmp_path, monkeypatch, capsys, request):
    checkpoint = request.getfixturevalue("a_checkpoint") if "checkpoint-" in line else None
    workspace(tmp_path, monkeypatch, argv, checkpoint)
    if argv[0] in ("--help", "--version") or "--help" in argv or argv[0] == "bench":
        argv = argv + ["--help"] if argv[0] == "bench" else argv
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code in (0, None)
        return
    assert main(argv + ["--dry_run"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert isinstance(yaml.safe_load(printed), dict)
    assert not (tmp_path / "runs").exists() or "checkpoint-" in line   # a dry run makes nothing
    if is_cheap(printed, argv, line):
        extra = WHOLE if argv[0] == "train" else \
            ["--eval_num_questions", "16", "--k", "2"] if argv[0] == "eval" else []
        assert main(argv + extra) == 0, capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["train", "--generator_cpus", "[1]", "--async_rollout", "true"], None),
    (["train", "--gradient_checkpointing_kwargs", "{use_reentrant: true}"], None),
    (["train", "--learning_rate", "fast"], "learning_rate"),
    (["train", "--output_dir", "/proc/cppo-run"], "output_dir"),
])
def test_dry_run_gives_a_real_runs_answer(argv, names, tmp_path, monkeypatch, capsys):
    """--dry_run accepts what a run accepts (the CLI's own examples) and refuses with the same
    one line and exit 2 what a run refuses."""
    monkeypatch.chdir(tmp_path)
    code = main(argv + ["--dry_run"])
    err = capsys.readouterr().err
    if names is None:
        assert code == 0, err
    else:
        assert code == 2 and f"'{names}'" in err and err.startswith("cppo train: error:")
        assert "Traceback" not in err


def help_examples() -> list[tuple[str, str]]:
    """(field, example) for each `--name value` and each {...} / [...] example in a field's
    --help text."""
    import dataclasses
    from cppo.config import CPPOConfig
    found = []
    for fld in dataclasses.fields(CPPOConfig):
        text = fld.metadata.get("help", "")
        found += [(fld.name, span) for span in re.findall(r"`(--\w+ [^`]+)`", text)]
        found += [(fld.name, span) for span in re.findall(r"e\.g\. (\{[^}]*\}|\[[^\]]*\])", text)]
    return found


@pytest.mark.parametrize("field, example", help_examples())
def test_help_examples_follow_the_command_lines_syntax(field, example):
    """What `cppo train --help` shows as an example is accepted as the command line gives it."""
    from cppo.config import CPPOConfig
    from cppo.config.reading import coerce
    import dataclasses
    fld = {f.name: f for f in dataclasses.fields(CPPOConfig)}[field]
    if example.startswith("--"):
        name, *values = shlex.split(example)
        assert name == f"--{field}"
        raw = values if len(values) > 1 or "list[" in str(fld.type) else values[0]
    else:
        raw = [example] if "list[" in str(fld.type) else example
    assert coerce(fld, raw, cls=CPPOConfig, source="command line") is not None


def test_help_shows_examples():
    assert len(help_examples()) >= 5
