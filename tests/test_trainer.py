"""The training loop on a tiny random model: pruning before the passes, resume, errors."""

import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.models import load_model, load_tokenizer
from cppo.errors import RewardError
from cppo.trainer import CPPOTrainer
from helpers import ROWS, make_trainer, odd_length_reward
from helpers.tool_calls import multiply


def count_rows(trainer, log, monkeypatch):
    """Record (model, completion rows, sequence length, generating) of every forward pass:
    the models' own forward passes through F.embedding with (rows, length) ids; cppo's lean
    scoring pass (which runs each distinct prompt once) is recorded with its completion rows."""
    from cppo.models.lean import LeanForward
    weights = {id(trainer.policy.get_input_embeddings().weight): "policy",
               id(trainer.reference.get_input_embeddings().weight): "reference"}
    generating = [False]
    embedding = torch.nn.functional.embedding

    def counted(ids, weight, *args, **kwargs):
        if ids.dim() == 2:          # a (rows, length) forward; the lean scoring pass is below
            log.append((weights.get(id(weight), "other"), *ids.shape, generating[0]))
        return embedding(ids, weight, *args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "embedding", counted)
    scoring = LeanForward.completion_logits

    def counted_scoring(self, prompt_ids, prompt_mask, question, completion_ids, completion_mask, **kw):
        name = weights.get(id(self.model.get_input_embeddings().weight), "other")
        log.append((name, completion_ids.shape[0], prompt_ids.shape[1] + completion_ids.shape[1],
                    generating[0]))
        return scoring(self, prompt_ids, prompt_mask, question, completion_ids, completion_mask, **kw)
    monkeypatch.setattr(LeanForward, "completion_logits", counted_scoring)
    original = trainer.backend.generate

    def generate(*args, **kwargs):
        generating[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            generating[0] = False
    trainer.backend.generate = generate


@pytest.mark.parametrize("lean_forward", [True, False])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_passes_see_only_kept_completions(tiny_model_dir, tmp_path, num_iterations, lean_forward,
                                          monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", beta=0.04, num_iterations=num_iterations,
                           max_steps=num_iterations, gradient_accumulation_steps=2,
                           per_device_train_batch_size=4, lean_forward=lean_forward,
                           generation_dtype=None)   # sampling with the policy's own weights
    plan = trainer.plan          # B = 8 kept from Q = 4 questions x G = 4 = 16 scored
    assert (plan.questions_per_step, plan.completions_scored, plan.completions_kept) == (4, 16, 8)
    calls = []
    count_rows(trainer, calls, monkeypatch)
    trainer.training_round()
    policy_calls = [c[1:] for c in calls if c[0] == "policy"]
    reference_calls = [c[1:] for c in calls if c[0] == "reference"]
    assert len(policy_calls) + len(reference_calls) == len(calls)
    prompt_length = 7            # BOS + "ab*cd="; completions are at most 5 tokens
    completion_rows = [n for n, length, generating in policy_calls if length > prompt_length]
    assert not any(generating for _, length, generating in policy_calls if length > prompt_length)
    # policy: micro-batches of 4 kept rows, mu updates (+ one old-policy pass when mu > 1)
    assert sum(completion_rows) == 8 * (num_iterations + (num_iterations > 1))
    assert max(completion_rows) == 4
    # reference: the kept rows, once
    assert sum(n for n, length, _ in reference_calls if length > prompt_length) == 8
    prefill = [n for n, length, generating in policy_calls if generating and length == prompt_length]
    decode = [n for n, length, generating in policy_calls if generating and length == 1]
    assert prefill == [4] and decode and decode[0] == 16   # prefill once per question
    assert decode == sorted(decode, reverse=True)          # finished completions leave the batch


def test_grpo_without_pruning_keeps_everything(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", pruning_rate=0.0, max_steps=1)
    assert (trainer.plan.questions_per_step, trainer.plan.completions_kept) == (2, 8)
    metrics = trainer.training_round()
    assert metrics["cppo/completions_kept"] == 8 and metrics["cppo/kept_fraction"] == 1.0


def test_all_zero_advantages_skip_the_step(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=lambda completions, **kw: [1.0] * len(completions),
                           max_steps=2)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    summary = trainer.train()
    assert summary["skipped_steps"] == 2 and summary["steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("cppo/skipped") == 1 for r in records if "reward" in r)


@pytest.mark.cpu_paths
def test_interrupted_and_resumed_run_ends_with_the_same_parameters(tiny_model_dir, tmp_path):
    straight = make_trainer(tiny_model_dir, tmp_path / "a")
    straight.train()

    interrupted = make_trainer(tiny_model_dir, tmp_path / "b")
    real_round = interrupted.training_round

    def round_then_ctrl_c():
        metrics = real_round()
        if interrupted.run_state.step == 2:
            interrupted.stop_requested = True      # what a Ctrl-C does
        return metrics
    interrupted.training_round = round_then_ctrl_c
    assert interrupted.train()["status"] == "interrupted"

    resumed = make_trainer(tiny_model_dir, tmp_path / "b", resume=True)
    summary = resumed.train()
    assert summary["resumed_from"].endswith("checkpoint-2") and summary["steps"] == 4
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert straight.run_state.counters == resumed.run_state.counters


def test_a_launcher_restart_resumes_without_the_flag(tiny_model_dir, tmp_path, monkeypatch):
    """torchrun --max-restarts starts the worker group again with TORCHELASTIC_RESTART_COUNT
    > 0: the run resumes from the newest checkpoint (no --resume typed) and ends identical."""
    straight = make_trainer(tiny_model_dir, tmp_path / "a")
    straight.train()
    killed = make_trainer(tiny_model_dir, tmp_path / "b")
    real_round = killed.training_round

    def round_then_die():
        if killed.run_state.step == 3:           # inside step 4: the newest checkpoint is checkpoint-2
            raise RuntimeError("worker died")
        return real_round()
    killed.training_round = round_then_die
    with pytest.raises(RuntimeError, match="worker died"):
        killed.train()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    summary = make_trainer(tiny_model_dir, tmp_path / "b").train()
    assert summary["resumed_from"].endswith("checkpoint-2") and summary["steps"] == 4
    got = load_file(tmp_path / "b" / "checkpoint-4" / "model.safetensors")
    expected = load_file(tmp_path / "a" / "checkpoint-4" / "model.safetensors")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_close_ends_the_engine_the_reward_workers_then_the_process_group(tiny_model_dir, tmp_path):
    order = []
    with make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1) as trainer:
        trainer.backend.close = lambda: order.append("generation engine")
        trainer.rewards.close = lambda: order.append("reward workers")
        trainer.dist.close = lambda: order.append("process group")
        trainer.train()
        assert order == []     # train() leaves them up: a script may still use them
    assert order == ["generation engine", "reward workers", "process group"]


def test_update_changes_parameters_and_logs_trl_metrics(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, eval_steps=1)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    from cppo.evaluate import evaluate
    initial = evaluate(trainer.policy, trainer.tokenizer, trainer.task.eval_rows,
                       trainer.task.scoring_reward(trainer.rewards.funcs[0]), k=0,
                       max_new_tokens=trainer.args.max_completion_length,
                       max_prompt_length=trainer.args.max_prompt_length, progress=False,
                       batch_size=trainer.batch_sizes.evaluation)
    import dataclasses
    import cppo.trainer as trainer_module
    measured, evaluate_now = [], trainer_module.evaluate

    def numbered(*args, **kwargs):   # each evaluation's own accuracy: 0.1, 0.2, 0.3
        measured.append(evaluate_now(*args, **kwargs))
        return dataclasses.replace(measured[-1], greedy_accuracy=len(measured) / 10)
    monkeypatch.setattr(trainer_module, "evaluate", numbered)
    summary = trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in records if "reward" in r][0]
    for key in ["reward", "reward_std", "frac_reward_zero_std", "rewards/odd_length_reward/mean",
                "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean",
                "loss", "grad_norm", "learning_rate", "cppo/kept_fraction",
                "cppo/mean_abs_advantage_kept", "cppo/mean_abs_advantage_pruned",
                "cppo/questions_per_step", "timing/generate", "timing/score", "timing/logprobs",
                "timing/update", "throughput/tokens_per_s"]:
        assert key in step, key
    assert step["cppo/mean_abs_advantage_kept"] >= step["cppo/mean_abs_advantage_pruned"]
    assert (run / "reward.png").is_file() and (run / "accuracy.png").is_file()
    assert json.loads((run / "summary.json").read_text())["accuracy_before"] == summary["accuracy_before"]
    # before: the first evaluation's, of the untrained policy; after: the last one's (step 2)
    assert measured[0].greedy_accuracy == initial.greedy_accuracy
    assert (summary["accuracy_before"], summary["accuracy_after"]) == (0.1, 0.3)
    assert [(h["label"], h["step"], h["accuracy"]) for h in summary["history"]] == [
        ("before", 0, 0.1), ("step 1", 1, 0.2), ("step 2", 2, 0.3)]


@pytest.mark.parametrize("reward, message", [
    (lambda completions, **kw: 1 / 0, "raised ZeroDivisionError"),
    (lambda completions, **kw: [1.0], "returned 1 values for"),
    (lambda completions, **kw: [float("nan")] * len(completions), "rewards must be finite"),
    (lambda completions, **kw: ["good"] * len(completions), "expected a float or None"),
])
def test_bad_reward_functions_fail_before_training(tiny_model_dir, tmp_path, reward, message):
    with pytest.raises(RewardError, match=message):
        make_trainer(tiny_model_dir, tmp_path / "run", reward=reward)


def test_bad_rows_fail_before_training(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="row 1 has no 'prompt' column"):
        make_trainer(tiny_model_dir, tmp_path / "run", rows=[{"prompt": "1*2="}, {"question": "x"}])
    with pytest.raises(RewardError, match="needs the dataset column 'answer'"):
        make_trainer(tiny_model_dir, tmp_path / "run", reward="arithmetic", rows=[{"prompt": "1*2="}] * 4)



def test_bfloat16_sampling_records_logprobs_and_reweights_the_loss(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", generation_dtype="bfloat16", max_steps=2)
    prompts, completions = trainer.generate(ROWS[:2])
    assert completions.logprobs is not None and completions.logprobs.dtype == torch.float32
    assert (completions.logprobs[completions.mask == 0] == 0).all()
    assert (completions.logprobs[completions.mask == 1] < 0).all()
    # the bfloat16 sampler's log-probs are close to, but not exactly, the float32 policy's
    policy = trainer.learner.logprobs(trainer.policy, trainer.build_batch(
        prompts, completions, torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool)))
    valid = completions.mask.bool()
    difference = (policy - completions.logprobs).abs()[valid]
    assert 0 < difference.max() < 0.1
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ratios = [r["sampling/importance_sampling_ratio/mean"] for r in records
              if "sampling/importance_sampling_ratio/mean" in r]
    assert ratios and all(0.9 < r < 1.1 for r in ratios)


@pytest.mark.parametrize("fast", [True, False])
def test_auto_generation_dtype_samples_from_a_bfloat16_copy_only_where_bfloat16_is_fast(
        tiny_model_dir, tmp_path, monkeypatch, capsys, fast):
    from cppo.parallel import hardware
    monkeypatch.setattr(hardware, "cpu_has_fast_dtype", lambda dtype: fast)
    monkeypatch.setattr(hardware, "BF16_MIN_DECODE_MULTIPLY_ADDS", 0)   # any decode step pays
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", generation_dtype="auto", max_steps=1)
    assert trainer.generation_dtype == ("bfloat16" if fast else None)
    # a bfloat16 sampler records its own log-probs, which the loss corrects with
    assert (trainer.generate(ROWS[:2])[1].logprobs is not None) == fast
    said = capsys.readouterr().out
    assert said.count("generation_dtype: auto -> bfloat16") == (1 if fast else 0)
    assert "auto -> float32" not in said   # not fast: nothing to explain


def test_auto_generation_dtype_keeps_the_policys_dtype_where_no_copy_can_sample(
        tiny_model_dir, tmp_path, monkeypatch):
    from cppo.parallel import hardware
    monkeypatch.setattr(hardware, "cpu_has_fast_dtype", lambda dtype: True)
    monkeypatch.setattr(hardware, "BF16_MIN_DECODE_MULTIPLY_ADDS", 0)   # only the copy decides
    assert CPPOConfig().generation_dtype == "auto"
    if importlib.util.find_spec("vllm") is not None:   # use_vllm's config check needs vLLM
        assert CPPOConfig(use_vllm=True, vllm_enable_sleep_mode=False).generation_dtype == "auto"
    no_lean = make_trainer(tiny_model_dir, tmp_path / "a", lean_forward=False, max_steps=1)
    assert no_lean.generation_dtype is None
    tools = CPPOTrainer(model=load_model(tiny_model_dir), processing_class=load_tokenizer(tiny_model_dir),
                        reward_funcs=[odd_length_reward], train_dataset=ROWS, tools=[multiply],
                        args=CPPOConfig(output_dir=str(tmp_path / "b"), max_steps=1, num_generations=4,
                                        per_device_train_batch_size=8, max_completion_length=5))
    assert tools.generation_dtype is None   # the tool loop samples with the policy itself
    assert hardware.auto_generation_dtype(torch.bfloat16, "cpu", True) is None
    assert hardware.auto_generation_dtype(torch.float32, "cpu", True) == "bfloat16"


def test_auto_generation_dtype_keeps_float32_where_a_cpu_decode_step_is_too_small_to_pay(
        tiny_model_dir, tmp_path, monkeypatch, capsys):
    from cppo.parallel import hardware
    monkeypatch.setattr(hardware, "cpu_has_fast_dtype", lambda dtype: True)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", generation_dtype="auto", max_steps=1)
    # the work of one decode step: 4 questions x G = 4 rows x every Linear's weights (lm_head too)
    linear = sum(m.weight.numel() for m in trainer.policy.modules() if isinstance(m, torch.nn.Linear))
    assert 16 * linear < hardware.BF16_MIN_DECODE_MULTIPLY_ADDS
    said = capsys.readouterr().out
    assert trainer.generation_dtype is None and "auto -> bfloat16" not in said
    assert said.count(f"generation_dtype: auto -> float32: a decode step here ({16 * linear:.1e} "
                      f"multiply-adds) is too small") == 1
    make_trainer(tiny_model_dir, tmp_path / "chunked", generation_dtype="auto",
                 max_steps=1, generation_chunk_size=8)
    said = capsys.readouterr().out   # a chunk is what decodes together
    assert said.count(f"a decode step here ({8 * linear:.1e} multiply-adds)") == 1
    limit = hardware.BF16_MIN_DECODE_MULTIPLY_ADDS
    assert hardware.auto_generation_dtype(torch.float32, "cpu", True, limit) == "bfloat16"
    assert hardware.auto_generation_dtype(torch.float32, "cpu", True, limit - 1) is None
    # a GPU has no per-call cost of that kind: its decision does not depend on the batch
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert hardware.auto_generation_dtype(torch.float32, "cuda", True, 1) == "bfloat16"


@pytest.mark.filterwarnings("ignore::cppo.errors.SlowPrecisionWarning")   # bf16 where "slow"
@pytest.mark.parametrize("fast", [True, False])
def test_auto_matmul_dtype_is_bfloat16_only_where_fast_and_a_micro_batch_is_large_enough(
        tiny_model_dir, tmp_path, monkeypatch, capsys, fast):
    from cppo.parallel import hardware
    monkeypatch.setattr(hardware, "cpu_has_fast_dtype", lambda dtype: fast)
    small = make_trainer(tiny_model_dir, tmp_path / "small", matmul_dtype="auto", max_steps=1)
    assert small.matmul_dtype is None   # 8 completions x 5 tokens: too little work to pay
    monkeypatch.setattr(hardware, "BF16_MIN_DECODE_MULTIPLY_ADDS", 0)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", matmul_dtype="auto", max_steps=1)
    assert trainer.matmul_dtype == ("bfloat16" if fast else None)
    said = capsys.readouterr().out
    assert said.count("matmul_dtype: auto -> bfloat16") == (1 if fast else 0)
    # not with bf16 autocast, nor where the lean forward does not run the passes
    assert make_trainer(tiny_model_dir, tmp_path / "b", matmul_dtype="auto", bf16=True,
                        max_steps=1).matmul_dtype is None
    assert make_trainer(tiny_model_dir, tmp_path / "c", matmul_dtype="auto", lean_forward=False,
                        max_steps=1).matmul_dtype is None
    linear = sum(m.weight.numel() for m in trainer.policy.modules() if isinstance(m, torch.nn.Linear))
    work = 8 * 5 * linear   # per_device_train_batch_size x max_completion_length x per token
    monkeypatch.setattr(hardware, "cpu_has_fast_dtype", lambda dtype: True)
    monkeypatch.setattr(hardware, "BF16_MIN_DECODE_MULTIPLY_ADDS", work)
    assert make_trainer(tiny_model_dir, tmp_path / "d", matmul_dtype="auto",
                        max_steps=1).matmul_dtype == "bfloat16"
    monkeypatch.setattr(hardware, "BF16_MIN_DECODE_MULTIPLY_ADDS", work + 1)
    assert make_trainer(tiny_model_dir, tmp_path / "e", matmul_dtype="auto",
                        max_steps=1).matmul_dtype is None
    assert hardware.auto_matmul_dtype(torch.bfloat16, "cpu", True, math.inf) is None
    assert hardware.auto_matmul_dtype(torch.float32, "cpu", False, math.inf) is None


@pytest.mark.parametrize("field", ["generation_dtype", "matmul_dtype"])
def test_an_explicit_dtype_needs_a_model_the_lean_forward_supports(tiny_model_dir, tmp_path, field):
    from cppo.errors import ConfigError
    with pytest.raises(ConfigError, match=f"'{field}' is 'bfloat16' but 'lean_forward' is false"):
        CPPOConfig(**{field: "bfloat16"}, lean_forward=False)
    model = load_model(tiny_model_dir)
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    with pytest.raises(ConfigError, match=f"'{field}' is 'bfloat16'.*forward hooks"):
        CPPOTrainer(model=model, processing_class=load_tokenizer(tiny_model_dir),
                    reward_funcs=[odd_length_reward], train_dataset=ROWS,
                    args=CPPOConfig(output_dir=str(tmp_path / "run"), max_steps=1,
                                    **{"generation_dtype": None, field: "bfloat16"},
                                    per_device_train_batch_size=8, num_generations=4))


def test_matmul_dtype_is_not_asked_for_with_bf16_autocast():
    from cppo.errors import ConfigError
    with pytest.raises(ConfigError, match="'matmul_dtype' is 'bfloat16' with 'bf16' true"):
        CPPOConfig(matmul_dtype="bfloat16", bf16=True)


def test_ctrl_c_after_the_last_step_still_completes_cleanly(tiny_model_dir, tmp_path, monkeypatch):
    """A SIGINT while the final plots are drawn only asks to stop: no KeyboardInterrupt, the run
    ends 'completed' with its final checkpoint and summary (CI once caught it mid-import)."""
    import os
    import signal
    import cppo.run.summary as summary_module
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2)
    original = summary_module.write_plots

    def interrupted_plots(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)
    monkeypatch.setattr(summary_module, "write_plots", interrupted_plots)
    # what was there before (Python's default, or SIG_IGN when started in a shell's background)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    assert {sig: signal.getsignal(sig) for sig in before} == before   # handlers restored


def test_importance_weights_scale_the_loss_and_its_gradient(tiny_model_dir, tmp_path):
    """A sampler whose log-probs are the policy's - log 2 gives every token the weight 2 (clip 3):
    the update's loss and gradient norm are exactly twice those of the same batch without it."""
    import dataclasses
    import math
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, max_grad_norm=0.0,
                           generation_dtype=None)   # the plain batch: no sampler log-probs
    prompts, completions = trainer.generate(ROWS[:2])
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.25, -0.25, 1.0, -1.0]])
    batch = trainer.build_batch(prompts, completions, advantages, torch.ones(2, 4, dtype=torch.bool))
    with torch.no_grad():
        policy_logps = trainer.learner.logprobs(trainer.policy, batch)
    reweighted = dataclasses.replace(batch, sampler_logps=policy_logps - math.log(2.0))
    start = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    plain = trainer.update(batch)
    trainer.policy.load_state_dict(start)
    weighted = trainer.update(reweighted)
    assert weighted["sampling/importance_sampling_ratio/mean"] == pytest.approx(2.0, rel=1e-5)
    assert weighted["loss"] == pytest.approx(2 * plain["loss"], rel=1e-4)
    assert weighted["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("advantages_on_kept", [True, False])
def test_a_rules_traits_decide_whether_advantages_are_recomputed(tiny_model_dir, tmp_path,
                                                                  monkeypatch, advantages_on_kept):
    """The trainer asks the rule registry, not the rule's name, whether the loss uses advantages
    recomputed on the kept completions (PODS)."""
    import cppo.trainer as trainer_module
    from cppo.algorithm import SELECTION_RULES, register_rule
    from cppo.algorithm.selection import keep_highest_scores

    @register_rule("first_half_test_only", scopes=("question",), advantages_on_kept=advantages_on_kept)
    def first_half(advantages, rewards, *, num_keep, scope, generator):
        order = -torch.arange(advantages.shape[1], dtype=torch.float32).expand_as(advantages)
        return keep_highest_scores(order, num_keep=num_keep, scope=scope)

    calls = []
    recompute = trainer_module.recompute_advantages_on_kept
    monkeypatch.setattr(trainer_module, "recompute_advantages_on_kept",
                        lambda *a, **k: calls.append(1) or recompute(*a, **k))
    try:
        trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1,
                               selection_rule="first_half_test_only", selection_scope="question")
        trainer.training_round()
    finally:
        del SELECTION_RULES["first_half_test_only"]
    assert calls == ([1] if advantages_on_kept else [])


def test_reward_weights_are_checked_against_the_trainers_reward_functions(tiny_model_dir, tmp_path):
    """TRL's habit: the config names no functions (its default is the embedded task's one), the
    trainer gets two, and the two weights fit them; a count that fits neither is refused."""
    def length_reward(completions, **kw):
        return [float(len(c)) for c in completions]
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=[odd_length_reward, length_reward],
                           reward_weights=[1, 0.5])
    assert trainer.rewards.weights.tolist() == [1.0, 0.5]
    with pytest.raises(ConfigError, match="'reward_weights' has 3 values but 'reward_funcs' has 2"):
        make_trainer(tiny_model_dir, tmp_path / "run", reward=[odd_length_reward, length_reward],
                     reward_weights=[1, 0.5, 2])


@pytest.mark.parametrize("num_generations_eval, sampled", [(0, 0), (3, 3), (None, 4)])
def test_num_generations_eval_samples_and_scores_the_held_out_questions(tiny_model_dir, tmp_path,
                                                                         num_generations_eval,
                                                                         sampled):
    """TRL's evaluation: num_generations_eval completions per held-out question (None:
    num_generations), scored by the reward functions, logged as TRL's eval_* metrics."""
    calls = []

    def reward(prompts, completions, **kw):
        calls.append(len(completions))
        return odd_length_reward(prompts, completions, **kw)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=reward, max_steps=1,
                           num_generations_eval=num_generations_eval)
    preflight = len(calls)
    trainer.train()
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval/accuracy" in r]
    assert len(evals) == 2       # before and after
    # each evaluation: greedy accuracy (4 held-out questions), then `sampled` x 4; the step: 4 x 4
    evaluation = [4, 4 * sampled] if sampled else [4]
    assert calls[preflight:] == evaluation + [16] + evaluation
    if not sampled:
        assert all("eval_reward" not in r for r in evals)
        return
    for r in evals:
        assert 0 <= r["eval_reward"] <= 1 and r["eval_rewards/reward/mean"] == r["eval_reward"]
        assert {"eval_reward_std", "eval_frac_reward_zero_std", "eval_completions/mean_length",
                "eval_completions/clipped_ratio"} <= set(r)


def test_adaptive_entropy_coefficient_is_logged_and_checkpointed(tiny_model_dir, tmp_path):
    """Every step's entropy is below a target of 100 nats: the coefficient rises by delta per
    optimizer step (logged as TRL's entropy_coef) and the checkpoint carries it and the last
    step's entropy (with top_entropy_quantile 1, the logged one) for a resume."""
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, use_adaptive_entropy=True,
                           entropy_coef=0.0, entropy_coef_delta=0.25, entropy_target=100.0)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["entropy_coef"] for r in records if "entropy_coef" in r] == [0.25, 0.5]
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    last = [r["entropy"] for r in records if "entropy_coef" in r][-1]
    saved = state["features"]["adaptive_entropy"]
    assert saved["coef"] == 0.5
    assert saved["last_entropy"] == pytest.approx(last, abs=1e-5)
    assert 0 < saved["last_entropy"] <= math.log(trainer.policy.config.vocab_size)


def test_adaptive_entropy_control_measures_the_whole_step(tiny_model_dir, tmp_path):
    """TRL's controller sees the step's token-weighted mean entropy over every micro-batch (with
    top_entropy_quantile 1 that is the logged entropy), not the last micro-batch's."""
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, use_adaptive_entropy=True,
                           per_device_train_batch_size=4, gradient_accumulation_steps=2)
    control = trainer.features.get("adaptive_entropy")
    seen, adapt = [], control.after_step
    control.after_step = lambda entropy: seen.append(entropy) or adapt(entropy)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["entropy"] for r in records if "entropy_coef" in r]
    assert len(seen) == len(logged) == 2 and seen == pytest.approx(logged, rel=1e-6)
