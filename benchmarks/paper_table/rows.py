"""The table's rows and shared settings: the paper's G, B and pruning rates, and one Row per line."""

from __future__ import annotations

from dataclasses import dataclass


GROUP_SIZE = 16                  # G: completions per question (the paper's)
UPDATE_BATCH = 16                # B: completions per optimizer update (the paper's, 1 GPU)
PRUNING_RATES = (0.5, 0.75, 0.875, 0.9375)
PAPER_SPEEDUP = {0.5: 1.81, 0.75: 3.27, 0.875: 4.89, 0.9375: 8.32}   # GSM8K, Qwen2.5-1.5B
ABLATION_RATE = 0.875
UNBIASED_RATES = (0.75, 0.875)   # selection_rule unbiased beside CPPO's largest |A|
ACCURACY_TOLERANCE = 0.01        # CPPO may be at most 1 point below GRPO
BOUND_FRACTION = 0.9             # measured speed-up must reach 90 % of the measured bound
TRL_SPEED_RATIO = 2.0            # our GRPO step must be 2x faster than TRL's
TRL_ROUNDS = 2                   # TRL runs, interleaved with TRL_ROUNDS + 1 runs of ours
TIME_BUDGET_SECONDS = 3600       # the full table should finish within about an hour
TRAIN_PHASES = ("generate", "score", "logprobs", "update")

DEFAULTS = dict(train_questions=1024, seeds="3", eval_questions=500, evals_per_run=4,
                learning_rate=3e-5, trl_steps=30, trl_warmup=5, generation_dtype="policy",
                top_p=1.0, replay_sampling="auto")
QUICK = dict(train_questions=32, seeds="1", rows="grpo,cppo-0.875,fair-0.875,trl",
             eval_questions=200, evals_per_run=2, trl_steps=5, trl_warmup=2)


@dataclass(frozen=True)
class Row:
    """One line of the table: the knobs of CPPOConfig that differ from the shared recipe."""

    name: str
    kind: str                      # grpo | cppo | fair | ablation | trl
    pruning_rate: float = 0.0      # the P this row stands for (fair rows: the CPPO P they match)
    selection_rule: str = "largest_abs"
    selection_scope: str = "step"

    @property
    def label(self) -> str:
        return {"grpo": "GRPO (paper: B = 16)",
                "cppo": f"CPPO P={self.pruning_rate:g}",
                "fair": f"GRPO fair (Q of P={self.pruning_rate:g})",
                "ablation": f"CPPO P={self.pruning_rate:g}, {self.selection_rule}",
                "trl": "TRL GRPOTrainer vs ours"}[self.kind]

    def config_values(self) -> dict:
        """CPPOConfig overrides for this row (B, P, selection); the rest is shared."""
        if self.kind == "grpo":
            return dict(pruning_rate=0.0, per_device_train_batch_size=UPDATE_BATCH)
        if self.kind == "fair":
            return dict(pruning_rate=0.0,
                        per_device_train_batch_size=questions_per_step(self.pruning_rate) * GROUP_SIZE)
        return dict(pruning_rate=self.pruning_rate, allocation=True,
                    per_device_train_batch_size=UPDATE_BATCH, selection_rule=self.selection_rule,
                    selection_scope=self.selection_scope)


def all_rows() -> dict[str, Row]:
    rows = [Row("grpo", "grpo")]
    rows += [Row(f"cppo-{p:g}", "cppo", p) for p in PRUNING_RATES]
    rows += [Row(f"fair-{p:g}", "fair", p) for p in PRUNING_RATES]
    rows += [Row(f"smallest-{ABLATION_RATE:g}", "ablation", ABLATION_RATE, "smallest_abs"),
             Row(f"random-{ABLATION_RATE:g}", "ablation", ABLATION_RATE, "random"),
             Row(f"maxvar-{ABLATION_RATE:g}", "ablation", ABLATION_RATE, "max_variance", "question"),
             *(Row(f"unbiased-{p:g}", "ablation", p, "unbiased") for p in UNBIASED_RATES),
             Row("trl", "trl")]
    return {r.name: r for r in rows}


def questions_per_step(pruning_rate: float) -> int:
    """Q of CPPO with allocation at P (B = 16, G = 16, scope 'step'): 1/(1-P) here."""
    from cppo.algorithm.allocation import plan_step
    return plan_step(completions_per_update=UPDATE_BATCH, group_size=GROUP_SIZE,
                     pruning_rate=pruning_rate, allocation=True, scope="step").questions_per_step
