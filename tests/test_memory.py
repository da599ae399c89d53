"""Memory budget -> batch sizes: a hand count for Qwen2.5-1.5B's real config, the trainer and
`cppo eval` using the sizes, and clear errors for budgets and batch settings that cannot work."""

import dataclasses
import pytest
import torch

from cppo.errors import ConfigError
from cppo.parallel.memory import (GIB, BatchSizes, ModelShape, budget_bytes, decode_bytes,
                                  plan_batch_sizes, scoring_bytes, training_bytes)
from helpers import make_trainer


def qwen25_15b_config():
    """Qwen2.5-1.5B's published config.json values (no weights are built)."""
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       tie_word_embeddings=True)


QWEN_PARAMS = 1_543_714_304   # embeddings 151936 x 1536 (tied) + 28 layers x 46,797,824 + norm


def test_qwen25_15b_hand_count():
    shape = ModelShape.from_config(qwen25_15b_config())
    assert shape == ModelShape(num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                               hidden_size=1536, intermediate_size=8960, vocab_size=151936)
    # KV cache: 2 (k, v) x 28 layers x 2 kv heads x 128 x 2 bytes = 28,672 B/token in bf16
    assert shape.kv_bytes_per_token(2) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert shape.kv_bytes_per_token(4) == 57_344
    # GSM8K test at once: 1,319 completions x ~1,300 tokens in bf16 = 45.8 GiB
    assert 1319 * 1300 * shape.kv_bytes_per_token(2) / GIB == pytest.approx(45.8, abs=0.05)
    # one layer's saved activations per token: 4h + (q 1536 + k 256 + v 256) + 2h + 4I + h
    assert shape.layer_activation_values() == 4 * 1536 + 2048 + 2 * 1536 + 4 * 8960 + 1536 == 48_640
    # the shipped GSM8K recipe: prompts 512, completions 1024, fp32 sampler, G = 16
    kv = 57_344 * (512 + 1024)                               # 88,080,384
    logits = 3 * 151_936 * 4                                 # 1,823,232
    prefill = (512 * 48_640 * 4 + 12 * 512 ** 2 * 4) // 16   # 7,012,352 per completion
    assert decode_bytes(shape, prompt_length=512, completion_length=1024, dtype_bytes=4,
                        group=16) == kv + logits + prefill == 96_915_968
    # training, bf16 activations, gradient checkpointing: layer inputs (fp32 residual stream),
    # one layer recomputed, 3 copies of the 1,025 completion positions' fp32 logits
    layer = 1536 * 48_640 * 2
    assert training_bytes(shape, prompt_length=512, completion_length=1024, activation_bytes=2,
                          gradient_checkpointing=True) == \
        28 * 1536 * 1536 * 4 + layer + 3 * 1025 * 151_936 * 4 == 2_282_476_032
    assert scoring_bytes(shape, prompt_length=512, completion_length=1024, activation_bytes=2) == \
        layer + 1536 * 1536 * 4 + 2 * 1025 * 151_936 * 4 == 1_404_734_464


def test_gsm8k_recipe_batch_sizes_on_an_80_gib_gpu():
    """fp32 policy with AdamW (16 B/param) + fp32 reference (4 B/param) = 20 B x 1.54e9 params;
    the rest of 90% of 80 GiB is the budget."""
    state = 20 * QWEN_PARAMS
    budget = budget_bytes(None, device_bytes=80 * GIB, state_bytes=state)
    assert budget == int(0.9 * 80 * GIB) - state == 46_435_125_248   # 43.2 GiB
    sizes = plan_batch_sizes(ModelShape.from_config(qwen25_15b_config()), budget_bytes=budget,
                             prompt_length=512, completion_length=1024, num_generations=16,
                             sampling_dtype_bytes=4, activation_bytes=2,
                             gradient_checkpointing=True)
    assert sizes == BatchSizes(generation=464, evaluation=229, scoring=33, training=20)
    assert sizes.generation >= 8 * 16       # the recipe's 8 questions x 16 decode in one chunk
    assert sizes.training >= 16             # its per_device_train_batch_size fits
    assert sizes.evaluation < 1319          # GSM8K test is evaluated in 6 chunks, not at once


def test_a_budget_too_small_for_one_sequence_is_an_error():
    shape = ModelShape.from_config(qwen25_15b_config())
    with pytest.raises(ConfigError, match=r"too small for one training sequence of 512 prompt \+ "
                       r"1024 completion tokens.*'max_completion_length'.*'memory_budget_gib'"):
        plan_batch_sizes(shape, budget_bytes=GIB, prompt_length=512, completion_length=1024,
                         num_generations=16, sampling_dtype_bytes=4, activation_bytes=2,
                         gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="more than 90% of the device.*'memory_budget_gib'"):
        budget_bytes(None, device_bytes=24 * GIB, state_bytes=20 * QWEN_PARAMS)


def tiny_sizes(trainer, budget_gib):
    from cppo.parallel.memory import RunShape, plan_for_run
    args = trainer.args
    run = RunShape(args.max_prompt_length, args.max_completion_length, args.num_generations,
                   generation_dtype=trainer.generation_dtype, bf16=args.bf16,
                   gradient_checkpointing=args.gradient_checkpointing)
    return plan_for_run(trainer.policy, trainer.reference, trainer.device, run,
                        memory_budget_gib=budget_gib)


def test_trainer_uses_the_budget_for_generation_and_evaluation(tiny_model_dir, tmp_path,
                                                              monkeypatch):
    settings = dict(max_prompt_length=8, num_generations=8, pruning_rate=0.875,
                    per_device_train_batch_size=4,      # 4 questions x 8 = 32 completions a step
                    generation_dtype=None)              # a float32 KV cache on every machine
    probe = make_trainer(tiny_model_dir, tmp_path / "probe", **settings)
    one = tiny_sizes(probe, 1.0)
    budget = 4.5 / one.training                         # room for 4 training sequences
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", memory_budget_gib=budget, **settings)
    assert trainer.batch_sizes.training == 4
    assert 8 <= trainer.batch_sizes.generation < 32
    assert trainer.backend.chunk_size == trainer.batch_sizes.generation
    chunks = []
    import cppo.sampling.backends as generation
    sample = generation.sample_completions

    def spy(model, prompts, **kw):
        chunks.append(len(prompts))
        return sample(model, prompts, **kw)
    monkeypatch.setattr(generation, "sample_completions", spy)
    rows, _, _ = trainer.take_questions()
    trainer.generate(rows)
    assert len(chunks) > 1 and sum(chunks) == len(rows) == 4
    assert max(chunks) * 8 <= trainer.batch_sizes.generation
    seen = {}
    import cppo.trainer as trainer_module
    evaluate = trainer_module.evaluate

    def spy_eval(*args, **kw):
        seen.update(kw)
        return evaluate(*args, **kw)
    monkeypatch.setattr(trainer_module, "evaluate", spy_eval)
    trainer.held_out_evaluation(None, 0.0, label="before")
    assert seen["batch_size"] == trainer.batch_sizes.evaluation < 4096


def test_batch_settings_that_contradict_the_budget_fail_before_training(tiny_model_dir, tmp_path):
    probe = make_trainer(tiny_model_dir, tmp_path / "probe")
    one = tiny_sizes(probe, 1.0)
    budget = 6 * (1.0 * GIB / one.training) / GIB        # ~6 training sequences fit
    with pytest.raises(ConfigError, match=r"'per_device_train_batch_size' is 8, but only [56] "
                       r"sequences.*per_device_train_batch_size <= [56].*gradient_accumulation"):
        make_trainer(tiny_model_dir, tmp_path / "run", memory_budget_gib=budget)
    tiny = 0.5 * (1.0 * GIB / one.training) / GIB         # not even one
    with pytest.raises(ConfigError, match="too small for one training sequence"):
        make_trainer(tiny_model_dir, tmp_path / "run", memory_budget_gib=tiny)
    with pytest.raises(ConfigError, match=r"'generation_chunk_size' is 100000, but only \d+ "
                       r"completions fit"):
        make_trainer(tiny_model_dir, tmp_path / "run", memory_budget_gib=1.0, generation_chunk_size=100_000)


def test_generation_batch_size_means_what_trl_means(tiny_model_dir, tmp_path):
    """Without pruning: per_device_train_batch_size x processes x gradient_accumulation_steps."""
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", pruning_rate=0.0, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, generation_batch_size=8)
    assert trainer.plan.questions_per_step * 4 == 8
    with pytest.raises(ConfigError, match=r"'generation_batch_size' is 16, but a generation round "
                       r"of this run makes 8 completions.*set it to 8 or None.*generation_chunk_size"):
        make_trainer(tiny_model_dir, tmp_path / "run", pruning_rate=0.0, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, generation_batch_size=16)
    with pytest.raises(ConfigError, match="not a multiple of num_generations"):
        make_trainer(tiny_model_dir, tmp_path / "run", generation_batch_size=6)


def test_cppo_eval_decodes_in_budgeted_batches(tiny_model_dir, monkeypatch):
    import cppo.evaluate
    from cppo.cli import main
    seen = {}
    evaluate = cppo.evaluate.evaluate

    def spy(*args, **kw):
        seen.update(kw)
        return evaluate(*args, **kw)
    monkeypatch.setattr(cppo.evaluate, "evaluate", spy)
    from cppo.parallel.memory import eval_batch_size
    from cppo.models import load_model, load_tokenizer
    rows = [{"prompt": "12*34="}]
    from cppo.sampling.sampler import prompts_length
    per_4 = eval_batch_size(load_model(tiny_model_dir), prompts_length(load_tokenizer(tiny_model_dir), rows),
                            max_new_tokens=8, k=4, memory_budget_gib=1.0)
    budget = 20 * (1.0 / per_4)          # ~20 x 4 completions... scaled below
    assert main(["eval", "--model", tiny_model_dir, "--k", "4", "--eval_num_questions", "12",
                 "--max_completion_length", "8", "--memory_budget_gib", str(budget)]) == 0
    assert seen["batch_size"] % 4 == 0 and 4 <= seen["batch_size"] <= 20


def test_model_states_count_trainable_parameters_four_times_and_shards_locally():
    from cppo.parallel.memory import model_state_bytes
    policy = torch.nn.Linear(10, 10, bias=False)           # 100 fp32 trainable: 4 x 400 B
    reference = torch.nn.Linear(10, 10, bias=False).requires_grad_(False)
    assert model_state_bytes(policy) == 1600
    assert model_state_bytes(policy, reference) == 2000

    class Shard(torch.nn.Parameter):                        # what FSDP's DTensor offers
        def to_local(self):
            return self.data[:5]
    sharded = torch.nn.Module()
    sharded.weight = Shard(torch.zeros(10, 10))
    assert model_state_bytes(sharded) == 4 * 50 * 4


def colocated(tiny_model_dir, **kw):
    """A config with vLLM colocated (set after validation: no engine is started here)."""
    from cppo.config import CPPOConfig
    from cppo.models import load_model
    cfg = CPPOConfig(num_generations=4, max_completion_length=8, max_prompt_length=24,
                     per_device_train_batch_size=16)
    for key, value in dict(use_vllm=True, vllm_mode="colocate", **kw).items():
        setattr(cfg, key, value)
    return cfg, load_model(tiny_model_dir)


def test_a_colocated_vllm_engine_takes_its_share_of_the_budget(tiny_model_dir, monkeypatch):
    """CPU (vLLM's CPU build): its copy of the weights plus its KV cache (cppo's size for it,
    or VLLM_CPU_KVCACHE_SPACE); CUDA: vllm_gpu_memory_utilization of the device unless sleep
    mode releases it; server mode: nothing on this device."""
    import cppo.parallel.memory as memory
    from cppo.assembly.run import backend_settings as settings
    from cppo.config.sections import SamplingSection, VLLMSection
    from cppo.sampling.vllm import cpu_kv_cache_bytes, vllm_engine_bytes, vllm_max_model_len
    cfg, policy = colocated(tiny_model_dir)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    cache = cpu_kv_cache_bytes(settings(cfg), policy.config, torch.float32,
                               vllm_max_model_len(VLLMSection.of(cfg), SamplingSection.of(cfg),
                                                  policy.config),
                               memory.device_memory_bytes("cpu"))
    cpu = torch.device("cpu")
    assert vllm_engine_bytes(settings(cfg), policy, cpu, 64 * GIB) == weights + cache
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert vllm_engine_bytes(settings(cfg), policy, cpu, 64 * GIB) == weights + 2 * GIB
    cuda = torch.device("cuda", 0)
    cfg.vllm_enable_sleep_mode = False
    assert vllm_engine_bytes(settings(cfg), policy, cuda, 80 * GIB) == int(0.3 * 80 * GIB)
    cfg.vllm_enable_sleep_mode = True
    assert vllm_engine_bytes(settings(cfg), policy, cuda, 80 * GIB) == 0
    cfg.vllm_mode = "server"
    assert vllm_engine_bytes(settings(cfg), policy, cpu, 64 * GIB) == 0

    # plan_for_run hands the budget less the engine's share to the batch planner
    seen = []
    monkeypatch.setattr(memory, "plan_batch_sizes", lambda shape, budget_bytes, **kw: seen.append(budget_bytes))
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 8 * GIB)
    cfg.vllm_mode = "colocate"
    share = vllm_engine_bytes(settings(cfg), policy, cpu, 8 * GIB)
    run = memory.RunShape(prompt_length=8, max_completion_length=4, num_generations=4)
    memory.plan_for_run(policy, None, cpu, run, memory_budget_gib=None, engine_bytes=share)
    memory.plan_for_run(policy, None, cpu, run, memory_budget_gib=None)
    assert seen[1] - seen[0] == share == weights + 2 * GIB
    # and less the training passes' bfloat16 copy of the decoder's Linear weights (matmul_dtype)
    memory.plan_for_run(policy, None, cpu, dataclasses.replace(run, matmul_dtype="bfloat16"),
                        memory_budget_gib=None)
    linear = sum(p.numel() for name, p in policy.model.layers.named_parameters()
                 if "proj" in name and name.endswith("weight"))
    assert seen[1] - seen[2] == 2 * linear


def test_an_engine_share_that_leaves_nothing_is_an_error_naming_the_field():
    with pytest.raises(ConfigError, match="colocated vLLM engine 60.0 GiB .*vllm_gpu_memory_utilization"):
        budget_bytes(None, device_bytes=80 * GIB, state_bytes=20 * GIB, engine_bytes=60 * GIB)
    assert budget_bytes(None, device_bytes=80 * GIB, state_bytes=20 * GIB,
                        engine_bytes=24 * GIB) == int(0.9 * 80 * GIB) - 44 * GIB
