"""Prompts -> one left-padded batch (encode_prompts) and token lists -> a padded batch."""

import copy

import pytest
import torch

from cppo.sampling.padding import pad_token_lists
from cppo.sampling.sampler import encode_prompts


@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_token_lists_places_each_row_and_its_mask(side):
    rows = [[5, 6, 7], [], [8], [9, 10]]
    ids, mask = pad_token_lists(rows, 0, side=side, min_width=4)
    if side == "left":
        expected = [[0, 5, 6, 7], [0, 0, 0, 0], [0, 0, 0, 8], [0, 0, 9, 10]]
        expected_mask = [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]]
    else:
        expected = [[5, 6, 7, 0], [0, 0, 0, 0], [8, 0, 0, 0], [9, 10, 0, 0]]
        expected_mask = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert ids.tolist() == expected and mask.tolist() == expected_mask
    assert ids.dtype == mask.dtype == torch.long
    assert pad_token_lists(rows, 0, side=side)[0].shape == (4, 3)       # width: the longest row
    assert pad_token_lists([], 0, side=side, min_width=2)[0].shape == (0, 2)
    with pytest.raises(ValueError, match="side"):
        pad_token_lists(rows, 0, side="middle")


def test_encode_prompts_keeps_the_order_of_plain_and_chat_prompts(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}"
    prompts = ["12*34=", [{"role": "user", "content": "5*6="}], "99*1=", [{"role": "user", "content": "7*8="}]]
    batch = encode_prompts(tok, prompts)
    rows = [batch.ids[i][batch.mask[i].bool()].tolist() for i in range(len(prompts))]
    # a plain prompt gets the tokenizer's BOS; a chat prompt's template writes its own, once
    assert rows[0] == tok("12*34=")["input_ids"] and rows[2] == tok("99*1=")["input_ids"]
    assert rows[1] == tok("<bos>5*6=", add_special_tokens=False)["input_ids"]
    assert rows[3] == tok("<bos>7*8=", add_special_tokens=False)["input_ids"]
    assert rows[0][0] == rows[1][0] == tok.bos_token_id and rows[1][1] != tok.bos_token_id
    assert bool(batch.mask[:, -1].all())                                 # left-padded


def test_encode_prompts_keeps_the_last_max_prompt_length_tokens(tiny_tokenizer):
    full = tiny_tokenizer("12*34=")["input_ids"]
    batch = encode_prompts(tiny_tokenizer, ["12*34=", "5*6="], max_prompt_length=4)
    assert batch.ids.shape == (2, 4)
    assert batch.ids[0].tolist() == full[-4:]
    assert batch.ids[1].tolist() == tiny_tokenizer("5*6=")["input_ids"][-4:]
