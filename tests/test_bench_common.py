"""benchmarks/common.py, the harness the benchmark programs share: ranges over repeats, the
machine record and its older shapes (as headlines.py reads them), a trainer to time, results files."""

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import ROWS, odd_length_reward

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def common():
    return load("common")


@pytest.fixture(scope="module")
def headlines(common):
    return load("headlines")


# --- ranges over repeats ------------------------------------------------------------------------

def test_spread_is_the_median_and_the_range(common):
    assert common.spread([3.0, 1.0, 4.0, 1.5, 5.0]) == {"median": 3.0, "min": 1.0, "max": 5.0}
    assert common.spread([4.0, 1.0, 2.0, 8.0]) == {"median": 3.0, "min": 1.0, "max": 8.0}   # even
    assert common.spread([7.0]) == {"median": 7.0, "min": 7.0, "max": 7.0}


def test_spread_scales_then_rounds(common):
    seconds = [0.00123, 0.00456, 0.00234]
    assert common.spread(seconds, 1000, 1) == {"median": 2.3, "min": 1.2, "max": 4.6}
    assert common.spread(seconds, 1000)["max"] == pytest.approx(4.56)   # not rounded


def test_spread_text_writes_median_then_range(common):
    assert common.spread_text(1.234, 1.1, 1.456, 2) == "1.23 (1.10-1.46)"
    assert common.spread_text(0.9876, 0.9, 1.2, 3, 2, "[]") == "0.988 [0.90-1.20]"
    assert common.spread_text(12.5, 11.0, 14.25, brackets="[]") == "12.5 [11.0-14.25]"
    assert common.spread_text(1.0, 0.5, 2.0, 1, sep=" to ") == "1.0 (0.5 to 2.0)"


# --- the machine record ---------------------------------------------------------------------------

def test_machine_has_what_headlines_and_the_programs_read(common, headlines):
    import torch
    m = common.machine(backend="gloo")
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {"cpu", "machine", "torch", "threads", "avx512_bf16", "amx_bf16", "fast_bfloat16",
            "cores", "python", "platform"} <= set(m)
    assert m["cores"] == os.cpu_count() and m["backend"] == "gloo"
    assert headlines.cpu({"machine": m}).endswith(f", {m['cpu_capability']}")
    assert common.machine_of({"machine": m}) == m   # the current shape reads as it is


def test_machine_in_an_environment_is_taken_there(common):
    m = common.machine(env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}, note="emulated")
    assert m["cpu_capability"] == "DEFAULT" and m["note"] == "emulated"


NEW = {"cpu": "AMD EPYC", "machine": "x86_64", "cpu_capability": "AVX512", "threads": 2,
       "cores": 2, "torch": "2.13.0+cpu", "python": "3.11.7"}
OLD_SHAPES = {
    "meta.machine (describe)": {"meta": {"machine": {k: NEW[k] for k in
                                                     ("cpu", "machine", "cpu_capability", "threads", "torch")}}},
    "cppo_table: nested hardware": {"machine": {
        "platform": "Linux", "processor": "x86_64", "cpu_count": 2, "torch": "2.13.0+cpu",
        "torch_threads": 2, "python": "3.11.7",
        "hardware": {"cpu": "AMD EPYC", "machine": "x86_64", "torch": "2.13.0+cpu",
                     "cpu_capability": "AVX512", "threads": 2}}},
    "exit_codes: cpu_model": {"machine": {"cpu": "x86_64", "cpu_model": "AMD EPYC",
                                          "cpu_capability": "AVX512", "cores": 2, "torch": "2.13.0+cpu",
                                          "python": "3.11.7", "threads_per_process": 1}},
    "async_rollout: top level": {"cpu": "AMD EPYC", "capability": "AVX512", "speed": []},
}


@pytest.mark.parametrize("shape", OLD_SHAPES)
def test_headlines_read_an_old_shape_as_the_new_one(common, headlines, shape):
    old = OLD_SHAPES[shape]
    assert headlines.cpu(old) == headlines.cpu({"machine": NEW}) == "AMD EPYC, AVX512"
    record = common.machine_of(old)
    assert {k: record[k] for k in record if k in NEW} == {k: NEW[k] for k in record if k in NEW}
    assert record["cpu"] == "AMD EPYC" and record["cpu_capability"] == "AVX512"


def test_old_names_become_the_new_ones(common):
    record = common.machine_of(OLD_SHAPES["cppo_table: nested hardware"])
    assert record["cores"] == 2 and record["threads"] == 2 and record["platform"] == "Linux"
    assert "cpu_count" not in record and "torch_threads" not in record and "hardware" not in record
    record = common.machine_of(OLD_SHAPES["exit_codes: cpu_model"])
    assert record["machine"] == "x86_64" and "cpu_model" not in record
    # objectives wrote no CPU name: none is made up (headlines says 'x86_64 CPU')
    objectives = {"meta": {"machine": {"platform": "Linux", "cpu_capability": "AVX512", "cpu_count": 2}}}
    assert "cpu" not in common.machine_of(objectives)
    assert common.machine_of(objectives)["cores"] == 2


def test_every_committed_results_file_has_a_readable_machine_record(common):
    files = [p for p in (BENCH / "results").rglob("*.json") if p.name in ("results.json", "round_cost.json")]
    assert len(files) > 20
    for path in files:
        record = common.machine_of(json.loads(path.read_text()))
        assert record.get("cpu_capability"), path
        assert "cpu_model" not in record and "hardware" not in record, path


# --- a trainer to time ----------------------------------------------------------------------------

def test_trainer_for_builds_the_config_asked_for(common, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    trainer = common.trainer_for(tiny_model_dir, ROWS, odd_length_reward, prefix="cppo_test_",
                                 num_generations=4, per_device_train_batch_size=8,
                                 pruning_rate="0.5", max_completion_length=5, eval_steps=0,
                                 save_steps=0, log_completions=False)
    args = trainer.args
    assert args.model == tiny_model_dir and args.progress_bar is False
    assert args.pruning_rate == 0.5 and args.num_generations == 4   # strings parsed as by the CLI
    assert Path(args.output_dir).parent == tmp_path and Path(args.output_dir).name.startswith("cppo_test_")
    assert trainer.rewards.funcs == [odd_length_reward]
    assert [r["prompt"] for r in trainer.task.train_rows] == [r["prompt"] for r in ROWS]
    named = common.trainer_for(tiny_model_dir, ROWS, odd_length_reward, output_dir=str(tmp_path / "run"),
                               num_generations=4, per_device_train_batch_size=8, progress_bar=True)
    assert named.args.output_dir == str(tmp_path / "run") and named.args.progress_bar is True


def test_parts_for_builds_a_run_without_a_trainer(common, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parts = common.parts_for(tiny_model_dir, ROWS, odd_length_reward, num_generations=4,
                             per_device_train_batch_size=8, pruning_rate="0.5",
                             max_completion_length=5, log_completions=False)
    assert parts.rewards.funcs == [odd_length_reward] and parts.plan.completions_kept == 8
    rows = common.first_round_rows(parts)
    assert len(rows) == parts.plan.questions_per_step == 4
    assert rows == [ROWS[i] for i in type(parts.questions)(len(ROWS), 42).take(4)]   # seed 42


def test_accuracy_cells_are_means_and_ranges_over_seeds(common):
    runs = [{"accuracy_before": 0.30, "accuracy_after": 0.45, "train_seconds": 100.4},
            {"accuracy_before": 0.30, "accuracy_after": 0.42, "train_seconds": 90.0},
            {"accuracy_before": 0.30, "accuracy_after": 0.50, "train_seconds": 120.0}]
    assert common.accuracy_cells(runs) == ("30.0 % -> 45.7 % | +15.0 (+12.0 to +20.0) "
                                           "| 100 (90-120)")


def test_earlier_rows_are_kept_only_for_the_same_run(common, tmp_path):
    import argparse
    common.write_results(tmp_path, {"max_steps": 600, "top_p": 0.9, "rows": [{"seed": 1}]}, None,
                         echo=False)
    args = argparse.Namespace(out=str(tmp_path), resume=True, max_steps=600)
    assert common.earlier_rows(args, top_p=0.9) == [{"seed": 1}]
    assert common.earlier_rows(args, top_p=0.8) == []
    assert common.earlier_rows(argparse.Namespace(out=str(tmp_path), resume=True, max_steps=100)) == []
    assert common.earlier_rows(argparse.Namespace(out=str(tmp_path), resume=False, max_steps=600)) == []


# --- results files --------------------------------------------------------------------------------

def test_write_results_writes_json_and_markdown(common, tmp_path, capsys):
    out = tmp_path / "a" / "b"
    written = common.write_results(out, {"rows": [1, 2]}, ["# title", "", "| x |"], indent=1)
    assert written == [out / "results.json", out / "results.md"]
    assert json.loads((out / "results.json").read_text()) == {"rows": [1, 2]}
    assert (out / "results.json").read_text() == '{\n "rows": [\n  1,\n  2\n ]\n}\n'
    assert (out / "results.md").read_text() == "# title\n\n| x |\n"
    assert capsys.readouterr().out == "# title\n\n| x |\n"
    assert common.read_results(out) == {"rows": [1, 2]}
    assert common.read_results(tmp_path / "nothing") == {}


def test_write_results_leaves_out_what_is_none_and_writes_text_as_it_is(common, tmp_path, capsys):
    common.write_results(tmp_path, None, "text\n\n", md_name="soak.md", echo=False)
    assert (tmp_path / "soak.md").read_text() == "text\n\n" and not (tmp_path / "results.json").exists()
    common.write_results(tmp_path, {"k": 1}, None, json_name="round_cost.json")
    assert json.loads((tmp_path / "round_cost.json").read_text()) == {"k": 1}
    assert not (tmp_path / "results.md").exists() and capsys.readouterr().out == ""
