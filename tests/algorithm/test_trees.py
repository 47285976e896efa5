"""Token trees: their shape helpers, and greedy tree verification (exactly the target's greedy continuation)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from specdec.algorithm.draft import Draft
from specdec.algorithm.trees import chain_parents, check_tree, children, depths, verify_tree_greedy
from specdec.algorithm.verify import GreedyVerifier, Verdict, verify_greedy
from specdec.errors import SpecdecError
from tests.algorithm.test_verify import logits_for

# A tree of 6 tokens:  root -> 0 (5) -> 2 (7)
#                      root -> 1 (3) -> 3 (2)
#                                    -> 4 (9) -> 5 (4)
TOKENS = [5, 3, 7, 2, 9, 4]
PARENTS = [-1, -1, 0, 1, 1, 4]


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The indices from the root's child down to `node` (inclusive), in order; [] for -1: the reference the
    tests build a node's path with, by walking its parents."""
    path: list[int] = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_shape_helpers():
    assert chain_parents(0) == [] and chain_parents(4) == [-1, 0, 1, 2]
    assert children(PARENTS) == [[0, 1], [2], [3, 4], [], [], [5], []]  # [node + 1]: node's children
    assert depths(PARENTS) == [0, 0, 1, 1, 1, 2]
    assert path_to(PARENTS, 5) == [1, 4, 5] and path_to(PARENTS, 2) == [0, 2] and path_to(PARENTS, -1) == []
    assert depths(chain_parents(3)) == [0, 1, 2] and path_to(chain_parents(3), 2) == [0, 1, 2]


def test_check_tree_says_what_is_wrong():
    check_tree(TOKENS, PARENTS, distinct=True)
    check_tree([1, 1], [-1, 0], distinct=True)  # the same token at two depths is no duplicate
    with pytest.raises(SpecdecError, match="parent"):
        check_tree([1, 2], [-1, 1])  # a parent after (or at) its child
    with pytest.raises(SpecdecError, match="parent"):
        check_tree([1, 2], [-1, -2])
    with pytest.raises(SpecdecError, match="2 parents for 1"):
        check_tree([1], [-1, 0])
    check_tree([1, 1], [-1, -1])  # duplicate siblings are allowed unless asked ...
    with pytest.raises(SpecdecError, match="same token"):
        check_tree([1, 1], [-1, -1], distinct=True)  # ... and found when asked


def tree_logits(argmax_by_row: dict[int, int], vocab: int = 12) -> torch.Tensor:
    """Logits [len(TOKENS) + 1, V] with the given argmax in the given rows (others random)."""
    gen = torch.Generator().manual_seed(sum(argmax_by_row.values()))
    rows = torch.randint(0, vocab, (len(TOKENS) + 1,), generator=gen).tolist()
    for row, token in argmax_by_row.items():
        rows[row] = token
    return logits_for(rows, vocab)


@pytest.mark.parametrize("argmax_by_row,verdict", [
    ({0: 3, 2: 9, 5: 4, 6: 1}, Verdict(3, 1, (1, 4, 5))),  # the second sibling, then the deepest leaf: bonus
    ({0: 8}, Verdict(0, 8, ())),  # no child of the root matches
    ({0: 5, 1: 6}, Verdict(1, 6, (0,))),  # a match, then its only child does not
    ({0: 5, 1: 7, 3: 0}, Verdict(2, 0, (0, 2))),  # a short branch to its leaf: the bonus from the leaf's row
    ({0: 3, 2: 2, 4: 11}, Verdict(2, 11, (1, 3))),  # the first child of node 1
    ({0: 3, 2: 9, 5: 10}, Verdict(2, 10, (1, 4))),  # node 4's child does not match
])
def test_greedy_tree_hand_made(argmax_by_row, verdict):
    logits = tree_logits(argmax_by_row)
    assert verify_tree_greedy(TOKENS, PARENTS, logits) == verdict
    assert GreedyVerifier().verify_tree(Draft(TOKENS, parents=PARENTS), logits) == verdict


def test_greedy_tree_takes_the_first_of_duplicate_siblings():
    tokens, parents = [5, 5, 6], [-1, -1, 1]  # only the second 5 has a child
    logits = logits_for([5, 1, 6, 2])  # rows: root, after 0, after 1, after 2
    assert verify_tree_greedy(tokens, parents, logits) == Verdict(1, 1, (0,))


def test_greedy_tree_follows_the_targets_greedy_continuation():
    # Random trees over a seeded "target": logits after a path are a function of the path's tokens.
    # The verdict must emit the target's greedy continuation, as deep as the tree goes along it.
    vocab, rng = 6, random.Random(5)
    table: dict[tuple[int, ...], torch.Tensor] = {}

    def after(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in table:
            table[prefix] = torch.randn(vocab, generator=torch.Generator().manual_seed(hash(prefix) % 2**31))
        return table[prefix]

    accepted = []
    for _ in range(300):
        n = rng.randint(0, 12)
        tokens: list[int] = []
        parents: list[int] = []
        while len(tokens) < n:  # distinct siblings (a duplicate's subtree is never entered)
            parent = rng.randint(-1, len(tokens) - 1)
            prefix = tuple(tokens[j] for j in path_to(parents, parent))
            token = int(after(prefix).argmax()) if rng.random() < 0.6 else rng.randrange(vocab)
            if all(tokens[c] != token for c in children(parents)[parent + 1]):
                tokens.append(token)
                parents.append(parent)
        logits = torch.stack([after(())] + [after(tuple(tokens[j] for j in path_to(parents, i))) for i in range(n)])
        verdict = verify_tree_greedy(tokens, parents, logits)
        emitted = tuple(tokens[j] for j in verdict.path) + (verdict.next_token,)
        greedy: tuple[int, ...] = ()
        for _ in range(len(emitted)):
            greedy += (int(after(greedy).argmax()),)
        assert emitted == greedy
        assert len(verdict.path) == verdict.num_accepted and (not verdict.path or verdict.path == tuple(
            path_to(parents, verdict.path[-1])))
        # no node of the tree continues the greedy path further
        assert all(tuple(tokens[j] for j in path_to(parents, i)) != greedy for i in range(n))
        accepted.append(verdict.num_accepted)
    assert max(accepted) >= 4 and accepted.count(0) < 150  # deep paths were found, and often some


def test_a_chain_given_as_a_tree_is_verified_as_a_chain():
    gen = torch.Generator().manual_seed(2)
    for trial in range(200):
        k = trial % 6
        logits = torch.randn(k + 1, 5, generator=gen)
        tokens = logits[:k].argmax(-1).tolist()
        if k and trial % 3:
            tokens[trial % k] = (tokens[trial % k] + 1) % 5
        chain = verify_greedy(tokens, logits)
        for parents in (None, chain_parents(k)):
            tree = GreedyVerifier().verify_tree(Draft(tokens, parents=parents), logits)
            assert (tree.num_accepted, tree.next_token) == (chain.num_accepted, chain.next_token)
            assert tree.path == tuple(range(chain.num_accepted))
        if parents is not None:
            assert GreedyVerifier().verify(Draft(tokens, parents=parents), logits) == chain


def test_verify_refuses_a_tree():
    with pytest.raises(ValueError, match="verify_tree"):
        GreedyVerifier().verify(Draft(TOKENS, parents=PARENTS), tree_logits({}))


def test_too_few_logit_rows_is_an_error():
    with pytest.raises(ValueError, match="rows"):
        verify_tree_greedy(TOKENS, PARENTS, torch.zeros(len(TOKENS), 12))
