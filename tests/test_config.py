"""Config parsing: defaults, YAML, command-line overrides, and every kind of config error."""

import pytest

from cppo.cli import main
from cppo.config import CPPOConfig
from cppo.errors import ConfigError


def test_defaults_are_the_embedded_cppo_recipe():
    cfg = CPPOConfig()
    assert cfg.model == "embedded" and cfg.dataset_name == "embedded"
    assert cfg.pruning_rate == 0.75 and cfg.allocation is True and cfg.max_steps == 600
    assert cfg.num_generations == 8 and cfg.loss_type == "dapo" and cfg.beta == 0.0


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1.0e-4\nnum_generations: 8\nreward_funcs: [arithmetic, arithmetic_format]\n"
                    "reward_weights: [1.0, 0.5]\nallocation: false\nper_device_train_batch_size: 64\n")
    cfg = CPPOConfig.load(path, {"num_generations": "4", "beta": "0.04", "epsilon_high": "none"})
    assert cfg.learning_rate == 1e-4 and cfg.num_generations == 4 and cfg.beta == 0.04
    assert cfg.reward_funcs == ["arithmetic", "arithmetic_format"] and cfg.reward_weights == [1.0, 0.5]
    assert cfg.allocation is False and cfg.epsilon_high is None


def test_round_trip_through_yaml(tmp_path):
    cfg = CPPOConfig(pruning_rate=0.5, report_to=["jsonl", "tensorboard"])
    cfg.to_yaml(tmp_path / "c.yaml")
    assert CPPOConfig.load(tmp_path / "c.yaml") == cfg


def test_command_line_lists_parse():
    cfg = CPPOConfig.load(None, {"reward_funcs": "arithmetic,arithmetic_format",
                                 "reward_weights": "1,0.25"})
    assert cfg.reward_weights == [1.0, 0.25]


@pytest.mark.parametrize("values, message", [
    ({"learning_rat": 1e-3}, "unknown key 'learning_rat'; did you mean 'learning_rate'"),
    ({"num_generations": "abc"}, "'num_generations' expects int, got 'abc'"),
    ({"allocation": "maybe"}, "'allocation' expects bool"),
    ({"temperature": "hot"}, "'temperature' expects float"),
    ({"pruning_rate": 1.0}, "'pruning_rate' is 1.0: the pruning rate P must lie in [0, 1)"),
    ({"pruning_rate": -0.1}, "'pruning_rate' is -0.1"),
    ({"num_generations": 1}, "'num_generations' is 1: pruning (P = 0.75) needs groups of G >= 2"),
    ({"pruning_rate": 0, "per_device_train_batch_size": 20},
     "per_device_train_batch_size x gradient_accumulation_steps = 20 x 1 = 20 completions, "
     "num_generations = 8"),
    ({"loss_type": "ppo"}, "'loss_type' is 'ppo'; allowed: grpo, bnpo, dr_grpo, dapo"),
    ({"scale_rewards": "yes"}, "'scale_rewards' is 'yes'"),
    ({"selection_rule": "best"}, "'selection_rule' is 'best'"),
    ({"selection_rule": "max_variance"}, "'selection_scope' is 'step': set selection_scope=question"),
    ({"temperature": 0}, "'temperature' is 0.0; must be > 0"),
    ({"top_p": 1.5}, "'top_p' is 1.5"),
    ({"min_p": 1.5}, "'min_p' is 1.5; allowed: 0 <= min_p <= 1, or None (None: off)"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1},
     "need entropy_coef_min <= entropy_coef_max"),
    ({"entropy_coef_delta": -1}, "'entropy_coef_delta' is -1.0; must be >= 0"),
    ({"repetition_penalty": 0}, "'repetition_penalty' is 0.0; must be > 0 (1.0: off)"),
    ({"learning_rate": float("nan")}, "'learning_rate' must be a finite number"),
    ({"max_steps": 0}, "'max_steps' is 0"),
    ({"model": None}, "'model' may not be None"),
    ({"report_to": ["mlflow"]}, "'report_to' has 'mlflow'"),
    ({"task_level": 7}, "'task_level' is 7"),
    ({"selection_scope": "question", "num_generations": 16, "pruning_rate": 0.6,
      "per_device_train_batch_size": 10}, "must be divisible by keep_per_question=6"),
])
def test_config_errors_name_the_key(values, message):
    with pytest.raises(ConfigError, match=pytest.importorskip("re").escape(message)):
        CPPOConfig.from_dict(values)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        CPPOConfig.load(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        CPPOConfig.load(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CPPOConfig.load(tmp_path / "broken.yaml")


def test_cli_reports_errors_without_traceback(capsys):
    assert main(["train", "--pruning_rate", "1"]) == 2
    assert "'pruning_rate' is 1.0" in capsys.readouterr().err
    assert main(["train", "--prunign_rate", "0.5"]) == 2
    assert "did you mean --pruning_rate" in capsys.readouterr().err


def test_help_documents_every_field(capsys):
    import dataclasses
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fld in dataclasses.fields(CPPOConfig):
        assert f"--{fld.name}" in text
    assert "(default: 0.75)" in text


# ---------------------------------------------------------------- one source of truth


@pytest.mark.parametrize("batch", [9, 16, 12, 15, 18])
def test_step_plan_is_validated_by_the_planner(batch):
    """G = 16, P = 0.84375 keeps 16 x 0.15625 = 2.5 per question: the planner rounds half up
    (3), so a batch of 9 is fine and 16 is not; the config must agree with it exactly."""
    from cppo.algorithm import plan_step
    values = {"num_generations": 16, "pruning_rate": 0.84375, "selection_scope": "question",
              "per_device_train_batch_size": batch}
    try:
        plan_step(completions_per_update=batch, group_size=16, pruning_rate=0.84375,
                  allocation=True, scope="question")
    except ValueError:
        with pytest.raises(ConfigError, match="per_device_train_batch_size.*num_generations = 16.*"
                                              "pruning_rate = 0.84375.*selection_scope = 'question'"):
            CPPOConfig.from_dict(values)
    else:
        assert CPPOConfig.from_dict(values).step_plan().keep_per_question == 3
    assert (batch % 3 == 0) == (batch in (9, 12, 15, 18))


def test_config_takes_names_from_the_algorithm_registries():
    from cppo.algorithm import LOSS_TYPES, SCALE_REWARDS, SELECTION_RULES, register_rule
    for loss_type in LOSS_TYPES:
        assert CPPOConfig(loss_type=loss_type).loss_type == loss_type
    for scale in SCALE_REWARDS:
        assert CPPOConfig(scale_rewards=scale).scale_rewards == scale

    @register_rule("keep_first_config_test", scopes=("question",))
    def keep_first(advantages, rewards, *, num_keep, scope, generator):
        raise AssertionError("not called by the config")

    try:
        cfg = CPPOConfig.from_dict({"selection_rule": "keep_first_config_test",
                                    "selection_scope": "question", "pruning_rate": 0.5})
        assert cfg.selection_rule == "keep_first_config_test"
        with pytest.raises(ConfigError, match="keep_first_config_test ranks only with selection_scope"):
            CPPOConfig.from_dict({"selection_rule": "keep_first_config_test"})
    finally:
        del SELECTION_RULES["keep_first_config_test"]
    with pytest.raises(ConfigError, match="'selection_rule' is 'keep_first_config_test'"):
        CPPOConfig.from_dict({"selection_rule": "keep_first_config_test"})
