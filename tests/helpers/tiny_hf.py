"""Tiny randomly initialised Llama and Qwen2 models with byte-level BPE tokenizers (built with the
`tokenizers` library, chat templates set), and GSM8K/MATH-format files, for tests that exercise
the "any transformers model / real dataset" paths offline."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                  "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                  "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

SPECIALS = {
    "qwen2": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                  pad="<|endoftext|>", bos=None, template=QWEN_TEMPLATE),
    "llama": dict(specials=["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                            "<|end_header_id|>", "<|pad|>"], eos="<|eot_id|>", pad="<|pad|>",
                  bos="<|begin_of_text|>", template=LLAMA_TEMPLATE),
}


def build_tokenizer(arch: str, chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (as Qwen2 and Llama 3 use) with no merges: one token per byte,
    the architecture's special tokens, and its chat template."""
    spec = SPECIALS[arch]
    vocab = {tok: i for i, tok in enumerate(spec["specials"] + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    named = (spec["eos"], spec["pad"], spec["bos"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=spec["eos"], pad_token=spec["pad"],
                                  bos_token=spec["bos"],
                                  additional_special_tokens=[t for t in spec["specials"] if t not in named])
    if chat_template:
        tok.chat_template = spec["template"]
    return tok


def build_model(arch: str, tok, **sizes):
    """sizes: config fields to change (hidden_size 128 gives vLLM's CPU attention a head_dim of 32)."""
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.bos_token_id)
    common.update(sizes)
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        return Qwen2ForCausalLM(Qwen2Config(**{"num_key_value_heads": 2,
                                               "tie_word_embeddings": True, **common}))
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, tie_word_embeddings=False, **common))


def build_moe(vocab_size: int, *, eos_token_id: int, pad_token_id: int, bos_token_id=None,
              router_aux_loss_coef: float = 0.001):
    """A tiny random Qwen3-MoE (4 experts, 2 per token, both layers sparse) with transformers'
    eager experts (grouped_mm takes no float64); its config returns router logits on request."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=256, router_aux_loss_coef=router_aux_loss_coef,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
        experts_implementation="eager"))


def save_tiny(arch: str, path: Path, chat_template: bool = True) -> str:
    tok = build_tokenizer(arch, chat_template)
    model = build_model(arch, tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"Tom has {a} apples and buys {a + 3} more. How many now?",
             "answer": f"He has {a} + {a + 3} = {2 * a + 3}.\n#### {2 * a + 3:,}"}
            for a in range(start, start + n)]


def math_rows(n: int, start: int = 0) -> list[dict]:
    return [{"problem": f"Compute ${a}/{2 * a}$ in lowest terms.",
             "solution": f"Cancel {a}: $\\frac{{{a}}}{{{2 * a}}} = \\boxed{{\\frac{{1}}{{2}}}}$.",
             "level": "Level 1", "type": "Prealgebra"} for a in range(start + 1, start + 1 + n)]
