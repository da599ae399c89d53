"""A character-level tokenizer for the embedded arithmetic task, as a transformers tokenizer.

It is a real `PreTrainedTokenizerFast` (saved as tokenizer.json), so the shipped model loads with
`AutoTokenizer.from_pretrained` like any other. Each character is one token; BOS is prepended.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = tuple("0123456789+-*=")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Vocabulary: 4 special tokens then the task's characters (18 tokens)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, padding_side="left")


def chat_template_variables(tokenizer) -> set[str]:
    """The names the tokenizer's chat template reads (every template, when it has several)."""
    import jinja2
    from jinja2 import meta
    templates = tokenizer.chat_template
    templates = templates.values() if isinstance(templates, dict) else [templates]
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return set().union(*(meta.find_undeclared_variables(env.parse(t)) for t in templates if t))


def with_chat_template_kwargs(tokenizer, kwargs: dict | None):
    """A shallow copy of `tokenizer` whose apply_chat_template passes `kwargs` (TRL's
    chat_template_kwargs, e.g. enable_thinking) to the template on every call (training,
    evaluation and tool prompts); the tokenizer itself is not changed. ConfigError naming the
    field when the tokenizer has no chat template or the template reads none of a key."""
    if not kwargs:
        return tokenizer
    import copy
    import functools
    from cppo.errors import ConfigError
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"'chat_template_kwargs' is {kwargs!r} but the tokenizer has no chat "
                          f"template: remove it, or give a chat model's tokenizer")
    unused = sorted(set(kwargs) - chat_template_variables(tokenizer))
    if unused:
        raise ConfigError(f"'chat_template_kwargs' has {', '.join(map(repr, unused))}, which the "
                          f"tokenizer's chat template does not read (it renders the same with and "
                          f"without): remove it, or check the key's spelling against the "
                          f"template")
    bound = copy.copy(tokenizer)
    bound.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **kwargs)
    return bound
