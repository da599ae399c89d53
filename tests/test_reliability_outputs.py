"""Bad model output: empty completions, completions that never stop, only special tokens, huge
numbers, deeply nested or malformed LaTeX. Every reward returns a value (or None), and a training
step on such completions goes on. Nothing here is timed: the inputs are large enough that a
quadratic or exponential parser (or a hang) runs into the test's pytest-timeout.

(tests/test_rewards_*.py check the extractors on short random text; here the inputs are the big
and degenerate ones a broken policy produces, and the rewards are called through RewardRunner,
as the trainer calls them.)
"""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cppo.rewards.arithmetic import arithmetic_accuracy_reward, arithmetic_format_reward, extract_answer
from cppo.rewards.answers import extract_last_boxed, extract_numeric_answer
from cppo.rewards.math_rewards import make_math_accuracy_reward
from cppo.rewards.runner import RewardRunner
from helpers import make_trainer

# every case takes milliseconds; a quadratic parser on the megabyte inputs below (about 10^12
# steps) or a hang does not finish within the timeout of each test here
pytestmark = pytest.mark.timeout(300)

SPECIAL_TOKENS = ["<eos>", "<pad>", "<bos>", "<unk>", "</s>", "<|endoftext|>", "<|im_end|>", "<think>",
                  "</answer>", "\x00", "\ufffd"]
_nesting = st.integers(min_value=1, max_value=5000)
_degenerate = st.one_of(
    st.just(""),
    st.text(max_size=50),
    st.integers(min_value=1, max_value=50_000).map(lambda n: "9" * n),                 # huge number
    st.integers(min_value=1, max_value=2000).map(lambda n: "12+34=" * n),              # never stops
    st.lists(st.sampled_from(SPECIAL_TOKENS), max_size=200).map("".join),             # specials only
    _nesting.map(lambda d: "\\boxed{" + "\\frac{" * d + "1" + "}{2}" * d + "}"),      # deep nesting
    _nesting.map(lambda d: "\\boxed{" * d + "7"),                                      # never closed
    _nesting.map(lambda d: "}" * d + "\\boxed{" + "{" * d + "1"),                      # unbalanced
    _nesting.map(lambda d: "<answer>" * d + "5" + "</answer>" * (d // 2)),             # nested tags
    _nesting.map(lambda d: "9^{" * d + "9" + "}" * d),                                 # power towers
)
completions = st.lists(st.one_of(_degenerate, st.lists(_degenerate, max_size=3).map("".join)),
                       min_size=1, max_size=4)
REGISTRY = ["arithmetic", "arithmetic_format", "gsm8k", "format", "boxed_format"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completions, st.integers(min_value=0, max_value=99_999))
def test_arithmetic_reward_is_a_bounded_zero_or_one(texts, gold):
    answers = [f"{gold:04d}"] * len(texts)
    for reward in (arithmetic_accuracy_reward, arithmetic_format_reward):
        values = reward(None, texts, answer=answers)
        assert all(v in (0.0, 1.0) for v in values)
        assert len(values) == len(texts)
    for text in texts:
        stated = extract_answer(text)
        assert stated is None or isinstance(stated, int)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completions, st.booleans())
def test_reward_runner_scores_degenerate_completions(texts, conversational):
    """Every registry reward (math-verify's below) through RewardRunner: a number or NaN per
    completion, no exception; also with chat-message completions."""
    runner = RewardRunner(REGISTRY)
    rows = [{"prompt": "12*34=" if not conversational else [{"role": "user", "content": "12*34="}],
             "answer": "0408"}]
    out = runner(rows, texts, None, len(texts), conversational=conversational)
    assert out.shape == (len(texts), len(REGISTRY))
    finite = out[~torch.isnan(out)]
    assert ((finite == 0) | (finite == 1)).all()


def test_extractors_read_the_largest_inputs_in_one_pass(monkeypatch):
    """A megabyte of nesting or digits: the right answer, no recursion error, and the boxed
    parser visits each brace token once (a rescan per opening brace would be quadratic)."""
    from cppo.rewards import answers
    real, visits = answers._BOXED_TOKEN, []

    class CountingTokens:
        def finditer(self, text):
            for match in real.finditer(text):
                visits.append(match.start())
                yield match
    monkeypatch.setattr(answers, "_BOXED_TOKEN", CountingTokens())
    n = 200_000
    cases = [("\\boxed{" + "{" * n + "1" + "}" * n + "}", "{" * n + "1" + "}" * n, 1, 2 * n + 2),
             ("9" * 1_000_000, None, None, 0),              # too long to be a number
             ("\\boxed{" * n, None, None, n),              # never closed
             ("<answer>" * 100_000 + "1" + "</answer>", None, 1, 0)]
    for text, boxed, number, tokens in cases:
        visits.clear()
        assert extract_last_boxed(text) == boxed
        assert len(visits) == tokens and len(set(visits)) == tokens
        assert extract_numeric_answer(text) == number


def test_math_verify_reward_through_the_runner_is_bounded():
    """math-verify in its worker processes: every degenerate completion gets 0/1/None (a pair
    that outlives timeout_s is killed and scores 0: the work per pair is bounded)."""
    reward = make_math_accuracy_reward(num_workers=2, timeout_s=3.0)
    texts = ["", "9" * 5000, "<eos><pad><pad>", "\\boxed{" + "\\frac{" * 400 + "1" + "}{2}" * 400 + "}",
             "\\boxed{9^{9^{9^{9^{9}}}}}", "\\boxed{" * 300 + "1", "\\sqrt{" * 200 + "2",
             "\\boxed{\\frac{1}{0}}"]
    try:
        runner = RewardRunner([reward])
        out = runner([{"prompt": "p", "answer": "2"}], texts, None, len(texts))
    finally:
        reward.verifier.close()
    values = out[:, 0]
    assert ((values == 0) | (values == 1) | torch.isnan(values)).all()


# --- a training step on degenerate completions ---------------------------------------------------

def by_index(prompts, completions, completion_ids=None, **kw):
    """Varied rewards whatever the text says, so the update (not only the skip path) runs."""
    return [float(i % 2) for i in range(len(completions))]


def force_tokens(model, token_ids):
    """Make the model put all its probability on `token_ids` (generation and scoring alike)."""
    bias = torch.zeros(model.config.vocab_size)
    bias[token_ids] = 20.0    # other tokens: p < 1e-7 (a larger bias underflows the gradient to 0)
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)


@pytest.mark.parametrize("case, mask_truncated", [
    ("eos_only", False),          # every completion is EOS at once: empty text
    ("never_stops", False),       # digits until max_completion_length: all truncated
    ("never_stops", True),        # ... and masked out of the loss: zero tokens to learn from
    ("special_only", False),      # <pad>/<bos>/<unk> only: empty text, no EOS
])
def test_training_goes_on_with_degenerate_completions(tiny_model_dir, tmp_path, case, mask_truncated):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2, save_steps=0,
                           reward=[by_index, "arithmetic", "arithmetic_format"],
                           mask_truncated_completions=mask_truncated,
                           generation_dtype=None)   # the head's hook below steers the policy's sampling
    tok = trainer.tokenizer
    ids = {"eos_only": [tok.eos_token_id], "never_stops": [tok.convert_tokens_to_ids("9")],
           "special_only": [tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]}[case]
    force_tokens(trainer.policy, ids)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["nonfinite_steps"] == 0 and summary["skipped_steps"] == 0
    params = list(trainer.policy.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    if mask_truncated:      # masked-out completions teach nothing, and break nothing
        assert all(r["loss"] == 0 and r["grad_norm"] == 0 for r in steps)
        assert all(torch.equal(a, b) for a, b in zip(before, params))
    elif case == "special_only":   # completions differ within a group: a real gradient, applied
        assert all(r["grad_norm"] > 0 for r in steps)
        assert any(not torch.equal(a, b) for a, b in zip(before, params))
    else:   # identical completions in a group: their advantages cancel, the gradient is ~0
        assert all(math.isfinite(r["grad_norm"]) for r in steps)
    clipped = {"eos_only": 0.0, "never_stops": 1.0, "special_only": 1.0}[case]
    assert all(r["completions/clipped_ratio"] == clipped for r in steps)
    if case == "eos_only":
        assert all(r["completions/max_length"] == 1 for r in steps)
