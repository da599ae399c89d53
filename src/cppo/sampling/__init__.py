"""Where completions come from: the KV-shared sampler, log-prob scoring, generation backends (transformers, vLLM), padding."""
