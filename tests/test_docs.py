"""The docs stay true: config reference in sync, the public API TRL-shaped, the results tables
read from their files (.ci/run and the README's commands: tests/test_install.py)."""

from pathlib import Path

from cppo.config.reference import reference_block

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_in_sync():
    assert reference_block() in (ROOT / "docs" / "configuration.md").read_text(), \
        "docs/configuration.md is stale: run `python scripts/update_docs.py`"


# CPPOTrainer's parameters, in order: TRL's GRPOTrainer names (each checked against TRL's own
# signature below), every one optional (None); TRL's optimizers and quantization_config are not taken
TRAINER_PARAMETERS = ["model", "reward_funcs", "args", "train_dataset", "eval_dataset",
                      "processing_class", "peft_config", "callbacks", "reward_processing_classes",
                      "rollout_func", "tools", "environment_factory"]


def test_public_api_is_trl_shaped():
    import inspect
    import cppo
    assert cppo.__all__ == ["CPPOConfig", "CPPOTrainer", "__version__"]
    params = inspect.signature(cppo.CPPOTrainer).parameters
    assert list(params) == TRAINER_PARAMETERS
    for name, param in params.items():
        assert param.default is None and param.kind == param.POSITIONAL_OR_KEYWORD, name
    trl = __import__("pytest").importorskip("trl")
    theirs = inspect.signature(trl.GRPOTrainer).parameters
    assert set(TRAINER_PARAMETERS) <= set(theirs)
    assert [n for n in theirs if n in TRAINER_PARAMETERS][:6] == TRAINER_PARAMETERS[:6]   # positional


# --- the results tables (benchmarks/headlines.py, written by scripts/update_docs.py) ----------

def headlines():
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("headlines", ROOT / "benchmarks" / "headlines.py")
    module = sys.modules["headlines"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the numbers a headline looks rows up by, not figures
IDENTIFIERS = {"pruning_rate", "seed", "L", "d", "heads", "vocabulary", "vocab", "tokens",
               "head_chunk", "rows", "batch", "steps", "num_iterations"}


def scaled(data, key: str = ""):
    """`data` with every measured number (not booleans, not the IDENTIFIERS' values) scaled by a
    factor that depends on its key, so a ratio of two fields changes too."""
    if isinstance(data, dict):
        return {k: scaled(v, k) for k, v in data.items()}
    if isinstance(data, list):
        return [scaled(v, key) for v in data]
    if isinstance(data, (int, float)) and not isinstance(data, bool) and key not in IDENTIFIERS:
        return data * (1.5 + len(key) / 10)
    return data


def test_each_headline_is_read_from_its_results_file():
    """A figure follows its file: scale the file's numbers and every row's figure changes (a
    row that typed its figure by hand would not); each names the CPU it ran on, or says why none."""
    module = headlines()
    for row in module.HEADLINES:
        data = row.data()
        figure = row.figure(data)
        assert row.figure(scaled(data)) != figure, row.what
        assert "AVX" in figure or "machine-independent" in figure or "parameters" in figure, row.what
        assert (ROOT / row.page()).is_file(), row.page()


def test_the_readme_shows_at_most_eight_headlines_each_with_its_link():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- results table")[1].split("<!-- end of results table -->")[0]
    rows = [line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| what")]
    assert 1 <= len(rows) <= 8
    for line in rows:
        link = line.rsplit("](", 1)[1].split(")")[0]
        assert (ROOT / link).is_file(), link
