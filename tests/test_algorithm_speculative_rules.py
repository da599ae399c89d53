"""The accept / resample rule of exact speculative sampling (cppo.algorithm.speculative), exact
integers and hand-picked probabilities, no model: which leading drafts a row accepts."""

import torch

from cppo.algorithm.speculative import accepted_drafts, accepted_drafts_greedy, residual_weights


def test_greedy_accepts_the_leading_drafts_that_are_the_argmax():
    argmax = torch.tensor([[1, 2, 3], [1, 2, 3], [5, 5, 5], [7, 7, 7]])
    drafts = torch.tensor([[1, 2, 4], [1, 9, 3], [5, 5, 5], [0, 7, 7]])
    num_drafts = torch.tensor([3, 3, 2, 3])
    # row 0 stops at the third, row 1 at the second (a later match does not count), row 2 has 2
    # drafts (its padding matches but is not a draft), row 3 rejects the first
    assert accepted_drafts_greedy(argmax, drafts, num_drafts).tolist() == [2, 1, 2, 0]


def test_sampled_drafts_stop_at_the_first_rejection_and_the_padding():
    probs = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.9, 0.9, 0.9]], dtype=torch.float64)
    uniforms = torch.tensor([[0.25, 0.5, 0.0], [0.0, 0.25, 0.75], [0.0, 0.0, 0.0]], dtype=torch.float64)
    # accepted iff u < p: row 0 rejects its second (u = p), row 1 its third, row 2 has 1 draft
    got = accepted_drafts(probs, torch.tensor([3, 3, 1]), uniforms)
    assert got.tolist() == [1, 2, 1] and got.dtype == torch.long


def test_the_rules_work_on_their_tensors_device_not_the_default_one():
    argmax = torch.tensor([[1, 2]])
    probs = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    torch.set_default_device("meta")
    try:
        greedy = accepted_drafts_greedy(argmax, argmax, torch.tensor([2], device="cpu"))
        sampled = accepted_drafts(probs, torch.tensor([2], device="cpu"),
                                  torch.tensor([[0.25, 0.75]], dtype=torch.float64, device="cpu"))
        rest = residual_weights(probs, torch.tensor([1], device="cpu"), torch.tensor([True], device="cpu"))
    finally:
        torch.set_default_device(None)
    assert greedy.tolist() == [2] and sampled.tolist() == [1] and rest.tolist() == [[0.5, 0.0]]


def test_residual_removes_the_rejected_token_of_rejected_rows_only():
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8]], dtype=torch.float64)
    rest = residual_weights(probs, torch.tensor([2, 0]), torch.tensor([True, False]))
    assert rest.tolist() == [[0.2, 0.5, 0.0], [0.1, 0.1, 0.8]]
    assert rest.dtype == torch.float64
