"""The update stage: log-probs of the kept completions and the optimizer step."""
