"""Reward functions (cppo.rewards.math_rewards) and the reward registry (cppo.rewards)."""

import multiprocessing
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cppo.rewards import REWARD_FUNCTIONS, get_reward_function
from cppo.rewards.math_rewards import (
    MathVerifier,
    boxed_format_reward,
    format_reward,
    gsm8k_accuracy_reward,
    make_math_accuracy_reward,
    math_accuracy_reward,
    math_answer_text,
    math_gold,
)

PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"  # sympy would try to evaluate this for hours


def chat(text):
    return [{"role": "assistant", "content": text}]


# --- gsm8k_accuracy_reward ------------------------------------------------------------------------

def test_gsm8k_reward_strings_and_messages():
    completions = [
        "<think>3 boxes of 4</think><answer>12</answer>",
        "The answer is 1,234.",
        chat("so \\boxed{12}"),
        chat("<answer>13</answer>"),
        "no number at all",
        "12.00",
    ]
    golds = ["3*4=12\n#### 12", "#### 1,234", "12", "#### 12", "#### 12", "12"]
    assert gsm8k_accuracy_reward(None, completions, answer=golds) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_gsm8k_reward_none_for_bad_gold():
    out = gsm8k_accuracy_reward(None, ["12", "12", "12", "12"], answer=["#### twelve", None, "", 12])
    assert out == [None, None, None, 1.0]  # an int gold (typed column) is fine


def test_rewards_name_missing_column():
    with pytest.raises(ValueError, match=r"'answer'.*\['solution'\]"):
        gsm8k_accuracy_reward(None, ["1"], solution=["x"])
    with pytest.raises(ValueError, match="'answer' or 'solution'"):
        math_accuracy_reward(None, ["1"], question=["q"])
    with pytest.raises(ValueError, match="2 values for 1 completions"):
        gsm8k_accuracy_reward(None, ["1"], answer=["1", "2"])


# --- format rewards -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, reward", [
    ("<think>reasoning</think><answer>4</answer>", 1.0),
    ("  <think>\na\n</think>\n\n<answer>\n4\n</answer>\n", 1.0),
    ("<think></think><answer></answer>", 1.0),
    ("<think>a</think> extra <answer>4</answer>", 0.0),
    ("<think>a</think><answer>4</answer> trailing", 0.0),
    ("<answer>4</answer><think>a</think>", 0.0),
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0),
    ("<think><think>a</think><answer>4</answer>", 0.0),
    ("4", 0.0),
    ("", 0.0),
])
def test_format_reward(text, reward):
    assert format_reward(None, [text]) == [reward]
    assert format_reward(None, [chat(text)]) == [reward]


def test_boxed_format_reward():
    texts = ["so \\boxed{4}", "\\boxed{}", "\\boxed{4", "no box", chat("\\boxed{\\frac{1}{2}}")]
    assert boxed_format_reward(None, texts) == [1.0, 0.0, 0.0, 0.0, 1.0]


# --- math_accuracy_reward -------------------------------------------------------------------------

def test_math_gold_and_answer_text():
    assert math_gold(answer="work #### 1,000") == "1000"
    assert math_gold(answer="\\frac{1}{2}") == "\\frac{1}{2}"
    assert math_gold(solution="so $x=\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"
    assert math_gold(answer="", solution="\\boxed{3}") == "3"
    assert math_gold(answer=None, solution="no box") is None
    assert math_answer_text("<think>\\boxed{1}</think><answer>\\boxed{2} ok</answer>") == "\\boxed{2}"
    assert math_answer_text("x" * 5000, max_chars=100) == "x" * 100


def test_math_reward_equivalent_forms():
    completions = [
        "<think>half</think><answer>0.5</answer>",
        chat("so the answer is $\\sqrt{8}$"),
        "\\boxed{\\frac{2}{4}}",
        chat("<answer>\\boxed{3}</answer>"),
        "",
    ]
    out = math_accuracy_reward(None, completions, answer=["\\frac{1}{2}", "2\\sqrt{2}", "0.5", "4", "1"])
    assert out == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_reward_uses_solution_boxed_and_gsm8k_answers():
    out = math_accuracy_reward(None, ["\\boxed{2\\sqrt{2}}", "18", "18"],
                               solution=["$\\sqrt{8} = \\boxed{2\\sqrt{2}}$", "no box here", "x"],
                               answer=[None, "She earns 18.\n#### 18", None])
    assert out == [1.0, 1.0, None]


def test_math_reward_from_worker_thread():
    """math-verify's signal.alarm would fail outside the main thread; ours must not."""
    results, errors = [], []

    def run():
        try:
            results.append(math_accuracy_reward(None, ["\\boxed{\\frac{1}{2}}", "1/3"], answer=["0.5", "0.5"]))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not errors and results == [[1.0, 0.0]]


def _reward_in_child(queue):
    out = []
    thread = threading.Thread(target=lambda: out.append(
        math_accuracy_reward(None, ["\\boxed{4}", "\\boxed{5}"], answer=["4", "4"])))
    thread.start()
    thread.join(60)
    queue.put(out)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_math_reward_in_forked_worker_process():
    math_accuracy_reward(None, ["1"], answer=["1"])  # the parent's workers exist before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_reward_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) == [[1.0, 0.0]]
    finally:
        child.join(10)
    assert math_accuracy_reward(None, ["2"], answer=["2"]) == [1.0]  # the parent's pool still works


@pytest.mark.timeout(120)   # a hang fails here; the work per pair is bounded by the verifier
def test_math_reward_pathological_input_is_bounded():
    out = math_accuracy_reward(None, [PATHOLOGICAL, "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}"],
                               answer=["2", "1"])
    assert out == [0.0, 0.0]


@pytest.mark.timeout(120)   # without the hard timeout the check would run for an hour
def test_hard_timeout_kills_a_stuck_worker_and_recovers():
    """With math-verify's own timeouts out of reach, the worker is killed at timeout_s."""
    with MathVerifier(num_workers=1, timeout_s=1.0) as verifier:
        verifier._soft_timeout = 3600  # as if the signal could not stop the computation
        assert verifier.check("\\boxed{2}", PATHOLOGICAL) == 0.0   # killed, not waited for
        assert verifier.check("\\boxed{2}", "\\boxed{2}") == 1.0  # a fresh worker took over


def test_worker_that_cannot_start_raises_a_clear_error(monkeypatch):
    from cppo.rewards import math_rewards

    monkeypatch.setattr(math_rewards, "_WORKER_CMD", "import sys; sys.exit('boom {soft}')")
    with MathVerifier(num_workers=1) as verifier:
        with pytest.raises(RuntimeError, match=r"did not start.*exit code 1.*boom 3"):
            verifier.check("\\boxed{1}", "1")


def test_make_math_accuracy_reward():
    reward = make_math_accuracy_reward(num_workers=1, timeout_s=5, max_chars=50)
    try:
        assert reward.__name__ == "math_accuracy_reward"
        out = reward(None, ["\\boxed{7}", "7" + " " * 100 + "8"], answer=["7", "7"])
        assert out == [1.0, 0.0]
    finally:
        reward.verifier.close()
    with pytest.raises(ValueError, match="num_workers"):
        MathVerifier(num_workers=0)


# --- properties -------------------------------------------------------------------------------------

_special = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "{", "}", "####",
                            "\\frac{", "^", "\\sqrt{", "$", "<|im_end|>", "<|endoftext|>", "9" * 60])
_texty = st.lists(st.one_of(st.text(max_size=15), _special, st.integers().map(str)), max_size=20).map("".join)
_completion = st.one_of(_texty, _texty.map(chat))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_completion, st.one_of(_texty, st.none())), min_size=1, max_size=4))
def test_simple_rewards_never_raise(rows):
    completions = [c for c, _ in rows]
    golds = [g for _, g in rows]
    for reward in (gsm8k_accuracy_reward(None, completions, answer=golds),
                   format_reward(None, completions), boxed_format_reward(None, completions)):
        assert len(reward) == len(rows)
        assert all(r in (0.0, 1.0, None) for r in reward)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_completion, st.one_of(_texty, st.none()), st.one_of(_texty, st.none())),
                min_size=1, max_size=3))
def test_math_reward_never_raises(rows):
    out = math_accuracy_reward(None, [c for c, _, _ in rows], answer=[a for _, a, _ in rows],
                               solution=[s for _, _, s in rows])
    assert len(out) == len(rows) and all(r in (0.0, 1.0, None) for r in out)


def test_math_reward_edge_inputs():
    completions = ["", "<think></think><answer></answer>", "9" * 10_000, "\\boxed{" * 1000, "{" * 5000]
    out = math_accuracy_reward(None, completions, answer=["1"] * 5)
    assert out == [0.0] * 5


# --- registry ---------------------------------------------------------------------------------------

def test_registry_resolves_names_and_paths():
    assert REWARD_FUNCTIONS["arithmetic"] == "cppo.rewards.arithmetic:arithmetic_accuracy_reward"
    assert get_reward_function("gsm8k") is gsm8k_accuracy_reward
    assert get_reward_function("math") is math_accuracy_reward
    assert get_reward_function("format") is format_reward
    assert get_reward_function("boxed_format") is boxed_format_reward
    assert get_reward_function("cppo.rewards.math_rewards:format_reward") is format_reward
    assert get_reward_function(format_reward) is format_reward


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown reward function 'nope'.*'gsm8k'"):
        get_reward_function("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no 'missing'"):
        get_reward_function("cppo.rewards.math_rewards:missing")
    with pytest.raises(TypeError, match="not callable"):
        get_reward_function("cppo.rewards.math_rewards:DEFAULT_TIMEOUT_S")


def test_the_reward_runner_s_close_stops_the_math_verify_workers():
    from cppo.rewards import math_rewards
    from cppo.rewards.runner import RewardRunner
    verifier = math_rewards.default_verifier()
    assert verifier.check("1", "1") == 1.0            # starts a worker process
    workers = [w for w in list(verifier._idle.queue) if w is not None]
    assert workers and all(w.alive() for w in workers)
    RewardRunner(["math"]).close()                    # what CPPOTrainer.close() calls
    assert not any(w.alive() for w in workers)
    assert verifier.check("2", "3") == 0.0            # and it starts again when used
