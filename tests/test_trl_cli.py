"""TRL's command-line habits and config files in `cppo train`: space-separated lists, TRL field
names honoured, mapped or named as ignored (cppo.config.trl_fields)."""

import dataclasses
import json

import pytest

from cppo import cli
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.config.trl_fields import TRL_FIELDS, translate

# every field of trl 1.16's GRPOConfig (TrainingArguments included), ModelConfig, ScriptArguments
# and the `trl grpo` script arguments
TRL_1_16_FIELDS = """
accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_beta1
adam_beta2 adam_epsilon attn_implementation auto_find_batch_size average_tokens_across_devices
batch_eval_metrics beta bf16 bf16_full_eval bnb_4bit_quant_storage bnb_4bit_quant_type
cache_implementation cast_lm_head_to_fp32 chat_template_kwargs data_seed dataloader_drop_last
dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers
dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor dataset_config
dataset_name dataset_streaming dataset_test_split dataset_train_split ddp_backend
ddp_broadcast_buffers ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout
debug deepspeed delta disable_dropout disable_tqdm do_eval do_predict do_train
ds3_gather_for_generation dtype enable_jit_checkpoint entropy_coef entropy_coef_delta
entropy_coef_max entropy_coef_min entropy_target epsilon epsilon_high eval_accumulation_steps
eval_delay eval_do_concat_batches eval_on_start eval_steps eval_strategy eval_use_gather_object
fp16 fp16_full_eval fsdp fsdp_config full_determinism generation_batch_size generation_kwargs
gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs
greater_is_better hub_always_push hub_model_id hub_private_repo hub_revision hub_strategy
hub_token ignore_bias_buffers ignore_data_skip importance_sampling_level include_for_metrics
include_num_input_tokens_seen label_names label_smoothing_factor learning_rate
length_column_name liger_kernel_config load_best_model_at_end load_in_4bit load_in_8bit
local_rank log_completions log_completions_hub_repo log_level log_level_replica log_multimodal
log_on_each_node log_unique_prompts logging_first_step logging_nan_inf_filter logging_steps
logging_strategy lora_alpha lora_dropout lora_modules_to_save lora_r lora_target_modules
lora_target_parameters lora_task_type loss_type lr_scheduler_kwargs lr_scheduler_type
mask_truncated_completions max_completion_length max_grad_norm max_steps
max_tool_calling_iterations metric_for_best_model min_p model_init_kwargs model_name_or_path
model_revision multi_objective_aggregation neftune_noise_alpha num_completions_to_print
num_generations num_generations_eval num_iterations num_train_epochs off_policy_mask_threshold
optim optim_args optim_target_modules output_dir pad_to_multiple_of parallelism_config
per_device_eval_batch_size per_device_train_batch_size prediction_loss_only project push_to_hub
ref_model_mixup_alpha ref_model_sync_steps remove_unused_columns repetition_penalty report_to
restore_callback_states_from_checkpoint resume_from_checkpoint reward_funcs
reward_model_name_or_path reward_weights router_aux_loss_coef run_name sapo_temperature_neg
sapo_temperature_pos save_on_each_node save_only_model save_steps save_strategy save_total_limit
scale_rewards seed shuffle_dataset skip_memory_metrics steps_per_generation sync_ref_model
temperature tf32 top_entropy_quantile top_k top_p torch_compile torch_compile_backend
torch_compile_mode torch_empty_cache_steps trackio_bucket_id trackio_space_id
trackio_static_space_id train_sampling_strategy transformers_continuous_batching_config
trust_remote_code use_adaptive_entropy use_bias_correction_kl use_bnb_nested_quant use_cache
use_cpu use_dora use_liger_kernel use_peft use_rslora use_transformers_continuous_batching
use_transformers_paged use_vllm vespo_k_neg vespo_k_pos vespo_lambda_neg vespo_lambda_pos
vllm_enable_sleep_mode vllm_gpu_memory_utilization vllm_group_port vllm_importance_sampling_cap
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min
vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_max_model_length
vllm_mode vllm_model_impl vllm_server_base_url vllm_server_host vllm_server_port
vllm_server_timeout vllm_structured_outputs_regex vllm_tensor_parallel_size warmup_steps
weight_decay
""".split()


def config_from(argv):
    parser = cli.build_parser()
    args, unknown = parser.parse_known_args(["train", *argv])
    assert not unknown, unknown
    return cli.train_config(args)


def test_lists_take_space_separated_values_as_trl_does():
    cfg = config_from(["--reward_funcs", "gsm8k", "format", "--lora_target_modules", "q_proj",
                       "v_proj", "--reward_weights", "1", "0.5", "--report_to", "none"])
    assert cfg.reward_funcs == ["gsm8k", "format"]
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.reward_weights == [1.0, 0.5]
    assert cfg.report_to == ["none"]


def test_lists_still_take_the_comma_form():
    cfg = config_from(["--reward_funcs", "gsm8k,format", "--lora_target_modules", "q_proj, v_proj"])
    assert cfg.reward_funcs == ["gsm8k", "format"]
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert config_from(["--reward_weights", "none"]).reward_weights is None


def test_every_trl_field_is_honoured_mapped_or_ignored():
    own = {f.name for f in dataclasses.fields(CPPOConfig)}
    missing = [n for n in TRL_1_16_FIELDS if n not in own and n not in TRL_FIELDS]
    assert missing == []


def test_installed_trl_has_no_field_the_table_lacks():
    trl = pytest.importorskip("trl")
    from trl.scripts.grpo import GRPOScriptArguments
    own = {f.name for f in dataclasses.fields(CPPOConfig)}
    classes = (trl.GRPOConfig, trl.ModelConfig, trl.ScriptArguments, GRPOScriptArguments)
    fields = {f.name for c in classes for f in dataclasses.fields(c)}
    assert sorted(fields - own - set(TRL_FIELDS)) == []


TRL_YAML = """
model_name_or_path: {model}
dataset_name: {data}
dataset_train_split: train
output_dir: {out}
learning_rate: 1.0e-3
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: null
dtype: float32
per_device_train_batch_size: 8
gradient_accumulation_steps: 1
num_generations: 4
max_completion_length: 5
max_steps: 2
temperature: 1.0
top_k: null
beta: 0.0
loss_type: dapo
scale_rewards: group
logging_steps: 1
logging_strategy: steps
save_strategy: "no"
eval_strategy: "no"
report_to: none
seed: 3
push_to_hub: true
hub_model_id: me/my-model
gradient_checkpointing: false
use_liger_kernel: true
liger_kernel_config: null
gradient_checkpointing_kwargs: {{use_reentrant: false}}
tf32: null
fp16: false
torch_compile: false
dataloader_num_workers: 4
vllm_importance_sampling_correction: false
reward_funcs: [helpers:odd_length_reward]
disable_tqdm: true
"""


def test_a_trl_grpo_yaml_runs_and_names_what_it_ignores(tiny_model_dir, tmp_path, capsys,
                                                        monkeypatch):
    from helpers import write_jsonl as write_rows
    data = write_rows(tmp_path / "rows.jsonl")
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_YAML.format(model=tiny_model_dir, data=data, out=tmp_path / "run"))
    assert cli.main(["train", "--config", str(path), "--pruning_rate", "0"]) == 0
    err = capsys.readouterr().err
    assert "4 TRL field(s) ignored" in err
    for name in ("push_to_hub", "hub_model_id", "dataloader_num_workers", "bf16"):  # bf16: null
        assert name in err                                         # is on in TRL, off here
    for name in ("push_to_hub", "hub_model_id", "dataloader_num_workers"):
        assert name in err
    for name in ("use_liger_kernel", "logging_strategy", "model_name_or_path"):
        assert name not in err   # TRL's default value, or mapped
    cfg = json.loads(json.dumps(__import__("yaml").safe_load((tmp_path / "run" / "config.yaml")
                                                                 .read_text())))
    assert cfg["model"] == tiny_model_dir and cfg["save_steps"] == 0 and cfg["eval_steps"] == 0
    assert cfg["torch_dtype"] == "float32" and cfg["importance_sampling_correction"] is False
    assert cfg["progress_bar"] is False and cfg["bf16"] is False and cfg["top_k"] == 0
    assert cfg["use_liger_kernel"] is True and cfg["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert (tmp_path / "run" / "checkpoint-2").is_dir()


def test_trl_names_work_on_the_command_line(capsys):
    cfg = config_from(["--model_name_or_path", "embedded", "--save_strategy", "no",
                       "--warmup_steps", "45", "--max_steps", "450", "--push_to_hub"])
    assert cfg.save_steps == 0 and cfg.warmup_ratio == 0.1
    assert "push_to_hub" in capsys.readouterr().err


def test_conversions():
    own = {f.name for f in dataclasses.fields(CPPOConfig)}
    out, dropped = translate({"model_init_kwargs": {"torch_dtype": "bfloat16", "device_map": "auto",
                                                    "attn_implementation": "sdpa"},
                              "optim": "adafactor", "save_strategy": "epoch",
                              "resume_from_checkpoint": True, "fsdp": None,
                              "reward_model_name_or_path": "rm-dir", "reward_funcs": ["format"]},
                             own)
    assert out == {"torch_dtype": "bfloat16", "attn_implementation": "sdpa", "resume": True,
                   "reward_funcs": ["format", "rm-dir"]}
    assert set(dropped) == {"model_init_kwargs", "optim", "save_strategy"}
    assert "device_map" in dropped["model_init_kwargs"] and "AdamW" in dropped["optim"]


def test_an_explicit_cppo_name_wins_over_a_mapped_trl_one():
    own = {f.name for f in dataclasses.fields(CPPOConfig)}
    out, _ = translate({"save_strategy": "no", "save_steps": 10}, own)
    assert out["save_steps"] == 10


def test_a_typo_is_still_an_error():
    with pytest.raises(ConfigError, match="unknown key 'learning_rat'; did you mean 'learning_rate'"):
        CPPOConfig.load(overrides={"learning_rat": 0.1})


def test_the_migration_guide_maps_every_trl_field():
    from pathlib import Path
    guide = (Path(__file__).resolve().parents[1] / "docs" / "migrating-from-trl.md").read_text()
    missing = [n for n in TRL_1_16_FIELDS if f"| `{n}` |" not in guide]
    assert missing == []


def test_report_to_takes_a_string_as_trl_does():
    assert CPPOConfig(report_to="none").report_to == "none"
    with pytest.raises(ConfigError, match="'report_to' has 'comet'"):
        CPPOConfig(report_to="comet")
