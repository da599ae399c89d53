"""Held-out evaluation on user data: the reward passed in, eval_num_questions, chat rewards."""

from cppo.evaluate import evaluate
from cppo.models import load_model, load_tokenizer
from helpers import ROWS, make_trainer


def test_trainer_evaluates_with_the_reward_passed_in(tiny_model_dir, tmp_path):
    """User data, user reward: the held-out accuracy comes from that reward (here: always
    correct), not from the config's default reward_funcs[0] ('arithmetic')."""
    seen = []

    def always_right(prompts, completions, completion_ids, **kw):
        seen.append(len(completions))
        return [1.0] * len(completions)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", reward=always_right, eval_num_questions=3)
    assert trainer.args.reward_funcs == ["arithmetic"]
    seen.clear()
    trainer.held_out_evaluation(None, 0.0, label="before")
    assert seen == [3]
    assert trainer.run_state.history[-1]["accuracy"] == 1.0


def test_eval_num_questions_applies_to_a_user_eval_dataset(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", eval_num_questions=3)
    assert len(trainer.task.eval_rows) == 3
    assert trainer.task.eval_rows == [dict(r) for r in ROWS[:3]]


def test_evaluation_hands_chat_rewards_message_lists_and_unpadded_ids(tiny_model_dir):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in ROWS[:4]]
    calls = []

    def chat_reward(prompts, completions, completion_ids, answer, **kw):
        calls.append((completions, completion_ids))
        return [1.0 if isinstance(c, list) and c[0]["role"] == "assistant" else 0.0
                for c in completions]
    result = evaluate(model, tok, rows, chat_reward, k=2, max_new_tokens=6, progress=False)
    assert result.greedy_accuracy == 1.0 and result.pass_at_k == 1.0
    completions, ids = calls[0]
    assert all(isinstance(c[0]["content"], str) for c in completions)
    assert all(isinstance(i, list) and 1 <= len(i) <= 6 for i in ids)
