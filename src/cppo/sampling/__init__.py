"""Sampling completions: the KV-shared sampler, its backends, speculative decoding."""
