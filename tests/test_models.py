"""The shipped tiny model: loads offline, is small, has the advertised partial skill."""

import json

import pytest

from cppo.cli import main
from cppo.data import arithmetic
from cppo.rewards import arithmetic as arithmetic_rewards
from cppo.evaluate import evaluate
from cppo.models import EMBEDDED_DIR, load_model, load_tokenizer


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_shipped_model_loads_offline_and_is_small():
    model = load_model("embedded")
    tok = load_tokenizer("embedded")
    assert sum(p.numel() for p in model.parameters()) <= 10_000_000
    assert (EMBEDDED_DIR / "model.safetensors").stat().st_size <= 20 * 2**20
    assert not list(EMBEDDED_DIR.glob("*.bin"))  # safetensors only
    assert tok("37*42=")["input_ids"][0] == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    card = (EMBEDDED_DIR / "README.md").read_text()
    assert "cppo pretrain" in card and "pass@16" in card


def test_shipped_model_has_partial_skill():
    model, tok = load_model("embedded"), load_tokenizer("embedded")
    rows = [p.to_row() for p in arithmetic.generate(3, "test", seed=0)]
    result = evaluate(model, tok, rows, arithmetic_rewards.arithmetic_accuracy_reward, k=8,
                      max_new_tokens=5, progress=False)
    report = json.loads((EMBEDDED_DIR / "pretrain_report.json").read_text())
    assert 0.20 <= result.greedy_accuracy <= 0.60
    assert result.greedy_accuracy == pytest.approx(report["eval"]["greedy_accuracy"], abs=1e-9)
    assert result.pass_at_k > result.greedy_accuracy + 0.15


def test_unknown_model_gives_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="could not load model"):
        load_model(str(tmp_path / "nowhere"))


def test_pretrain_and_eval_commands(tmp_path, capsys):
    out = tmp_path / "base"
    assert main(["pretrain", "--output_dir", str(out), "--steps", "3", "--hidden_size", "32",
                 "--num_layers", "1", "--intermediate_size", "64", "--eval_questions", "20",
                 "--pass_k", "2", "--progress_bar", "false"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    result = tmp_path / "eval.json"
    assert main(["eval", "--model", str(out), "--eval_num_questions", "20", "--k", "2",
                 "--output_json", str(result)]) == 0
    data = json.loads(result.read_text())
    out = capsys.readouterr().out
    # pretrain's own evaluation and `cppo eval` read the same 20 held-out questions greedily
    assert data["num_questions"] == 20 and f"greedy {100 * data['greedy_accuracy']:.1f}%" in out
    assert "greedy accuracy" in out


def test_eval_command_counts_what_greedy_decoding_gets_right(tmp_path):
    """`cppo eval` on the shipped model against an independent count: transformers' own greedy
    generate on the same 20 held-out questions, checked against the gold answers."""
    import torch
    result = tmp_path / "eval.json"
    assert main(["eval", "--model", "embedded", "--eval_num_questions", "20", "--k", "0",
                 "--output_json", str(result)]) == 0
    model, tok = load_model("embedded"), load_tokenizer("embedded")
    rows = [p.to_row() for p in arithmetic.generate(3, "test", seed=0)][:20]
    correct = 0
    for row in rows:
        ids = torch.tensor([tok(row["prompt"])["input_ids"]])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                 do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        correct += tok.decode(new, skip_special_tokens=True).strip() == row["answer"]
    assert 0 < correct < 20   # the shipped model's partial skill: the count can be off either way
    assert json.loads(result.read_text())["greedy_accuracy"] == correct / 20


def test_pretrain_learning_rate_schedules():
    from cppo.errors import ConfigError
    from cppo.pretrain import PretrainConfig, lr_factor
    constant = PretrainConfig(steps=100, warmup_steps=10)
    assert [lr_factor(s, constant) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert all(lr_factor(s, constant) == 1.0 for s in range(10, 100))
    cosine = PretrainConfig(steps=100, warmup_steps=10, lr_schedule="cosine")
    assert [lr_factor(s, cosine) for s in (0, 9)] == [0.1, 1.0]
    after = [lr_factor(s, cosine) for s in range(10, 100)]
    assert after[0] == 1.0 and all(a > b for a, b in zip(after, after[1:]))
    assert lr_factor(55, cosine) == pytest.approx(0.5)      # half-way through the decay
    assert 0 < after[-1] < 0.001
    with pytest.raises(ConfigError, match="lr_schedule"):
        PretrainConfig(lr_schedule="linear")
