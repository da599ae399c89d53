"""The selection rule end to end: in a trainer's step, the completions that go on to the forward
passes are exactly those `selection_rule` picks (every registered rule, and one registered
here), within `selection_scope`; and random pruning repeats under a seed, whatever else draws
from torch's global generator, and changes with the seed.

The rewards are a fixed table by position (question-major, G = 8 per question), so the
advantages are known by hand (scale_rewards none: A = r - the group's mean, exact in float32)
whatever the tiny model samples, and each rule's pick is derived here in plain Python, apart
from cppo's rules. The table has 32 distinct |A| and, in question 0, its two largest |A| on the
same side, so largest_abs, smallest_abs, max_variance, the test's rule and the two scopes all
pick different sets: a trainer that prunes by largest |A| whatever `selection_rule` says (or
that ranks in the wrong scope) fails here.
"""

from fractions import Fraction
from itertools import combinations

import pytest
import torch

from cppo.algorithm import SELECTION_RULES
from cppo.algorithm.selection import RULE_TRAITS, keep_highest_scores, register_rule
from helpers import make_trainer

G, Q, KEEP = 8, 4, 8   # B = 8 kept of Q = 4 x G = 8 (pruning_rate 0.75)
BASE = 40              # rewards are A + BASE: the group means are BASE exactly
ADVANTAGES = [         # by hand: each row sums to 0; the 32 |A| are distinct
    [30, 29, -13, -12, -11, -10, -9, -4],     # largest |A| 30, 29 both above the mean
    [-32, 14, 8, 7, 6, 3, -1, -5],
    [27, -28, 20, -19, 2.5, -18, 15, 0.5],
    [-26, 25, -24, 23, 17, -16, 22, -21],
]
REWARDS = [[a + BASE for a in row] for row in ADVANTAGES]
CUSTOM = "highest_reward_test_only"


def table_reward(prompts, completions, completion_ids=None, **columns):
    """REWARDS by position for a training round (Q x G completions); 0 for anything else (the
    trainer's preflight probes)."""
    if len(completions) != Q * G:
        return [0.0] * len(completions)
    return [float(r) for row in REWARDS for r in row]


def top(scores: dict, count: int) -> set:
    """The `count` positions of the highest scores (no ties among them in this table)."""
    ranked = sorted(scores, key=scores.get, reverse=True)
    assert scores[ranked[count - 1]] != scores[ranked[count]], "a tie at the boundary"
    return set(ranked[:count])


def by_scope(score, scope: str) -> set:
    """The positions (question, completion) kept by ranking score(q, g) within `scope`."""
    if scope == "step":
        return top({(q, g): score(q, g) for q in range(Q) for g in range(G)}, KEEP)
    return set().union(*(top({(q, g): score(q, g) for g in range(G)}, KEEP // Q)
                         for q in range(Q)))


def max_variance_pick() -> set:
    """PODS by its definition: each question's KEEP // Q rewards of largest variance (every
    subset tried, in exact fractions; the best is unique in this table)."""
    kept = set()
    for q, row in enumerate(REWARDS):
        def variance(subset):
            values = [Fraction(row[g]) for g in subset]
            mean = sum(values) / len(values)
            return sum((v - mean) ** 2 for v in values) / len(values)
        ranked = sorted(combinations(range(G), KEEP // Q), key=variance, reverse=True)
        assert variance(ranked[0]) > variance(ranked[1])
        kept |= {(q, g) for g in ranked[0]}
    return kept


EXPECTED = {   # rule -> scope -> the kept positions
    "largest_abs": {s: by_scope(lambda q, g: abs(ADVANTAGES[q][g]), s) for s in ("step", "question")},
    "smallest_abs": {s: by_scope(lambda q, g: -abs(ADVANTAGES[q][g]), s) for s in ("step", "question")},
    CUSTOM: {s: by_scope(lambda q, g: REWARDS[q][g], s) for s in ("step", "question")},
    "max_variance": {"question": max_variance_pick()},
}


@pytest.fixture
def custom_rule():
    """A rule registered by the test: keep the highest rewards."""
    @register_rule(CUSTOM)
    def highest_reward(advantages, rewards, *, num_keep, scope, generator):
        return keep_highest_scores(rewards, num_keep=num_keep, scope=scope)
    yield CUSTOM
    del SELECTION_RULES[CUSTOM], RULE_TRAITS[CUSTOM]


def run_rounds(model_dir, output_dir, rounds: int = 2, reward=table_reward, **overrides):
    """A tiny trainer's `rounds` steps; each step's (keep mask (Q, G), kept batch) as the trainer
    built the batch that goes on to the forward passes."""
    built = []
    values = dict(num_generations=G, pruning_rate=0.75, per_device_train_batch_size=KEEP,
                  scale_rewards="none", max_steps=rounds, save_steps=rounds)
    values.update(overrides)
    trainer = make_trainer(model_dir, output_dir, reward=reward, **values)
    build = trainer.build_batch

    def recording(prompts, completions, advantages, keep_mask):
        batch = build(prompts, completions, advantages, keep_mask)
        built.append((keep_mask.clone(), batch))
        return batch
    trainer.build_batch = recording
    trainer.train()
    assert len(built) == rounds
    return built


def positions(mask: torch.Tensor) -> set:
    assert mask.shape == (Q, G)
    return {tuple(p) for p in mask.nonzero().tolist()}


def test_the_tables_rules_pick_different_completions():
    """The premise of the test below: the table's rows are centred and its |A| distinct, and
    every (rule, scope) pair keeps its own set."""
    assert all(sum(row) == 0 for row in ADVANTAGES)
    assert len({abs(a) for row in ADVANTAGES for a in row}) == Q * G
    picks = [frozenset(kept) for scopes in EXPECTED.values() for kept in scopes.values()]
    assert len(set(picks)) == len(picks) == 7
    assert all(len(p) == KEEP for p in picks)


@pytest.mark.parametrize("rule, scope", [
    ("largest_abs", "step"), ("largest_abs", "question"), ("smallest_abs", "step"),
    ("smallest_abs", "question"), ("max_variance", "question"), (CUSTOM, "step"),
    (CUSTOM, "question")])
def test_the_selection_rule_decides_which_completions_are_kept(tiny_model_dir, tmp_path,
                                                               custom_rule, rule, scope):
    """Each step keeps exactly the rule's pick, and the batch carries those completions'
    advantages (for PODS, recomputed on the kept pair: r - their mean), in position order."""
    for keep_mask, batch in run_rounds(tiny_model_dir, tmp_path / "run", selection_rule=rule,
                                       selection_scope=scope):
        kept = sorted(positions(keep_mask))
        assert set(kept) == EXPECTED[rule][scope], (rule, scope)
        if rule == "max_variance":
            means = {q: sum(REWARDS[q][g] for p, g in kept if p == q) / (KEEP // Q) for q in range(Q)}
            expected = [REWARDS[q][g] - means[q] for q, g in kept]
        else:
            expected = [ADVANTAGES[q][g] for q, g in kept]
        assert batch.advantages.tolist() == expected


def perturbing_reward(draws: int):
    """table_reward, after `draws` draws from torch's global generator (something else in the
    user's code that uses it, right before the selection)."""
    def reward(prompts, completions, completion_ids=None, **columns):
        torch.rand(draws)
        return table_reward(prompts, completions, completion_ids, **columns)
    return reward


@pytest.mark.parametrize("scope", ["step", "question"])
def test_random_pruning_repeats_under_a_seed_and_changes_with_it(tiny_model_dir, tmp_path, scope):
    """selection_rule random keeps the same completions in two runs with the same seed, though
    the global generator was drawn differently before each selection (its draws come from a
    generator seeded by the run's seed and the round), other ones with another seed, and other
    ones round after round."""
    runs = {name: [positions(mask) for mask, _ in run_rounds(
                tiny_model_dir, tmp_path / name, reward=perturbing_reward(draws),
                selection_rule="random", selection_scope=scope, seed=seed)]
            for name, draws, seed in (("a", 1, 3), ("b", 7, 3), ("other_seed", 1, 4))}
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["other_seed"]
    assert runs["a"][0] != runs["a"][1]   # seeded per round
    for kept in runs["a"] + runs["other_seed"]:
        assert len(kept) == KEEP
        if scope == "question":
            assert all(sum(q == p for p, _ in kept) == KEEP // Q for q in range(Q))
