"""`cppo pretrain`: supervised training of the tiny base model on the embedded task.

Stops on purpose at a partial skill (greedy held-out accuracy around 35 %, pass@16 much higher) so
that RL has room to improve it. Seeded and reproducible on CPU. Writes a transformers model
directory (config.json, model.safetensors, tokenizer) and a model card with the measured numbers.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from cppo.data import arithmetic
from cppo.rewards import arithmetic as arithmetic_rewards
from cppo.evaluate import EvalSampling, evaluate
from cppo.config import CPPOConfig, check_fields, option, same_as
from cppo.models.loading import tiny_model_config
from cppo.sampling.padding import pad_token_lists
from cppo.models.tokenizer import build_tokenizer


@dataclass
class PretrainConfig:
    output_dir: str = option("runs/pretrain", "Where to write the model directory and model card.")
    task_level: int = same_as(CPPOConfig, "task_level")
    steps: int = option(780, "Supervised optimizer steps.", at_least=1)
    batch_size: int = option(256, "Problems per step.", at_least=1)
    learning_rate: float = option(1e-3, "AdamW learning rate.", above=0)
    warmup_steps: int = option(50, "Linear warm-up steps.", at_least=0)
    lr_schedule: str = option("constant", "Learning rate after the warm-up: 'constant', or 'cosine' "
                              "decay to 0 at the last step.", ("constant", "cosine"))
    weight_decay: float = option(0.01, "AdamW weight decay.", at_least=0)
    hidden_size: int = option(128, "Model width.", at_least=1)
    num_layers: int = option(4, "Transformer layers.", at_least=1)
    num_heads: int = option(4, "Attention heads.", at_least=1)
    intermediate_size: int = option(512, "MLP width.", at_least=1)
    seed: int = same_as(CPPOConfig, "seed", 0, "Seed for initialisation and data order.")
    eval_questions: int = option(988, "Held-out questions for the final evaluation (test split size "
                             "of level 3 is 988).", at_least=1)
    pass_k: int = option(16, "k of pass@k in the final evaluation (0: greedy only).", at_least=0)
    threads: int = option(2, "torch CPU threads (fixed for reproducibility).", at_least=1)
    progress_bar: bool = option(True, "Show a progress bar.")

    def __post_init__(self):
        check_fields(self)


def lr_factor(step: int, cfg: PretrainConfig) -> float:
    """Multiplier of the learning rate at optimizer step `step` (0-based)."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    if cfg.lr_schedule == "constant" or step < cfg.warmup_steps:
        return warm
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def encode_supervised(tokenizer, problems) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (N, L) of '<bos>prompt answer<eos>' and a loss mask (N, L) on answer + EOS."""
    rows, masks = [], []
    for p in problems:
        prompt = tokenizer(p.prompt)["input_ids"]
        answer = tokenizer(p.answer_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    ids, _ = pad_token_lists(rows, tokenizer.pad_token_id, side="right")
    loss_mask, _ = pad_token_lists(masks, 0, side="right")
    return ids, loss_mask.bool()


def pretrain(cfg: PretrainConfig, command: str | None = None) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(tiny_model_config(
        len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size))
    train = arithmetic.generate(cfg.task_level, "train", seed=cfg.seed)
    ids, loss_mask = encode_supervised(tokenizer, train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    generator = torch.Generator().manual_seed(cfg.seed)
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(cfg.steps), desc="pretrain", disable=not cfg.progress_bar)
    for step in bar:
        batch = torch.randint(len(ids), (cfg.batch_size,), generator=generator)
        x, m = ids[batch], loss_mask[batch]
        logits = model(input_ids=x).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[m[:, 1:]], x[:, 1:][m[:, 1:]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    train_seconds = time.perf_counter() - start

    test_rows = [p.to_row() for p in arithmetic.generate(cfg.task_level, "test", seed=0)]
    test_rows = test_rows[:cfg.eval_questions]
    result = evaluate(model, tokenizer, test_rows, arithmetic_rewards.arithmetic_accuracy_reward,
                      k=cfg.pass_k, max_new_tokens=arithmetic.answer_width(cfg.task_level) + 1,
                      sampling=EvalSampling(seed=cfg.seed), progress=cfg.progress_bar)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = {
        "command": command or "cppo pretrain",
        "config": asdict(cfg),
        "train_seconds": round(train_seconds, 1),
        "final_loss": round(loss.item(), 4),
        "parameters": sum(p.numel() for p in model.parameters()),
        "eval": result.to_dict(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
    }
    (out / "pretrain_report.json").write_text(json.dumps(report, indent=2))
    (out / "README.md").write_text(model_card(report))
    return report


def model_card(report: dict) -> str:
    ev = report["eval"]
    cfg = report["config"]
    return f"""# cppo embedded tiny model

A {report['parameters']:,}-parameter Llama (hidden {cfg['hidden_size']}, {cfg['num_layers']} layers,
{cfg['num_heads']} heads, MLP {cfg['intermediate_size']}, tied embeddings) with a character-level
tokenizer, trained supervised on the embedded arithmetic task (level {cfg['task_level']}) and stopped
on purpose at a partial skill so that RL has room to improve it.

| what | value |
|---|---|
| command | `{report['command']}` |
| training time | {report['train_seconds']} s on {report['machine']} |
| steps x batch | {cfg['steps']} x {cfg['batch_size']} (AdamW lr {cfg['learning_rate']}, seed {cfg['seed']}) |
| final training loss | {report['final_loss']} |
| held-out greedy accuracy | {100 * ev['greedy_accuracy']:.1f} % ({ev['num_questions']} test questions) |
| held-out pass@{ev['k']} (temperature 1.0) | {100 * ev['pass_at_k']:.1f} % |
| held-out sampled accuracy (pass@1, temperature 1.0) | {100 * ev['sample_accuracy']:.1f} % |

Weights: `model.safetensors`. Load with `transformers.AutoModelForCausalLM.from_pretrained(<this dir>)`
or `cppo.models.load_model("embedded")`. Test questions never appear in training (the split is a
seed-independent hash of the problem text).
"""


def command_line() -> str:
    return "cppo " + " ".join(shlex.quote(a) for a in sys.argv[1:])
