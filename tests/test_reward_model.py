"""Reward models as reward functions (TRL's sequence-classification scoring), on a tiny random
model built and saved here."""

import pytest
import torch

from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.models import load_model, load_tokenizer
from cppo.rewards import resolve_reward
from cppo.rewards.reward_model import RewardModel
from cppo.errors import RewardModelError
from cppo.rewards.runner import RewardRunner
from cppo.trainer import CPPOTrainer
from helpers import ROWS



def classifier(tokenizer, num_labels=1):
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    return LlamaForSequenceClassification(config).eval()


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("reward_model")
    classifier(tiny_tokenizer).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return str(path)


def direct_scores(model, tokenizer, texts):
    """TRL's scoring, one text at a time (no padding): logits[0, 0] of prompt + completion."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out.append(float(model(**ids).logits[0, 0]))
    return out


def test_a_folder_scores_prompt_plus_completion(reward_model_dir, tiny_tokenizer):
    fn = resolve_reward(reward_model_dir)
    assert isinstance(fn, RewardModel)
    prompts, completions = ["12*34=", "12*34=", "07*05="], ["0408", "4", "0035"]
    scores = fn(prompts=prompts, completions=completions, completion_ids=None, answer=["x"] * 3)
    model = load_model(reward_model_dir) if False else fn.model
    expected = direct_scores(model, tiny_tokenizer, [p + c for p, c in zip(prompts, completions)])
    assert scores == pytest.approx(expected, abs=1e-5)   # right padding does not change a score
    assert len(set(round(s, 6) for s in scores)) == 3


def test_a_model_object_with_its_processing_class(tiny_tokenizer):
    model = classifier(tiny_tokenizer)
    runner = RewardRunner([model], processing_classes=[tiny_tokenizer])
    rows = [{"prompt": "12*34=", "answer": "0408"}]
    out = runner(rows, ["0408", "1"], None, 2)
    assert out.shape == (2, 1)
    expected = direct_scores(model, tiny_tokenizer, ["12*34=0408", "12*34=1"])
    assert out[:, 0].tolist() == pytest.approx(expected, abs=1e-5)


def test_wrong_output_shape_is_a_clear_error(tiny_tokenizer):
    fn = RewardModel(classifier(tiny_tokenizer, num_labels=3), tiny_tokenizer)
    with pytest.raises(RewardModelError, match=r"returned logits of shape \(2, 3\) for 2 texts; "
                                               r"expected \(2, 1\)"):
        fn(prompts=["1", "2"], completions=["a", "b"])


def test_processing_classes_must_match_the_functions(tiny_tokenizer):
    with pytest.raises(ConfigError, match="2 reward_processing_classes for 1 reward functions"):
        RewardRunner(["format"], processing_classes=[tiny_tokenizer, tiny_tokenizer])


def test_not_a_model_folder_is_named(tmp_path):
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="reward_funcs: reward function .*rm.* loadable "
                                          "sequence-classification model"):
        RewardRunner([str(tmp_path / "rm")])


def test_training_with_a_reward_model_folder(tiny_model_dir, reward_model_dir, tmp_path):
    cfg = CPPOConfig(model=tiny_model_dir, output_dir=str(tmp_path / "run"), max_steps=2,
                     per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                     max_completion_length=4, eval_steps=0, save_steps=0, progress_bar=False,
                     eval_num_questions=2, reward_funcs=[reward_model_dir], seed=3)
    trainer = CPPOTrainer(model=load_model(tiny_model_dir),
                          processing_class=load_tokenizer(tiny_model_dir), args=cfg,
                          train_dataset=ROWS, eval_dataset=ROWS[:2])
    name = trainer.rewards.names[0]
    assert name == reward_model_dir.rstrip("/").split("/")[-1]
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["skipped_steps"] == 0
