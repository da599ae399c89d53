"""Importance sampling against the sampler (vLLM's own log-probs, or a cast copy's): TRL 1.16's
four modes (token/sequence x truncate/mask) and bounds, as pure tensor code
(cppo.algorithm.sampler_correction), as TRL's field names (cppo.config.trl_fields), and in a training
step beside TRL's own GRPOTrainer run with use_vllm (tests/helpers/trl_twin.py: the engine is
replaced by forced completions that carry a sampler's log-probs)."""

import math

import pytest
import torch

from cppo.algorithm.sampler_correction import sampler_correction_stats, sampler_importance_weights
from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.config.trl_fields import translate

POLICY = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
SAMPLER = torch.tensor([[-2.5, -1.0, -0.5], [-1.2, -0.9, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_truncate_clamps_each_token_ratio():
    w = sampler_importance_weights(POLICY, SAMPLER, MASK, "token_truncate", clip_min=0.5, clip_max=3.0)
    expected = torch.tensor([[3.0, 0.5, 1.0], [math.exp(0.2), math.exp(-0.1), 1.0]])
    torch.testing.assert_close(w, expected)


def test_token_mask_zeroes_the_tokens_outside_the_bounds():
    w = sampler_importance_weights(POLICY, SAMPLER, MASK, "token_mask", clip_min=0.5, clip_max=3.0)
    expected = torch.tensor([[0.0, 0.0, 1.0], [math.exp(0.2), math.exp(-0.1), 1.0]])
    torch.testing.assert_close(w, expected)


def test_sequence_modes_weigh_a_whole_sequence_by_its_summed_log_ratio():
    # row 0: 1.5 - 1.0 + 0 = 0.5; row 1: 0.2 - 0.1 (the masked token does not count) = 0.1
    truncate = sampler_importance_weights(POLICY, SAMPLER, MASK, "sequence_truncate", clip_max=1.5)
    torch.testing.assert_close(truncate, torch.tensor([[1.5], [math.exp(0.1)]]))
    mask = sampler_importance_weights(POLICY, SAMPLER, MASK, "sequence_mask", clip_max=1.5)
    torch.testing.assert_close(mask, torch.tensor([[0.0], [math.exp(0.1)]]))
    low = sampler_importance_weights(POLICY, SAMPLER, MASK, "sequence_mask", clip_min=1.2,
                                     clip_max=None)   # mask below C_min only
    torch.testing.assert_close(low, torch.tensor([[math.exp(0.5)], [0.0]]))


def test_nan_sampler_log_probs_give_ratio_one_and_are_left_out_of_the_difference():
    sampler = SAMPLER.clone()
    sampler[0, 0] = float("nan")
    w = sampler_importance_weights(POLICY, sampler, MASK, "token_truncate", clip_max=3.0)
    assert w[0, 0] == 1.0 and torch.isfinite(w).all()
    stats = sampler_correction_stats(POLICY, sampler, MASK, w)
    assert stats["logp_diff_count"] == 4 and stats["logp_diff_max"] == pytest.approx(1.0)


def test_stats_are_over_masked_tokens_or_sequences():
    w = sampler_importance_weights(POLICY, SAMPLER, MASK, "token_truncate", clip_max=3.0)
    stats = sampler_correction_stats(POLICY, SAMPLER, MASK, w)
    assert stats["ratio_count"] == 5 and stats["ratio_max"] == 3.0
    assert stats["logp_diff_sum"] == pytest.approx(1.5 + 1.0 + 0.0 + 0.2 + 0.1)
    seq = sampler_importance_weights(POLICY, SAMPLER, MASK, "sequence_truncate", clip_max=3.0)
    stats = sampler_correction_stats(POLICY, SAMPLER, MASK, seq)
    assert stats["ratio_count"] == 2
    assert stats["ratio_min"] == pytest.approx(math.exp(0.1))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="token_truncate"):
        sampler_importance_weights(POLICY, SAMPLER, MASK, "tokens")
    with pytest.raises(ValueError, match="clip_min or clip_max"):
        sampler_importance_weights(POLICY, SAMPLER, MASK, "token_truncate", None, None)
    with pytest.raises(ValueError, match="same shape"):
        sampler_importance_weights(POLICY, SAMPLER[:, :2], MASK)


# ------------------------------------------------------------------------ TRL's field names ---
def test_trls_fields_are_honoured_under_cppos_names():
    known = {"importance_sampling_correction", "importance_sampling_mode",
             "importance_sampling_clip_max", "importance_sampling_clip_min"}
    out, dropped = translate({"vllm_importance_sampling_correction": False,
                              "vllm_importance_sampling_mode": "sequence_mask",
                              "vllm_importance_sampling_clip_max": None,
                              "vllm_importance_sampling_clip_min": 0.5}, known)
    assert dropped == {}
    assert out == {"importance_sampling_correction": False, "importance_sampling_mode":
                   "sequence_mask", "importance_sampling_clip_max": None,
                   "importance_sampling_clip_min": 0.5}
    # TRL's older name wins over clip_max, as in TRL; its default (null) sets nothing
    for order in ((4.0, 2.0), (2.0, 4.0)):
        values = dict(zip(("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap")
                          [::1 if order[0] == 4.0 else -1], order))
        assert translate(values, known)[0] == {"importance_sampling_clip_max": 2.0}
    assert translate({"vllm_importance_sampling_cap": None}, known) == ({}, {})


@pytest.mark.parametrize("values, named", [
    (dict(importance_sampling_mode="token"), "importance_sampling_mode"),
    (dict(importance_sampling_clip_min=3.0, importance_sampling_clip_max=2.0),
     "importance_sampling_clip_min"),
    (dict(importance_sampling_clip_max=None, importance_sampling_clip_min=None),
     "importance_sampling_mode"),
    (dict(importance_sampling_clip_min=-1.0), "importance_sampling_clip_min"),
    (dict(loss_type="vespo", importance_sampling_mode="sequence_mask"), "importance_sampling_mode"),
])
def test_bad_bounds_and_modes_are_config_errors(values, named):
    with pytest.raises(ConfigError, match=named):
        CPPOConfig(**values)


def test_no_bounds_is_fine_in_mask_modes_and_without_correction():
    CPPOConfig(importance_sampling_mode="token_mask", importance_sampling_clip_max=None)
    CPPOConfig(importance_sampling_correction=False, importance_sampling_clip_max=None)


# ------------------------------------------------------------------ beside TRL's own trainer ---
def forced_with_sampler(model_dir, seed=0):
    """The twin's forced rounds, each completion carrying a sampler's log-probs: the initial
    policy's own plus N(0, 0.7) noise per token, so that some ratios fall outside [0.5, 3]."""
    from cppo.models import load_model, load_tokenizer
    from cppo.sampling.padding import pad_token_lists
    from cppo.sampling.logprobs import completion_logprobs
    from helpers.trl_twin import make_rounds
    tok = load_tokenizer(model_dir)
    rounds = make_rounds(tok, 1, seed=seed)
    model = load_model(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    for rnd in rounds:
        G = len(rnd.completion_ids) // len(rnd.prompt_ids)
        prompts = [p for p in rnd.prompt_ids for _ in range(G)]
        p_ids, p_mask = pad_token_lists(prompts, tok.pad_token_id, side="left")
        c_ids, c_mask = pad_token_lists(rnd.completion_ids, tok.pad_token_id, side="right")
        with torch.no_grad():
            logps = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
        logps = logps + 0.7 * torch.randn(logps.shape, generator=g)
        rnd.sampler_logps = [logps[i, :len(c)].tolist() for i, c in enumerate(rnd.completion_ids)]
    return rounds


TRL_OPTIONS = {   # TRL's names; cppo gets them through cppo.config.trl_fields.translate
    "token_truncate": dict(vllm_importance_sampling_mode="token_truncate",
                           vllm_importance_sampling_clip_min=0.5),
    "token_mask": dict(vllm_importance_sampling_mode="token_mask",
                       vllm_importance_sampling_clip_min=0.5),
    "sequence_truncate": dict(vllm_importance_sampling_mode="sequence_truncate",
                              vllm_importance_sampling_clip_max=2.0),
    "sequence_mask_beta": dict(vllm_importance_sampling_mode="sequence_mask", beta=0.04),
    "vespo_token_truncate": dict(vllm_importance_sampling_mode="token_truncate", loss_type="vespo",
                             vllm_importance_sampling_clip_min=0.5),
    # multi-turn completions (the twin's tool_mask): the tool's tokens are out of the summed
    # log-ratio in TRL (completion_mask * tool_mask), and in cppo
    "sequence_truncate_tool_mask": dict(vllm_importance_sampling_mode="sequence_truncate",
                                        vllm_importance_sampling_clip_max=2.0, tool_mask=True),
}


@pytest.mark.cpu_paths
@pytest.mark.parametrize("name", TRL_OPTIONS)
def test_the_correction_matches_trl_run_with_vllm(tiny_model_dir, tmp_path, monkeypatch, name):
    """One round, mu = 2 (the second step has policy ratios != 1 too), dapo: TRL's importance
    weights, every micro-step's loss and both optimizer steps' gradients, cppo's equal to TRL's."""
    from helpers.trl_twin import assert_same_training, run_cppo, run_trl
    forced = forced_with_sampler(tiny_model_dir)
    trl_options = {"loss_type": "dapo", "num_iterations": 2, **TRL_OPTIONS[name]}
    tool_mask = trl_options.pop("tool_mask", False)
    cppo_options, dropped = translate(trl_options, set(CPPOConfig.__dataclass_fields__))
    assert dropped == {}
    kw = dict(max_steps=2, learning_rate=0.05, tool_mask=tool_mask)
    trl = run_trl(tiny_model_dir, tmp_path, forced, monkeypatch, use_vllm=True, **kw, **trl_options)
    cppo = run_cppo(tiny_model_dir, tmp_path, forced, monkeypatch, **kw, **cppo_options)
    (theirs,) = trl.sampler_weights   # once per generation round; cppo's once per micro-step
    assert len(cppo.sampler_weights) == 2
    ours = cppo.sampler_weights[0]
    if name.startswith("sequence"):   # one weight per completion: (N, 1) in both
        assert ours.shape == theirs.shape == (8, 1)
    width = min(ours.shape[1], theirs.shape[1])   # token modes: TRL pads wider
    mask = trl.masks[0][:, :width].bool() if ours.shape[1] > 1 else torch.ones(8, 1, dtype=torch.bool)
    torch.testing.assert_close(ours[:, :width][mask], theirs[:, :width][mask], rtol=1e-5, atol=1e-6)
    some_bounded = {"token_truncate": (theirs == 0.5).any() or (theirs == 3.0).any(),
                    "token_mask": (theirs == 0).any(), "sequence_truncate": (theirs == 2.0).any(),
                    "sequence_truncate_tool_mask": (theirs == 2.0).any(),
                    "sequence_mask_beta": (theirs == 0).any(), "vespo_token_truncate": (theirs == 0.5).any()}
    assert some_bounded[name]   # the bound acts in this batch
    assert_same_training(trl, cppo, 2)
