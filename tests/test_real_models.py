"""Any transformers causal LM (tiny random Llama and Qwen2 with chat templates), GSM8K/MATH files
end to end through `cppo train`, both prompt styles and accuracy rewards, bad rows, LoRA."""

import json
import sys

import pytest
import torch

from helpers import write_jsonl
from helpers.tiny_hf import gsm8k_rows, math_rows, save_tiny
from cppo.config import CPPOConfig
from cppo.data.sources import load_task
from cppo.models import load_model, load_tokenizer
from cppo.sampling.batches import Completions
from cppo.sampling.sampler import encode_prompts
from cppo.trainer import CPPOTrainer

ARCHS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    dirs = {arch: save_tiny(arch, root / arch) for arch in ARCHS}
    dirs["llama_plain"] = save_tiny("llama", root / "llama_plain", chat_template=False)
    return dirs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    bad_gsm8k = [{"question": "No gold here", "answer": "it is forty"},      # unparsable gold
                 {"question": "", "answer": "#### 3"}]                        # empty question
    gsm8k = root / "gsm8k"
    write_jsonl(gsm8k / "train.jsonl", gsm8k_rows(6) + bad_gsm8k)
    write_jsonl(gsm8k / "test.jsonl", gsm8k_rows(3, start=50))
    bad_math = [{"problem": "Find x.", "solution": "x is two"}]               # no \boxed{}
    math_train = write_jsonl(root / "math" / "math_train.jsonl", math_rows(6) + bad_math)
    write_jsonl(root / "math" / "math_test.jsonl", math_rows(3, start=40))
    lone = write_jsonl(root / "lone.jsonl", gsm8k_rows(4))
    return {"gsm8k": str(gsm8k), "math": str(math_train), "lone": str(lone), "root": root}


def small(**overrides) -> CPPOConfig:
    values = dict(num_generations=4, per_device_train_batch_size=4, pruning_rate=0.5,
                  max_completion_length=6, max_steps=2, eval_steps=0, save_steps=0,
                  eval_num_questions=2, progress_bar=False, learning_rate=1e-3, seed=5,
                  max_prompt_length=None)
    values.update(overrides)
    return CPPOConfig(**values)


# --- models ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_prompts_and_plain_prompts(tiny_dirs, data, arch):
    tok = load_tokenizer(tiny_dirs[arch])
    task = load_task(small(dataset_name=data["gsm8k"], prompt_style="boxed"), tokenizer=tok)
    prompt = task.train_rows[0]["prompt"]
    assert isinstance(prompt, list) and prompt[0]["role"] == "system" and "\\boxed" in prompt[0]["content"]
    text = tok.decode(encode_prompts(tok, [prompt]).ids[0])
    opener = "<|im_start|>system\n" if arch == "qwen2" else "<|begin_of_text|><|start_header_id|>system"
    closer = "<|im_start|>assistant\n" if arch == "qwen2" else "assistant<|end_header_id|>\n\n"
    assert text.startswith(opener) and text.endswith(closer) and text.count(opener) == 1
    # a model without a chat template gets plain-text prompts in the same style
    plain = load_task(small(dataset_name=data["gsm8k"], prompt_style="r1"),
                      tokenizer=load_tokenizer(tiny_dirs["llama_plain"]))
    first = plain.train_rows[0]["prompt"]
    assert isinstance(first, str) and "<think>" in first and first.endswith("Assistant:")


def test_dtype_gradient_checkpointing_and_attention_implementation(tiny_dirs, data, tmp_path):
    cfg = small(model=tiny_dirs["llama"], dataset_name=data["gsm8k"], torch_dtype="bfloat16",
                gradient_checkpointing=True, attn_implementation="eager", bf16=True, prompt_style="none",
                reward_funcs=["helpers:odd_length_reward"], output_dir=str(tmp_path), max_steps=1)
    trainer = CPPOTrainer(args=cfg)
    assert next(trainer.policy.parameters()).dtype == torch.bfloat16
    assert trainer.policy.is_gradient_checkpointing
    assert trainer.policy.config._attn_implementation == "eager"
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = trainer.training_round()
    assert metrics.get("cppo/skipped") != 1 and "loss" in metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


# --- datasets and rewards end to end --------------------------------------------------------------

@pytest.mark.parametrize("arch, dataset, style, accuracy", [
    ("llama", "gsm8k", "r1", "gsm8k"),
    ("qwen2", "math", "boxed", "math"),
])
def test_cppo_train_on_gsm8k_and_math_files(tiny_dirs, data, tmp_path, arch, dataset, style, accuracy):
    from cppo.cli import main
    out = tmp_path / "run"
    code = main(["train", "--model", tiny_dirs[arch], "--dataset_name", data[dataset],
                 "--prompt_style", style, "--reward_funcs", f"{accuracy},helpers:odd_length_reward",
                 "--num_generations", "4", "--per_device_train_batch_size", "4",
                 "--pruning_rate", "0.5", "--max_completion_length", "6", "--max_steps", "2",
                 "--eval_steps", "0", "--eval_num_questions", "2", "--progress_bar", "false",
                 "--learning_rate", "1e-3", "--max_prompt_length", "none", "--output_dir", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["skipped_data_rows"] == (2 if dataset == "gsm8k" else 1)
    before, = [h for h in summary["history"] if h["label"] == "before"]   # held-out split scored
    assert summary["accuracy_before"] == before["accuracy"] and before["step"] == 0
    assert 0 <= before["accuracy"] <= 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "reward" in r)
    assert f"rewards/{accuracy}/mean" in step and "rewards/odd_length_reward/mean" in step
    assert (out / "checkpoint-2" / "model.safetensors").is_file()
    task = load_task(small(dataset_name=data[dataset], prompt_style=style),
                     tokenizer=load_tokenizer(tiny_dirs[arch]))
    assert task.accuracy_reward == accuracy and len(task.eval_rows) == 2


@pytest.mark.parametrize("accuracy, style, gold_key", [("gsm8k", "r1", "answer"), ("math", "boxed", "answer")])
def test_accuracy_rewards_score_through_the_trainer(tiny_dirs, data, tmp_path, accuracy, style, gold_key):
    dataset = data["gsm8k"] if accuracy == "gsm8k" else data["math"]
    cfg = small(model=tiny_dirs["qwen2"], dataset_name=dataset, prompt_style=style,
                reward_funcs=[accuracy], output_dir=str(tmp_path))
    trainer = CPPOTrainer(args=cfg)
    row = trainer.task.train_rows[0]
    gold = row[gold_key]
    right = f"<think>easy</think> <answer>{gold}</answer>" if style == "r1" else f"so \\boxed{{{gold}}}"
    texts = [right, "<answer>12345</answer>", "\\boxed{7/9}", "no idea"]
    tok = trainer.tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    padded = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in ids])
    completions = Completions(padded, (padded != tok.pad_token_id).long(), torch.zeros(4, dtype=torch.bool))
    rewards, _, means, _ = trainer.score([row], completions)
    assert rewards.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert means[f"rewards/{accuracy}/mean"] == 0.25


def test_bad_rows_and_missing_columns(tiny_dirs, data, tmp_path):
    tok = load_tokenizer(tiny_dirs["llama"])
    task = load_task(small(dataset_name=data["gsm8k"]), tokenizer=tok)
    assert [i for i, _ in task.skipped_rows] == [6, 7] and len(task.train_rows) == 6
    assert "unparsable GSM8K answer" in task.skipped_rows[0][1]
    no_answer = write_jsonl(tmp_path / "bad" / "train.jsonl", [{"question": "2+2?"}] * 3)
    with pytest.raises(ValueError, match="gsm8k data needs a column 'answer'"):
        load_task(small(dataset_name=str(no_answer)), tokenizer=tok)
    all_bad = write_jsonl(tmp_path / "allbad.jsonl", [{"question": "q", "answer": "none"}] * 2)
    with pytest.raises(ValueError, match="all 2 rows are unusable"):
        load_task(small(dataset_name=str(all_bad)), tokenizer=tok)
    # a lone file has no held-out split: training only, never evaluating on the training rows
    lone = load_task(small(dataset_name=data["lone"]), tokenizer=tok)
    assert lone.eval_rows == [] and len(lone.train_rows) == 4
    # evaluation only (cppo eval): the held-out split alone
    held_out = load_task(small(dataset_name=data["gsm8k"], eval_num_questions=None), tokenizer=tok,
                         train_split=False)
    assert held_out.train_rows == [] and len(held_out.eval_rows) == 3 and held_out.accuracy_reward == "gsm8k"


# --- LoRA -----------------------------------------------------------------------------------------

def lora_trainer(model_dir, dataset, tmp_path, **overrides):
    pytest.importorskip("peft")
    cfg = small(model=model_dir, dataset_name=dataset, use_peft=True, lora_r=4, lora_alpha=8,
                beta=0.04, num_iterations=2, max_steps=4, learning_rate=1e-2, prompt_style="none",
                eval_num_questions=1,
                reward_funcs=["helpers:odd_length_reward"], output_dir=str(tmp_path / "run"),
                save_steps=2, **overrides)
    return CPPOTrainer(args=cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_reference_is_the_base_and_only_adapters_train(tiny_dirs, data, tmp_path, arch):
    from peft import PeftModel
    trainer = lora_trainer(tiny_dirs[arch], data["gsm8k"], tmp_path, lora_dropout=0.0)
    assert isinstance(trainer.policy, PeftModel) and trainer.reference is None
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    seen = []
    fill = trainer.fill_old_and_ref_logprobs
    trainer.fill_old_and_ref_logprobs = lambda batch: (fill(batch), seen.append(batch))
    trainer.training_round()
    trainer.training_round()   # second round: adapters are non-zero, so policy != reference
    after = dict(trainer.policy.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trainable
    base = load_model(tiny_dirs[arch]).eval()
    batch = seen[-1]
    with torch.no_grad():
        expected = trainer.learner.logprobs(base, batch)
        policy_now = trainer.learner.logprobs(trainer.policy.eval(), batch)
    torch.testing.assert_close(batch.ref_logps, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(policy_now, expected, atol=1e-4)


def test_lora_checkpoints_hold_adapters_and_resume_exactly(tiny_dirs, data, tmp_path):
    straight = lora_trainer(tiny_dirs["qwen2"], data["gsm8k"], tmp_path / "a")
    straight.train()
    interrupted = lora_trainer(tiny_dirs["qwen2"], data["gsm8k"], tmp_path / "b")
    real_round = interrupted.training_round

    def round_then_ctrl_c():
        metrics = real_round()
        interrupted.stop_requested = interrupted.run_state.step == 2
        return metrics
    interrupted.training_round = round_then_ctrl_c
    assert interrupted.train()["status"] == "interrupted"
    checkpoint = tmp_path / "b" / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists()
    resumed = lora_trainer(tiny_dirs["qwen2"], data["gsm8k"], tmp_path / "b", resume=True)
    summary = resumed.train()
    assert summary["resumed_from"].endswith("checkpoint-2") and summary["steps"] == 4
    for (name, a), (_, b) in zip(straight.policy.named_parameters(), resumed.policy.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # the adapters load with plain peft too
    from peft import PeftModel
    reloaded = PeftModel.from_pretrained(load_model(tiny_dirs["qwen2"]), tmp_path / "a" / "run" / "checkpoint-4")
    for (name, a), (_, b) in zip(straight.policy.named_parameters(), reloaded.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_missing_peft_names_the_extra(monkeypatch, tiny_dirs):
    from cppo.config.sections import ModelSection
    from cppo.models.lora import wrap_with_lora
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"pip install 'cppo\[peft\]'"):
        wrap_with_lora(load_model(tiny_dirs["llama"]), ModelSection.of(small(use_peft=True)))


def test_lora_targets_that_match_nothing_fail_clearly(tiny_dirs):
    pytest.importorskip("peft")
    from cppo.config.sections import ModelSection
    from cppo.models.lora import wrap_with_lora
    with pytest.raises(ValueError, match="match no module"):
        wrap_with_lora(load_model(tiny_dirs["llama"]),
                       ModelSection.of(small(use_peft=True, lora_target_modules=["c_attn"])))


# --- generation backends --------------------------------------------------------------------------

def test_vllm_backend_missing_names_the_extra(monkeypatch, tiny_dirs):
    from cppo.assembly.run import backend_settings
    from cppo.sampling.backends import make_backend
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'cppo\[vllm\]'"):
        make_backend(None, load_tokenizer(tiny_dirs["qwen2"]),
                     backend_settings(small(use_vllm=True)))


def test_token_lists_become_completions():
    from cppo.sampling.batches import completions_from_token_lists
    out = completions_from_token_lists([[5, 6, 2, 9], [7, 8, 8], []], eos_token_id=2, pad_token_id=0,
                                       max_new_tokens=3)
    assert out.ids.tolist() == [[5, 6, 2], [7, 8, 8], [0, 0, 0]]
    assert out.mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]
    assert out.truncated.tolist() == [False, True, True]
