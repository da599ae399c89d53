"""Where completions come from: the KV-shared sampler (speculative too), log-prob scoring, generation
backends (transformers, vLLM), padding."""
