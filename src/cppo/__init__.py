"""cppo: fast GRPO fine-tuning with Completion Pruning (CPPO) and Exact Causal Attention (ECA)."""

__version__ = "0.2.0"   # the one place: pyproject.toml and `cppo --version` read it

__all__ = ["CPPOConfig", "CPPOTrainer", "__version__"]


def __getattr__(name):  # lazy: `import cppo` stays cheap, the trainer pulls in transformers
    if name == "CPPOConfig":
        from cppo.config import CPPOConfig
        return CPPOConfig
    if name == "CPPOTrainer":
        from cppo.trainer import CPPOTrainer
        return CPPOTrainer
    raise AttributeError(f"module 'cppo' has no attribute {name!r}")
