"""Held-out accuracy: greedy accuracy and pass@k with sampling."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from cppo.sampling.sampler import Decoding, encode_prompts, prompts_length, sample_completions
from cppo.sampling.settings import SamplingSettings


@dataclass(frozen=True)
class EvalSampling:
    """How evaluate draws pass@k's k completions per question: with the sampling settings
    (e.g. SamplingSettings(temperature=0.7)) from a CPU generator seeded with `seed`."""

    settings: SamplingSettings = SamplingSettings()
    seed: int = 0


@dataclass
class EvalResult:
    num_questions: int
    greedy_accuracy: float
    pass_at_k: float | None
    k: int
    sample_accuracy: float | None  # mean accuracy of the k sampled completions (pass@1 sampled)
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        text = f"greedy accuracy {100 * self.greedy_accuracy:.1f}% on {self.num_questions} questions"
        if self.pass_at_k is not None:
            text += (f", pass@{self.k} {100 * self.pass_at_k:.1f}%, sampled accuracy "
                     f"{100 * self.sample_accuracy:.1f}%")
        return text + f" ({self.seconds:.1f} s)"


def _correct(reward_fn, rows, completions, tokenizer, num_generations: int) -> torch.Tensor:
    """(Q, num_generations) bool: reward >= 1 means correct. The reward is called as in training (TRL's
    signature): chat-message completions for chat prompts, unpadded completion_ids."""
    from cppo.rewards.runner import RewardRunner
    scores = RewardRunner([reward_fn]).score(tokenizer, rows, completions, num_generations).per_function
    return (scores[:, 0] >= 1.0).view(len(rows), num_generations)   # NaN (None: does not apply) is wrong


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], reward_fn, *, k: int = 16,
             sampling: EvalSampling = EvalSampling(), max_new_tokens: int = 8,
             batch_size: int | None = None, max_prompt_length: int | None = None,
             progress: bool = True) -> EvalResult:
    """Greedy accuracy and (k > 0) pass@k over rows with a 'prompt' column, in batches of
    batch_size completions (None: as many as fit in memory, cppo.parallel.memory.eval_batch_size).
    sampling: how pass@k's completions are drawn (EvalSampling: the settings and the seed); the
    greedy completions take the plain argmax."""
    import time
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(sampling.seed)
    greedy_hits, pass_hits, sample_hits = 0, 0, 0.0
    if batch_size is None:
        from cppo.parallel.memory import eval_batch_size
        batch_size = eval_batch_size(model, prompts_length(tokenizer, rows, max_prompt_length),
                                     max_new_tokens=max_new_tokens, k=k, memory_budget_gib=None)
    per_batch = max(1, batch_size // max(k, 1))
    bar = tqdm(total=len(rows), desc="eval", unit="q", disable=not progress, leave=False)
    for s in range(0, len(rows), per_batch):
        chunk = rows[s:s + per_batch]
        prompts = encode_prompts(tokenizer, [r["prompt"] for r in chunk], max_prompt_length)
        common = dict(max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
        greedy = sample_completions(model, prompts, num_generations=1, greedy=True, **common)
        greedy_hits += int(_correct(reward_fn, chunk, greedy, tokenizer, 1).sum())
        if k > 0:
            sampled = sample_completions(model, prompts, num_generations=k,
                                         sampling=sampling.settings, generator=generator, **common)
            hits = _correct(reward_fn, chunk, sampled, tokenizer, k)
            pass_hits += int(hits.any(1).sum())
            sample_hits += float(hits.float().mean(1).sum())
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    n = len(rows)
    return EvalResult(num_questions=n, greedy_accuracy=greedy_hits / n,
                      pass_at_k=pass_hits / n if k > 0 else None, k=k,
                      sample_accuracy=sample_hits / n if k > 0 else None,
                      seconds=time.perf_counter() - start)


@torch.no_grad()
def sampled_metrics(policy, generation, rows: list[dict], rewards, *, num_generations: int,
                    max_new_tokens: int, sampling: SamplingSettings, generator,
                    decoding: Decoding, scale_rewards: str) -> dict:
    """TRL's evaluation metrics (before its eval_ prefix): num_generations completions per row
    sampled by cppo's sampler with the training settings (`sampling`, cppo.sampling.settings;
    `decoding`, cppo.sampling.sampler.Decoding), scored by the reward functions (`rewards`, a
    RewardRunner): reward statistics, each function's mean and the completion lengths.
    generation: the run's cppo.sampling.generation.Generation (its tokenizer, and its prompts()
    encoding of the rows' prompts)."""
    from cppo.algorithm import reward_stats
    from cppo.run.tracking import length_metrics
    tokenizer, prompts = generation.tokenizer, generation.prompts(rows)
    was_training = policy.training
    policy.eval()
    try:
        completions = sample_completions(
            policy, prompts, num_generations=num_generations, max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            sampling=sampling, generator=generator, decoding=decoding)
    finally:
        policy.train(was_training)
    scores = rewards.score(tokenizer, rows, completions, num_generations)
    return {**reward_stats(scores.rewards, scale_rewards), **scores.means,
            **length_metrics(completions.lengths.float(), completions.truncated)}
