"""results.md, results.json and the plots from the raw runs; the machine description."""

from __future__ import annotations

from pathlib import Path

from common import machine as machine_record, machine_of, write_results

from .formatting import fmt_list, fmt_num, fmt_pm, markdown_table
from .plots import write_plots
from .rows import GROUP_SIZE, PAPER_SPEEDUP, PRUNING_RATES, all_rows, questions_per_step
from .stats import by_seed, evaluate_targets, fair_stats, mean_std, row_stats


def truncation(settings: dict) -> str:
    """', top_p 0.9 (replayed)': the recipe's nucleus sampling, when on ('' when off)."""
    top_p = settings.get("top_p", 1.0)
    if top_p >= 1.0:
        return ""
    replay = {"auto": "replayed", "true": "replayed", "false": "not replayed"}[
        settings.get("replay_sampling", "auto")]
    return f", top_p {top_p:g} ({replay} by the training passes)"


def machine() -> dict:
    """common.machine() with the transformers version (the TRL comparison's)."""
    try:
        import transformers
        return machine_record(transformers=transformers.__version__)
    except ImportError:
        return machine_record()


def build_report(raw: dict) -> tuple[str, dict, list[dict]]:
    """The markdown of results.md, the per-row stats and the target rows, from the raw JSON."""
    runs, settings, rows = raw["runs"], raw["settings"], all_rows()
    grpo = by_seed(runs, "grpo")
    target = mean_std(s["accuracy_after"] for s in grpo.values())[0]
    names = [n for n in settings["rows"] if n != "trl"]
    stats = {n: row_stats(runs, n, grpo, target) for n in names}
    trl = raw.get("trl")
    targets = evaluate_targets(stats, trl, raw.get("total_seconds"), settings["quick"])

    pct = lambda v: fmt_pm(*v, scale=100, digits=1) if v else "n/a"
    m = machine_of(raw)
    lines = [f"# CPPO paper table on the embedded task{' (QUICK MODE: smoke test only)' if settings['quick'] else ''}",
             "", f"Command: `{raw['command']}`  ",
             f"Machine: {m['platform']}, {m['cores']} CPUs ({m['threads']} torch threads), torch "
             f"{m['torch']}, transformers {m.get('transformers', '?')}, Python {m['python']}"
             + (f", CPU capability {m['cpu_capability']}"
                if "cpu_capability" in m else ", CPU capability not recorded") + "  ",
             f"Started {raw['started']}; total wall time {fmt_num(raw.get('total_seconds', 0) / 60, 1)} min "
             f"(estimate before starting: {fmt_num(raw.get('estimate_seconds', 0) / 60, 1)} min)  ",
             f"Recipe: embedded model and task (2x2-digit multiplication), N = {settings['train_questions']} "
             f"training questions, one pass (num_train_epochs=1, max_steps=-1), G = {GROUP_SIZE}, "
             f"lr {settings['learning_rate']:g} constant, AdamW, beta 0, loss dapo, 1 update per batch, "
             f"temperature 1.0{truncation(settings)}, sampling weights in "
             f"{settings.get('generation_dtype', 'policy')} "
             f"(TRL comparison: float32); seeds {settings['seeds']}; held-out greedy accuracy on "
             f"{settings['eval_questions']} test questions every ~{100 // settings['evals_per_run']} % "
             f"of a run. Speed-ups use training seconds (train_seconds: the trainer's rounds, "
             f"without evaluation and checkpoints); wall seconds add evaluation and the final checkpoint.",
             "", "## Main table (paper protocol: B = 16 completions per update for every row)", ""]
    head = ["row", "P", "Q/step", "steps", "accuracy %", "Δ vs GRPO pt", "train s", "wall s",
            "speed-up (train)", "speed-up (wall)", "paper", "bound", "% of bound",
            "time to GRPO acc (train s)", "reached"]
    body = []
    for n in names:
        s = stats[n]
        if "accuracy" not in s:
            continue
        r = rows[n]
        delta = None if target is None else 100 * (s["accuracy"][0] - target)
        tta = s.get("time_to_target", (None, None))
        body.append([r.label, f"{r.pruning_rate:g}" if r.kind in ("cppo", "ablation") else "0",
                     s["questions_per_step"], s["steps"], pct(s["accuracy"]),
                     fmt_num(delta, 1) if delta is not None else "n/a",
                     fmt_pm(*s["train_seconds"]), fmt_pm(*s["wall_seconds"]),
                     fmt_num(s.get("speedup_train"), 2, "x"), fmt_num(s.get("speedup_wall"), 2, "x"),
                     f"{PAPER_SPEEDUP[r.pruning_rate]}x" if r.kind == "cppo" else "",
                     fmt_num(s.get("bound"), 2, "x"),
                     fmt_num(100 * s["fraction_of_bound"], 0, "%") if "fraction_of_bound" in s else "",
                     fmt_pm(*tta) if tta[0] is not None else "not reached",
                     f"{s.get('reached', 0)}/{len(s['seeds'])}"])
    lines += [markdown_table(head, body, "lrrrrrrrrrrrrrr"), ""]
    lines += ["Accuracy before training: " + pct(stats["grpo"]["accuracy_before"]) if "accuracy_before" in stats.get("grpo", {}) else "", ""]

    update_rows = []
    for n in names:
        s = stats[n]
        if "updates_bound" in s:   # GRPO's updates paired by seed, as in bound_U
            update_rows.append([rows[n].label, fmt_num(s["updates_run"], 0), fmt_num(s["grpo_updates_run"], 0),
                                fmt_num(s["updates_run"] / s["grpo_updates_run"], 2),
                                fmt_num(1 - s["effective_pruning_rate"], 3),
                                fmt_num(s["speedup_train"], 2, "x"), fmt_num(s["bound"], 2, "x"),
                                fmt_num(s["updates_bound"], 2, "x"),
                                fmt_num(100 * s["fraction_of_updates_bound"], 0, "%")])
    if update_rows:
        lines += ["## Updates run (steps less those skipped because every kept advantage was 0)", "",
                  "GRPO with one question per step skips the update of every group whose rewards are all "
                  "equal; a CPPO step skips only when all of its questions' groups are, so CPPO runs more "
                  "than (1 - P) times GRPO's updates. bound_U replaces (1 - P) in the bound by the measured "
                  "ratio of updates run.", "",
                  markdown_table(["row", "updates run", "GRPO updates run", "ratio U_CPPO / U_GRPO",
                                  "1 - P", "speed-up", "bound", "bound_U", "% of bound_U"], update_rows), ""]

    fair_rows = []
    for p in PRUNING_RATES:
        f = fair_stats(runs, p)
        if f:
            fair_rows.append([f"{p:g}", questions_per_step(p), pct(f["accuracy_cppo"]), pct(f["accuracy_fair"]),
                              fmt_num(f["train_cppo"]), fmt_num(f["train_fair"]),
                              fmt_num(f["speedup_train"], 2, "x"), fmt_num(f["bound"], 2, "x"),
                              fmt_num(100 * f["speedup_train"] / f["bound"], 0, "%")])
    if fair_rows:
        lines += ["## CPPO against the fair GRPO baseline (same questions per step, all 16 Q "
                  "completions trained, one update per step)", "",
                  markdown_table(["P", "Q/step", "CPPO accuracy %", "fair GRPO accuracy %",
                                  "CPPO train s", "fair GRPO train s", "speed-up", "bound vs fair",
                                  "% of bound"], fair_rows), ""]

    phase_rows = []
    for n in names:
        s = stats[n]
        if "phases" in s:
            ph = s["phases"]
            phase_rows.append([rows[n].label] + [fmt_num(ph[k], 1) for k in
                              ("generate", "score", "logprobs", "update", "other", "eval", "checkpoint")]
                              + [fmt_num(100 * (ph["generate"] + ph["score"]) / max(s["train_seconds"][0], 1e-9), 0, "%")])
    lines += ["## Where the time goes (seconds, mean over seeds)", "",
              "train_seconds = generate + score + logprobs + update + other (other: per-step "
              "bookkeeping outside the timed phases); wall adds eval and checkpoint.", "",
              markdown_table(["row", "generate", "score", "logprobs", "update", "other", "eval",
                              "checkpoint", "gen+score share"], phase_rows), ""]

    lines += ["## TRL's GRPOTrainer against ours (GRPO, B = G = 16, one question per step, "
              "max 8 new tokens, CPU)", ""]
    if trl is None:
        lines += ["Not run (row 'trl' not selected).", ""]
    else:
        ours, theirs = trl.get("ours", {}), trl.get("trl", {})
        cell = lambda d, k, dig: fmt_num(d.get(k), dig) if isinstance(d, dict) else "n/a"
        table = [["ours (CPPOTrainer, P=0)", cell(ours, "seconds_per_step", 3), cell(ours, "tokens_per_s", 0), ""],
                 [f"TRL {trl.get('trl_version', '(not installed)')} GRPOTrainer",
                  cell(theirs, "seconds_per_step", 3), cell(theirs, "tokens_per_s", 0),
                  fmt_num(trl.get("ratio"), 2, "x") if trl.get("ratio") else trl.get("error", "n/a")]]
        lines += [markdown_table(["trainer", "s/step (median)", "completion tokens/s", "ours faster by"], table), "",
                  f"{trl['measured_steps']} steps measured after {trl['warmup_steps']} warm-up steps per "
                  f"run; runs interleaved (ours, TRL, ours, TRL, ours) and each side's steps pooled; "
                  f"per-run medians: ours {fmt_list(ours.get('per_run_median'))}, TRL "
                  f"{fmt_list(theirs.get('per_run_median'))} s. A step is timed from the end "
                  "of one optimizer step to the end of the next (generation, scoring, update, logging; "
                  "ours logs every step, TRL not at all). TRL: gradient_checkpointing off, beta 0, loss "
                  "dapo, use_cpu, bf16 off." + (f" Ours failed: {ours['error']}" if "error" in ours else ""), ""]

    lines += ["## Targets", "", markdown_table(
        ["target", "measured", "met"],
        [[t["target"], t["measured"], {True: "met", False: "NOT met", None: "n/a"}[t["met"]]]
         for t in targets], "llc"), ""]
    lines += ["## Formulas", "",
              "- speed-up (train) = mean T_GRPO / mean T_row over the seeds both ran, T = train_seconds "
              "(the trainer's rounds: generate, score, log-probs, update, bookkeeping; no evaluation, no "
              "checkpoints). speed-up (wall) uses wall_seconds (adds the evaluations and the final checkpoint).",
              "- bound(P) = T_GRPO / (G_CPPO + (1 - P) · (T_GRPO - G_GRPO)), G = measured generate + score "
              "seconds. What pruning can at best give when generation and scoring take what they measurably "
              "take in the CPPO run and everything else GRPO does per step shrinks by (1 - P) (CPPO runs (1 - P) "
              "times the steps on the same 16 completions). % of bound = speed-up / bound. Against the fair "
              "baseline, T_GRPO and G_GRPO are the fair run's.",
              "- bound_U = T_GRPO / (G_CPPO + (U_CPPO / U_GRPO) · (T_GRPO - G_GRPO)), U = optimizer updates "
              "run (steps - skipped steps), mean over seeds: the bound with the measured share of GRPO's "
              "updates that CPPO runs in place of (1 - P).",
              "- classic Amdahl (in speedup.png) = 1 / ((1 - f) + f (1 - P)), f = (T_GRPO - G_GRPO) / T_GRPO: "
              "keeps GRPO's own generation time, so CPPO's bigger generation batches can beat it.",
              "- ideal = 1 / (1 - P).",
              "- time to GRPO acc: training seconds until the held-out accuracy first reaches the mean final "
              "accuracy of the GRPO (paper) row, linearly interpolated between the eval before and the first "
              "eval at or above it; mean over the seeds that reached it (reached = seeds that did).",
              "- accuracy: held-out greedy accuracy after the last step, mean ± sample std over seeds.", ""]
    return "\n".join(lines), stats, targets


def write_outputs(raw: dict, output: Path) -> tuple[str, list[dict]]:
    markdown, stats, targets = build_report(raw)
    raw["stats"], raw["targets"] = stats, targets
    write_results(output, raw, markdown, indent=1, echo=False)
    write_plots(raw, stats, output)
    return markdown, targets
