"""Bad data and config: every row of docs/errors.md, driven here. Each mistake gives `cppo train`
exit code 2 and a one-line message naming the value at fault, before any training step (a case
that reached a step would show up as a traceback or as exit 0/1 here); the same checks guard
CPPOTrainer(train_dataset=...) with ConfigError.
"""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from cppo.cli import main
from cppo.errors import ConfigError
from helpers import ROWS, make_trainer, write_jsonl

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def _jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    """Files the cases point at: data files, model directories, a config file, checkpoints."""
    d = tmp_path_factory.mktemp("errors")
    files = {"model": tiny_model_dir, "good": str(write_jsonl(d / "good.jsonl"))}
    files["empty"] = _jsonl(d / "empty.jsonl", [])
    files["bad_json"] = _jsonl(d / "bad.jsonl", ['{"prompt": "1+1="}', '{"prompt": "2+2=",'])
    files["not_object"] = _jsonl(d / "list.jsonl", ['["1+1="]'])
    files["no_prompt"] = _jsonl(d / "text.jsonl", ['{"text": "1+1="}'])
    files["all_bad"] = _jsonl(d / "blank.jsonl", ['{"prompt": ""}', '{"prompt": "  "}', '{"prompt": 12}'])
    files["no_answer"] = _jsonl(d / "noanswer.jsonl", ['{"prompt": "12*34="}'] * 8)
    files["bad_gold"] = _jsonl(d / "badgold.jsonl", ['{"prompt": "12*34=", "answer": "lots"}'] * 8)
    files["chat"] = _jsonl(d / "chat.jsonl", [json.dumps({"prompt": [{"role": "user", "content": "1+1="}]})] * 8)
    (d / "not_a_dir").write_text("x")
    files["file"] = str(d / "not_a_dir")
    files["missing"] = str(d / "missing")
    (d / "broken.yaml").write_text("learning_rate: [1\n")
    (d / "typo.yaml").write_text("learning_rat: 0.1\n")
    files["broken_yaml"], files["typo_yaml"] = str(d / "broken.yaml"), str(d / "typo.yaml")
    # a model directory with only pickle weights (pytorch_model.bin), and one with no tokenizer
    from transformers import AutoConfig, LlamaForCausalLM
    config = AutoConfig.from_pretrained(tiny_model_dir)
    pickled = d / "pickle_model"
    pickled.mkdir()
    config.save_pretrained(pickled)
    torch.save(LlamaForCausalLM(config).state_dict(), pickled / "pytorch_model.bin")
    files["pickle_model"] = str(pickled)
    no_tok = d / "no_tokenizer"
    LlamaForCausalLM(config).save_pretrained(no_tok)
    files["no_tokenizer"] = str(no_tok)
    # run directories to --resume from: a checkpoint of another architecture, a poisoned one
    for name in ("other_arch", "poisoned"):
        (d / name / "checkpoint-1").mkdir(parents=True)
    bigger = AutoConfig.from_pretrained(tiny_model_dir)
    bigger.hidden_size, bigger.intermediate_size = 64, 96
    LlamaForCausalLM(bigger).save_pretrained(d / "other_arch" / "checkpoint-1")
    (d / "other_arch" / "checkpoint-1" / "COMPLETE").write_text("1")
    LlamaForCausalLM(config).save_pretrained(d / "poisoned" / "checkpoint-1")
    torch.save({"state": {}, "param_groups": [], "payload": Payload()},
               d / "poisoned" / "checkpoint-1" / "optimizer.pt")
    (d / "poisoned" / "checkpoint-1" / "COMPLETE").write_text("1")
    files["other_arch"], files["poisoned"] = str(d / "other_arch"), str(d / "poisoned")
    return files


class Payload:
    """Stands for a malicious pickled object: unpickling it would call os.system."""

    def __reduce__(self):
        import os
        return (os.system, ("echo pwned",))


# (id, extra `cppo train` arguments ({name} = a file of the env fixture), message fragment)
CASES = [
    ("memory_budget_too_small", ["--memory_budget_gib", "0.0001"],
     "the memory budget of 0.00 GiB per device is too small for one training sequence"),
    ("vllm_missing", ["--use_vllm", "true"],
     "'use_vllm' is true but vLLM is not installed: pip install 'cppo[vllm]'"),
    ("generation_chunk_size", ["--generation_chunk_size", "0"],
     "'generation_chunk_size' is 0; must be >= 1 or None"),
    ("speculation_with_vllm", ["--use_vllm", "true", "--num_speculative_tokens", "2"],
     "'num_speculative_tokens' is 2, which applies to the built-in sampler; with use_vllm"),
    ("speculation_without_lean", ["--lean_forward", "false", "--num_speculative_tokens", "2"],
     "'num_speculative_tokens' is 2 but 'lean_forward' is false"),
    ("skip_exploration_floor", ["--skip_zero_variance_prompts", "true", "--skip_exploration_floor", "0"],
     "'skip_exploration_floor' is 0.0; allowed: 0 < skip_exploration_floor <= 1"),
    ("unknown_option", ["--learnign_rate", "1"], "unknown option --learnign_rate; did you mean --learning_rate"),
    ("option_prefix", ["--learning_rat", "1"], "unknown option --learning_rat; did you mean --learning_rate"),
    ("wrong_type", ["--num_generations", "four"], "'num_generations' expects int, got 'four'"),
    ("out_of_range", ["--pruning_rate", "1"], "'pruning_rate' is 1.0: the pruning rate P must lie in [0, 1)"),
    ("not_a_choice", ["--loss_type", "ppo"], "'loss_type' is 'ppo'; allowed: grpo, bnpo, dr_grpo, dapo"),
    ("not_finite", ["--learning_rate", "nan"], "'learning_rate' must be a finite number"),
    ("unknown_loss_type", ["--loss_type", "gspo"], "'loss_type' is 'gspo'; allowed: grpo, bnpo, "
     "dr_grpo, dapo, luspo, cispo, sapo, vespo"),
    ("importance_sampling_level", ["--importance_sampling_level", "tokens"],
     "'importance_sampling_level' is 'tokens'; allowed: token, sequence"),
    ("delta_not_positive", ["--delta", "0"], "'delta' is 0.0; must be > 0 or None"),
    ("top_entropy_quantile", ["--top_entropy_quantile", "1.5"],
     "'top_entropy_quantile' is 1.5; allowed: 0 <= top_entropy_quantile <= 1 (1.0: off)"),
    ("entropy_coef_negative", ["--entropy_coef", "-0.1"],
     "'entropy_coef' is -0.1; must be >= 0 (a bonus for entropy)"),
    ("adaptive_entropy_bounds", ["--use_adaptive_entropy", "true", "--entropy_coef_min", "0.5",
                                 "--entropy_coef_max", "0.1"],
     "'entropy_coef_min' is 0.5 and 'entropy_coef_max' 0.1; need entropy_coef_min <= "
     "entropy_coef_max"),
    ("min_p_range", ["--min_p", "2"], "'min_p' is 2.0; allowed: 0 <= min_p <= 1, or None (None: off)"),
    ("repetition_penalty", ["--repetition_penalty", "0"],
     "'repetition_penalty' is 0.0; must be > 0 (1.0: off)"),
    ("sapo_temperature", ["--loss_type", "sapo", "--sapo_temperature_neg", "0"],
     "'sapo_temperature_neg' is 0.0; must be > 0"),
    ("sync_ref_model_without_beta", ["--sync_ref_model", "true", "--beta", "0"],
     "'sync_ref_model' is true but 'beta' is 0, so there is no reference model to sync"),
    ("sync_ref_model_with_lora", ["--sync_ref_model", "true", "--beta", "0.04", "--use_peft", "true"],
     "'sync_ref_model' is true with use_peft"),
    ("4bit_and_8bit", ["--use_peft", "true", "--load_in_4bit", "true", "--load_in_8bit", "true"],
     "'load_in_4bit' and 'load_in_8bit' are both true; set one of them"),
    ("quantised_without_lora", ["--load_in_4bit", "true"],
     "'load_in_4bit' is true but no LoRA adapters train on the quantised base"),
    ("qlora_without_bitsandbytes", ["--use_peft", "true", "--load_in_4bit", "true"],
     "'load_in_4bit' is true, which needs bitsandbytes: pip install 'cppo[qlora]'"),
    ("dora_refused_by_peft", ["--use_peft", "true", "--use_dora", "true", "--lora_dropout", "0",
                              "--lora_target_parameters", "mlp.up_proj.weight"],
     "peft refuses the LoRA settings (use_dora True"),
    ("cast_head_with_lora_on_it", ["--use_peft", "true", "--cast_lm_head_to_fp32", "true",
                                   "--lora_target_modules", "q_proj", "lm_head"],
     "'cast_lm_head_to_fp32' is true but lora_target_modules puts a LoRA adapter on lm_head"),
    ("batch_not_divisible", ["--pruning_rate", "0", "--per_device_train_batch_size", "6"],
     "x 1 = 6 completions, num_generations = 4, pruning_rate = 0.0"),
    ("weights_count", ["--reward_weights", "1,2"], "'reward_weights' has 2 values but 'reward_funcs' has 1"),
    ("generation_batch_size", ["--generation_batch_size", "0"], "'generation_batch_size' is 0; must be >= 1"),
    ("seed_range", ["--seed", str(2**64)], "'seed' is 18446744073709551616; allowed: 0 <= seed < 4294967296 (a 32-bit seed)"),
    ("output_dir_is_file", ["--output_dir", "{file}"], "which is a file; give a directory"),
    ("output_dir_below_a_file", ["--output_dir", "{file}/run"],
     "'output_dir' is '{file}/run': cannot create or write this directory ({file} is a file, "
     "not a directory)"),
    ("output_dir_not_creatable", ["--output_dir", "/proc/cppo-run"],
     "'output_dir' is '/proc/cppo-run': cannot create or write this directory"),
    ("config_missing", ["--config", "{missing}"], "does not exist"),
    ("config_is_a_directory", ["--config", "{model}"], "is a directory; give a YAML file"),
    ("config_not_yaml", ["--config", "{broken_yaml}"], "is not valid YAML"),
    ("config_unknown_key", ["--config", "{typo_yaml}"], "unknown key 'learning_rat'; did you mean 'learning_rate'"),
    ("model_missing", ["--model", "{missing}"], "could not load model '{missing}': no such directory"),
    ("model_pickle_only", ["--model", "{pickle_model}"],
     "holds only PyTorch pickle weights (pytorch_model.bin)"),
    ("model_no_tokenizer", ["--model", "{no_tokenizer}"], "could not load the tokenizer of model"),
    ("attn_implementation", ["--attn_implementation", "bogus"], "could not load model"),
    ("data_missing", ["--dataset_name", "{missing}.jsonl"], "dataset file or directory not found"),
    ("data_empty", ["--dataset_name", "{empty}"], "file is empty (no rows)"),
    ("data_bad_json", ["--dataset_name", "{bad_json}"], "bad.jsonl:2: invalid JSON"),
    ("data_not_object", ["--dataset_name", "{not_object}"], "list.jsonl:1: expected a JSON object, got list"),
    ("data_no_prompt", ["--dataset_name", "{no_prompt}"], "cannot tell the data format from columns ['text']"),
    ("data_all_rows_bad", ["--dataset_name", "{all_bad}"], "all 3 rows are unusable, e.g. row 0: 'prompt' must be"),
    ("chat_without_template", ["--dataset_name", "{chat}"], "the tokenizer has no chat_template"),
    ("too_many_questions", ["--dataset_name", "embedded", "--task_level", "1",
                            "--num_train_questions", "100000"], "'num_train_questions' is 100000"),
    ("reward_unknown", ["--reward_funcs", "acuracy"], "unknown reward function 'acuracy'"),
    ("reward_not_importable", ["--reward_funcs", "no_such_module:f"], "cannot import module 'no_such_module'"),
    ("reward_missing_column", ["--dataset_name", "{no_answer}", "--reward_funcs", "arithmetic"],
     "needs the dataset column 'answer'"),
    ("reward_bad_gold", ["--dataset_name", "{bad_gold}", "--reward_funcs", "arithmetic"],
     "on row 0 ({{'prompt': '12*34=', 'answer': 'lots'}}): reward function 'arithmetic' raised ValueError"),
    ("reward_raises", ["--reward_funcs", "helpers:raising_reward"], "raised ZeroDivisionError"),
    ("reward_not_finite", ["--reward_funcs", "helpers:nan_reward"], "rewards must be finite"),
    ("resume_other_model", ["--output_dir", "{other_arch}", "--resume", "true"], "does not match the model"),
    ("resume_pickled_object", ["--output_dir", "{poisoned}", "--resume", "true"],
     "refusing to load {poisoned}/checkpoint-1/optimizer.pt: it holds pickled objects"),
]


# start-up failures: what the machine lacks (paths, extras) is found before any model loads
BEFORE_LOADING = {"output_dir_is_file", "output_dir_below_a_file", "output_dir_not_creatable",
                  "config_missing", "config_is_a_directory", "config_not_yaml",
                  "config_unknown_key", "model_missing", "model_pickle_only", "data_missing",
                  "vllm_missing"}


NEEDS_PEFT = {"qlora_without_bitsandbytes", "dora_refused_by_peft"}   # what peft itself says


def base_args(env, tmp_path) -> list[str]:
    return ["train", "--model", env["model"], "--dataset_name", env["good"],
            "--reward_funcs", "helpers:odd_length_reward", "--output_dir", str(tmp_path / "run"),
            "--max_steps", "1", "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--pruning_rate", "0.5", "--max_completion_length", "3", "--eval_steps", "0",
            "--progress_bar", "false"]


@pytest.mark.parametrize("extra, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cli_error(env, tmp_path, capsys, monkeypatch, extra, message, request):
    started = []
    import cppo.trainer
    monkeypatch.setattr(cppo.trainer.CPPOTrainer, "training_round",
                        lambda self: started.append(1) or pytest.fail("a training step started"))
    monkeypatch.setitem(sys.modules, "vllm", None)   # as where vLLM is not installed
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)   # ... and bitsandbytes
    loaded = []   # start-up failures (paths, extras) are found before any model loads
    import cppo.assembly.models
    original_load = cppo.assembly.models.load_policy
    monkeypatch.setattr(cppo.assembly.models, "load_policy",
                        lambda *a, **k: loaded.append(1) or original_load(*a, **k))
    if request.node.callspec.id in NEEDS_PEFT:
        pytest.importorskip("peft")   # the plain install stops earlier, naming the extra
    args = base_args(env, tmp_path) + [a.format(**env) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cppo train: error: " in err and message.format(**env) in err, err
    assert not started
    assert "Traceback" not in err
    if request.node.callspec.id in BEFORE_LOADING:
        assert not loaded, "a start-up failure was found only after the model loaded"


def test_poisoned_checkpoint_never_runs_its_payload(env, tmp_path, capfd):
    """The refused optimizer.pt above really holds an os.system payload: it was not executed."""
    assert main(base_args(env, tmp_path) + ["--output_dir", env["poisoned"], "--resume", "true"]) == 2
    assert "pwned" not in capfd.readouterr().out


# --- the same checks through CPPOTrainer(train_dataset=...) ----------------------------------

TRAINER_CASES = [
    ("no_rows", [], "train_dataset: no rows"),
    ("missing_prompt", [{"prompt": "1*2="}, {"question": "x"}], "row 1 has no 'prompt' column"),
    ("empty_prompt", [{"prompt": "1*2="}, {"prompt": ""}], "row 1 has an empty 'prompt'"),
    ("prompt_not_text", [{"prompt": 12}], "row 0: 'prompt' must be text or a list of"),
    ("uneven_columns", [{"prompt": "1*2=", "answer": "2"}, {"prompt": "1*3="}],
     "row 1 has columns ['prompt'] but row 0 has ['answer', 'prompt']"),
    ("mixed_prompt_kinds", [{"prompt": "1*2="}, {"prompt": [{"role": "user", "content": "1*3="}]}],
     "row 1 has a chat prompt but earlier rows have text prompts"),
]


@pytest.mark.parametrize("rows, message", [c[1:] for c in TRAINER_CASES], ids=[c[0] for c in TRAINER_CASES])
def test_trainer_dataset_error(tiny_model_dir, tmp_path, rows, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_trainer(tiny_model_dir, tmp_path / "run", rows=rows)


def test_bad_gold_in_a_later_row_is_found_before_training(tiny_model_dir, tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[30]["answer"] = "lots"
    with pytest.raises(ConfigError, match="on row 30"):
        make_trainer(tiny_model_dir, tmp_path / "run", reward="arithmetic", rows=rows)


def test_docs_table_lists_every_case():
    """docs/errors.md has one row per case here, each naming its test."""
    text = DOC.read_text()
    documented = set(re.findall(r"test_(?:cli_error|trainer_dataset_error)\[([\w]+)\]", text))
    assert documented == {c[0] for c in CASES} | {c[0] for c in TRAINER_CASES}
