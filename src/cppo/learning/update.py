"""The update stage of a round: log-probs of the kept completions and one optimizer step.

`Learner` holds what a step touches (policy, reference, engine, optimizer, schedule) and nothing
that changes between steps: the run's counters stay with the trainer, and the step's entropy
coefficient comes in as a value. The loss of a micro-batch and its statistics are pure tensor code
in cppo.algorithm.micro_batch; here they meet the model, the engine and the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from cppo.algorithm.micro_batch import (MAX_KEYS, SUM_KEYS, LossSettings, add_micro_batch,
                                        empty_sums, micro_batch_loss, step_metrics)
from cppo.algorithm.loss import router_aux_coef, router_aux_loss
from cppo.errors import ConfigError
from cppo.features.fp16_scaling import FP16Scaling
from cppo.models.compiled import CompileSettings, compile_seconds
from cppo.models.loading import torch_dtype
from cppo.run.batch import StepBatch
from cppo.run.optimizer import advance_schedule
from cppo.sampling.logprobs import ForwardSettings, completion_logprobs
from cppo.sampling.settings import SamplingSettings


@dataclass(frozen=True)
class LearnerSettings:
    """The values a step reads, taken from the config once (cppo.assembly.run.build_learner):
    the loss's settings, the micro-batch size (per_device_train_batch_size), the sampling
    temperature, the optimizer steps per generation round (steps_per_round), max_grad_norm, and
    speed and precision (transformers' names: lean_forward, use_liger_kernel -> chunk_head, bf16,
    fp16, torch_compile's settings -> compile, None: off); router_aux_loss_coef as set (None:
    the model config's)."""

    loss: LossSettings
    batch_size: int
    temperature: float
    steps_per_round: int
    max_grad_norm: float
    lean_forward: bool
    chunk_head: bool
    bf16: bool
    fp16: bool
    compile: CompileSettings | None = None
    router_aux_loss_coef: float | None = None


class Learner:
    """Log-probs under the policy, old policy and reference, and the optimizer step."""

    def __init__(self, policy, reference, engine, dist, optimizer, scheduler,
                 settings: LearnerSettings, device: torch.device, matmul_dtype: str | None,
                 replay: SamplingSettings | None = None) -> None:
        self.policy, self.reference, self.engine, self.dist = policy, reference, engine, dist
        self.replay = replay   # the sampler's transforms the policy's passes replay (None: off)
        self.optimizer, self.scheduler, self.settings = optimizer, scheduler, settings
        self.device, self.matmul_dtype = device, matmul_dtype   # a dtype name or None
        self.loss = settings.loss   # what each micro-batch's loss reads
        # speed and precision (transformers' names): torch_compile, use_liger_kernel, fp16
        self.compile = settings.compile
        self.compile_seconds, self._compile_mark = 0.0, compile_seconds() if self.compile else 0.0
        self.fp16 = FP16Scaling.for_weights(device, optimizer) if settings.fp16 else None
        self.scaler = None if self.fp16 is None else self.fp16.scaler
        self.aux_coef = moe_aux_coef(policy, settings.router_aux_loss_coef)

    def logprobs(self, model, batch: StepBatch, entropies: list | None = None,
                 aux_losses: list | None = None, replay: bool = True) -> torch.Tensor:
        """(B, C) log-probs of the completion tokens under `model`; with `entropies`, each
        micro-batch's (B_micro, C) entropies are appended to it; with `aux_losses`, the
        mixture-of-experts load-balancing losses. replay: under the sampler's replayed
        distribution when the run replays it (the policy and old policy; the reference's are
        the full softmax's, which the KL estimate against the sampled tokens wants)."""
        if len(batch) == 0:  # global selection can leave a process nothing to train on
            return batch.completion_ids.new_zeros(batch.completion_ids.shape, dtype=torch.float32)
        settings = self.settings
        forward = ForwardSettings(batch_size=settings.batch_size,
                                  lean=settings.lean_forward,
                                  matmul_dtype=torch_dtype(self.matmul_dtype),
                                  compile=self.compile, chunk_head=settings.chunk_head,
                                  replay=self.replay if replay else None)
        return completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, temperature=settings.temperature,
                                   forward=forward, entropies=entropies,
                                   entropy_grad=entropies is not None and self.loss.entropy_bonus,
                                   aux_losses=aux_losses)

    def autocast(self):
        """The one precision of every pass of a step (old policy, reference, policy): bf16 or
        fp16 autocast when one is on, so the first iteration's ratio is exactly 1."""
        fp16, bf16 = self.settings.fp16, self.settings.bf16
        return torch.autocast(self.device.type, dtype=torch.float16 if fp16 else torch.bfloat16,
                              enabled=bf16 or fp16)

    @torch.no_grad()
    def fill_old_and_ref_logprobs(self, batch: StepBatch) -> None:
        """Old-policy log-probs (once per generation round, when it has several optimizer steps:
        num_iterations > 1 or steps_per_generation slices) and reference ones."""
        with self.autocast():
            if self.settings.steps_per_round > 1:   # the policy moves before the last slice
                self.policy.eval()
                batch.old_logps = self.logprobs(self.policy, batch)
                self.policy.train()
            if self.loss.beta > 0:
                if self.reference is not None:
                    batch.ref_logps = self.logprobs(self.reference, batch, replay=False)
                else:  # LoRA: the base model with adapters disabled is the reference
                    with self.policy.disable_adapter():
                        batch.ref_logps = self.logprobs(self.policy, batch, replay=False)

    def step(self, batch: StepBatch, entropy_coef: float,
             adapt_entropy_coef: Callable[[float], float] | None, tokens: float | None = None) -> dict:
        """One optimizer step over the kept batch: the micro-batches' losses backward in turn
        (gradient accumulation), then the step; never a NaN/inf one ("nonfinite": True then).
        `adapt_entropy_coef(step entropy)` returns the next coefficient (adaptive control; None:
        off).
        `tokens`: the token-sum losses' normaliser (None: this batch's tokens, all processes')."""
        max_grad_norm = self.settings.max_grad_norm
        self.optimizer.zero_grad(set_to_none=True)
        coef = entropy_coef if self.loss.entropy_bonus else 0.0
        totals = self.backward(batch, coef, tokens)
        aux = totals.pop("aux_loss", None)
        if self.scaler is not None:   # fp16: the gradients unscaled before they are measured
            self.scaler.unscale_(self.optimizer)
        with_grad = [p for group in self.optimizer.param_groups for p in group["params"]
                     if p.grad is not None]
        grad_norm = self.engine.clip_grad_norm(  # max_norm inf: measure, don't clip
            with_grad, max_grad_norm if max_grad_norm > 0 else math.inf) if with_grad else 0.0
        totals = {**self.dist.sum_values({k: totals[k] for k in SUM_KEYS}),   # the global batch's
                  **(self.dist.max_values({k: totals[k] for k in MAX_KEYS})
                     if batch.sampler_logps is not None else {})}
        if adapt_entropy_coef is not None:   # the whole step's tokens, every process's (TRL)
            coef = adapt_entropy_coef(totals["bonus_entropy"] / max(totals["bonus_tokens"], 1.0))
        metrics = step_metrics(totals, kl=self.loss.beta > 0, grad_norm=grad_norm,
                               learning_rate=self.scheduler.get_last_lr()[0],
                               entropy_coef=coef if self.loss.entropy_bonus else None,
                               sampler_corrected=batch.sampler_logps is not None)
        if self.aux_coef:   # TRL's metric: the mean over micro-batches and processes
            metrics["aux_loss"] = self.dist.sum(aux or 0.0) / self.dist.world_size
        metrics.update(self.compile_metrics())
        if self.scaler is not None:
            return self.scaled_step(metrics, grad_norm)
        if self.dist.any(not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm))):
            self.optimizer.zero_grad(set_to_none=True)   # never apply a NaN/inf update
            advance_schedule(self.scheduler, 1)   # the schedule follows the step count
            return {**metrics, "nonfinite": True}
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def scaled_step(self, metrics: dict, grad_norm: float) -> dict:
        """fp16: the gradient scaler's step, as transformers runs it: an overflow (inf/NaN
        gradients at this loss scale) skips the update and lowers the scale, which is not a
        non-finite step; a non-finite loss still is one."""
        self.scaler.step(self.optimizer)   # skipped when the unscaled gradients hold inf/NaN
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {**metrics, "cppo/fp16_loss_scale": float(self.scaler.get_scale()),
                   "cppo/fp16_overflow": float(not math.isfinite(grad_norm))}
        if self.dist.any(not math.isfinite(metrics["loss"])):
            return {**metrics, "nonfinite": True}
        return metrics

    def compile_metrics(self) -> dict:
        """torch_compile: seconds spent compiling since the last step (timing/compile)."""
        if self.compile is None:
            return {}
        now = compile_seconds()
        took, self._compile_mark = now - self._compile_mark, now
        self.compile_seconds += took
        return {"timing/compile": took}

    def backward(self, batch: StepBatch, entropy_coef: float, tokens: float | None = None) -> dict:
        """Each micro-batch's loss backward (cppo.algorithm.micro_batch); the step's sums of
        this process (SUM_KEYS, MAX_KEYS)."""
        batch_size, world = self.settings.batch_size, self.dist.world_size
        total_sequences = self.dist.sum(len(batch) - batch.filler_rows)
        total_tokens = self.dist.sum(int(batch.loss_mask.sum())) if tokens is None else tokens
        totals = empty_sums()
        num_micro = max(1, math.ceil(len(batch) / batch_size))  # bnpo's
        # gradients are reduced by the engine once per step, in the last micro-batch's backward
        for micro in self.engine.accumulate(batch.micro_batches(batch_size)):
            entropies, aux = [], [] if self.aux_coef else None
            with self.autocast():
                logps = self.engine.forward(self.logprobs, micro, entropies, aux)
            loss, part = micro_batch_loss(logps, entropies, micro, self.loss,
                                          entropy_coef=entropy_coef,
                                          total_sequences=total_sequences,
                                          total_tokens=total_tokens, num_micro=num_micro)
            loss = loss * world   # the engines average gradients over processes
            if aux:   # each process's own, averaged by the engines (TRL)
                loss = loss + router_aux_loss(aux, self.aux_coef, num_micro)
                totals["aux_loss"] = totals.get("aux_loss", 0.0) + float(torch.stack(aux).mean()) / num_micro
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            add_micro_batch(totals, {**part, "loss": loss.item() / world})
        return totals


def moe_aux_coef(policy, coef: float | None) -> float:
    """The load-balancing coefficient for `policy` (cppo.algorithm.loss.router_aux_coef): 0 for
    a model without router logits; ConfigError naming router_aux_loss_coef when one is set
    there."""
    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") \
        else policy.config
    try:
        return router_aux_coef(coef, hasattr(config, "output_router_logits"),
                               getattr(config, "router_aux_loss_coef", None))
    except ValueError as err:
        raise ConfigError(f"'router_aux_loss_coef': {err}; set it to None or 0 for "
                          f"{type(policy).__name__}") from None
