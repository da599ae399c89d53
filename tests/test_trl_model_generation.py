"""TRL's loss, generation, optimizer and data fields in cppo (issue 42): router_aux_loss_coef,
steps_per_generation, chat_template_kwargs, vllm_structured_outputs_regex, optim_args,
lr_scheduler_kwargs, adam_epsilon, data_seed, dataset_config and dataset_streaming. Each is a
CPPOConfig field under TRL's name with TRL's default, reaches the code that uses it, and a bad
value is a ConfigError before training naming the field. The math against TRL's own trainer:
tests/test_trl_differential.py (router_aux_loss, steps_per_generation, adam_epsilon); the real
vLLM engine's structured outputs: tests/test_vllm_structured.py."""

import dataclasses
import json

import pytest
import torch

from cppo.config import CPPOConfig
from cppo.config.trl_fields import TRL_FIELDS
from cppo.errors import ConfigError
from helpers import ROWS, make_trainer, write_jsonl

FIELDS = ("router_aux_loss_coef", "steps_per_generation", "chat_template_kwargs",
          "vllm_structured_outputs_regex", "optim_args", "lr_scheduler_kwargs", "adam_epsilon",
          "data_seed", "dataset_config", "dataset_streaming")
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}{% endif %}")


def trl_default(name):
    trl = pytest.importorskip("trl")
    from trl.scripts.grpo import GRPOScriptArguments
    for cls in (trl.GRPOConfig, GRPOScriptArguments):
        found = {f.name: f for f in dataclasses.fields(cls)}
        if name in found:
            return found[name].default
    raise KeyError(name)


@pytest.mark.parametrize("name", FIELDS)
def test_each_field_is_honoured_under_trls_name_with_trls_default(name):
    assert name not in TRL_FIELDS and name in {f.name for f in dataclasses.fields(CPPOConfig)}
    assert getattr(CPPOConfig(), name) == trl_default(name)


def test_the_defaults_equal_a_trl_grpo_config_instance(tmp_path):
    """TRL resolves steps_per_generation None to gradient_accumulation_steps in __post_init__;
    cppo keeps None and means the same."""
    trl = pytest.importorskip("trl")
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                            gradient_accumulation_steps=3)
    ours = CPPOConfig(gradient_accumulation_steps=3, per_device_train_batch_size=8,
                      num_generations=4)
    for name in FIELDS:
        if name not in ("dataset_config", "dataset_streaming", "steps_per_generation"):
            assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.updates_per_generation * 3 == theirs.steps_per_generation == 3


# ---------------------------------------------------------------- steps_per_generation -----
def test_steps_per_generation_sizes_the_round_and_its_optimizer_steps():
    """A round makes per_device_train_batch_size x steps_per_generation completions and trains on
    them in steps_per_generation / gradient_accumulation_steps steps (x num_iterations)."""
    base = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                pruning_rate=0.0)
    cfg = CPPOConfig(**base, steps_per_generation=6, num_iterations=2)
    assert cfg.step_plan().completions_scored == 48 and cfg.step_plan().questions_per_step == 12
    assert cfg.updates_per_generation == 3 and cfg.steps_per_round == 6
    default = CPPOConfig(**base)   # TRL's None: gradient_accumulation_steps, one step a round
    assert default.step_plan().completions_scored == 16 and default.steps_per_round == 1
    pruned = CPPOConfig(**{**base, "pruning_rate": 0.5}, steps_per_generation=4)   # kept ones
    assert pruned.step_plan().completions_kept == 32 and pruned.step_plan().questions_per_step == 16


def test_trls_generation_batch_size_agrees_with_steps_per_generation():
    """TRL: generation_batch_size = per_device_train_batch_size x processes x steps_per_generation."""
    from cppo.config.checks import check_generation_batch_size
    cfg = CPPOConfig(per_device_train_batch_size=8, num_generations=4, pruning_rate=0.0,
                     steps_per_generation=2, generation_batch_size=32)
    round_completions = cfg.step_plan().completions_scored
    check_generation_batch_size(cfg, round_completions * 2)   # 2 processes: 8 x 2 x 2
    with pytest.raises(ConfigError, match="set steps_per_generation"):
        check_generation_batch_size(cfg, round_completions)


@pytest.mark.parametrize("value", [3, 1])
def test_steps_per_generation_that_does_not_fill_whole_steps_is_named_with_the_fix(value):
    with pytest.raises(ConfigError, match=r"'steps_per_generation' is .*multiple of 2"):
        CPPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                   steps_per_generation=value)
    with pytest.raises(ConfigError, match=r"'steps_per_generation' is 0; must be >= 1 or None"):
        CPPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                   steps_per_generation=0)


def test_a_round_splits_into_consecutive_slices_with_their_filler_rows():
    from cppo.run.batch import StepBatch
    k, t = 7, 3
    batch = StepBatch(torch.arange(k)[:, None], torch.ones(k, 1, dtype=torch.long),
                      torch.ones(k, t, dtype=torch.long), torch.ones(k, t, dtype=torch.long),
                      torch.arange(k).double(), filler_rows=2)
    parts = batch.split(2)
    assert [len(p) for p in parts] == [3, 4]
    assert [p.advantages.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [p.filler_rows for p in parts] == [0, 2]
    assert [p.filler_rows for p in batch.split(3)] == [0, 0, 2]   # rows 5, 6 are the last slice


def test_the_trainer_generates_once_per_steps_per_generation(tiny_model_dir, tmp_path):
    """One epoch of 8 questions, 4 a round (per_device_train_batch_size 8 x steps_per_generation 2
    / G 4), gradient_accumulation_steps 1: 2 rounds, each of 2 slices of 8 completions, 4
    optimizer steps."""
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", pruning_rate=0.0, max_steps=-1,
                           num_train_epochs=1, num_train_questions=8, steps_per_generation=2,
                           save_steps=0, logging_steps=3)
    assert trainer.total_steps == 4
    calls, updates = [], []
    generate, update = trainer.generate, trainer.update
    trainer.generate = lambda rows: calls.append(len(rows)) or generate(rows)
    trainer.update = lambda batch, tokens=None: updates.append(len(batch)) or update(batch, tokens)
    trainer.train()
    assert calls == [4, 4] and updates == [8, 8, 8, 8] and trainer.run_state.step == 4
    assert trainer.round_index == 2   # rounds done: what seeds each round's sampling
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "reward" in r] == [4]   # the round that crossed step 3


# ---------------------------------------------------------------- router_aux_loss_coef -----
def test_the_load_balancing_term_is_coef_times_the_mean_over_accumulation():
    from cppo.algorithm.loss import router_aux_coef, router_aux_loss
    aux = [torch.tensor(2.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)]
    assert float(router_aux_loss(aux, 0.5, accumulation_steps=2)) == 0.5 * 3.0 / 2
    assert router_aux_coef(None, True, 0.001) == 0.001      # the model's own
    assert router_aux_coef(0.3, True, 0.001) == 0.3         # the field over it
    assert router_aux_coef(None, True, None) == 0.0
    assert router_aux_coef(None, False, None) == router_aux_coef(0.0, False, None) == 0.0
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        router_aux_coef(0.3, False, None)


def test_router_aux_loss_coef_on_a_dense_model_is_an_error_before_training(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="'router_aux_loss_coef'.*LlamaForCausalLM"):
        make_trainer(tiny_model_dir, tmp_path / "run", router_aux_loss_coef=0.01)
    make_trainer(tiny_model_dir, tmp_path / "run", router_aux_loss_coef=0.0)   # 0: off, as TRL


def test_a_mixture_of_experts_policy_trains_its_router_with_the_load_balancing_loss(
        tiny_moe_dir, tmp_path, monkeypatch):
    """One step of a tiny Qwen3-MoE (float32, transformers' own experts kernel): aux_loss is
    logged, and the routers' gradients change with the coefficient."""
    def router_grads(coef):
        trainer = make_trainer(tiny_moe_dir, tmp_path / f"run{coef}", max_steps=1, save_steps=0,
                               pruning_rate=0.0, router_aux_loss_coef=coef)
        step, grads = trainer.optimizer.step, {}
        trainer.optimizer.step = lambda *a, **k: grads.update(
            {n: p.grad.clone() for n, p in trainer.policy.named_parameters()
             if "mlp.gate." in n and p.grad is not None}) or step(*a, **k)
        metrics = trainer.training_round()
        return metrics, grads
    with_aux, grads = router_grads(1.0)
    without, plain = router_grads(0.0)
    assert with_aux["aux_loss"] > 0 and "aux_loss" not in without
    assert grads.keys() == plain.keys() and grads
    assert max(float((grads[n] - plain[n]).abs().max()) for n in grads) > 1e-4


# ---------------------------------------------------------------- chat_template_kwargs -----
@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory):
    """A tiny random Qwen2 whose chat template has a thinking switch (enable_thinking)."""
    from helpers.tiny_hf import save_tiny
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("thinking")
    save_tiny("qwen2", path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = THINKING
    tok.save_pretrained(path)
    return str(path)


CHAT_ROWS = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)}
             for a in range(8)]


def chat_trainer(model_dir, tmp_path, **overrides):
    from cppo.models import load_model, load_tokenizer
    from cppo.trainer import CPPOTrainer
    from helpers import odd_length_reward
    values = dict(model=model_dir, output_dir=str(tmp_path / "run"), max_steps=1,
                  per_device_train_batch_size=8, num_generations=4, pruning_rate=0.0,
                  max_completion_length=4, eval_steps=0, save_steps=0, progress_bar=False)
    return CPPOTrainer(model=load_model(model_dir), processing_class=load_tokenizer(model_dir),
                       reward_funcs=[odd_length_reward], args=CPPOConfig(**values, **overrides),
                       train_dataset=CHAT_ROWS, eval_dataset=CHAT_ROWS[:2])


def test_chat_template_kwargs_reach_training_and_evaluation_prompts(thinking_model_dir, tmp_path):
    def rendered(trainer):
        ids = trainer.generation.prompts(CHAT_ROWS[:1]).ids[0]
        return trainer.tokenizer.decode(ids, skip_special_tokens=False)
    off = chat_trainer(thinking_model_dir, tmp_path, chat_template_kwargs={"enable_thinking": False})
    plain = chat_trainer(thinking_model_dir, tmp_path)
    assert rendered(off).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in rendered(plain)
    from cppo.sampling.sampler import prompt_text   # held-out evaluation renders with it too
    assert prompt_text(off.tokenizer, CHAT_ROWS[0]["prompt"]).endswith("</think>\n\n")
    # the tokenizer the caller passed is left as it was
    assert "<think>" not in prompt_text(plain.tokenizer, CHAT_ROWS[0]["prompt"])


def test_a_key_the_template_does_not_read_is_an_error_before_training(thinking_model_dir,
                                                                      tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="'chat_template_kwargs' has 'enable_thinkin'.*does not read"):
        chat_trainer(thinking_model_dir, tmp_path, chat_template_kwargs={"enable_thinkin": False})
    with pytest.raises(ConfigError, match="'chat_template_kwargs'.*no chat template"):
        make_trainer(tiny_model_dir, tmp_path / "r", chat_template_kwargs={"enable_thinking": False})


def test_the_fields_take_trls_command_line_forms():
    from cppo import cli
    args = cli.build_parser().parse_args([
        "train", "--chat_template_kwargs", '{"enable_thinking": false}', "--lr_scheduler_type",
        "cosine_with_restarts", "--lr_scheduler_kwargs", '{"num_cycles": 2}', "--optim_args",
        "amsgrad=true,eps=1e-6", "--steps_per_generation", "2", "--data_seed", "9",
        "--dataset_streaming", "--router_aux_loss_coef", "0.01"])
    cfg = cli.train_config(args)
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.lr_scheduler_kwargs == {"num_cycles": 2} and cfg.optim_args == "amsgrad=true,eps=1e-6"
    assert (cfg.steps_per_generation, cfg.data_seed, cfg.dataset_streaming,
            cfg.router_aux_loss_coef) == (2, 9, True, 0.01)
    with pytest.raises(ConfigError, match="'chat_template_kwargs' is '{enable'"):
        CPPOConfig.load(overrides={"chat_template_kwargs": "{enable"})


# ---------------------------------------------------------------- vllm_structured_outputs_regex
def test_structured_outputs_need_vllm_and_a_valid_regex():
    with pytest.raises(ConfigError, match="'vllm_structured_outputs_regex'.*use_vllm: true"):
        CPPOConfig(vllm_structured_outputs_regex="[0-9]+")
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError, match="not a regular expression"):
        CPPOConfig(use_vllm=True, vllm_structured_outputs_regex="[0-9")


def test_the_regex_reaches_vllms_sampling_params_and_the_server_client():
    pytest.importorskip("vllm")
    from cppo.assembly.run import backend_settings
    from cppo.sampling.vllm import VLLMBackend
    from cppo.sampling.settings import SamplingSettings
    import vllm
    backend = VLLMBackend.__new__(VLLMBackend)   # no engine: the parameters only
    backend.settings = backend_settings(CPPOConfig(use_vllm=True,
                                                   vllm_structured_outputs_regex="[0-9]{3}"))
    backend.vllm, backend.eos_ids = vllm, [2]
    backend.sampling = SamplingSettings.of(backend.settings.generation)
    (params,) = backend.sampling_params(4, [5], [0])
    assert params.structured_outputs.regex == "[0-9]{3}"
    backend.settings = backend_settings(CPPOConfig(use_vllm=True))
    assert backend.sampling_params(4, [5], [0])[0].structured_outputs is None
    seen = {}
    backend.settings = backend_settings(CPPOConfig(use_vllm=True,
                                                   vllm_structured_outputs_regex="a+"))
    backend.servers = [(type("Client", (), {"generate": lambda self, **kw: seen.update(kw) or
                                            {"completion_ids": [], "logprobs": []}})(),
                        "http://server:8000")]
    backend._server_sample([[1, 2]], 4, [5])
    assert seen["structured_outputs_regex"] == "a+"


# ---------------------------------------------------------------- optimizer and schedule ---
def test_optim_args_reach_adamw_over_the_fields():
    from cppo.config.sections import OptimizationSection
    from cppo.run.optimizer import make_adamw
    args = CPPOConfig(optim_args="amsgrad=true, eps=1e-6,beta2=0.95,maximize=False")
    opt = make_adamw([torch.nn.Parameter(torch.zeros(2))], OptimizationSection.of(args))
    group = opt.param_groups[0]
    assert group["amsgrad"] is True and group["eps"] == 1e-6 and group["betas"] == (0.9, 0.95)
    assert group["maximize"] is False
    plain = make_adamw([torch.nn.Parameter(torch.zeros(2))],
                       OptimizationSection.of(CPPOConfig())).param_groups[0]
    assert plain["amsgrad"] is False and plain["eps"] == 1e-8 and plain["betas"] == (0.9, 0.99)


def test_adam_epsilon_reaches_adamw():
    from cppo.config.sections import OptimizationSection
    from cppo.run.optimizer import make_adamw
    opt = make_adamw([torch.nn.Parameter(torch.zeros(2))],
                     OptimizationSection.of(CPPOConfig(adam_epsilon=1e-5)))
    assert opt.param_groups[0]["eps"] == 1e-5


@pytest.mark.parametrize("text, message", [
    ("amsgrad", "'amsgrad' is not key=value"),
    ("amsgrad=true,=3", "'=3' is not key=value"),
    ("momentum=0.9", "'momentum', which cppo's AdamW does not take"),
    ("amsgrad=maybe", "amsgrad='maybe' is not a bool"),
    ("eps=small", "eps='small' is not a float"),
])
def test_malformed_optim_args_are_named(text, message):
    with pytest.raises(ConfigError, match=f"'optim_args'.*{message}"):
        CPPOConfig(optim_args=text)


def lr_at_each_step(**fields):
    from cppo.config.sections import OptimizationSection
    from cppo.run.optimizer import make_adamw, make_scheduler
    optimization = OptimizationSection.of(CPPOConfig(learning_rate=1.0, **fields))
    opt = make_adamw([torch.nn.Parameter(torch.zeros(1))], optimization)
    scheduler = make_scheduler(opt, optimization, total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    return lrs + [scheduler.get_last_lr()[0]]


def test_lr_scheduler_kwargs_reach_the_schedule():
    floor = lr_at_each_step(lr_scheduler_type="cosine_with_min_lr",
                            lr_scheduler_kwargs={"min_lr_rate": 0.25})
    assert floor[-1] == pytest.approx(0.25, abs=1e-12) and floor[0] == 1.0
    restarts = lr_at_each_step(lr_scheduler_type="cosine_with_restarts",
                               lr_scheduler_kwargs={"num_cycles": 2})
    assert restarts[5] == pytest.approx(1.0) and restarts[4] < 0.5   # back up at half-way
    squared = lr_at_each_step(lr_scheduler_type="polynomial",
                              lr_scheduler_kwargs={"power": 2.0, "lr_end": 0.0})
    assert squared[5] == pytest.approx(0.25)
    assert lr_at_each_step(lr_scheduler_type="cosine")[-1] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("schedule, kwargs, message", [
    ("cosine", {"min_lr_rate": 0.1}, "'min_lr_rate', which lr_scheduler_type 'cosine' does not take"),
    ("linear", {"power": 2}, "'power', which lr_scheduler_type 'linear' does not take"),
    ("cosine_with_min_lr", {"num_cycles": 0.5}, "refuses it"),   # needs min_lr or min_lr_rate
])
def test_unknown_or_refused_lr_scheduler_kwargs_are_named(schedule, kwargs, message):
    with pytest.raises(ConfigError, match=f"'lr_scheduler_kwargs'.*{message}"):
        CPPOConfig(lr_scheduler_type=schedule, lr_scheduler_kwargs=kwargs)


# ---------------------------------------------------------------- data -----------------------
def test_data_seed_seeds_the_question_order_and_seed_does_otherwise(tiny_model_dir, tmp_path):
    from cppo.data.questions import QuestionStream
    n = len(ROWS)
    by_data_seed = make_trainer(tiny_model_dir, tmp_path / "a", data_seed=7).questions.take(n)
    by_seed = make_trainer(tiny_model_dir, tmp_path / "b").questions.take(n)
    assert by_data_seed == QuestionStream(n, 7).take(n) != by_seed == QuestionStream(n, 3).take(n)


@pytest.fixture(scope="module")
def dataset_repo(tmp_path_factory):
    """A local copy of a dataset repository with two configs (its README declares them)."""
    root = tmp_path_factory.mktemp("repo")
    lines = ["---", "configs:"]
    for name in ("easy", "hard"):
        lines += [f"- config_name: {name}", "  data_files:"]
        for split in ("train", "test"):
            write_jsonl(root / name / f"{split}.jsonl",
                        [{"prompt": f"{name}-{split}-{i}=", "answer": str(i)} for i in range(6)])
            lines += [f"  - split: {split}", f"    path: {name}/{split}.jsonl"]
    (root / "README.md").write_text("\n".join(lines + ["---", ""]))
    return str(root)


@pytest.mark.parametrize("streaming", [False, True])
def test_dataset_config_picks_the_subset_and_streaming_reads_the_stream(dataset_repo, streaming,
                                                                       monkeypatch, tmp_path):
    from cppo.data import loaders
    from cppo.data.sources import TaskSource, run_task
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    load, streamed = loaders.datasets.load_dataset, []
    monkeypatch.setattr(loaders.datasets, "load_dataset",
                        lambda *a, **kw: streamed.append(kw["streaming"]) or load(*a, **kw))
    task = run_task(TaskSource.of(CPPOConfig(dataset_name=dataset_repo, dataset_config="hard",
                                             dataset_streaming=streaming, num_train_questions=4)))
    assert [r["prompt"] for r in task.train_rows] == [f"hard-train-{i}=" for i in range(4)]
    assert task.eval_rows[0]["prompt"] == "hard-test-0="
    assert streamed == [streaming, streaming]   # the train and held-out splits


def test_dataset_config_reaches_load_dataset_for_a_hub_id(monkeypatch):
    from cppo.data import loaders
    seen = {}

    def fake(*args, **kwargs):
        seen.update(args=args, **kwargs)
        raise RuntimeError("offline")
    monkeypatch.setattr(loaders.datasets, "load_dataset", fake)
    with pytest.raises(ValueError, match="config 'socratic'.*streaming"):
        loaders.load_prompt_dataset("gsm8k", dataset_config="socratic", streaming=True)
    assert seen == {"args": ("openai/gsm8k", "socratic"), "split": "train", "streaming": True}


def test_dataset_config_on_a_single_file_is_an_error(tmp_path):
    from cppo.data.loaders import load_prompt_dataset
    with pytest.raises(ValueError, match="single file"):
        load_prompt_dataset(str(write_jsonl(tmp_path / "rows.jsonl")), dataset_config="main")


# ---------------------------------------------------------------- a TRL YAML -----------------
TRL_YAML = """
model_name_or_path: {model}
dataset_name: {data}
dataset_config: hard
dataset_streaming: true
output_dir: {out}
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
steps_per_generation: 2
num_generations: 4
max_completion_length: 4
max_steps: 2
learning_rate: 1.0e-3
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs: {{min_lr_rate: 0.1}}
optim_args: "amsgrad=true"
adam_epsilon: 1.0e-6
router_aux_loss_coef: 0.0
chat_template_kwargs: {{enable_thinking: false}}
data_seed: 5
seed: 3
save_strategy: "no"
eval_strategy: "no"
report_to: none
disable_tqdm: true
reward_funcs: [helpers:odd_length_reward]
"""


def test_a_trl_yaml_with_these_fields_trains_and_ignores_none_of_them(thinking_model_dir,
                                                                      dataset_repo, tmp_path,
                                                                      capsys, monkeypatch):
    from cppo import cli
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_YAML.format(model=thinking_model_dir, data=dataset_repo, out=tmp_path / "run"))
    assert cli.main(["train", "--config", str(path), "--pruning_rate", "0"]) == 0
    err = capsys.readouterr().err
    assert not [name for name in FIELDS if name in err], err
    cfg = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert cfg["status"] == "completed"
    written = __import__("yaml").safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert {k: written[k] for k in ("steps_per_generation", "data_seed", "dataset_config",
                                    "chat_template_kwargs", "optim_args")} == {
        "steps_per_generation": 2, "data_seed": 5, "dataset_config": "hard",
        "chat_template_kwargs": {"enable_thinking": False}, "optim_args": "amsgrad=true"}


ALL_42_FIELDS = """
use_peft: true
load_in_4bit: true
load_in_8bit: false
bnb_4bit_quant_type: nf4
use_bnb_nested_quant: true
bnb_4bit_quant_storage: uint8
use_dora: true
use_rslora: true
lora_modules_to_save: null
lora_target_parameters: null
lora_task_type: CAUSAL_LM
model_revision: main
trust_remote_code: false
disable_dropout: true
cast_lm_head_to_fp32: true
use_liger_kernel: true
liger_kernel_config: null
gradient_checkpointing_kwargs: {{use_reentrant: false}}
torch_compile: false
tf32: null
fp16: false
vllm_structured_outputs_regex: null
"""


def test_one_trl_yaml_with_every_field_of_the_issue_runs_and_ignores_none(thinking_model_dir,
                                                                           dataset_repo, tmp_path,
                                                                           capsys, monkeypatch):
    """The loss, generation, optimizer and data fields above together with the model, adapter,
    quantisation and speed fields TRL users set (QLoRA with DoRA and rsLoRA, dropout off, a
    float32 head, liger's head): a 2-step run names none of them as ignored. (A vLLM regex needs
    the vLLM engine: tests/test_vllm_structured.py; a MoE's aux coefficient a MoE model: above.)"""
    pytest.importorskip("bitsandbytes")
    from cppo import cli
    from cppo.config.trl_fields import TRL_FIELDS
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "grpo.yaml"
    path.write_text((TRL_YAML + ALL_42_FIELDS).format(model=thinking_model_dir, data=dataset_repo,
                                                      out=tmp_path / "run"))
    assert cli.main(["train", "--config", str(path), "--pruning_rate", "0"]) == 0
    err = capsys.readouterr().err
    named = {line.split()[0] for line in err.splitlines()   # the ignored block's "  key  reason"
             if line.startswith("  ") and line.split() and line.split()[0] in TRL_FIELDS}
    assert named == set(), err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
