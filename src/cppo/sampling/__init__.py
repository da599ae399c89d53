"""Where completions come from: the KV-shared sampler (speculative too), the logit transforms the
samplers share, log-prob scoring, generation backends (transformers, vLLM), multi-turn rollouts and
tools, padding."""
