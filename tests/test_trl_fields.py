"""cppo.config.trl_fields tells the truth about every field of the installed TRL (GRPOConfig with the
TrainingArguments it extends, ModelConfig, ScriptArguments, `trl grpo`'s arguments): each is
honoured under its own name, mapped, or ignored with a reason, and a value with which TRL would
behave differently from cppo is always named, TRL's own default included."""

import dataclasses
from pathlib import Path

import pytest

from cppo.config import CPPOConfig
from cppo.config.trl_fields import (_MISSING, DEFAULTS_DIFFER, MACHINERY, MAPPED_DEFAULTS_DIFFER,
                                    TRL_FIELDS, machinery_kind, translate)

trl = pytest.importorskip("trl")

OWN = {f.name for f in dataclasses.fields(CPPOConfig)}
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-trl.md"
OTHER = object()   # a value no field has


def trl_fields():
    from trl.scripts.grpo import GRPOScriptArguments
    seen = {}
    for cls in (trl.GRPOConfig, trl.ModelConfig, trl.ScriptArguments, GRPOScriptArguments):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                seen.setdefault(f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                seen.setdefault(f.name, f.default_factory())
            else:
                seen.setdefault(f.name, _MISSING)
    return seen


FIELDS = trl_fields()
# ignored fields whose TRL default makes TRL behave differently from cppo (named when given)
TRL_DEFAULT_DIFFERS: set[str] = set()


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_trl_field_is_honoured_mapped_or_named(name):
    trl_default = FIELDS[name]
    entry = TRL_FIELDS.get(name)
    if name in OWN and (entry is None or entry[0] == "ignored"):     # honoured
        out, dropped = translate({name: "x"}, OWN)
        assert out == {name: "x"} and dropped == {}
        return
    assert entry is not None, f"{name}: neither a CPPOConfig field nor in TRL_FIELDS"
    kind, detail, behaves_as = entry
    if kind == "mapped":   # converted (conversions: test_trl_cli.py, and the test below)
        if trl_default is not _MISSING:
            translate({name: trl_default}, OWN)
        return
    assert kind == "ignored" and isinstance(detail, str) and detail
    _, dropped = translate({name: OTHER}, OWN)
    assert dropped == {name: detail}             # any other value is named, with the reason
    if behaves_as is not _MISSING:
        assert translate({name: behaves_as}, OWN) == ({}, {})
    if trl_default is not _MISSING:
        named = name in translate({name: trl_default}, OWN)[1]
        assert named == (name in TRL_DEFAULT_DIFFERS or behaves_as is _MISSING), name


def test_the_table_has_no_field_trl_lacks():
    """(transformers before 5.20, which the vllm extra may pin, lacks the activation_* names)"""
    newer_transformers = {"activation_checkpointing", "activation_checkpointing_kwargs"}
    assert sorted(set(TRL_FIELDS) - set(FIELDS) - newer_transformers) == []


def test_trls_defaults_that_make_it_behave_otherwise_are_named():
    own = OWN
    for values, field in (({"bf16": None}, "bf16"), ({"save_total_limit": None}, "save_total_limit")):
        out, dropped = translate(values, own)
        assert field in dropped and field not in out


def test_honoured_defaults_that_differ_from_trl_are_listed_in_the_guide():
    cfg = CPPOConfig()
    differ = {n for n, d in FIELDS.items() if n in OWN and d is not _MISSING
              and d != getattr(cfg, n)}
    assert differ == set(DEFAULTS_DIFFER)
    guide = GUIDE.read_text()
    section = guide.split("## Defaults that differ from TRL's", 1)[1].split("\n## ", 1)[0]
    assert [n for n in DEFAULTS_DIFFER if f"`{n}`" not in section] == []


def test_mapped_fields_whose_trl_default_differs_from_cppos_are_listed_in_the_guide():
    """A mapped TRL field whose default maps to a value other than cppo's default: its target is
    in DEFAULTS_DIFFER, or the TRL name in MAPPED_DEFAULTS_DIFFER, and the guide's table has it."""
    cfg, differ = CPPOConfig(), set()
    for name, (kind, _, _) in TRL_FIELDS.items():
        if kind != "mapped" or FIELDS.get(name, _MISSING) is _MISSING:
            continue
        out, _ = translate({name: FIELDS[name]}, OWN)
        if any(getattr(cfg, k) != v for k, v in out.items() if k not in DEFAULTS_DIFFER):
            differ.add(name)
    assert differ == set(MAPPED_DEFAULTS_DIFFER)
    section = GUIDE.read_text().split("## Defaults that differ from TRL's", 1)[1].split("\n## ", 1)[0]
    assert [n for n in MAPPED_DEFAULTS_DIFFER if f"`{n}`" not in section] == []


def test_the_objective_fields_are_honoured_with_trls_defaults():
    cfg = CPPOConfig()
    for name in ("loss_type", "importance_sampling_level", "delta", "use_bias_correction_kl",
                 "epsilon", "epsilon_high", "beta", "sapo_temperature_pos", "sapo_temperature_neg",
                 "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                 "top_entropy_quantile", "off_policy_mask_threshold", "scale_rewards",
                 "num_iterations", "temperature", "mask_truncated_completions"):
        assert name not in TRL_FIELDS and getattr(cfg, name) == FIELDS[name], name


def test_generation_kwargs_set_the_sampling_fields_over_them_as_in_trl():
    values = {"temperature": 0.7, "generation_kwargs": {"temperature": 0.9, "min_p": 0.1,
                                                        "repetition_penalty": 1.1, "do_sample": True}}
    out, dropped = translate(values, OWN)
    assert out == {"temperature": 0.9, "min_p": 0.1, "repetition_penalty": 1.1} and dropped == {}
    out, dropped = translate({"generation_kwargs": '{"top_k": 5, "use_cache": true}'}, OWN)
    assert out == {"top_k": 5} and "use_cache" in dropped["generation_kwargs"]
    assert CPPOConfig.from_dict(out).top_k == 5
    from cppo.errors import ConfigError
    with pytest.raises(ConfigError, match=r"'generation_kwargs' has \['typical_p'\], which change "
                                          r"the sampled tokens"):   # refused, not dropped
        translate({"generation_kwargs": {"typical_p": 0.9, "use_cache": True}}, OWN)
    with pytest.raises(ConfigError, match="'generation_kwargs' is '{top_k'"):
        translate({"generation_kwargs": "{top_k"}, OWN)


# --- only machinery is ignored (issue #42) ------------------------------------------------------
# TRL fields that change the model, the loss, the optimizer, the sampled tokens or the data (issue
# #42 honoured them)
MUST_BE_HONOURED = (
    "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
    "bnb_4bit_quant_storage", "use_dora", "use_rslora", "lora_modules_to_save",
    "lora_target_parameters", "lora_task_type", "trust_remote_code", "model_revision",
    "disable_dropout", "cast_lm_head_to_fp32", "router_aux_loss_coef", "steps_per_generation",
    "chat_template_kwargs", "vllm_structured_outputs_regex", "optim_args", "lr_scheduler_kwargs",
    "data_seed", "dataset_config", "dataset_streaming")
MACHINERY_KINDS = ("trainer", "hub", "data loading", "process setup", "logging", "evaluation",
                   "checkpoints", "generation engine", "not applicable")


def ignored_fields() -> set[str]:
    return {name for name, entry in TRL_FIELDS.items()
            if entry[0] == "ignored" and not (name in OWN)}


def test_every_ignored_field_is_machinery_of_a_known_kind():
    """An ignored TRL field may only be machinery: it must be listed in MACHINERY, under one of
    the machinery kinds; one that changes what is trained is honoured, mapped or refused."""
    assert set(MACHINERY) <= set(MACHINERY_KINDS)
    listed = [n for names in MACHINERY.values() for n in names]
    assert len(listed) == len(set(listed)), "a field listed under two kinds"
    not_machinery = sorted(n for n in ignored_fields() - set(MUST_BE_HONOURED)
                           if machinery_kind(n) is None)
    assert not_machinery == [], f"ignored but not machinery: {not_machinery}"
    assert sorted(set(listed) - ignored_fields()) == [], "MACHINERY lists a field not ignored"


def test_the_fields_that_change_training_are_not_ignored():
    assert sorted(set(MUST_BE_HONOURED) & ignored_fields()) == []


def test_a_refused_field_is_an_error_naming_it():
    from cppo.errors import ConfigError
    assert translate({"neftune_noise_alpha": None}, OWN) == ({}, {})   # TRL's default: off
    with pytest.raises(ConfigError, match="'neftune_noise_alpha' is 5.0: NEFTune noise"):
        translate({"neftune_noise_alpha": 5.0}, OWN)
