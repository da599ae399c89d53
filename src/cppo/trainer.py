"""The training loop: GRPO with completion pruning (CPPO) and dynamic completion allocation.

One round reads top to bottom (`training_round`), each stage a function of the values before it:

    questions -> completions (G each) -> rewards -> advantages -> keep_mask (selection)
              -> batch (the kept completions only) -> old-policy and reference log-probs
              -> num_iterations x (steps_per_generation / gradient_accumulation_steps) updates
                 (micro-batch losses, one optimizer step each, on consecutive slices)

Pruning happens right after scoring, before any policy, old-policy or reference forward pass, so
those passes see only the kept rows. The stages live in their rooms (cppo.data.questions,
cppo.sampling.generation, cppo.rewards.runner, cppo.algorithm, cppo.learning, cppo.run); this
file wires them to a model, an optimizer, data, checkpoints and logs, and keeps the run's state
in one place.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from cppo.algorithm import mix_into_reference, recompute_advantages_on_kept
from cppo.algorithm.advantages import round_advantages
from cppo.assembly import Round, Rollout, build_run, round_counts, round_metrics
from cppo.config import CPPOConfig
from cppo.config.sections import AsyncSection, OptimizationSection, RunSection
from cppo.errors import CallbackError
from cppo.features import states_of_old_checkpoint
from cppo.evaluate import evaluate, sampled_metrics
from cppo.parallel.engines import pad_rows
from cppo.parallel.processes import launcher_restarts
from cppo.rewards.runner import Scores
from cppo.run import checkpoint as ckpt
from cppo.run.batch import StepBatch, kept_batch
from cppo.run.callbacks import Callbacks
from cppo.run.completions_log import CompletionsLog
from cppo.run.optimizer import advance_schedule, make_adamw
from cppo.run.loop import record_evaluation, run_rounds
from cppo.run.metrics import push_metrics
from cppo.run.signals import EXIT_CODES, stop_handlers, stop_request
from cppo.run.saving import save_pretrained_folder
from cppo.run.summary import run_summary, write_summary
from cppo.run.tracking import MetricsLog, MetricsWindow, PhaseTimer
from cppo.sampling.async_rollout import RolloutScheduler, check_async_launch, start_rollouts
from cppo.sampling.batches import Completions, PromptBatch
from cppo.features.two_stage import TwoStageDraw
from cppo.sampling.sampler import Decoding, chunk_seed
from cppo.sampling.tools import ToolContext, ToolLoop, rollout_function

__all__ = ["CPPOTrainer", "EXIT_CODES", "make_adamw", "train"]   # EXIT_CODES: for cppo.cli


class CPPOTrainer:
    """TRL-style entry point: CPPOTrainer(model=..., reward_funcs=[...], args=CPPOConfig(...),
    train_dataset=...).train(). Model and rewards may be names (strings) or objects."""

    def __init__(self, model=None, reward_funcs=None, args: CPPOConfig | None = None,
                 train_dataset=None, eval_dataset=None, processing_class=None,
                 peft_config=None, callbacks=None, reward_processing_classes=None,
                 rollout_func=None, tools=None, environment_factory=None) -> None:
        self.args = args = args or CPPOConfig()
        parts = build_run(args, model=model, reward_funcs=reward_funcs, train_dataset=train_dataset,
                          eval_dataset=eval_dataset, processing_class=processing_class,
                          peft_config=peft_config, reward_processing_classes=reward_processing_classes,
                          rollout_func=rollout_function(rollout_func, tools, environment_factory,
                                                        args.max_tool_calling_iterations,
                                                        args.two_stage_generations))
        # the run's parts (cppo.assembly.run.RunParts), under TRL's and the stages' names
        self.dist, self.device, self.rollout_func = parts.dist, parts.dist.device, parts.rollout_func
        models = parts.models
        self.policy, self.tokenizer, self.reference = models.policy, models.tokenizer, models.reference
        self.engine, self.use_lora = models.engine, models.lora
        self.plan, self.task, self.batch_sizes = parts.plan, parts.task, parts.batch_sizes
        self.generation_dtype, self.matmul_dtype = parts.generation_dtype, parts.matmul_dtype
        self.sampling, self.generation = parts.sampling, parts.generation   # it holds the backend
        self.rewards, self.selector, self.learner = parts.rewards, parts.selector, parts.learner
        self.optimizer, self.scheduler = parts.learner.optimizer, parts.learner.scheduler
        self.total_steps, self.features, self.questions = parts.total_steps, parts.features, parts.questions
        self.checkpointer = parts.checkpointer
        self.output_dir = Path(args.output_dir)
        self.timer = PhaseTimer()
        self.run_state = ckpt.RunState()   # step, counters, history, ...: what a checkpoint resumes
        self.stop_requested = False
        self.rollouts = None   # async_rollout: the generator process, from train() on
        self.window = MetricsWindow()     # each metric's values since the last logging step
        self.completions_log = CompletionsLog(self.output_dir, self.rewards.names,
                                              args.num_completions_to_print) \
            if args.log_completions and self.dist.is_main else None
        self.callbacks = Callbacks(callbacks, RunSection.of(args), OptimizationSection.of(args),
                                   event_args=args, max_steps=self.total_steps,   # TRL's `args`
                                   is_main=self.dist.is_main, is_local_main=self.dist.is_local_main)
        self.callbacks.bind(model=self.policy, processing_class=self.tokenizer,
                            optimizer=self.optimizer, lr_scheduler=self.scheduler)
        self.callbacks.event("on_init_end")

    @property
    def backend(self):
        """The generation backend (cppo's sampler or vLLM), held by the generation stage; set it
        to sample with another one."""
        return self.generation.backend

    @backend.setter
    def backend(self, backend) -> None:
        self.generation = dataclasses.replace(self.generation, backend=backend)

    # ---------------------------------------------------------------- one round -------------
    @property
    def round_index(self) -> int:
        """Generation rounds done (each runs steps_per_round optimizer steps); seeds sampling."""
        return self.run_state.step // self.args.steps_per_round

    def training_round(self) -> dict:
        """Generate for a batch of questions, score, prune, and run steps_per_round updates."""
        args, timer = self.args, self.timer
        auto, skipping = self.features.get("auto_pruning"), self.features.get("prompt_skipping")
        with timer("generate"):
            rollout = self.rollout_round()
        if auto is not None:   # this round's rate, from how long each side waited (the first
            rollout.metrics["cppo/pruning_rate"] = auto.rate_for_round(   # process's, on every one)
                rollout.metrics, self.rollouts.rounds_taken, agree=self.dist.broadcast_object)
        with timer("score"):
            scores = self.score(rollout.rows, rollout.completions)
            if skipping is not None:
                skipping.after_scores(rollout.order, self.dist.gather(scores.rewards))
            advantages = self.advantages(scores)
            keep_mask = self.select(advantages, scores.rewards)
            if self.selector.advantages_on_kept:  # question scope: local statistics
                advantages = recompute_advantages_on_kept(scores.rewards, keep_mask, args.scale_rewards)
            batch = self.build_batch(rollout.prompts, rollout.completions, advantages, keep_mask)
        done = Round(rollout, scores, advantages, keep_mask, batch)
        if self.completions_log is not None:
            self.completions_log.capture_scores(rollout.rows, scores.texts, scores.per_function)
            self.completions_log.capture_selection(scores.rewards, advantages, keep_mask)
        metrics = self.step_metrics(done)
        self._count(done)
        metrics.update(getattr(self.rollout_func, "metrics", {}))   # tools/*: the tool loop's
        metrics.update(self.learn(batch), **rollout.metrics)
        if self.rollouts is not None:   # the new weights to the generator process
            pushed = self.rollouts.sync(self.policy, self.run_state.step, args.weight_sync_steps)
            if pushed is not None:
                metrics.update(push_metrics(pushed, self.rollouts.generator.pushed_bytes))
        elif getattr(self.backend, "last_push", None) is not None:   # this round's vLLM push
            metrics.update(push_metrics(*self.backend.last_push))
            self.backend.last_push = None
        return metrics

    def rollout_round(self) -> Rollout:
        """This round's generation stage: sampled now, or (async_rollout) arrived from the
        generator."""
        if self.rollouts is not None:
            return self.arrived_round()
        rows, order, skipped = self.take_questions()
        if "two_stage" in self.features:   # rows: the questions that get all G completions
            draw = self.generate_two_stage(rows)
            return Rollout(draw.rows, order, draw.prompts, draw.completions, skipped, draw.counts)
        return Rollout(rows, order, *self.generate(rows), skipped_prompts=skipped)

    def arrived_round(self) -> Rollout:
        """async_rollout: this round as it arrived from the generator (cppo.sampling.async_rollout)."""
        def every_process_rows() -> tuple[list[list[dict]], list[int]]:
            order = self.take_questions()[1]
            return [self.rows_of(order, rank) for rank in range(self.dist.world_size)], order
        rows, order, prompts, completions, metrics, turns = self.rollouts.next_round(
            self.round_index, (self.total_steps - 1) // self.args.steps_per_round,
            version=self.run_state.step, take_questions=every_process_rows,
            questions_state=self.questions.state)
        if turns is not None:   # the generator ran the tool loop: its messages and tools/* metrics
            self.rollout_func.messages, self.rollout_func.metrics = turns["messages"], turns["metrics"]
        return Rollout(rows, order, prompts, completions, metrics=metrics)

    def take_questions(self) -> tuple[list[dict], list[int], int | None]:
        """This process's slice of the round's questions, the round's question indices (all
        processes') and how many were passed over (None without skip_zero_variance_prompts):
        every process walks the same seeded order and takes its own contiguous part, so N
        processes x Q/N questions = 1 process x Q. With skip_zero_variance_prompts, questions
        predicted to have zero reward variance are passed over (cppo.data.questions)."""
        q = self.plan.questions_per_step
        want = q * self.dist.world_size
        skipping = self.features.get("prompt_skipping")
        if skipping is not None:
            gen = torch.Generator().manual_seed(chunk_seed(self.args.seed, self.round_index, -1_000))
            order, skipped = skipping.draw(self.questions, want, gen)
        else:
            order, skipped = self.questions.take(want), None
        return self.rows_of(order, self.dist.rank), order, skipped

    def rows_of(self, order: list[int], rank: int) -> list[dict]:
        """Process `rank`'s contiguous part of the round's question order, as rows."""
        q = self.plan.questions_per_step
        return [self.task.train_rows[i] for i in order[rank * q:(rank + 1) * q]]

    def generate(self, rows: list[dict]) -> tuple[PromptBatch, Completions]:
        """G completions per row through the generation backend (cppo.sampling.generation); or,
        with rollout_func, its rollouts (then one prompt row per completion)."""
        if self.rollout_func is None:
            return self.generation.sample(rows, self.round_index)
        caller = self.tool_context() if isinstance(self.rollout_func, ToolLoop) else self
        return self.generation.rollout(self.rollout_func, rows, self.round_index, caller)

    def generate_two_stage(self, rows: list[dict]) -> TwoStageDraw:
        """The continued rows, their prompts, G completions each, and the stage's counts."""
        return self.features.get("two_stage").draw(
            self.generation, rows, self.round_index, dist=self.dist,
            score=lambda rows, completions, k: self.score(rows, completions, group_size=k).rewards)

    def tool_context(self) -> ToolContext:
        args = self.args
        return ToolContext(self.tokenizer, self.policy, self.backend, self.device, self.sampling,
                           args.seed, args.num_generations, args.max_prompt_length,
                           args.max_completion_length, args.lean_forward, args.share_prefixes,
                           self.dist.rank, self.round_index, self.run_state.step)

    def score(self, rows: list[dict], completions: Completions, group_size: int | None = None) -> Scores:
        """Rewards (Q, G) of the weighted reward functions, G = group_size (None: num_generations),
        per function, their means and the texts (cppo.rewards.runner)."""
        return self.rewards.score(self.tokenizer, rows, completions,
                                  group_size or self.args.num_generations,
                                  extra_columns=completions.columns,
                                  messages=getattr(self.rollout_func, "messages", None))

    def advantages(self, scores: Scores) -> torch.Tensor:
        """(Q, G) advantages, normalised with every process's rewards (cppo.algorithm)."""
        return round_advantages(scores.rewards, scores.per_function, self.rewards.weights,
                                aggregation=self.args.multi_objective_aggregation,
                                scale_rewards=self.args.scale_rewards, gather=self.dist.gather)

    def select(self, advantages: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """keep_mask (Q, G): which completions go on to the forward passes (the selector,
        cppo.assembly.selector; pruning_rate auto: this round's rate)."""
        auto = self.features.get("auto_pruning")
        return self.selector.keep_mask(advantages, rewards, self.round_index,
                                       None if auto is None else auto.rate)

    def build_batch(self, prompts: PromptBatch, completions: Completions, advantages: torch.Tensor,
                    keep_mask: torch.Tensor) -> StepBatch:
        """The kept completions as the updates' batch, with the advantages the loss takes."""
        stale = self.rollouts is not None and self.args.max_staleness > 0   # behaviour != policy
        advantages = self.selector.loss_advantages(advantages, keep_mask, completions)
        return kept_batch(prompts, completions, advantages, keep_mask,
                          num_generations=self.args.num_generations,
                          mask_truncated=self.args.mask_truncated_completions,
                          sampler_logprobs=self.args.importance_sampling_correction or stale)

    def step_metrics(self, done: Round) -> dict:
        """The round's metrics (cppo.assembly.rounds), the two-stage draw's with them."""
        g, two_stage = self.args.num_generations, self.features.get("two_stage")
        metrics = round_metrics(done, self.dist.gather(done.scores.rewards),
                                scale_rewards=self.args.scale_rewards, num_generations=g)
        if two_stage is not None:
            metrics.update(two_stage.metrics(done.rollout.two_stage, g))
        return metrics

    def _count(self, done: Round) -> None:
        counts = round_counts(done, num_generations=self.args.num_generations)
        counts["num_tokens"] = int(self.dist.sum(counts["num_tokens"]))
        two_stage = self.features.get("two_stage")
        for key, value in [*counts.items(),
                           *(two_stage.counted(done.rollout.two_stage).items() if two_stage else ())]:
            self.run_state.counters[key] += value

    def learn(self, batch: StepBatch) -> dict:
        """steps_per_round optimizer steps on the kept batch's slices (TRL's steps_per_generation;
        never past max_steps), or none when every kept advantage is 0 (with beta > 0 the KL term
        still has a gradient: the step runs, as in TRL). Every process joins the collectives."""
        args = self.args
        iterations = min(args.steps_per_round, self.total_steps - self.run_state.step)
        if args.beta == 0 and self.dist.all_zero(batch.advantages):   # the policy gradient is 0
            self.run_state.counters["skipped_steps"] += iterations
            self.run_state.step += iterations
            advance_schedule(self.scheduler, iterations)
            return {"cppo/skipped": 1}
        batch = pad_rows(batch, self.dist)  # as many forward passes on every process
        with self.timer("logprobs"):
            self.fill_old_and_ref_logprobs(batch)
        metrics, slices = {}, batch.split(args.updates_per_generation)
        tokens = None if len(slices) == 1 else \
            self.dist.sum(int(batch.loss_mask.sum())) / len(slices)   # TRL's token normaliser
        for i in range(iterations):
            with self.timer("update"):
                update = self.update(slices[i % len(slices)], tokens)
            self.run_state.step += 1
            if args.sync_ref_model and self.run_state.step % args.ref_model_sync_steps == 0:
                mix_into_reference(self.reference.parameters(), self.policy.parameters(),
                                   args.ref_model_mixup_alpha)
            if update.pop("nonfinite", False):
                self.run_state.counters["nonfinite_steps"] += 1
                self.run_state.consecutive_nonfinite += 1
                metrics["cppo/nonfinite"] = 1
            else:
                self.run_state.consecutive_nonfinite = 0
            metrics.update(update)
        self.run_state.counters["completions_trained"] += (len(batch) - batch.filler_rows) * iterations
        return metrics

    # ---------------------------------------------------------------- the update ------------
    @torch.no_grad()
    def fill_old_and_ref_logprobs(self, batch: StepBatch) -> None:
        """Old-policy (steps_per_round > 1) and reference (beta > 0) log-probs (cppo.learning)."""
        self.learner.fill_old_and_ref_logprobs(batch)

    def update(self, batch: StepBatch, round_tokens: float | None = None) -> dict:
        """One optimizer step over (a slice of) the kept batch (cppo.learning.update.Learner.step);
        adaptive entropy control moves its coefficient after it."""
        entropy = self.features.get("adaptive_entropy")
        return self.learner.step(batch, self.entropy_coef_now(),
                                 None if entropy is None else entropy.after_step, round_tokens)

    def entropy_coef_now(self) -> float:
        """The coefficient this step applies: entropy_coef, or adaptive control's (gated by the
        last step's entropy)."""
        entropy = self.features.get("adaptive_entropy")
        return self.args.entropy_coef if entropy is None else entropy.coef_now()

    # ---------------------------------------------------------------- the loop --------------
    def train(self) -> dict:
        args = self.args
        log = MetricsLog(self.output_dir, args.report_to, values=args.to_dict(),
                         run_name=args.run_name) if self.dist.is_main else None
        resumed_from = self._maybe_resume(log)
        if resumed_from is None and log is not None:
            log.reset()  # a fresh run does not append to an earlier run's metrics
        if self.dist.is_main:
            args.to_yaml(self.output_dir / "config.yaml")
        start_wall = time.perf_counter() - self.run_state.wall_offset
        if args.async_rollout:
            self.rollouts = self.start_generator()
        self.sync_callbacks()
        try:
            self.callbacks.event("on_train_begin")
        except CallbackError:
            self.save(start_wall)
            raise
        if not self.run_state.history:
            with self.engine.gathered():   # fsdp: every process gathers, rank 0 evaluates
                self.held_out_evaluation(log, start_wall, label="before")
        try:   # a signal from here to the end only asks to stop (cppo.run.signals)
            with stop_handlers(self._request_stop):
                return self._train_loop(log, resumed_from, start_wall)
        finally:
            if log is not None:
                log.close()   # also on an error: tracker writers flushed and stopped

    def _train_loop(self, log, resumed_from, start_wall: float) -> dict:
        status = run_rounds(self, log, start_wall)   # cppo.run.loop
        self.save(start_wall, final=True)  # finite parameters: a NaN/inf update is never applied
        history = self.run_state.history
        if status == "completed" and (not history or history[-1]["step"] != self.run_state.step):
            with self.engine.gathered():
                self.held_out_evaluation(log, start_wall, label="after")
        self.callbacks.event("on_train_end")
        return self._summary(status, start_wall, resumed_from, log)

    def start_generator(self) -> RolloutScheduler:
        """async_rollout: the generator on this policy's weights (version: the step), built as
        this trainer's backend is (its settings, chunk size and sampling dtype)."""
        args = self.args
        check_async_launch(self.rollout_func)
        return start_rollouts(self.tokenizer, AsyncSection.of(args), version=self.run_state.step,
                              steps_per_round=args.steps_per_round,
                              questions_per_round=self.plan.questions_per_step,
                              backend=self.backend, weights_dir=self.output_dir / ".async_weights",
                              dist=self.dist, engine=self.engine,
                              tools=self.rollout_func)

    def _request_stop(self, signum, frame) -> None:
        """SIGINT / SIGTERM handler: the loop stops after this step (cppo.run.signals)."""
        self.stop_requested = stop_request(self.stop_requested, signum)

    def sync_callbacks(self) -> None:
        epoch = self.questions.epoch + self.questions.position / max(1, self.questions.num_rows)
        self.callbacks.sync(step=self.run_state.step, epoch=epoch, num_tokens=self.run_state.counters["num_tokens"])

    # ---------------------------------------------------------------- evaluation ------------
    def held_out_evaluation(self, log, start_wall: float, label: str) -> None:
        rows = self.task.eval_rows
        if not rows or not self.dist.is_main:
            return
        reward = self.task.scoring_reward(self.rewards.funcs[0])   # as built (names, models)
        with self.timer("eval"):
            result = evaluate(self.policy, self.tokenizer, rows, reward, k=0,
                              max_new_tokens=self.args.max_completion_length,
                              max_prompt_length=self.args.max_prompt_length, progress=False,
                              batch_size=self.batch_sizes.evaluation)
            sampled = self.sampled_eval_metrics(rows)
        self.timer.pop_last()
        record_evaluation(self, log, start_wall, label, result.greedy_accuracy, sampled)

    def sampled_eval_metrics(self, rows: list[dict]) -> dict:
        """TRL's evaluation: num_generations_eval completions per held-out question (None:
        num_generations), sampled with the training settings, scored by the reward functions
        (cppo.evaluate.sampled_metrics); TRL's eval_ keys ({} when num_generations_eval is 0)."""
        args = self.args
        g = args.num_generations if args.num_generations_eval is None else args.num_generations_eval
        if g == 0:
            return {}
        generator = torch.Generator(device=self.device).manual_seed(
            chunk_seed(args.seed, -1 - self.run_state.step, 0))   # apart from the training rounds' seeds
        metrics = sampled_metrics(
            self.policy, self.generation, rows, self.rewards, num_generations=g,
            max_new_tokens=args.max_completion_length, sampling=self.sampling, generator=generator,
            decoding=Decoding(batch_size=self.batch_sizes.evaluation, lean=args.lean_forward,
                              share_prefixes=args.share_prefixes),
            scale_rewards=args.scale_rewards)
        return {f"eval_{key}": value for key, value in metrics.items()}

    # ---------------------------------------------------------------- checkpoints -----------
    def save(self, start_wall: float, final: bool = False) -> Path | None:
        """Every process takes part (cppo.run.saving.Checkpointer): the model or LoRA adapters,
        optimizer, every rank's RNG and the run state."""
        self.run_state.wall_offset = time.perf_counter() - start_wall
        self.run_state.questions = self.questions.state() if self.rollouts is None else \
            self.rollouts.questions_state(self.questions.state())   # in-flight rounds replay
        self.run_state.features = self.features.state_dict()
        state = self.run_state.to_dict(config=self.args.to_dict(), world_size=self.dist.world_size,
                                       distributed=self.engine.strategy)
        with self.timer("checkpoint"):
            path = self.checkpointer.save(self.run_state.step, state, final=final)
        self.timer.pop_last()
        self.callbacks.event("on_save")
        return path

    def save_model(self, output_dir: str | Path | None = None) -> Path | None:
        """Write the policy and its tokenizer as a Hugging Face folder (output_dir by default) that
        `from_pretrained` loads; with LoRA, the adapters in PEFT's format (as TRL saves them)."""
        return save_pretrained_folder(self.policy, self.tokenizer, Path(output_dir or self.output_dir),
                                      self.dist)

    def close(self) -> None:
        """End what the trainer started, in order: the generation engine, the reward workers,
        then the process group (no collective runs after this). `cppo train` calls it; a
        script may too, or use `with CPPOTrainer(...) as trainer:` (an exit handler ends the
        process group anyway)."""
        for part in (self.rollouts, self.backend, self.rewards):
            close = getattr(part, "close", None)
            if close is not None:
                close()
        self.dist.close()

    def __enter__(self) -> "CPPOTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _maybe_resume(self, log) -> str | None:
        """--resume, or a restart by the launcher (torchrun --max-restarts): continue from the
        newest complete checkpoint in output_dir, if there is one (cppo.run.saving): the model,
        optimizer, schedule, RNG, run state, question stream and features; the metrics log and
        the completions table cut back to its step."""
        latest = self.checkpointer.to_resume(resume=self.args.resume, restarts=launcher_restarts())
        if latest is None:
            return None
        self.run_state = state = self.checkpointer.load(latest)
        self.questions.load_state(state.questions)
        self.features.load_state_dict(   # an older checkpoint: its flat keys
            state.features or states_of_old_checkpoint(ckpt.load_trainer_state(latest)))
        for table in (log, self.completions_log):
            if table is not None:
                table.truncate_after(state.step)
        print(f"resumed from {latest} at step {state.step}")
        return str(latest)

    def _summary(self, status: str, start_wall: float, resumed_from, log) -> dict:
        summary = run_summary(status, run_state=self.run_state,
                              wall_seconds=time.perf_counter() - start_wall,
                              phase_seconds=self.timer.totals, total_steps=self.total_steps,
                              plan=self.plan, resumed_from=resumed_from, output_dir=self.output_dir,
                              skipped_data_rows=len(self.task.skipped_rows),
                              asynchronous=self.rollouts and self.rollouts.summary())
        auto = self.features.get("auto_pruning")
        if auto is not None and auto.rate is not None:   # the last round's
            summary["pruning_rate_last"] = round(auto.rate, 4)
        if self.learner.compile is not None:   # torch_compile: inside the phases' seconds
            summary["compile_seconds"] = round(self.learner.compile_seconds, 1)
        if self.dist.is_main:
            write_summary(summary, self.output_dir, log.read() if log else [])
        return summary


def train(cfg: CPPOConfig) -> dict:
    """`cppo train`: build the trainer from a config, run it and end it."""
    with CPPOTrainer(args=cfg) as trainer:
        return trainer.train()
