"""A run built from parts: `build_run(config, ...)` loads and wires what a run uses (models,
task, batch sizes, sampler, rewards, learner, features, question stream, selector,
checkpointer) and returns them in one `RunParts`; CPPOTrainer is TRL's facade over them. Each
part comes from a small builder that tests and benchmarks call directly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cppo.algorithm.allocation import StepShape, total_steps
from cppo.assembly.models import Models, build_models
from cppo.assembly.selector import Selector
from cppo.config.checks import check_generation_batch_size
from cppo.config.sections import (DataSection, LossSection, OptimizationSection,
                                  PrecisionSection, PruningSection, SamplingSection, VLLMSection)
from cppo.config.startup import check_startup
from cppo.data.questions import QuestionStream
from cppo.data.sources import TaskData, TaskSource, run_task
from cppo.errors import ConfigError
from cppo.features import Features, build_features
from cppo.learning.update import Learner, LearnerSettings
from cppo.models.compiled import compile_settings
from cppo.parallel.hardware import (apply_tf32, run_generation_dtype, run_matmul_dtype,
                                    warn_slow_precision)
from cppo.parallel.memory import (BatchSizes, RunShape, check_run_batches, device_memory_bytes,
                                  plan_for_run)
from cppo.parallel.processes import Distributed, first_process
from cppo.rewards.runner import RewardRunner, reward_sources
from cppo.run.optimizer import make_adamw, make_scheduler
from cppo.run.saving import Checkpointer
from cppo.sampling.backends import GenerationBackend, make_backend, speculation_slots
from cppo.sampling.generation import Generation
from cppo.sampling.sampler import prompts_length
from cppo.sampling.settings import BackendSettings, SamplingSettings
from cppo.sampling.tools import ToolLoop
from cppo.sampling.vllm import vllm_engine_bytes


@dataclass
class RunParts:
    """Everything a run is made of, built once (build_run). plan: questions sampled, scored
    and kept per step; generation_dtype / matmul_dtype: 'auto' resolved (names, None: the
    weights' dtype); total_steps: the optimizer steps of the whole run; rollout_func: TRL's
    rollout function or cppo's tool loop (None: one sampled turn per completion)."""

    dist: Distributed
    models: Models
    plan: StepShape
    generation_dtype: str | None
    matmul_dtype: str | None
    task: TaskData
    batch_sizes: BatchSizes
    sampling: SamplingSettings
    generation: Generation
    rewards: RewardRunner
    total_steps: int
    learner: Learner
    features: Features
    questions: QuestionStream
    selector: Selector
    checkpointer: Checkpointer
    rollout_func: object = None

    @property
    def backend(self) -> GenerationBackend:
        """The generation backend (cppo's sampler or vLLM): the one the generation stage holds."""
        return self.generation.backend


def build_run(args, *, model=None, reward_funcs=None, train_dataset=None, eval_dataset=None,
              processing_class=None, peft_config=None, reward_processing_classes=None,
              rollout_func=None) -> RunParts:
    """The parts of a run of config `args` (CPPOConfig), in the order they depend on each
    other; the other arguments are CPPOTrainer's (TRL's names). Start-up checks run before any
    loading; every row's gold answer is checked before the first round."""
    check_startup(args, model=model, own_data=train_dataset is not None,
                  output_dir="create" if first_process() else "skip")
    replay = sampling_replay(args, rollout_func)   # a rollout_func with replay: refused here
    funcs, weights, reward_processing_classes = reward_sources(   # environments' get_reward too
        reward_funcs, DataSection.of(args), getattr(rollout_func, "env_rewards", []),
        reward_processing_classes)
    dist = Distributed.from_environment()
    apply_tf32(PrecisionSection.of(args), args.bf16)   # transformers' rule; CUDA only
    models = build_models(args, dist, model, processing_class, peft_config)
    plan = args.step_plan()
    generation_dtype = run_generation_dtype(
        SamplingSection.of(args), models.policy, dist.device, engine=models.engine,
        use_vllm=args.use_vllm, announce=dist.is_main,
        built_in=args.lean_forward and not args.use_vllm and rollout_func is None,
        questions_per_step=plan.questions_per_step)
    matmul_dtype = run_matmul_dtype(
        SamplingSection.of(args), models.policy, dist.device, lean_forward=args.lean_forward,
        autocast=args.bf16 or args.fp16, announce=dist.is_main,
        per_device_train_batch_size=args.per_device_train_batch_size)
    warn_slow_precision(   # bf16 on a CPU without native bf16
        dist.device, bf16=args.bf16, fp16=args.fp16, torch_dtype=args.torch_dtype,
        generation_dtype=args.generation_dtype, matmul_dtype=args.matmul_dtype)
    task = run_task(TaskSource.of(args), models.tokenizer, train_dataset, eval_dataset)
    batch_sizes = plan_batches(args, models, task, generation_dtype, matmul_dtype, dist.device)
    sampling = SamplingSettings.of(SamplingSection.of(args))
    backend = build_sampler(models, backend_settings(args), sampling, batch_sizes,
                            generation_dtype, push_weights=not args.async_rollout)
    rewards = RewardRunner(funcs, weights, processing_classes=reward_processing_classes,
                           device=dist.device, trust_remote_code=args.trust_remote_code)
    rewards.preflight(task.train_rows, models.tokenizer)   # every row's gold, up front
    check_run_batches(
        batch_sizes, SamplingSection.of(args), plan.questions_per_step, dist.world_size,
        lambda n: check_generation_batch_size(args, completions_per_round=n),
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_checkpointing=args.gradient_checkpointing, use_vllm=args.use_vllm)
    steps = total_steps(args.max_steps, len(task.train_rows), plan.questions_per_step * dist.world_size,
                        args.num_train_epochs, args.steps_per_round)
    learner = build_learner(args, models, dist, steps, matmul_dtype, replay)
    return RunParts(
        dist=dist, models=models, plan=plan, generation_dtype=generation_dtype,
        matmul_dtype=matmul_dtype, task=task, batch_sizes=batch_sizes, sampling=sampling,
        generation=Generation(
            backend, models.tokenizer, models.engine, dist.device, dist.rank,
            args.num_generations, args.max_prompt_length, args.seed),
        rewards=rewards, total_steps=steps, learner=learner,
        features=build_features(   # the optional parts that are on
            LossSection.of(args), PruningSection.of(args), SamplingSection.of(args),
            fp16=learner.fp16),
        questions=QuestionStream(len(task.train_rows),
                                 args.seed if args.data_seed is None else args.data_seed),
        selector=Selector(args.selection_rule, args.selection_scope, args.pruning_rate, plan,
                          args.num_generations, args.seed, args.loss_type,
                          args.mask_truncated_completions, dist),
        checkpointer=Checkpointer(Path(args.output_dir), models.policy, models.tokenizer,
                                  learner.optimizer, learner.scheduler, models.engine, dist,
                                  keep=args.save_total_limit),
        rollout_func=rollout_func)


def plan_batches(args, models: Models, task: TaskData, generation_dtype: str | None,
                 matmul_dtype: str | None, device: torch.device) -> BatchSizes:
    """How many completions fit at once in each pass (cppo.parallel.memory), for the task's
    longest prompt (max_prompt_length when set) and the config's memory budget."""
    rows = task.train_rows
    prompt_length = args.max_prompt_length if args.max_prompt_length is not None else \
        (prompts_length(models.tokenizer, rows) if rows else 2048)
    run = RunShape(prompt_length, args.max_completion_length, args.num_generations,
                   generation_dtype=generation_dtype, bf16=args.bf16,
                   gradient_checkpointing=args.gradient_checkpointing,
                   speculation_slots=speculation_slots(SamplingSection.of(args)),
                   matmul_dtype=matmul_dtype)
    return plan_for_run(
        models.policy, models.reference, device, run, memory_budget_gib=args.memory_budget_gib,
        engine_bytes=vllm_engine_bytes(backend_settings(args), models.policy, device,
                                       device_memory_bytes(device)))


def backend_settings(args) -> BackendSettings:
    """What the generation backend reads of config `args` (cppo.sampling.settings): its
    generation and vLLM sections, the seed, lean_forward, the questions a round samples on this
    process, how vLLM loads the model and whether the sampler's correction is on."""
    return BackendSettings(
        generation=SamplingSection.of(args), vllm=VLLMSection.of(args), seed=args.seed,
        lean_forward=args.lean_forward, questions_per_step=args.step_plan().questions_per_step,
        model_revision=args.model_revision, trust_remote_code=args.trust_remote_code,
        importance_sampling_correction=args.importance_sampling_correction)


def build_sampler(models: Models, settings: BackendSettings, sampling: SamplingSettings,
                  batch_sizes: BatchSizes, generation_dtype: str | None, *,
                  push_weights: bool = True) -> GenerationBackend:
    """The generation backend (cppo's sampler or vLLM) on the policy: the built-in sampler
    decodes generation_chunk_size completions together (0: what the memory plan fits);
    push_weights: vLLM takes the policy's weights before each round (not under async_rollout,
    whose generator pushes them)."""
    return make_backend(models.policy, models.tokenizer, settings, sampling=sampling,
                        chunk_size=settings.generation.generation_chunk_size or
                        batch_sizes.generation,
                        generation_dtype=generation_dtype, push_weights=push_weights)


def build_learner(args, models: Models, dist: Distributed, steps: int,
                  matmul_dtype: str | None, replay: SamplingSettings | None = None) -> Learner:
    """The learner (cppo.learning.update): AdamW over the trainable parameters, the learning-rate
    schedule over `steps` optimizer steps, the loss settings, the precision of each pass and the
    sampler's transforms its policy passes replay (None: the full softmax, TRL's)."""
    optimization = OptimizationSection.of(args)
    optimizer = make_adamw([p for p in models.policy.parameters() if p.requires_grad],
                           optimization)
    scheduler = make_scheduler(optimizer, optimization, steps)
    settings = LearnerSettings(
        loss=args.loss_settings(), batch_size=args.per_device_train_batch_size,
        temperature=args.temperature, steps_per_round=args.steps_per_round,
        max_grad_norm=args.max_grad_norm, lean_forward=args.lean_forward,
        chunk_head=args.use_liger_kernel, bf16=args.bf16, fp16=args.fp16,
        compile=compile_settings(PrecisionSection.of(args)),
        router_aux_loss_coef=args.router_aux_loss_coef)
    return Learner(models.policy, models.reference, models.engine, dist, optimizer, scheduler,
                   settings, dist.device, matmul_dtype, replay)


def sampling_replay(args, rollout_func=None) -> SamplingSettings | None:
    """The sampler's transforms the training passes replay (replay_sampling), or None: cppo's
    sampler, its tool loop and vLLM sample with the config's settings; a rollout_func samples its
    own way, so the automatic choice is off with one and asking for replay is an error."""
    own = rollout_func is None or isinstance(rollout_func, ToolLoop)
    if args.replay_sampling and not own:
        raise ConfigError("'replay_sampling' is true with a rollout_func: cppo cannot replay a "
                          "sampler it does not run (its transforms are not known); set "
                          "replay_sampling: false, or sample with cppo (tools= or "
                          "environment_factory= run cppo's tool loop)")
    return SamplingSettings.of(SamplingSection.of(args)) if args.replays_sampling and own else None
