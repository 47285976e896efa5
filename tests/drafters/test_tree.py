"""Token-tree drafting (specdec.drafters.tree): shapes (specdec.algorithm.draft), merging candidates, lookup and
model trees."""

import pytest
import torch

from specdec.algorithm.draft import Draft, Drafter, TreeShape, parse_tree
from specdec.backends.hf import HFRunner
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.tree import alternatives, rerank, trie
from specdec.errors import SpecdecError
from tests.tiny import tiny_model


def test_parse_tree():
    assert parse_tree("off") is None and parse_tree(None) is None and parse_tree("1x5") is None
    assert parse_tree("auto") == TreeShape(width=2)
    assert parse_tree(" 3x4 ") == TreeShape(width=3, depth=4)
    for bad in ("wide", "2x", "0x3", "9x2", "2x0"):
        with pytest.raises(SpecdecError, match="tree"):
            parse_tree(bad)
    assert TreeShape(2).budget(5) == 10 and TreeShape(2, nodes=7).budget(5) == 7


def test_trie_merges_shared_prefixes_within_width_and_budget():
    tokens, parents = trie([[1, 2, 3], [1, 2, 4], [1, 5], [6, 7], [8]], width=2, nodes=10)
    assert tokens == [1, 2, 3, 4, 5, 6, 7]
    assert parents == [-1, 0, 1, 1, 0, -1, 5]  # [8] would be the root's third child
    tokens, parents = trie([[1, 2, 3], [1, 2, 4], [1, 5]], width=3, nodes=4)
    assert tokens == [1, 2, 3, 4] and parents == [-1, 0, 1, 1]  # the budget cuts [1, 5]


def test_alternatives_rank_runner_ups_by_path_probability():
    logits = [torch.log(torch.tensor(p)) for p in ([0.6, 0.3, 0.1, 0.0], [0.9, 0.05, 0.05, 0.0], [0.5, 0.0, 0.4, 0.1])]
    branches = alternatives([0, 0, 0], logits, width=2, nodes=5)
    # runner-ups: [1] (0.3), [0, 1] or [0, 2] (0.6 * 0.05), [0, 0, 2] (0.6 * 0.9 * 0.4 = 0.216)
    assert branches[0] == [0, 0, 0]
    assert branches[1:] == [[1], [0, 0, 2]]


def test_rerank_keeps_the_best_closed_set_best_path_first():
    # nodes:   0     1     2 (of 0)  3 (of 0)  4 (of 2)  5 (of 1)
    parents = [-1, -1, 0, 0, 2, 1]
    scores = [-1.0, -0.5, -1.0, -3.0, -1.0, -0.7]  # 2 and 4 tie with their ancestors: the shallower first
    assert rerank(parents, scores, 4) == ([1, 5, 0, 2], [-1, 0, -1, 2])  # the best path 1 -> 5 first
    assert rerank(parents, scores, 3) == ([1, 5, 0], [-1, 0, -1])
    assert rerank(parents, scores, 10) == ([1, 5, 0, 2, 3, 4], [-1, 0, -1, 2, 2, 3])  # by depth, then score
    assert rerank(parents, scores, 0) == ([], [])
    # a kept path comes first whatever its scores; the rest of the budget goes to the best others
    assert rerank(parents, scores, 4, keep=[0, 3]) == ([0, 3, 1, 5], [-1, 0, -1, 2])
    assert rerank(parents, scores, 1, keep=[0, 3]) == ([0], [-1])
    with pytest.raises(ValueError, match="above its parent"):
        rerank([-1, 0], [-2.0, -1.0], 2)
    with pytest.raises(ValueError, match="not a path"):
        rerank(parents, scores, 4, keep=[0, 4])
    with pytest.raises(ValueError, match="before their children"):
        rerank([1, -1], [-1.0, -1.0], 2)


def test_lookup_tree_offers_every_recent_continuation():
    context = [5, 6, 1, 5, 6, 2, 9, 5, 6, 3, 5, 6]
    drafter = LookupDrafter(max_ngram=2)
    chain = drafter.propose(context, 3)
    assert chain.tokens == [3, 5, 6]
    tree = drafter.propose_tree(context, 3, width=3, nodes=9)
    assert tree.tokens == [3, 5, 6, 2, 9, 5, 1, 5, 6] and tree.parents == [-1, 0, 1, -1, 3, 4, -1, 6, 7]
    assert tree.is_tree and tree.q is None
    narrow = drafter.propose_tree(context, 3, width=1, nodes=9)
    assert narrow.tokens == chain.tokens and narrow.parents is None  # width 1: the chain
    assert drafter.propose_tree([1, 2, 3], 3, 2, 6).tokens == []


def test_model_tree_is_the_chain_plus_runner_ups():
    model = tiny_model("llama", 3)
    prompt = [3, 17, 40, 8, 91]
    chain = ModelDrafter(HFRunner(model)).propose(prompt, 4)
    tree = ModelDrafter(HFRunner(model)).propose_tree(prompt, 4, width=2, nodes=7)
    assert tree.tokens[:4] == chain.tokens and tree.parents[:4] == [-1, 0, 1, 2]
    assert len(tree.tokens) == 7 and tree.is_tree
    with torch.inference_mode():
        for token, parent in zip(tree.tokens[4:], tree.parents[4:]):
            path = prompt + chain.tokens[: parent + 1]
            logits = model(torch.tensor([path])).logits[0, -1]  # [V]
            assert token == int(logits.topk(2).indices[1])  # the runner-up after the chain's prefix


def test_hybrid_and_chain_drafters_route_trees():
    hybrid = HybridDrafter(LookupDrafter(max_ngram=2, min_ngram=2), short_matches=False)
    context = [5, 6, 1, 5, 6, 2, 5, 6]
    tree = hybrid.propose_tree(context, 2, 2, 4, "lookup")
    assert tree.tokens == [2, 5, 1, 5] and tree.parents == [-1, 0, -1, 2]

    class Plain(Drafter):
        def propose(self, context, k, source=None):
            return Draft([1] * k)

    assert Plain().propose_tree([0], 3, 2, 4).tokens == [1, 1, 1]  # no propose_tree of its own: its chain
