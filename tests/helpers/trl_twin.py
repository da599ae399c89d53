"""Run TRL 1.16's own GRPOTrainer and CPPOTrainer side by side on forced completions.

Both trainers get the same tiny model (from one directory), the same prompts in the same order,
the same completion ids (given, not sampled: different lengths, EOS-only, truncated) and the same
rewards. TRL's generation (`GRPOTrainer._generate`) and cppo's (`CPPOTrainer.generate`) are
replaced by a table lookup, TRL's batch shuffle (`shuffle_sequence_dict`) by the identity, and
cppo's question order by the dataset order (TRL's with shuffle_dataset=False). Each side records
what the comparison needs: advantages, old and reference log-probs per round, the loss of each
micro-step, and every parameter's gradient just before each optimizer step.

Where rounding cannot decide the verdict (`assert_same_training`):
- Both models run in float64 (`DTYPE`). What stays float32 is what TRL fixes: its fused LM head
  (trl.kernels.chunked_logprob) accumulates the log-softmax and its backward in float32, and both
  sides hold rewards and advantages in float32 (TRL's `rewards_per_func`). A float32 reduction of
  n terms errs by at most gamma_n = n u / (1 - n u) of the sum of their magnitudes (u = 2^-24);
  the longest here runs over a micro-batch's tokens (<= 96 with MAX_LEN 6 and 8 completions of
  prompts up to 10 tokens), gamma_96 = 5.7e-6. So the first optimizer step's gradients agree to
  FIRST_STEP = 1e-5 of the largest entry, and the log-probs to LOGPS_ATOL.
- AdamW runs with eps = ADAM_EPSILON = 1e-3, not 1e-8: its step m / (sqrt(v) + eps) moves a
  parameter by at most lr / eps per unit of gradient difference, 50 at lr 0.05. With eps = 1e-8
  an entry whose gradient is ~1e-8 turns float32 round-off into a parameter move of order lr
  (that is what failed on one CPU and passed on another); with 1e-3 the entries larger than
  1e-3 (most of them) still move by ~lr, sign-like, so the second step's ratios are far from 1.
  Later steps then stay within LATER_STEPS = 1e-4 (gamma_96 x 50 x the loss's curvature, O(1) on
  this model, with a margin). A wrong objective misses by >= 1e-2.
All of this holds whichever kernels the CPU picks (tests/test_cpu_paths.py runs a case on AVX2
code paths and on the machine's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helpers import note_margin

COMPLETIONS = 8       # per round: 8 // group_size questions of group_size completions
MAX_LEN = 6           # max_completion_length
DTYPE = torch.float64          # both models; see the module docstring
ADAM_EPSILON = 1e-3
FIRST_STEP, LATER_STEPS = 1e-5, 1e-4   # gradient difference / largest gradient entry
LOSS_RTOL, LOSS_ATOL, LOGPS_ATOL = 5e-5, 1e-6, 1e-5
PROMPTS = ["12*34=", "5+6=", "78*9=", "1-2-3="]   # different lengths: left padding is exercised


@dataclass
class Round:
    prompt_ids: list[list[int]]        # Q prompts
    completion_ids: list[list[int]]    # Q * G, unpadded (EOS included when it ended)
    rewards: list[float]               # Q * G
    sampler_logps: list[list[float]] | None = None   # Q * G, a sampler's log-prob per token


def make_rounds(tokenizer, num_rounds: int, group_size: int = 4, seed: int = 0) -> list[Round]:
    """Completions of several shapes per round: EOS-only, short, truncated (no EOS; the first
    round only, so the second's longest completion is shorter than max_completion_length), and
    rewards that vary inside each group (one group of equal rewards 1.0 in the second round)."""
    G, Q = group_size, COMPLETIONS // group_size
    g = torch.Generator().manual_seed(seed)
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    text_ids = [i for i in range(vocab) if i not in tokenizer.all_special_ids]
    lengths = [1, 3, MAX_LEN, 2, 4, MAX_LEN, 5, 1]   # 1 = EOS only; MAX_LEN with no EOS = truncated
    rounds = []
    for r in range(num_rounds):
        prompts = PROMPTS[r * Q:(r + 1) * Q]
        completions = []
        for i, n in enumerate(lengths):
            n = lengths[(i + r) % len(lengths)] if r == 0 else min(lengths[i], MAX_LEN - 1)
            body = [text_ids[int(t)] for t in torch.randint(len(text_ids), (n,), generator=g)]
            truncated = n == MAX_LEN and (i + r) % 2 == 0
            completions.append(body if truncated else body[:n - 1] + [eos])
        rewards = torch.randint(0, 3, (Q * G,), generator=g).float().div(2).tolist()
        rewards[:G] = ([1.0, 0.0, 0.5, 0.0] * G)[:G] if r == 0 else [1.0] * G
        rounds.append(Round([tokenizer(p)["input_ids"] for p in prompts], completions, rewards))
    return rounds


@dataclass
class Record:
    advantages: list = field(default_factory=list)   # per round (Q*G,)
    old_logps: list = field(default_factory=list)    # per round (Q*G, T) or None
    ref_logps: list = field(default_factory=list)    # per round (Q*G, T) or None
    masks: list = field(default_factory=list)        # per round (Q*G, T)
    losses: list = field(default_factory=list)       # per micro-step
    grads: list = field(default_factory=list)        # per optimizer step: {name: grad}
    sampler_weights: list = field(default_factory=list)   # per round: the sampler's IS weights


class _Feed:
    """The forced rounds, one per generation call; the reward function reads the current one."""

    def __init__(self, rounds):
        self.rounds, self.index = rounds, -1
        self.group_size = len(rounds[0].completion_ids) // len(rounds[0].prompt_ids)

    def next(self) -> Round:
        self.index += 1
        return self.rounds[self.index]

    def reward(self, prompts, completions, completion_ids=None, **kw):
        return list(self.rounds[self.index].rewards)

    def functions(self, two: bool) -> list:
        return [self.reward, self.length_reward] if two else [self.reward]

    def length_reward(self, prompts, completions, completion_ids=None, **kw):
        """A second objective (for multi_objective_aggregation): the completion's length."""
        return [float(len(ids)) for ids in completion_ids]


def micro_batch_size(accumulation: int, options: dict) -> int:
    """A round's COMPLETIONS in steps_per_generation micro-batches (TRL's default: one optimizer
    step of gradient_accumulation_steps micro-batches)."""
    return COMPLETIONS // (options.get("steps_per_generation") or accumulation)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def tool_masks(completion_ids: list[list[int]]) -> list[list[int]]:
    """A multi-turn shape for forced completions: in each completion of 4+ tokens, tokens 1 and
    2 were written by a tool (0: in the context, out of the loss)."""
    return [[0 if len(c) >= 4 and i in (1, 2) else 1 for i in range(len(c))] for c in completion_ids]


def load_twin_model(model_dir):
    """The model both sides train, in DTYPE; transformers' eager experts for a mixture of
    experts (its grouped_mm takes no float64)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    moe = hasattr(AutoConfig.from_pretrained(model_dir), "output_router_logits")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE,
                                                **({"experts_implementation": "eager"} if moe else {}))


def run_trl(model_dir, tmp_path, rounds, monkeypatch, *, max_steps, accumulation=1,
            two_rewards=False, tool_mask=False, adam_epsilon=ADAM_EPSILON, lora=None,
            **options) -> Record:
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setattr(grpo_module, "shuffle_sequence_dict", lambda batch: batch)
    if options.get("use_vllm"):   # no engine: the forced rounds carry the sampler's log-probs
        monkeypatch.setattr(grpo_module, "VLLMGeneration", lambda **kw: None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    feed, record = _Feed(rounds), Record()
    G = feed.group_size

    def fake_generate(prompts):
        rnd = feed.next()
        assert prompts[::G] == [tokenizer.decode(i, skip_special_tokens=True)
                                for i in rnd.prompt_ids]   # the same questions, in order
        prompt_ids = [ids for ids in rnd.prompt_ids for _ in range(G)]
        texts = tokenizer.batch_decode(rnd.completion_ids, skip_special_tokens=True)
        masks = tool_masks(rnd.completion_ids) if tool_mask else None
        return prompt_ids, rnd.completion_ids, masks, texts, rnd.sampler_logps, {}, None, []

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            record.grads.append(_grads(model))

    args = GRPOConfig(output_dir=str(tmp_path / "trl"),
                      per_device_train_batch_size=micro_batch_size(accumulation, options),
                      gradient_accumulation_steps=accumulation,
                      num_generations=G, max_completion_length=MAX_LEN, max_steps=max_steps,
                      learning_rate=options.pop("learning_rate"), lr_scheduler_type="constant",
                      adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=adam_epsilon, weight_decay=0.0,
                      max_grad_norm=0.0, shuffle_dataset=False, seed=0, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, **options)
    trainer = GRPOTrainer(model=load_twin_model(model_dir),
                          reward_funcs=feed.functions(two_rewards), args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          callbacks=[Grads()], peft_config=_trl_lora(lora))
    _seed_adapters(trainer.model)
    trainer._generate = fake_generate
    score, compute_loss = trainer._generate_and_score_completions, trainer.compute_loss

    def spy_score(inputs):
        out = score(inputs)
        record.advantages.append(out["advantages"].detach().clone())
        record.old_logps.append(_clone(out.get("old_per_token_logps")))
        record.ref_logps.append(_clone(out.get("ref_per_token_logps")))
        record.masks.append(out["completion_mask"].clone())
        if "importance_sampling_ratio" in out:
            record.sampler_weights.append(out["importance_sampling_ratio"].clone())
        return out

    def spy_loss(model, inputs, **kw):
        loss = compute_loss(model, inputs, **kw)
        record.losses.append(loss.item())
        return loss
    trainer._generate_and_score_completions = spy_score
    trainer.compute_loss = spy_loss
    trainer.train()
    return record


def run_cppo(model_dir, tmp_path, rounds, monkeypatch, *, max_steps, accumulation=1,
             two_rewards=False, tool_mask=False, adam_epsilon=ADAM_EPSILON, lora=None,
             **options) -> Record:
    import cppo.trainer as trainer_module
    import cppo.algorithm.micro_batch as micro_batch
    import cppo.learning.update as update
    from cppo.config import CPPOConfig
    from cppo.models import load_model, load_tokenizer
    from cppo.sampling.padding import pad_token_lists
    from cppo.sampling.batches import Completions, PromptBatch

    tokenizer = load_tokenizer(model_dir)
    feed, record = _Feed(rounds), Record()
    G = feed.group_size
    Q = COMPLETIONS // G
    args = CPPOConfig(model=model_dir, output_dir=str(tmp_path / "cppo"), max_steps=max_steps,
                      per_device_train_batch_size=micro_batch_size(accumulation, options),
                      gradient_accumulation_steps=accumulation, num_generations=G, pruning_rate=0.0,
                      max_completion_length=MAX_LEN, lr_scheduler_type="constant",
                      adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=adam_epsilon, weight_decay=0.0,
                      max_grad_norm=0.0, seed=0, logging_steps=1, eval_steps=0, save_steps=0, progress_bar=False,
                      **({} if lora is None else dict(use_peft=True, **lora)), **options)
    trainer = trainer_module.CPPOTrainer(
        model=load_twin_model(model_dir),
        processing_class=tokenizer, reward_funcs=feed.functions(two_rewards), args=args, train_dataset=[{"prompt": p} for p in PROMPTS])
    _seed_adapters(trainer.policy)
    order = iter(range(len(PROMPTS)))
    trainer.take_questions = lambda: ([{"prompt": PROMPTS[next(order)]} for _ in range(Q)],
                                      list(range(Q)), None)

    def fake_generate(rows):
        rnd = feed.next()
        prompts = PromptBatch(*pad_token_lists(rnd.prompt_ids, tokenizer.pad_token_id, side="left"))
        ids, mask = pad_token_lists(rnd.completion_ids, tokenizer.pad_token_id, side="right")
        truncated = torch.tensor([c[-1] != tokenizer.eos_token_id for c in rnd.completion_ids])
        logps = None
        if rnd.sampler_logps is not None:
            logps = torch.zeros(ids.shape)
            for row, values in enumerate(rnd.sampler_logps):
                logps[row, :len(values)] = torch.tensor(values)
        masks = None
        if tool_mask:
            masks = pad_token_lists(tool_masks(rnd.completion_ids), 1, side="right")[0]
        return prompts, Completions(ids, mask, truncated, logps, tool_mask=masks)
    trainer.generate = fake_generate
    build, fill = trainer.build_batch, trainer.fill_old_and_ref_logprobs

    def spy_build(*a, **kw):
        batch = build(*a, **kw)
        record.advantages.append(batch.advantages.clone())
        record.masks.append(batch.completion_mask.clone())
        return batch

    def spy_fill(batch):
        fill(batch)
        record.old_logps.append(_clone(batch.old_logps))
        record.ref_logps.append(_clone(batch.ref_logps))
    trainer.build_batch, trainer.fill_old_and_ref_logprobs = spy_build, spy_fill
    _after_each_call(monkeypatch, micro_batch, "reduce_loss",
                     lambda loss: record.losses.append(loss.item()))
    _after_each_call(monkeypatch, micro_batch, "sampler_importance_weights",
                     lambda weights: record.sampler_weights.append(weights.clone()))

    def aux_into_the_loss(value):   # so is the load-balancing term
        record.losses[-1] += value.item()
    _after_each_call(monkeypatch, update, "router_aux_loss", aux_into_the_loss)

    def bonus_out_of_the_loss(value):   # the loss TRL returns includes the entropy bonus
        record.losses[-1] -= trainer.entropy_coef_now() * value.item()   # adaptive: gated
    _after_each_call(monkeypatch, micro_batch, "entropy_bonus", bonus_out_of_the_loss)
    step = trainer.optimizer.step

    def spy_step(*a, **kw):
        record.grads.append(_grads(trainer.policy))
        return step(*a, **kw)
    trainer.optimizer.step = spy_step
    trainer.train()
    return record


def assert_same_training(trl: Record, cppo: Record, steps: int) -> None:
    """The losses of every micro-step and the gradients before every optimizer step agree within
    the bounds of the module docstring."""
    import pytest
    assert len(trl.losses) == len(cppo.losses)
    assert len(trl.grads) == len(cppo.grads) == steps
    grads = [max_difference(b, a) for a, b in zip(trl.grads, cppo.grads)]
    losses = [abs(b - a) / max(abs(a) * LOSS_RTOL, LOSS_ATOL) for a, b in zip(trl.losses, cppo.losses)]
    note_margin("trl_twin", first_step=grads[0], first_step_bound=FIRST_STEP,
                later_steps=max(grads[1:], default=0.0), later_steps_bound=LATER_STEPS,
                loss=max(losses, default=0.0), loss_bound=1.0)   # loss: |difference| / tolerance
    assert cppo.losses == pytest.approx(trl.losses, rel=LOSS_RTOL, abs=LOSS_ATOL)
    for step, difference in enumerate(grads):
        assert difference <= (FIRST_STEP if step == 0 else LATER_STEPS), step


def _trl_lora(lora: dict | None):
    """TRL's LoraConfig for the same LoRA fields (trl.get_peft_config), or None."""
    if lora is None:
        return None
    from trl import ModelConfig, get_peft_config
    return get_peft_config(ModelConfig(use_peft=True, **lora))


def _seed_adapters(model) -> None:
    """Give every LoRA factor the same values on both sides, seeded by its name (B non-zero, so
    the first step's gradient reaches A too): the two trainers draw peft's random init from
    different RNG states."""
    import zlib
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float64) * 0.1)


def _after_each_call(monkeypatch, module, name: str, note) -> None:
    """module.name still runs; note(its result) is called after each call."""
    real = getattr(module, name)

    def spy(*a, **kw):
        out = real(*a, **kw)
        note(out)
        return out
    monkeypatch.setattr(module, name, spy)


def _clone(t):
    return None if t is None else t.detach().clone()


def max_difference(a: dict, b: dict) -> float:
    """Largest |a - b| over all parameters, relative to the largest |b| (a gradient's scale)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    scale = max(float(v.abs().max()) for v in b.values()) or 1.0
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def masked_difference(a, b, mask) -> float:
    """Largest |a - b| on mask's tokens; a and b may differ in width past the longest row."""
    width = min(a.shape[1], b.shape[1], mask.shape[1])
    m = mask[:, :width].bool()
    return float((a[:, :width] - b[:, :width]).abs()[m].max()) if m.any() else 0.0


__all__ = ["COMPLETIONS", "MAX_LEN", "DTYPE", "LOGPS_ATOL", "make_rounds", "run_trl", "run_cppo",
           "assert_same_training", "max_difference", "masked_difference"]
