"""`cppo` command line: train | eval | pretrain | bench | export-data.

Every field of a command's config dataclass is a `--name value` option; `cppo train` also takes
`--config run.yaml` (command-line values override the file). `--dry_run` resolves and checks a
command's config (and what it needs from this machine: extras, paths), prints it and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from cppo.config import (CPPOConfig, build_dataclass, check, check_fields, option, read_yaml,
                         same_as)
from cppo.errors import ConfigError


@dataclass
class EvalConfig:
    model: str = option("embedded", "Model: 'embedded', a local directory or a hub id.")
    dataset_name: str = option("embedded", "Held-out data (same choices as `cppo train`).")
    eval_dataset_split: str = option("test", "Split to evaluate on.")
    prompt_style: str = same_as(CPPOConfig, "prompt_style")
    task_level: int = same_as(CPPOConfig, "task_level")
    eval_num_questions: int | None = same_as(CPPOConfig, "eval_num_questions", None,
                                             "Evaluate on the first N questions (None: all).")
    reward_funcs: list[str] = same_as(CPPOConfig, "reward_funcs", help="For ready-made prompts "
                                      "(jsonl with prompt and answer columns): the first decides "
                                      "what is correct. gsm8k, math and the embedded task use "
                                      "their own.")
    k: int = option(16, "k of pass@k (0: greedy only).", at_least=0)
    temperature: float = same_as(CPPOConfig, "temperature", help="Sampling temperature for pass@k.")
    max_completion_length: int | None = option(None, "Max new tokens (None: the task's need, or 256).")
    batch_size: int | None = option(None, "Completions decoded together (None: as many as "
                                    "memory_budget_gib allows).", at_least=1)
    memory_budget_gib: float | None = same_as(CPPOConfig, "memory_budget_gib",
                                              help="GiB for KV caches and logits (None: 90% of the "
                                              "device's memory less the weights).")
    seed: int = same_as(CPPOConfig, "seed", 0, "Sampling seed.")
    output_json: str | None = option(None, "Write the result as JSON here.")
    torch_dtype: str = same_as(CPPOConfig, "torch_dtype")
    attn_implementation: str | None = same_as(CPPOConfig, "attn_implementation")

    def __post_init__(self):
        check_fields(self)


@dataclass
class ExportConfig:
    output: str = option("embedded_task.jsonl", "Output .jsonl file.")
    task_level: int = same_as(CPPOConfig, "task_level")
    split: str = option("train", "Split: train or test.", ("train", "test"))
    n: int | None = option(None, "Number of problems (None: the whole split).", at_least=1)
    seed: int = same_as(CPPOConfig, "seed", 0, "Order seed.")

    def __post_init__(self):
        check_fields(self)


def _add_fields(parser: argparse.ArgumentParser, cls) -> None:
    group = parser.add_argument_group(f"{cls.__name__} fields (--name value)")
    for fld in dataclasses.fields(cls):
        default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
        choices = fld.metadata.get("choices")
        text = fld.metadata.get("help", "")
        if choices:
            text += f" Choices: {', '.join(map(str, choices))}."
        text += f" (default: {default})"
        is_bool = str(fld.type).startswith("bool")
        is_list = "list[" in str(fld.type)   # TRL's habit: --reward_funcs gsm8k format
        group.add_argument(f"--{fld.name}", dest=fld.name, default=argparse.SUPPRESS,
                           metavar="BOOL" if is_bool else "VALUE",
                           nargs="?" if is_bool else ("+" if is_list else None),
                           const="true" if is_bool else None,
                           help=text.replace("%", "%%"))


def _add_dry_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry_run", action="store_true", default=False,
                        help="Resolve and check the config (values, extras, paths), print it as "
                        "YAML and exit without loading a model or training.")


def print_config(cfg, command: str) -> int:
    """--dry_run's answer: the config that would run, as YAML on stdout; exit code 0."""
    import yaml
    print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
    print(f"cppo {command}: dry run: the config above is valid; nothing was run", file=sys.stderr)
    return 0


def _add_trl_fields(parser: argparse.ArgumentParser, cls) -> None:
    """TRL's field names that cppo maps or ignores (cppo.config.trl_fields), accepted but not listed."""
    from cppo.config.trl_fields import TRL_FIELDS
    own = {f.name for f in dataclasses.fields(cls)}
    for name in TRL_FIELDS:
        if name not in own:
            parser.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS, nargs="*",
                                help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cppo", description="Fast GRPO fine-tuning with completion pruning (CPPO).",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from importlib.metadata import version   # cppo.__version__, through the installed metadata
    parser.add_argument("--version", action="version", version=f"cppo {version('cppo')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", allow_abbrev=False, help="GRPO/CPPO training (no arguments: the embedded default)",
                           description="Train with GRPO + completion pruning. With no arguments: "
                           "CPPO (G=8, P=0.75) with allocation on the shipped tiny model and task.")
    train.add_argument("--config", default=None, help="YAML file of field: value (overridden by "
                       "command-line options).")
    _add_dry_run(train)
    _add_fields(train, CPPOConfig)
    _add_trl_fields(train, CPPOConfig)
    ev = sub.add_parser("eval", allow_abbrev=False, help="held-out greedy accuracy and pass@k of a model")
    _add_dry_run(ev)
    _add_fields(ev, EvalConfig)
    from cppo.pretrain import PretrainConfig
    pre = sub.add_parser("pretrain", allow_abbrev=False, help="supervised pretraining of the tiny base model")
    _add_dry_run(pre)
    _add_fields(pre, PretrainConfig)
    bench = sub.add_parser("bench", allow_abbrev=False, help="the CPPO paper table on the embedded task "
                           "(benchmarks/cppo_table.py)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    exp = sub.add_parser("export-data", allow_abbrev=False, help="write the embedded task as jsonl for other tools")
    _add_dry_run(exp)
    _add_fields(exp, ExportConfig)
    return parser


def _overrides(args: argparse.Namespace, cls) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def _trl_overrides(args: argparse.Namespace) -> dict:
    """TRL-named options given on the command line: one value as a string, several as a list,
    a bare flag as "true"."""
    from cppo.config.trl_fields import TRL_FIELDS
    names = set(TRL_FIELDS) - {f.name for f in dataclasses.fields(CPPOConfig)}
    out = {}
    for key, value in vars(args).items():
        if key in names:
            out[key] = "true" if value == [] else value[0] if len(value) == 1 else value
    return out


def train_config(args) -> CPPOConfig:
    """`cppo train`'s config: defaults, then the YAML file, then the options; TRL names mapped."""
    from cppo.config import from_trl_names
    values = read_yaml(args.config) if args.config else {}
    source = args.config or "command line"
    values.update(_overrides(args, CPPOConfig))
    values.update(_trl_overrides(args))
    values = from_trl_names(values, CPPOConfig, source=source,
                            announce=lambda message: print(message, file=sys.stderr))
    return build_dataclass(CPPOConfig, values, source=source)


def cmd_train(args) -> int:
    cfg = train_config(args)
    if args.dry_run:
        from cppo.config.startup import check_startup
        check_startup(cfg, output_dir="probe")
        return print_config(cfg, "train")
    from cppo.trainer import EXIT_CODES, train
    summary = train(cfg)
    return EXIT_CODES.get(summary.get("status"), 1)


def cmd_eval(args) -> int:
    cfg = build_dataclass(EvalConfig, _overrides(args, EvalConfig), source="command line",
                          command="eval")
    from cppo.config.startup import check_readable, writable_directory
    from cppo.models.loading import resolve_model_path
    check_readable("model", resolve_model_path(cfg.model))   # a missing path: ModelLoadError
    if cfg.output_json:
        writable_directory("output_json", str(Path(cfg.output_json).parent), keep=not args.dry_run)
    if args.dry_run:
        return print_config(cfg, "eval")
    from cppo.data.sources import TaskSource, load_task
    from cppo.evaluate import EvalSampling, evaluate
    from cppo.parallel.memory import eval_batch_size
    from cppo.sampling.sampler import prompts_length
    from cppo.sampling.settings import SamplingSettings
    from cppo.models import load_model, load_tokenizer
    from cppo.rewards import get_reward_function

    tokenizer = load_tokenizer(cfg.model)
    task = load_task(TaskSource.of(cfg), tokenizer=tokenizer, train_split=False)
    if not task.eval_rows:
        raise ConfigError(f"no held-out rows in split '{cfg.eval_dataset_split}' of "
                          f"'{cfg.dataset_name}'")
    model = load_model(cfg.model, torch_dtype=cfg.torch_dtype,
                       attn_implementation=cfg.attn_implementation)
    max_new = cfg.max_completion_length or task.max_answer_tokens or 256
    batch_size = cfg.batch_size or eval_batch_size(model, prompts_length(tokenizer, task.eval_rows),
                                                   max_new_tokens=max_new, k=cfg.k,
                                                   memory_budget_gib=cfg.memory_budget_gib)
    reward = task.scoring_reward(get_reward_function(cfg.reward_funcs[0]))
    result = evaluate(model, tokenizer, task.eval_rows, reward,
                      k=cfg.k, sampling=EvalSampling(SamplingSettings(temperature=cfg.temperature),
                                                     seed=cfg.seed),
                      max_new_tokens=max_new, batch_size=batch_size)
    print(f"{cfg.model} on {task.description} ({cfg.eval_dataset_split}): {result.summary()}")
    if cfg.output_json:
        Path(cfg.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output_json).write_text(json.dumps(
            {"model": cfg.model, "dataset": task.description, **result.to_dict()}, indent=2))
        print(f"wrote {cfg.output_json}")
    return 0


def cmd_pretrain(args) -> int:
    from cppo.pretrain import PretrainConfig, command_line, pretrain
    cfg = build_dataclass(PretrainConfig, _overrides(args, PretrainConfig),
                          source="command line", command="pretrain")
    from cppo.config.startup import writable_directory
    writable_directory("output_dir", cfg.output_dir, keep=not args.dry_run)
    if args.dry_run:
        return print_config(cfg, "pretrain")
    report = pretrain(cfg, command=command_line())
    ev = report["eval"]
    print(f"pretrained in {report['train_seconds']} s: greedy {100 * ev['greedy_accuracy']:.1f}%, "
          f"pass@{ev['k']} {100 * ev['pass_at_k']:.1f}% -> {cfg.output_dir}")
    return 0


def cmd_export(args) -> int:
    from cppo.data import arithmetic
    cfg = build_dataclass(ExportConfig, _overrides(args, ExportConfig), source="command line",
                          command="export-data")
    from cppo.config.startup import writable_directory
    writable_directory("output", str(Path(cfg.output).parent), keep=not args.dry_run)
    if args.dry_run:
        return print_config(cfg, "export-data")
    problems = arithmetic.generate(cfg.task_level, cfg.split, n=cfg.n, seed=cfg.seed)
    path = arithmetic.export_jsonl(problems, cfg.output)
    print(f"wrote {len(problems)} {cfg.split} problems (level {cfg.task_level}) to {path}")
    return 0


BENCH_SCRIPT = Path("benchmarks") / "cppo_table.py"


def bench_script(cwd: Path | None = None) -> Path:
    """The paper-table program of a source checkout: the current directory's, else the one this
    package was installed from in editable mode. A wheel holds no benchmarks: ConfigError."""
    candidates = [(cwd or Path.cwd()) / BENCH_SCRIPT,
                  Path(__file__).resolve().parents[2] / BENCH_SCRIPT]
    for script in candidates:
        if script.is_file():
            return script
    raise ConfigError(f"cppo bench runs {BENCH_SCRIPT} of a source checkout, and there is none "
                      f"here ({candidates[0]}) or beside the installed package: clone the "
                      f"repository, cd into it, and run `cppo bench` there")


def cmd_bench(args) -> int:
    import runpy
    script = bench_script()
    sys.argv = [str(script)] + args.rest
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _unknown_option(parser, command: str, unknown: list[str]) -> int:
    import difflib
    sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == command)[1]
    options = [o for a in sub._actions for o in a.option_strings]
    bad = next((u for u in unknown if u.startswith("--")), unknown[0])
    hint = difflib.get_close_matches(bad.split("=")[0], options, n=1)
    extra = f"; did you mean {hint[0]}?" if hint else ""
    print(f"cppo {command}: error: unknown option {bad}{extra} (see `cppo {command} --help`)",
          file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "bench":  # everything after `bench` belongs to the benchmark program
        raw = list(sys.argv[1:] if argv is None else argv)
        args.rest = raw[raw.index("bench") + 1:]
    if unknown and args.command != "bench":
        return _unknown_option(parser, args.command, unknown)
    handlers = {"train": cmd_train, "eval": cmd_eval, "pretrain": cmd_pretrain,
                "export-data": cmd_export, "bench": cmd_bench}
    try:
        return handlers[args.command](args)
    except ConfigError as err:
        print(f"cppo {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
