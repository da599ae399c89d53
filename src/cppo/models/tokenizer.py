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
