"""A run built from parts (cppo.assembly.run.build_run), the round's stage values
(cppo.assembly.rounds) and the selection stage (cppo.assembly.selector). CPPOTrainer is TRL's
facade over these; tests and benchmarks build the parts they need directly."""

from cppo.assembly.models import Models, build_models
from cppo.assembly.rounds import Round, Rollout, round_counts, round_metrics
from cppo.assembly.run import RunParts, build_learner, build_run, build_sampler, plan_batches
from cppo.assembly.selector import Selector

__all__ = ["Models", "Round", "Rollout", "RunParts", "Selector", "build_learner", "build_models",
           "build_run", "build_sampler", "plan_batches", "round_counts", "round_metrics"]
