"""Greedy verification: accepted prefix and the target's own next token."""

import torch

from specdec.algorithm.draft import Draft
from specdec.algorithm.verify import GreedyVerifier, verify_greedy


def logits_for(choices: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits [len(choices), vocab] whose argmax in row i is choices[i]."""
    out = torch.randn(len(choices), vocab)
    for i, c in enumerate(choices):
        out[i, c] = out[i].max() + 1.0
    return out


def test_all_accepted_gives_bonus():
    v = verify_greedy([3, 4, 5], logits_for([3, 4, 5, 6]))
    assert (v.num_accepted, v.next_token) == (3, 6)


def test_first_rejected_gives_correction():
    v = verify_greedy([1, 4, 5], logits_for([3, 4, 5, 6]))
    assert (v.num_accepted, v.next_token) == (0, 3)


def test_middle_rejection_stops_acceptance():
    # Token 2 matches again after the mismatch, but acceptance is a prefix.
    v = verify_greedy([3, 7, 5], logits_for([3, 4, 5, 6]))
    assert (v.num_accepted, v.next_token) == (1, 4)


def test_empty_draft_is_a_plain_step():
    v = verify_greedy([], logits_for([2]))
    assert (v.num_accepted, v.next_token) == (0, 2)


def test_greedy_verifier_object():
    verifier = GreedyVerifier()
    assert verifier.choose(logits_for([5])[0]) == 5
    assert verifier.verify(Draft([5, 5]), logits_for([5, 1, 2])).num_accepted == 1
