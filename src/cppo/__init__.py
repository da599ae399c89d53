"""cppo: fast GRPO fine-tuning with Completion Pruning (CPPO) and Exact Causal Attention (ECA)."""

__version__ = "0.1.0"
