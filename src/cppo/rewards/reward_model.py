"""Reward models: a sequence-classification model scores prompt + completion, as in TRL.

`RewardModel` wraps a `transformers` model with one output label (a local folder, a hub id, or a
model object) and its tokenizer (TRL: `reward_processing_classes`) into a function with TRL's
reward signature. Plain-text rows are scored on `prompt + completion`; chat rows on the
conversation (prompt messages + the assistant's completion) through the reward tokenizer's chat
template. The score is `logits[:, 0]`; a model whose logits are not (N, 1) is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from cppo.errors import RewardModelError

SCORE_BATCH_SIZE = 64   # texts per reward-model forward pass


def is_reward_model(obj) -> bool:
    """A transformers model object (not a plain function)."""
    from transformers import PreTrainedModel
    return isinstance(obj, PreTrainedModel)


def looks_like_model(name: str) -> bool:
    """A local folder with a config.json, or a hub id ('org/name') that is not a local path."""
    path = Path(name).expanduser()
    if path.is_dir():
        return (path / "config.json").is_file()
    return name.count("/") == 1 and ":" not in name and not name.startswith((".", "/", "~"))


def load_reward_model(name: str, device=None, torch_dtype=None, trust_remote_code: bool = False):
    from transformers import AutoModelForSequenceClassification
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=1, trust_remote_code=trust_remote_code,
            **({"torch_dtype": torch_dtype} if torch_dtype else {}))
    except (OSError, ValueError) as err:
        raise RewardModelError(f"reward function {name!r} is neither a registry name, a "
                               f"'module:function' path nor a loadable sequence-classification "
                               f"model: {err}") from err


class RewardModel:
    """f(prompts, completions, completion_ids=None, **columns) -> list[float] from a model."""

    def __init__(self, model, processing_class=None, device=None,
                 trust_remote_code: bool = False) -> None:
        if isinstance(model, str):
            model = load_reward_model(model, trust_remote_code=trust_remote_code)
        if processing_class is None:
            from transformers import AutoTokenizer
            source = getattr(model.config, "_name_or_path", None)
            try:
                processing_class = AutoTokenizer.from_pretrained(
                    source, trust_remote_code=trust_remote_code)
            except (OSError, ValueError, TypeError) as err:
                raise RewardModelError(
                    f"reward model {source or type(model).__name__!r}: no tokenizer could be loaded from its folder or id "
                    f"({err}); pass one in reward_processing_classes") from err
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        model.config.pad_token_id = processing_class.pad_token_id
        self.model = model.eval().requires_grad_(False)
        if device is not None:
            self.model.to(device)
        self.tokenizer = processing_class
        name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.__name__ = Path(name.rstrip("/")).name or type(model).__name__

    def texts(self, prompts: list, completions: list) -> list[str]:
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                out.append(prompt + (completion if isinstance(completion, str)
                                     else completion[-1]["content"]))
            else:   # chat: the conversation through the reward tokenizer's template
                out.append(self.tokenizer.apply_chat_template(list(prompt) + list(completion),
                                                              tokenize=False))
        return out

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, completion_ids=None, **columns) -> list[float]:
        texts = self.texts(prompts, completions)
        device = next(self.model.parameters()).device
        scores = []
        for s in range(0, len(texts), SCORE_BATCH_SIZE):
            batch = self.tokenizer(texts[s:s + SCORE_BATCH_SIZE], return_tensors="pt", padding=True,
                                   padding_side="right", add_special_tokens=False).to(device)
            logits = self.model(**batch).logits
            if logits.dim() != 2 or logits.shape != (len(batch["input_ids"]), 1):
                raise RewardModelError(
                    f"reward model '{self.__name__}' returned logits of shape "
                    f"{tuple(logits.shape)} for {len(batch['input_ids'])} texts; expected "
                    f"({len(batch['input_ids'])}, 1): a sequence-classification model with "
                    f"num_labels=1")
            scores += logits[:, 0].float().tolist()
        return scores
