"""TRL's model, adapter and quantisation fields in cppo (issue 42): each under TRL's name with
TRL's default, each reaching the code that uses it, QLoRA on a tiny model (4-bit base frozen,
adapters trained with gradients through the 4-bit layers, the merged model sampling), a TRL YAML
that sets them running with none named as ignored, and each bad combination a ConfigError
before training. The same fields against TRL's own trainer: tests/test_trl_differential.py."""

import sys

import pytest
import torch
from torch import nn

from cppo import cli
from cppo.config import CPPOConfig
from cppo.config.sections import ModelSection, PrecisionSection
from cppo.errors import ConfigError
from cppo.models import loading
from cppo.models.loading import (dense_weight, load_model, load_policy, load_tokenizer,
                                 quantization_config)

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

MODEL_CONFIG_FIELDS = ("model_revision", "use_dora", "use_rslora", "lora_modules_to_save",
                       "lora_target_parameters", "lora_task_type", "load_in_4bit", "load_in_8bit",
                       "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
GRPO_CONFIG_FIELDS = ("trust_remote_code", "disable_dropout", "cast_lm_head_to_fp32")
FIELDS = MODEL_CONFIG_FIELDS + GRPO_CONFIG_FIELDS
CPU = torch.device("cpu")


def policy_of(model_dir, **fields):
    """load_policy on the tiny model with a CPPOConfig of `fields` (LoRA when use_peft)."""
    args = CPPOConfig(model=model_dir, **fields)
    return load_policy(None, None, ModelSection.of(args), PrecisionSection.of(args), CPU,
                       chat_template_kwargs=args.chat_template_kwargs, lora=args.use_peft)[0]


def trainable(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- names and defaults --------
def test_defaults_are_trls():
    import dataclasses
    cfg = CPPOConfig()
    for cls, names in ((trl.ModelConfig, MODEL_CONFIG_FIELDS), (trl.GRPOConfig, GRPO_CONFIG_FIELDS)):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for name in names:
            assert getattr(cfg, name) == defaults[name], name


def test_each_field_is_honoured_under_its_name():
    from cppo.config.trl_fields import TRL_FIELDS
    values = dict(model_revision="v1", trust_remote_code=True, disable_dropout=True,
                  cast_lm_head_to_fp32=True, use_dora=True, use_rslora=True,
                  lora_modules_to_save=["lm_head"], lora_target_parameters=["mlp.up_proj.weight"],
                  lora_task_type="CAUSAL_LM", load_in_4bit=True, bnb_4bit_quant_type="fp4",
                  use_bnb_nested_quant=True, bnb_4bit_quant_storage="bfloat16")
    assert set(values) | {"load_in_8bit"} == set(FIELDS)
    assert not set(FIELDS) & set(TRL_FIELDS)
    cfg = CPPOConfig.load(overrides={k: str(v) if not isinstance(v, list) else ",".join(v)
                                     for k, v in values.items()})   # as the command line gives them
    assert {k: getattr(cfg, k) for k in values} == values


# ---------------------------------------------------------------- each value reaches its use --
def test_the_lora_config_is_trls(tiny_model_dir):
    """cppo's peft LoraConfig equals trl.get_peft_config's for the same fields."""
    from cppo.models.lora import lora_config
    fields = dict(lora_r=8, lora_alpha=16, lora_dropout=0.1, lora_target_modules=["q_proj", "v_proj"],
                  use_dora=True, use_rslora=True, lora_modules_to_save=["lm_head"],
                  lora_target_parameters=["mlp.up_proj.weight"], lora_task_type="CAUSAL_LM")
    ours = lora_config(ModelSection(use_peft=True, **fields)).to_dict()
    theirs = trl.get_peft_config(trl.ModelConfig(use_peft=True, **fields)).to_dict()
    for key in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_dora", "use_rslora",
                "modules_to_save", "target_parameters", "task_type", "bias"):
        assert ours[key] == theirs[key], key
    other = lora_config(ModelSection(use_peft=True, lora_task_type="SEQ_CLS")).to_dict()
    assert other["task_type"] == "SEQ_CLS"


def test_dora_rslora_and_modules_to_save_shape_the_adapters(tiny_model_dir):
    plain = policy_of(tiny_model_dir, use_peft=True)
    dora = policy_of(tiny_model_dir, use_peft=True, use_dora=True, use_rslora=True,
                     lora_modules_to_save=["lm_head"], lora_alpha=32, lora_r=16)
    assert not any("magnitude" in n for n in trainable(plain))
    assert any("lora_magnitude_vector" in n for n in trainable(dora))
    q_proj = dora.get_base_model().model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(32 / 16 ** 0.5)   # rsLoRA: alpha / sqrt(r)
    assert plain.get_base_model().model.layers[0].self_attn.q_proj.scaling["default"] == 2.0
    assert any("lm_head.modules_to_save" in n for n in trainable(dora))


def test_target_parameters_reach_peft(untied_model_dir):
    policy = policy_of(untied_model_dir, use_peft=True, lora_dropout=0.0,
                       lora_target_parameters=["mlp.up_proj.weight"])
    names = trainable(policy)
    assert any("up_proj" in n and "lora_A" in n for n in names), sorted(names)[:6]


def test_revision_and_remote_code_reach_from_pretrained(tiny_model_dir, monkeypatch):
    """model_revision and trust_remote_code go to the model's and the tokenizer's
    from_pretrained, as TRL passes them."""
    seen = []
    model_load, tok_load = loading.AutoModelForCausalLM.from_pretrained, \
        loading.AutoTokenizer.from_pretrained

    def spy(real, kind):
        def load(path, **kw):
            seen.append((kind, kw.get("revision"), kw.get("trust_remote_code")))
            return real(path, **{k: v for k, v in kw.items() if k != "revision"})
        return load
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", spy(model_load, "model"))
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", spy(tok_load, "tokenizer"))
    policy_of(tiny_model_dir, model_revision="v1.0", trust_remote_code=True)
    assert sorted(seen) == [("model", "v1.0", True), ("tokenizer", "v1.0", True)]


def test_revision_and_remote_code_reach_the_vllm_engine():
    from types import SimpleNamespace
    from cppo.assembly.run import backend_settings
    from cppo.sampling.vllm import VLLMBackend
    settings = backend_settings(CPPOConfig(model_revision="v1.0", trust_remote_code=True))
    backend = SimpleNamespace(settings=settings,
                              model=SimpleNamespace(config=SimpleNamespace(_name_or_path="m")),
                              dtype=torch.float32, max_model_len=64, sleep_mode=False,
                              _platform=lambda: SimpleNamespace(is_cpu=lambda: False))
    kwargs = VLLMBackend.engine_kwargs(backend)
    assert (kwargs["revision"], kwargs["trust_remote_code"]) == ("v1.0", True)


def test_remote_code_reaches_a_reward_model_as_in_trl(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                     monkeypatch):
    """TRL applies trust_remote_code to reward models loaded by name and their tokenizers."""
    import transformers
    from transformers import LlamaForSequenceClassification
    from helpers import ROWS
    from cppo.trainer import CPPOTrainer
    config = load_model(tiny_model_dir).config
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    seen = []
    for cls in (transformers.AutoModelForSequenceClassification, transformers.AutoTokenizer):
        real = cls.from_pretrained
        def load(path, *a, _real=real, _cls=cls.__name__, **kw):
            if str(path) == str(tmp_path / "rm"):
                seen.append((_cls, kw.get("trust_remote_code")))
            return _real(path, *a, **kw)
        monkeypatch.setattr(cls, "from_pretrained", load)
    args = CPPOConfig(model=tiny_model_dir, output_dir=str(tmp_path / "run"), max_steps=1,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=3,
                      trust_remote_code=True, reward_funcs=[str(tmp_path / "rm")])
    CPPOTrainer(model=None, args=args, train_dataset=ROWS)
    assert sorted(seen) == [("AutoModelForSequenceClassification", True), ("AutoTokenizer", True)]


def _dropout_model(model_dir):
    """The tiny model with attention dropout 0.1."""
    model = load_model(model_dir)
    model.config.attention_dropout = 0.1
    return model


def test_disable_dropout_turns_every_dropout_off(tiny_model_dir, tmp_path):
    model = _dropout_model(tiny_model_dir)
    model.save_pretrained(tmp_path / "m")
    load_tokenizer(tiny_model_dir).save_pretrained(tmp_path / "m")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def two_passes_differ(policy):
        torch.manual_seed(0)
        with torch.no_grad():
            return not torch.equal(policy(ids).logits, policy(ids).logits)
    kept = policy_of(str(tmp_path / "m"), use_peft=True, lora_dropout=0.5)
    off = policy_of(str(tmp_path / "m"), use_peft=True, lora_dropout=0.5, disable_dropout=True)
    assert kept.training and off.training
    assert two_passes_differ(kept) and not two_passes_differ(off)
    assert all(m.p == 0 for m in off.modules() if isinstance(m, nn.Dropout))   # LoRA's, as TRL
    assert off.get_base_model().model.layers[0].self_attn.attention_dropout == 0.0


def test_cast_lm_head_to_fp32_computes_the_logits_in_float32(untied_model_dir):
    """A bfloat16 model: the head's weight float32, its logits float32 (under bf16 autocast
    too), equal to hidden.float() @ W.float()^T; the rest stays bfloat16."""
    plain = policy_of(untied_model_dir, torch_dtype="bfloat16")
    cast = policy_of(untied_model_dir, torch_dtype="bfloat16", cast_lm_head_to_fp32=True)
    assert plain.lm_head.weight.dtype == torch.bfloat16
    assert cast.lm_head.weight.dtype == torch.float32
    assert cast.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cast(ids, output_hidden_states=True)
    assert out.logits.dtype == torch.float32
    expected = out.hidden_states[-1].float() @ cast.lm_head.weight.t()
    torch.testing.assert_close(out.logits, expected, rtol=1e-6, atol=1e-6)


def test_cast_lm_head_to_fp32_keeps_a_tied_embedding_in_the_models_dtype(tiny_model_dir):
    cast = policy_of(tiny_model_dir, torch_dtype="bfloat16", cast_lm_head_to_fp32=True)
    assert cast.lm_head.weight is cast.model.embed_tokens.weight   # still tied
    assert cast.lm_head.weight.dtype == torch.float32
    assert cast.model.embed_tokens(torch.tensor([[5, 6]])).dtype == torch.bfloat16
    assert cast(torch.tensor([[5, 6]])).logits.dtype == torch.float32


# ---------------------------------------------------------------- quantisation ---------------
@pytest.mark.parametrize("fields", [
    dict(load_in_4bit=True),
    dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", use_bnb_nested_quant=True,
         bnb_4bit_quant_storage="bfloat16", torch_dtype="bfloat16"),
    dict(load_in_8bit=True),
])
def test_the_quantization_config_is_trls(fields):
    pytest.importorskip("bitsandbytes")
    theirs = dict(fields)
    if "torch_dtype" in theirs:
        theirs["dtype"] = theirs.pop("torch_dtype")
    ours = quantization_config(ModelSection(use_peft=True, **fields)).to_dict()
    assert ours == trl.get_quantization_config(trl.ModelConfig(**theirs)).to_dict()
    assert quantization_config(ModelSection()) is None


def _qlora_trainer(model_dir, tmp_path, **fields):
    from helpers import ROWS, odd_length_reward
    from cppo.trainer import CPPOTrainer
    args = CPPOConfig(model=model_dir, output_dir=str(tmp_path / "run"), max_steps=2,
                      per_device_train_batch_size=8, num_generations=4, pruning_rate=0.5,
                      max_completion_length=5, eval_steps=0, save_steps=0, progress_bar=False,
                      learning_rate=1e-2, seed=3, use_peft=True, lora_dropout=0.0,
                      lora_target_modules=["q_proj", "v_proj", "up_proj"], **fields)
    return CPPOTrainer(model=None, reward_funcs=[odd_length_reward], args=args,
                       train_dataset=ROWS, eval_dataset=ROWS[:4])


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_adapters_on_a_frozen_quantised_base(untied_model_dir, tmp_path, bits):
    """Two steps, each after sampling in eval mode without grad (where bitsandbytes would switch
    a 4-bit layer to its backward-less AVX512-BF16 kernel): the base stays bit-identical, every
    adapter of every layer gets a non-zero gradient in step 2 (B is 0 at step 1), and they move."""
    bnb = pytest.importorskip("bitsandbytes")
    trainer = _qlora_trainer(untied_model_dir, tmp_path, **{f"load_in_{bits}bit": True})
    policy = trainer.policy
    kind = bnb.nn.Linear4bit if bits == 4 else bnb.nn.Linear8bitLt
    assert len([m for m in policy.modules() if isinstance(m, kind)]) == 2 * 7   # lm_head: Linear
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    adapters = trainable(policy)
    assert adapters and all("lora_" in n for n in adapters)
    start = {n: p.detach().clone() for n, p in adapters.items()}
    grads, step = [], trainer.optimizer.step

    def spy(*a, **kw):
        grads.append({n: None if p.grad is None else float(p.grad.abs().max())
                      for n, p in adapters.items()})
        return step(*a, **kw)
    trainer.optimizer.step = spy
    trainer.train()
    assert len(grads) == 2
    assert all(g for g in grads[1].values()), grads[1]         # None or 0: no gradient came
    assert all(torch.equal(p, frozen[n]) for n, p in policy.named_parameters() if n in frozen)
    assert all(not torch.equal(p, start[n]) for n, p in adapters.items())


def test_qlora_gradients_are_the_dequantised_models(untied_model_dir):
    """After an eval-mode pass without grad (sampling), the adapters' gradients through the 4-bit
    base equal those of the same adapters on a float32 copy of the dequantised base: both run
    float32 matmuls on the same weights, so they agree to float32 round-off (1e-5 of the largest
    entry; a missing or wrong backward through a 4-bit layer misses by far more)."""
    pytest.importorskip("bitsandbytes")
    quantised = policy_of(untied_model_dir, use_peft=True, load_in_4bit=True, lora_dropout=0.0)
    dense = policy_of(untied_model_dir, use_peft=True, lora_dropout=0.0)
    source = dict(quantised.named_parameters())
    with torch.no_grad():
        for name, param in source.items():
            if "lora_B" in name:   # B = 0 at init: the gradient would not reach A
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
        for name, param in dense.named_parameters():
            owner = quantised.get_submodule(name.rpartition(".")[0])
            param.copy_(dense_weight(source[name], owner))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        quantised.eval()(ids)
    grads = []
    for model in (quantised, dense):
        model.train()(ids).logits.pow(2).mean().backward()
        grads.append({n: p.grad for n, p in trainable(model).items()})
    scale = max(float(g.abs().max()) for g in grads[1].values())
    assert all(grads[0][n] is not None for n in grads[1])
    assert max(float((grads[0][n] - g).abs().max()) for n, g in grads[1].items()) <= 1e-5 * scale


def test_the_merged_qlora_model_samples(untied_model_dir, tmp_path):
    """vLLM's weights of a QLoRA policy (4-bit base dequantised, adapter delta added) loaded into
    a plain model give the policy's logits (both compute W x from the same dequantised W), and
    that merged model samples."""
    pytest.importorskip("bitsandbytes")
    from cppo.sampling.sampler import encode_prompts, sample_completions
    from cppo.sampling.vllm import server_weight_metadata, vllm_weights
    trainer = _qlora_trainer(untied_model_dir, tmp_path, load_in_4bit=True)
    policy = trainer.policy.eval()
    with torch.no_grad():
        for n, p in trainable(policy).items():
            p.add_(0.05)   # adapters that change the output
    merged = load_model(untied_model_dir)
    with vllm_weights(policy) as weights:
        pushed = dict(weights)
    assert [(n, list(t.shape)) for n, t in pushed.items()] == \
        [(n, shape) for n, _, shape in server_weight_metadata(policy)]
    assert pushed.keys() == dict(merged.named_parameters()).keys()
    merged.load_state_dict(pushed)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        difference = (merged(ids).logits - policy(ids).logits).abs().max()
        shift = (merged(ids).logits - load_model(untied_model_dir)(ids).logits).abs().max()
    assert difference < 1e-4 < shift   # float32 rounding of one matmul order; the 4-bit error
    tok = load_tokenizer(untied_model_dir)
    prompts = encode_prompts(tok, ["12*34=", "5+6="])
    out = sample_completions(merged, prompts, num_generations=2, max_new_tokens=4,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             generator=torch.Generator().manual_seed(0))
    assert out.ids.shape[0] == 4 and out.mask.sum() > 0


def test_an_8bit_weight_dequantises_to_what_the_layer_computes(untied_model_dir):
    bnb = pytest.importorskip("bitsandbytes")
    policy = policy_of(untied_model_dir, use_peft=True, load_in_8bit=True)
    layer = policy.get_base_model().model.layers[0].mlp.up_proj
    assert isinstance(layer, bnb.nn.Linear8bitLt)
    x = torch.randn(3, layer.in_features)
    # bitsandbytes' CPU int8 path also rounds the activations per row: 2 % of this layer's outputs
    with torch.no_grad():   # before and after the first forward moves the scales
        before = x @ dense_weight(layer.weight, layer).t()
        torch.testing.assert_close(layer(x), before, rtol=0.02, atol=0.02)
        torch.testing.assert_close(x @ dense_weight(layer.weight, layer).t(), before)


# ---------------------------------------------------------------- bad input ------------------
def test_qlora_without_bitsandbytes_is_named(untied_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)   # import bitsandbytes fails
    with pytest.raises(ConfigError, match=r"'load_in_4bit' is true.*pip install 'cppo\[qlora\]'"):
        _qlora_trainer(untied_model_dir, tmp_path, load_in_4bit=True)


def test_4bit_and_8bit_together_are_refused():
    with pytest.raises(ConfigError, match="'load_in_4bit' and 'load_in_8bit' are both true"):
        CPPOConfig(use_peft=True, load_in_4bit=True, load_in_8bit=True)


def test_a_quantised_base_without_lora_says_what_to_set(untied_model_dir):
    pytest.importorskip("bitsandbytes")
    with pytest.raises(ConfigError, match="'load_in_4bit' is true but no LoRA.*set use_peft: true"):
        policy_of(untied_model_dir, load_in_4bit=True)


def test_a_quantised_model_object_without_lora_says_what_to_set(untied_model_dir):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig
    model = load_model(untied_model_dir, quantization=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(ConfigError, match="'load_in_8bit' is true but no LoRA.*set use_peft: true"):
        load_policy(model, load_tokenizer(untied_model_dir), ModelSection(), PrecisionSection(),
                    CPU, chat_template_kwargs=None, lora=False)


def test_dora_where_peft_refuses_it_is_named(untied_model_dir):
    """peft has no DoRA for adapters on parameters (lora_target_parameters); on bitsandbytes'
    4- and 8-bit layers it has, and cppo takes it."""
    with pytest.raises(ConfigError, match="peft refuses the LoRA settings.*use_dora True.*DoRA"):
        policy_of(untied_model_dir, use_peft=True, use_dora=True, lora_dropout=0.0,
                  lora_target_parameters=["mlp.up_proj.weight"], lora_target_modules=["q_proj"])


def test_dora_with_a_4bit_base_trains(untied_model_dir):
    pytest.importorskip("bitsandbytes")
    policy = policy_of(untied_model_dir, use_peft=True, use_dora=True, load_in_4bit=True)
    policy(torch.tensor([[5, 6, 7]])).logits.pow(2).sum().backward()
    magnitudes = [p for n, p in trainable(policy).items() if "magnitude" in n]
    assert magnitudes and all(p.grad is not None and p.grad.abs().max() > 0 for p in magnitudes)


def test_a_quantised_base_with_fsdp_is_refused():
    with pytest.raises(ConfigError, match="'load_in_8bit' is true with distributed: fsdp"):
        CPPOConfig(use_peft=True, load_in_8bit=True, distributed="fsdp")


def test_dora_with_vllm_is_refused():
    with pytest.raises(ConfigError, match="'use_dora' is true with use_vllm"):
        CPPOConfig(use_peft=True, use_dora=True, use_vllm=True)


def test_a_cast_head_with_a_lora_adapter_on_it_is_refused():
    with pytest.raises(ConfigError, match="'cast_lm_head_to_fp32' is true but lora_target_modules"):
        CPPOConfig(use_peft=True, cast_lm_head_to_fp32=True, lora_target_modules=["q_proj", "lm_head"])


def test_a_peft_config_with_a_lora_head_is_refused_by_the_same_rule(untied_model_dir):
    """A peft_config given to the trainer is not in the config: the loaded model is checked by
    the config's own rule (one message)."""
    import peft
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(untied_model_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError) as err:
        loading.cast_lm_head_to_fp32(model)
    with pytest.raises(ConfigError) as from_config:
        CPPOConfig(use_peft=True, cast_lm_head_to_fp32=True, lora_target_modules=["lm_head"])
    assert str(err.value) == str(from_config.value)
    loading.cast_lm_head_to_fp32(AutoModelForCausalLM.from_pretrained(untied_model_dir))


def test_a_dora_adapter_pushed_to_vllm_is_refused_by_the_same_rule(untied_model_dir):
    import peft
    from transformers import AutoModelForCausalLM
    from cppo.sampling.vllm import lora_delta

    def q_proj(**lora):
        base = AutoModelForCausalLM.from_pretrained(untied_model_dir)
        model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], **lora))
        return model.get_base_model().model.layers[0].self_attn.q_proj

    with pytest.raises(ConfigError) as err:
        lora_delta(q_proj(use_dora=True))
    with pytest.raises(ConfigError) as from_config:
        CPPOConfig(use_peft=True, use_dora=True, use_vllm=True)
    assert str(err.value) == str(from_config.value)
    assert lora_delta(q_proj()).shape == q_proj().weight.shape


# ---------------------------------------------------------------- a TRL YAML -----------------
TRL_YAML = """
model_name_or_path: {model}
model_revision: main
trust_remote_code: false
dataset_name: {data}
output_dir: {out}
learning_rate: 1.0e-2
dtype: float32
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 5
max_steps: 2
beta: 0.04
save_strategy: "no"
eval_strategy: "no"
report_to: none
seed: 3
reward_funcs: [helpers:odd_length_reward]
disable_tqdm: true
disable_dropout: true
cast_lm_head_to_fp32: true
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, v_proj]
lora_task_type: CAUSAL_LM
lora_modules_to_save: null
lora_target_parameters: null
use_rslora: true
use_dora: true
load_in_4bit: true
load_in_8bit: false
bnb_4bit_quant_type: nf4
use_bnb_nested_quant: true
bnb_4bit_quant_storage: uint8
"""


def test_a_trl_yaml_with_the_model_fields_runs_and_ignores_none(untied_model_dir, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    import yaml
    from helpers import write_jsonl
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_YAML.format(model=untied_model_dir, data=write_jsonl(tmp_path / "rows.jsonl"),
                                    out=tmp_path / "run"))
    assert cli.main(["train", "--config", str(path), "--pruning_rate", "0"]) == 0
    err = capsys.readouterr().err
    assert [name for name in FIELDS if name in err] == []
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["load_in_4bit"] and saved["use_dora"] and saved["cast_lm_head_to_fp32"]
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").is_file()
