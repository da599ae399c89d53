"""Pure arithmetic of the table: means, the Amdahl bounds, time-to-accuracy, per-row stats and targets."""

from __future__ import annotations

import statistics

from .rows import ACCURACY_TOLERANCE, BOUND_FRACTION, GROUP_SIZE, PAPER_SPEEDUP, PRUNING_RATES, TIME_BUDGET_SECONDS, TRAIN_PHASES, TRL_SPEED_RATIO


def mean_std(values) -> tuple[float | None, float | None]:
    """Mean and sample std (0 for one value); (None, None) for no values."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def train_split(summary: dict) -> tuple[float, float]:
    """(G, R) of a run: generate+score seconds (pruning cannot shrink them) and the rest of the
    training time R = train_seconds - G (log-prob passes, updates, per-step overhead)."""
    phases = summary["phase_seconds_this_session"]
    gen_score = phases.get("generate", 0.0) + phases.get("score", 0.0)
    return gen_score, summary["train_seconds"] - gen_score


def amdahl_bound(grpo_seconds: float, grpo_gen_score: float, cppo_gen_score: float,
                 pruning_rate: float) -> float:
    """Measured bound on CPPO's speed-up over GRPO:
        bound(P) = T_GRPO / (G_CPPO + (1 - P) * (T_GRPO - G_GRPO))
    T = training seconds, G = generate + score seconds (measured). Generation and scoring are what
    they measurably are in the CPPO run; everything else GRPO spends per step (log-probs, updates,
    per-step overhead) shrinks exactly by (1 - P), because CPPO runs (1 - P) times as many steps of
    the same 16 completions. A CPPO run at 100 % of the bound has no overhead from pruning."""
    if not 0 <= pruning_rate < 1:
        raise ValueError(f"pruning_rate must be in [0, 1), got {pruning_rate}")
    return _bound(grpo_seconds, grpo_gen_score, cppo_gen_score, 1 - pruning_rate)


def _bound(grpo_seconds: float, grpo_gen_score: float, cppo_gen_score: float, share: float) -> float:
    """T_GRPO / (G_CPPO + share * (T_GRPO - G_GRPO))."""
    denominator = cppo_gen_score + share * (grpo_seconds - grpo_gen_score)
    if denominator <= 0:
        raise ValueError(f"non-positive time in the bound: G_CPPO={cppo_gen_score}, "
                         f"T_GRPO={grpo_seconds}, G_GRPO={grpo_gen_score}")
    return grpo_seconds / denominator


def updates_bound(grpo_seconds: float, grpo_gen_score: float, cppo_gen_score: float,
                  grpo_updates: float, cppo_updates: float) -> float:
    """amdahl_bound with (1 - P) replaced by the measured ratio of optimizer updates run:
        bound_U = T_GRPO / (G_CPPO + (U_CPPO / U_GRPO) * (T_GRPO - G_GRPO))
    U = steps - skipped steps. A step whose kept completions all have advantage 0 runs no update
    (docs/migrating-from-trl.md): GRPO with one question per step skips every zero-variance group,
    while a CPPO step skips only when all of its questions have one, so CPPO runs more than
    (1 - P) times GRPO's updates and amdahl_bound overstates what pruning can give."""
    if grpo_updates <= 0 or cppo_updates < 0:
        raise ValueError(f"updates run must be positive for GRPO and non-negative for CPPO, got "
                         f"U_GRPO={grpo_updates}, U_CPPO={cppo_updates}")
    return _bound(grpo_seconds, grpo_gen_score, cppo_gen_score, cppo_updates / grpo_updates)


def updates_run(summary: dict) -> int:
    """Optimizer updates a run executed: its steps less the skipped ones."""
    return summary["steps"] - summary["skipped_steps"]


def classic_amdahl(reducible_fraction: float, pruning_rate: float) -> float:
    """Textbook Amdahl: 1 / ((1 - f) + f (1 - P)), f = fraction of GRPO's time that pruning
    shrinks. It keeps GRPO's generation time, so batching generation can beat it."""
    if not 0 <= reducible_fraction <= 1:
        raise ValueError(f"reducible_fraction must be in [0, 1], got {reducible_fraction}")
    return 1.0 / ((1 - reducible_fraction) + reducible_fraction * (1 - pruning_rate))


def time_to_accuracy(history: list[dict], target: float, clock: str = "train_seconds"
                     ) -> float | None:
    """Seconds on `clock` ('train_seconds' or 'wall_time') at which the held-out accuracy first
    reaches `target`, linearly interpolated between the eval before and the first eval at or above
    it; 0 if the first eval already reaches it; None if no eval does ("not reached")."""
    previous = None
    for point in history:
        if point["accuracy"] >= target:
            if previous is None:
                return float(point[clock]) if point["step"] else 0.0
            a0, a1 = previous["accuracy"], point["accuracy"]
            t0, t1 = float(previous[clock]), float(point[clock])
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
        previous = point
    return None


def by_seed(runs: list[dict], name: str) -> dict[int, dict]:
    return {r["seed"]: r["summary"] for r in runs if r["row"] == name}


def row_stats(runs: list[dict], name: str, grpo: dict[int, dict], target: float | None) -> dict:
    """Everything one table row shows, from its per-seed summaries (GRPO's paired by seed)."""
    mine = by_seed(runs, name)
    summaries = list(mine.values())
    stats: dict = {"row": name, "seeds": sorted(mine)}
    if not summaries:
        return stats
    acc = mean_std(s["accuracy_after"] for s in summaries)
    stats.update(
        accuracy=acc, accuracy_before=mean_std(s["accuracy_before"] for s in summaries),
        train_seconds=mean_std(s["train_seconds"] for s in summaries),
        wall_seconds=mean_std(s["wall_seconds"] for s in summaries),
        steps=summaries[0]["steps"], questions_per_step=summaries[0]["questions_per_step"],
        kept_per_step=summaries[0]["completions_kept_per_step"],
        effective_pruning_rate=summaries[0]["effective_pruning_rate"],
        skipped_steps=mean_std(s["skipped_steps"] for s in summaries)[0],
        updates_run=mean_std(updates_run(s) for s in summaries)[0])
    phases = {}
    for key in TRAIN_PHASES + ("eval", "checkpoint"):
        phases[key] = mean_std(s["phase_seconds_this_session"].get(key, 0.0) for s in summaries)[0]
    phases["other"] = stats["train_seconds"][0] - sum(phases[k] for k in TRAIN_PHASES)
    stats["phases"] = phases
    paired = [s for s in mine if s in grpo]
    if paired:
        t_grpo = statistics.fmean(grpo[s]["train_seconds"] for s in paired)
        w_grpo = statistics.fmean(grpo[s]["wall_seconds"] for s in paired)
        stats["speedup_train"] = t_grpo / statistics.fmean(mine[s]["train_seconds"] for s in paired)
        stats["speedup_wall"] = w_grpo / statistics.fmean(mine[s]["wall_seconds"] for s in paired)
        stats["speedup_train_per_seed"] = [grpo[s]["train_seconds"] / mine[s]["train_seconds"]
                                           for s in paired]
        p = summaries[0]["effective_pruning_rate"]
        if summaries[0]["completions_kept_per_step"] < summaries[0]["questions_per_step"] * GROUP_SIZE:
            g_grpo = statistics.fmean(train_split(grpo[s])[0] for s in paired)
            g_mine = statistics.fmean(train_split(mine[s])[0] for s in paired)
            stats["bound"] = amdahl_bound(t_grpo, g_grpo, g_mine, p)
            stats["classic_amdahl"] = classic_amdahl(1 - g_grpo / t_grpo, p)
            stats["fraction_of_bound"] = stats["speedup_train"] / stats["bound"]
            u_grpo = statistics.fmean(updates_run(grpo[s]) for s in paired)
            u_mine = statistics.fmean(updates_run(mine[s]) for s in paired)
            if u_grpo > 0:   # a GRPO run that skipped every update has no share to compare with
                stats["grpo_updates_run"] = u_grpo
                stats["updates_bound"] = updates_bound(t_grpo, g_grpo, g_mine, u_grpo, u_mine)
                stats["fraction_of_updates_bound"] = stats["speedup_train"] / stats["updates_bound"]
    if target is not None:
        reached = [time_to_accuracy(s["history"], target, "train_seconds") for s in summaries]
        reached_wall = [time_to_accuracy(s["history"], target, "wall_time") for s in summaries]
        stats["time_to_target"] = mean_std(reached)
        stats["time_to_target_wall"] = mean_std(reached_wall)
        stats["reached"] = sum(t is not None for t in reached)
    return stats


def fair_stats(runs: list[dict], pruning_rate: float) -> dict:
    """CPPO-P against the fair GRPO baseline with the same questions per step (paired by seed)."""
    cppo, fair = by_seed(runs, f"cppo-{pruning_rate:g}"), by_seed(runs, f"fair-{pruning_rate:g}")
    paired = sorted(set(cppo) & set(fair))
    if not paired:
        return {}
    t_fair = statistics.fmean(fair[s]["train_seconds"] for s in paired)
    t_cppo = statistics.fmean(cppo[s]["train_seconds"] for s in paired)
    g_fair = statistics.fmean(train_split(fair[s])[0] for s in paired)
    g_cppo = statistics.fmean(train_split(cppo[s])[0] for s in paired)
    p = cppo[paired[0]]["effective_pruning_rate"]
    return {"speedup_train": t_fair / t_cppo, "bound": amdahl_bound(t_fair, g_fair, g_cppo, p),
            "accuracy_fair": mean_std(fair[s]["accuracy_after"] for s in paired),
            "accuracy_cppo": mean_std(cppo[s]["accuracy_after"] for s in paired),
            "train_fair": t_fair, "train_cppo": t_cppo, "seeds": paired}


def evaluate_targets(stats: dict[str, dict], trl: dict | None, total_seconds: float | None,
                     quick: bool) -> list[dict]:
    """The table's targets as (target, measured, met) rows; met is None when not measured."""
    out = []
    grpo = stats.get("grpo", {})
    grpo_acc = grpo.get("accuracy", (None, None))[0]
    for p in PRUNING_RATES:
        s = stats.get(f"cppo-{p:g}", {})
        if "speedup_train" not in s or grpo_acc is None:
            out.append({"target": f"P={p:g}: speed-up >= {PAPER_SPEEDUP[p]}x at accuracy >= GRPO - 1 pt",
                        "measured": "not run", "met": None})
            out.append({"target": f"P={p:g}: speed-up >= {BOUND_FRACTION:.0%} of the measured bound",
                        "measured": "not run", "met": None})
            continue
        acc, speed = s["accuracy"][0], s["speedup_train"]
        ok = speed >= PAPER_SPEEDUP[p] and acc >= grpo_acc - ACCURACY_TOLERANCE
        out.append({"target": f"P={p:g}: speed-up >= {PAPER_SPEEDUP[p]}x at accuracy >= GRPO - 1 pt",
                    "measured": f"{speed:.2f}x, accuracy {100 * acc:.1f}% vs GRPO "
                                f"{100 * grpo_acc:.1f}% ({100 * (acc - grpo_acc):+.1f} pt)",
                    "met": ok})
        if "bound" in s:
            out.append({"target": f"P={p:g}: speed-up >= {BOUND_FRACTION:.0%} of the measured bound",
                        "measured": f"{speed:.2f}x of {s['bound']:.2f}x = "
                                    f"{100 * s['fraction_of_bound']:.0f}%",
                        "met": s["fraction_of_bound"] >= BOUND_FRACTION})
    if trl and trl.get("ratio") is not None:
        out.append({"target": f"our GRPO step >= {TRL_SPEED_RATIO:g}x faster than TRL's",
                    "measured": f"{trl['ratio']:.2f}x ({trl['trl']['seconds_per_step']:.3f} s vs "
                                f"{trl['ours']['seconds_per_step']:.3f} s per step)",
                    "met": trl["ratio"] >= TRL_SPEED_RATIO})
    else:
        reason = (trl or {}).get("error", "not run")
        out.append({"target": f"our GRPO step >= {TRL_SPEED_RATIO:g}x faster than TRL's",
                    "measured": reason, "met": None})
    if total_seconds is not None:
        out.append({"target": f"full table in <= {TIME_BUDGET_SECONDS / 60:.0f} min",
                    "measured": f"{total_seconds / 60:.1f} min" + (" (quick mode: not the full table)"
                                                                   if quick else ""),
                    "met": None if quick else total_seconds <= TIME_BUDGET_SECONDS * 1.05})
    return out
