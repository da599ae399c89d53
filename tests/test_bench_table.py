"""benchmarks/cppo_table.py: the bound formulas, time-to-accuracy, the report; one tiny real run."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("cppo_table", ROOT / "benchmarks" / "cppo_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cppo_table"] = module      # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_amdahl_bound_is_the_written_formula(table):
    # GRPO: 100 s, 40 of them generate+score; CPPO P=0.75 generates+scores in 10 s
    assert table.amdahl_bound(100.0, 40.0, 10.0, 0.75) == pytest.approx(100 / (10 + 0.25 * 60))
    # same generation time and P = 0: no speed-up possible
    assert table.amdahl_bound(100.0, 40.0, 40.0, 0.0) == pytest.approx(1.0)
    # free generation: the ideal 1 / (1 - P)
    assert table.amdahl_bound(100.0, 0.0, 0.0, 0.875) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="pruning_rate"):
        table.amdahl_bound(100.0, 40.0, 10.0, 1.0)


def test_updates_bound_uses_the_measured_share_of_updates(table):
    # GRPO ran 700 updates, CPPO 350: the same as amdahl_bound at P = 0.5
    assert table.updates_bound(100.0, 40.0, 10.0, 700, 350) == pytest.approx(100 / (10 + 0.5 * 60))
    # CPPO ran 2/3 of GRPO's updates (GRPO skipped its zero-variance groups): a lower bound
    assert table.updates_bound(100.0, 40.0, 10.0, 600, 400) == pytest.approx(100 / (10 + 60 * 400 / 600))
    assert table.updates_run({"steps": 1024, "skipped_steps": 291}) == 733
    with pytest.raises(ValueError, match="updates run"):
        table.updates_bound(100.0, 40.0, 10.0, 0, 10)


def test_classic_amdahl_limits(table):
    assert table.classic_amdahl(1.0, 0.9375) == pytest.approx(16.0)
    assert table.classic_amdahl(0.0, 0.9375) == pytest.approx(1.0)
    assert table.classic_amdahl(0.5, 0.5) == pytest.approx(1 / 0.75)
    with pytest.raises(ValueError):
        table.classic_amdahl(1.5, 0.5)


HISTORY = [{"step": 0, "accuracy": 0.30, "train_seconds": 0.0, "wall_time": 2.0},
           {"step": 10, "accuracy": 0.34, "train_seconds": 10.0, "wall_time": 14.0},
           {"step": 20, "accuracy": 0.40, "train_seconds": 20.0, "wall_time": 26.0}]


def test_time_to_accuracy_interpolates_between_evals(table):
    assert table.time_to_accuracy(HISTORY, 0.37) == pytest.approx(15.0)
    assert table.time_to_accuracy(HISTORY, 0.37, "wall_time") == pytest.approx(20.0)
    assert table.time_to_accuracy(HISTORY, 0.34) == pytest.approx(10.0)   # exactly at an eval
    assert table.time_to_accuracy(HISTORY, 0.25) == 0.0                    # reached before training
    assert table.time_to_accuracy(HISTORY, 0.41) is None                   # not reached


def test_time_to_accuracy_uses_the_first_crossing(table):
    history = HISTORY + [{"step": 30, "accuracy": 0.35, "train_seconds": 30.0, "wall_time": 38.0},
                         {"step": 40, "accuracy": 0.45, "train_seconds": 40.0, "wall_time": 50.0}]
    assert table.time_to_accuracy(history, 0.40) == pytest.approx(20.0)


def test_markdown_table_and_formatting(table):
    text = table.markdown_table(["row", "x"], [["a", 1], ["b", 2.5]])
    assert text.splitlines() == ["| row | x |", "|:---|---:|", "| a | 1 |", "| b | 2.5 |"]
    with pytest.raises(ValueError, match="row 0"):
        table.markdown_table(["row", "x"], [["a"]])
    assert table.fmt_pm(0.4123, 0.0112, scale=100) == "41.2 ± 1.1"
    assert table.fmt_pm(0.4123, 0.0, scale=100) == "41.2"
    assert table.fmt_pm(None, None) == "n/a"
    assert table.parse_seeds("3") == [0, 1, 2]
    assert table.parse_seeds("4,7") == [4, 7]


def test_rows_have_the_paper_shapes(table):
    rows = table.all_rows()
    assert [table.questions_per_step(p) for p in table.PRUNING_RATES] == [2, 4, 8, 16]
    assert rows["grpo"].config_values()["per_device_train_batch_size"] == 16
    assert rows["fair-0.875"].config_values() == {"pruning_rate": 0.0, "per_device_train_batch_size": 128}
    assert rows["maxvar-0.875"].config_values()["selection_scope"] == "question"
    unbiased = rows["unbiased-0.75"].config_values()
    assert unbiased["selection_rule"] == "unbiased" and unbiased["pruning_rate"] == 0.75
    assert rows["unbiased-0.875"].label == "CPPO P=0.875, unbiased"


def fake_summary(seconds, generate, accuracy, steps, q, kept=16, p=0.0, skipped=0):
    history = [{"step": 0, "accuracy": 0.30, "train_seconds": 0.0, "wall_time": 1.0},
               {"step": steps, "accuracy": accuracy, "train_seconds": seconds, "wall_time": seconds + 2}]
    return {"accuracy_before": 0.30, "accuracy_after": accuracy, "train_seconds": seconds,
            "wall_seconds": seconds + 2, "steps": steps, "questions_per_step": q,
            "completions_kept_per_step": kept, "effective_pruning_rate": p, "skipped_steps": skipped,
            "phase_seconds_this_session": {"generate": generate, "score": 0.0, "logprobs": 0.0,
                                           "update": seconds - generate - 1, "eval": 1.0,
                                           "checkpoint": 0.1},
            "history": history}


def test_report_from_fake_runs(table, tmp_path):
    runs = []
    for seed in (0, 1):
        runs.append({"row": "grpo", "seed": seed, "summary": fake_summary(100, 40, 0.40, 64, 1, skipped=16)})
        runs.append({"row": "cppo-0.5", "seed": seed,
                     "summary": fake_summary(50, 25, 0.395, 32, 2, p=0.5, skipped=2 * seed)})
        runs.append({"row": "fair-0.5", "seed": seed, "summary": fake_summary(80, 25, 0.41, 32, 2, kept=32)})
    raw = {"command": "python benchmarks/cppo_table.py --test", "machine": table.machine(),
           "started": "now", "total_seconds": 600.0, "estimate_seconds": 500.0,
           "settings": {"quick": False, "train_questions": 64, "seeds": [0, 1],
                        "rows": ["grpo", "cppo-0.5", "fair-0.5", "trl"], "eval_questions": 500,
                        "evals_per_run": 4, "learning_rate": 3e-5},
           "runs": runs, "trl": {"error": "TRL not installed", "warmup_steps": 1, "measured_steps": 2,
                                 "ours": {"seconds_per_step": 0.1, "tokens_per_s": 800}}}
    markdown, stats, targets = table.build_report(raw)
    cppo = stats["cppo-0.5"]
    assert cppo["speedup_train"] == pytest.approx(2.0)
    assert cppo["bound"] == pytest.approx(100 / (25 + 0.5 * 60))
    # updates run: GRPO 64 - 16 = 48; CPPO 32 and 30 over the seeds (mean 31)
    assert stats["grpo"]["updates_run"] == 48 and cppo["updates_run"] == 31
    assert cppo["updates_bound"] == pytest.approx(100 / (25 + 60 * 31 / 48))
    assert cppo["fraction_of_updates_bound"] == pytest.approx(2.0 / cppo["updates_bound"])
    assert "| CPPO P=0.5 | 31 | 48 | 0.65 | 0.500 | 2.00x | 1.82x | 1.57x | 127% |" in markdown
    assert cppo["time_to_target"] == (None, None) and cppo["reached"] == 0   # 39.5 % < 40 %
    assert stats["fair-0.5"]["time_to_target"][0] == pytest.approx(80 * 0.10 / 0.11)
    met = {t["target"]: t["met"] for t in targets}
    assert met["P=0.5: speed-up >= 1.81x at accuracy >= GRPO - 1 pt"] is True
    assert met["P=0.5: speed-up >= 90% of the measured bound"] is True
    assert met["P=0.75: speed-up >= 3.27x at accuracy >= GRPO - 1 pt"] is None   # not run
    assert met["full table in <= 60 min"] is True
    assert "not reached" in markdown and "TRL not installed" in markdown and "| GRPO (paper: B = 16) |" in markdown
    assert "bound(P) = T_GRPO / (G_CPPO + (1 - P)" in markdown
    table.write_plots(raw, stats, tmp_path)
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0


def test_tiny_end_to_end_run(table, tmp_path):
    """One real CPPO row on 16 questions (a single step) writes every output."""
    code = table.main(["--rows", "cppo-0.9375", "--train_questions", "16", "--seeds", "1",
                       "--eval_questions", "8", "--no_estimate", "--output", str(tmp_path)])
    assert code == 0
    raw = json.loads((tmp_path / "results.json").read_text())
    (run,) = raw["runs"]
    assert run["summary"]["steps"] == 1 and run["summary"]["questions_per_step"] == 16
    assert math.isfinite(run["summary"]["train_seconds"])
    for name in ("results.md", "accuracy_vs_time.png", "speedup.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_fitting_questions_scales_the_training_part(table):
    # 1024 questions: 3000 s of training + 600 s fixed; 3600 s budget fits exactly 1024
    assert table.fitting_questions(1024, 3000.0, 600.0, 3600.0) == 1024
    assert table.fitting_questions(1024, 6000.0, 600.0, 3600.0) == 512
    assert table.fitting_questions(1024, 6000.0, 5000.0, 3600.0) == 16     # never below 16
