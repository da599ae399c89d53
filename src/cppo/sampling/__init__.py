"""Sampling: the sampler, its generation backends and the logit transforms they share."""
