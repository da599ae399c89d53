"""pruning_rate: auto (async_rollout): the controller (cppo.algorithm.balance), the config's
checks, the rate a run logs and keeps, and --resume continuing from the checkpoint's rate."""

import json
import time
from collections import deque

import pytest

from cppo.algorithm.allocation import completions_kept
from cppo.algorithm.balance import GAIN, balanced_pruning_rate
from cppo.algorithm.two_stage import completions_to_keep
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.sampling.async_rollout import Arrival, RolloutScheduler
from cppo.trainer import CPPOTrainer
from helpers import assert_config_error_names, make_trainer, step_records

RANGE = dict(low=0.5, high=0.9375)
AUTO = dict(async_rollout=True, pruning_rate="auto", pruning_rate_min=0.25,
            pruning_rate_start=0.5, pruning_rate_max=0.75, generation_dtype=None,
            matmul_dtype=None)   # B = 8 kept of Q = 4 x G = 4 scored at the start


# --- the controller ------------------------------------------------------------------------

def test_a_trainer_that_waited_prunes_less():
    """The trainer waited half the round's sampling time: the kept share grows by GAIN / 2."""
    rate = balanced_pruning_rate(0.75, trainer_wait=0.5, generator_idle=0.0, round_seconds=1.0,
                                 **RANGE)
    assert rate == pytest.approx(1 - 0.25 * (1 + GAIN / 2))


def test_a_stalled_generator_makes_it_prune_more():
    rate = balanced_pruning_rate(0.75, trainer_wait=0.0, generator_idle=0.5, round_seconds=1.0,
                                 **RANGE)
    assert rate == pytest.approx(1 - 0.25 * (1 - GAIN / 2))


def test_the_move_is_proportional_to_the_imbalance_and_bounded_per_round():
    """Twice the net wait, twice the move; a wait beyond the round's sampling time moves no
    further than one of exactly that time (GAIN)."""
    def move(wait, idle):
        return 0.75 - balanced_pruning_rate(0.75, trainer_wait=wait, generator_idle=idle,
                                            round_seconds=2.0, **RANGE)
    assert move(0.4, 0.0) == pytest.approx(2 * move(0.2, 0.0))
    assert move(0.5, 0.3) == pytest.approx(move(0.2, 0.0))   # the net of the two waits
    assert move(50.0, 0.0) == pytest.approx(move(2.0, 0.0)) == pytest.approx(0.25 * GAIN)
    assert move(0.0, 50.0) == pytest.approx(-0.25 * GAIN)


@pytest.mark.parametrize("wait, idle", [(0.0, 0.0), (0.3, 0.3)])
def test_no_imbalance_leaves_the_rate_as_it_is(wait, idle):
    assert balanced_pruning_rate(0.8125, trainer_wait=wait, generator_idle=idle,
                                 round_seconds=1.0, **RANGE) == 0.8125
    assert balanced_pruning_rate(0.8125, trainer_wait=1.0, generator_idle=0.0,
                                 round_seconds=0.0, **RANGE) == 0.8125   # no sampling measured


@pytest.mark.parametrize("wait, idle, bound", [(5.0, 0.0, 0.5), (0.0, 5.0, 0.9375)])
def test_the_rate_stays_within_its_range(wait, idle, bound):
    """Round after round of the same imbalance: the rate reaches its bound and stays on it."""
    rate, seen = 0.75, []
    for _ in range(40):
        rate = balanced_pruning_rate(rate, trainer_wait=wait, generator_idle=idle,
                                     round_seconds=1.0, **RANGE)
        seen.append(rate)
    assert all(0.5 <= r <= 0.9375 for r in seen)
    assert seen[-1] == pytest.approx(bound, abs=1e-12)


def test_completions_to_keep_at_the_rate_now():
    """Step scope: round(Q G (1 - P)); question scope: round(G (1 - P)) for each question,
    whatever the plan's own rate."""
    step = CPPOConfig(per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5).step_plan()
    assert completions_to_keep(step, 4, 4, 0.75) == completions_kept(4, 4, 0.75,
                                                                     question_scope=False) == 4
    assert completions_to_keep(step, 4, 4, 0.3) == 11   # 11.2
    question = CPPOConfig(per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                          selection_scope="question").step_plan()
    assert completions_to_keep(question, 4, 4, 0.3) == 4 * 3   # 2.8 each
    assert completions_to_keep(question, 4, 4, None) == 8      # the plan's


# --- the config ----------------------------------------------------------------------------

def test_auto_is_read_from_yaml_and_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("pruning_rate: auto\nasync_rollout: true\npruning_rate_start: 0.875\n")
    cfg = CPPOConfig.load(path)
    assert cfg.pruning_rate == "auto" and cfg.planned_pruning_rate == 0.875
    assert cfg.step_plan() == CPPOConfig(pruning_rate=0.875).step_plan()   # the round's questions
    cli = CPPOConfig.load(None, {"pruning_rate": "auto", "async_rollout": "true"})
    assert cli.pruning_rate == "auto"
    assert CPPOConfig.load(None, {"pruning_rate": "0.5"}).pruning_rate == 0.5


@pytest.mark.parametrize("values, names", [
    (dict(pruning_rate="auto"), ["'pruning_rate' is 'auto'", "async_rollout: true"]),
    (dict(pruning_rate="fast"), ["'pruning_rate' is 'fast'", "'auto'"]),
    (dict(pruning_rate="auto", async_rollout=True, pruning_rate_min=0.9, pruning_rate_start=0.9,
          pruning_rate_max=0.9), ["pruning_rate_min", "pruning_rate_max", "<"]),
    (dict(pruning_rate="auto", async_rollout=True, pruning_rate_max=1.0),
     ["pruning_rate_max", "< 1"]),
    (dict(pruning_rate="auto", async_rollout=True, pruning_rate_start=0.25),
     ["'pruning_rate_start' is 0.25", "[0.5, 0.9375]"]),
    (dict(pruning_rate="auto", async_rollout=True, num_generations=1,
          per_device_train_batch_size=8), ["'num_generations' is 1", "G >= 2"]),
])
def test_bad_auto_settings_name_the_field_and_the_fix(values, names):
    assert_config_error_names(values, names)


def test_the_command_line_names_a_bad_value():
    with pytest.raises(ConfigError, match="'pruning_rate' expects float or str"):
        CPPOConfig.load(None, {"pruning_rate": ["0.5", "0.6"]})


# --- a run -----------------------------------------------------------------------------------

def auto_records(run_dir) -> list[dict]:
    return [r for r in step_records(run_dir) if "loss" in r]


def assert_kept_follows_the_rate(records: list[dict]) -> None:
    for r in records:
        kept = completions_kept(r["cppo/questions_per_step"], 4, r["cppo/pruning_rate"],
                                question_scope=False)
        assert r["cppo/completions_kept"] == kept, r


def slow_reward(prompts, completions, completion_ids=None, **kw):
    """The trainer's side made slow: the generator process waits for its next task."""
    time.sleep(0.3)
    return [float(len(c) % 2) for c in completions]


def test_a_stalled_generator_raises_the_rate_the_run_prunes_at(tiny_model_dir, tmp_path):
    """The generator process samples a round far faster than the trainer scores it (a slow
    reward): it waits for tasks, so the logged rate rises from pruning_rate_start, and each
    round keeps round(Q G (1 - P)) completions at the rate it logged. (The exact moves, round by
    round, are test_a_waiting_trainer_lowers_the_rate_to_its_bound's, with a generator that
    does not depend on the machine's timing.)"""
    with make_trainer(tiny_model_dir, tmp_path / "run", reward=slow_reward, max_steps=6,
                      max_staleness=1, **AUTO) as trainer:
        trainer.train()
    records = auto_records(tmp_path / "run")
    rates = [r["cppo/pruning_rate"] for r in records]
    # the first round keeps the start; then the generator's waits push the rate up (how much
    # each round moves follows the machine's timing: a busy machine may let one round's move
    # go a little either way, so the test asks for the rise over the run, not round by round)
    assert rates[0] == 0.5 and rates[-1] > 0.6 and max(rates) <= 0.75, rates
    assert_kept_follows_the_rate(records)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["pruning_rate_last"] == pytest.approx(rates[-1], abs=1e-4)


class SlowGenerator:
    """In place of the generator process: samples each round with the trainer's own sampler,
    `seconds` long at least (the trainer waits that long), reporting `seconds` of sampling and
    no idle time: error +1 each round, after the first."""

    pushed_bytes = 0   # the generators' interface: the last push's bytes

    def __init__(self, trainer, seconds: float) -> None:
        self.trainer, self.seconds, self.tasks, self.version = trainer, seconds, deque(), 0

    def submit(self, task) -> None:
        self.tasks.append(task)

    def receive(self) -> Arrival:
        task, start = self.tasks.popleft(), time.perf_counter()
        prompts, completions = self.trainer.generation.sample(task.rows[0], task.round_index)
        time.sleep(max(0.0, self.seconds - (time.perf_counter() - start)))
        return Arrival(task.task_id, self.version, prompts, completions, self.seconds, 0.0)

    def push(self, policy, version: int) -> float:
        self.version = version
        return 0.0

    def close(self) -> None:
        pass


@pytest.fixture
def slow_generator(monkeypatch):
    def start(trainer):
        scheduler = RolloutScheduler(SlowGenerator(trainer, 0.05), lookahead=0, max_staleness=0)
        scheduler.sync(trainer.policy, trainer.run_state.step, 1)
        return scheduler
    monkeypatch.setattr(CPPOTrainer, "start_generator", start)


def expected_rates(start: float, rounds: int, low: float = 0.25) -> list[float]:
    """A session from `start` whose every round but the first had error +1."""
    rates = [start]
    for _ in range(rounds - 1):
        rates.append(max(low, 1 - (1 - rates[-1]) * (1 + GAIN)))
    return rates


def test_a_waiting_trainer_lowers_the_rate_to_its_bound(tiny_model_dir, tmp_path, slow_generator):
    with make_trainer(tiny_model_dir, tmp_path / "run", max_steps=5, max_staleness=0,
                      **AUTO) as trainer:
        trainer.train()
    records = auto_records(tmp_path / "run")
    rates = [r["cppo/pruning_rate"] for r in records]
    assert rates == pytest.approx(expected_rates(0.5, 5), abs=1e-6)   # 0.5, 0.4, 0.28, 0.25, 0.25
    assert_kept_follows_the_rate(records)
    assert [r["cppo/completions_kept"] for r in records] == [8, 10, 12, 12, 12]


def test_resume_continues_from_the_checkpoints_rate(tiny_model_dir, tmp_path, slow_generator):
    """checkpoint-2 holds round 2's rate; the resumed session's first round prunes at it (its
    wait holds the generator's start-up, so it moves nothing) and the next moves on from it."""
    run = tmp_path / "run"
    with make_trainer(tiny_model_dir, run, max_steps=4, save_steps=2, save_total_limit=3, max_staleness=0,
                      **AUTO) as trainer:
        trainer.train()
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    saved = state["features"]["auto_pruning"]["rate"]
    assert saved == pytest.approx(expected_rates(0.5, 2)[-1])
    for later in ("checkpoint-3", "checkpoint-4"):
        if (run / later).exists():
            __import__("shutil").rmtree(run / later)
    with make_trainer(tiny_model_dir, run, max_steps=4, save_steps=2, save_total_limit=3, max_staleness=0,
                      resume=True, **AUTO) as trainer:
        trainer.train()
    rates = [r["cppo/pruning_rate"] for r in auto_records(run)]
    assert rates[2:] == pytest.approx([saved, max(0.25, 1 - (1 - saved) * (1 + GAIN))], abs=1e-6)
