"""EAGLE-2's dynamic draft trees from the head (specdec.head.model.DraftHead.grow / expand, HeadDrafter.propose_tree):
every node's logits in the tree forward are the head's chain forward over its path, each level expands the best
nodes of the one before, the kept tree is the best ancestor-closed set within the budget with the greedy chain
first, width 1 is the chain, the head's cache is rolled back exactly, and greedy decoding stays plain greedy."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.algorithm.draft import Draft, TreeShape
from specdec.algorithm.loop import StopCondition, run
from specdec.backends.hf import HFRunner
from specdec.drafters.tree import alternatives, tree_draft
from specdec.head.drafter import HeadDrafter
from specdec.head.fast import FastHead
from specdec.head.model import GrownTree, HeadCache
from specdec.head.store import TrainResult
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from tests.head.conftest import target_pass
from tests.head.test_drafter import Checked, prompts
from tests.tiny import assert_near_tie_parting, tiny_model

STOP = StopCondition(max_new_tokens=40)


def contexts(target: torch.nn.Module, text: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Verified pairs (the target's features [n, H], the next tokens [n]) of a few contexts: from the training
    text (the head is sure), another the head never saw, and one of a single pair."""
    out = []
    for ids in (text[1][:12], text[3][:7], [1, 50, 7, 88, 13, 41], text[2][:2]):
        features = target_pass(target, torch.tensor([ids]))[0][0]  # [T, H]
        out.append((features[:-1], torch.tensor(ids[1:])))
    return out


def path_of(tree: GrownTree, node: int) -> list[int]:
    """The nodes from the root's child down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def depths_of(parents: list[int]) -> list[int]:
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("form", ["trained", "fp32", "int8"])
@pytest.mark.parametrize("depth,top_k", [(4, 3), (3, 2)])
def test_each_nodes_logits_are_the_chains_over_its_path(depth: int, top_k: int, form: str, window: int | None,
                                                        target: torch.nn.Module, text: list[list[int]],
                                                        trained: TrainResult) -> None:
    """The trained head and its inference forms (specdec.head.fast; int8 where the kernel runs): a node's logits in
    the level's forward are those of the same head's chain forward over the node's path, with an attention
    window too (a node then sees the last verified pairs its path leaves room for)."""
    head = copy.deepcopy(trained.head)
    head.window = window
    head = head if form == "trained" else FastHead(head, form)
    for features, tokens in contexts(target, text):
        tree = head.grow(HeadCache(), features, tokens, depth, top_k)
        expanded = [node for node in tree.logits if node >= 0]
        assert len(expanded) == top_k * (depth - 1)  # the first level has top_k nodes, the others more
        for node in [-1, *expanded]:
            cache = HeadCache()
            feature, logits = head.extend(cache, features, tokens)
            score = 0.0
            for step in path_of(tree, node):  # the chain forward over the node's path
                logp = torch.log_softmax(logits.float(), dim=-1)
                score += float(logp[(head.vocab == tree.tokens[step]).nonzero()[0, 0]])
                assert tree.scores[step] == pytest.approx(score, abs=1e-5)
                feature, logits = head.extend(cache, feature[None], torch.tensor([tree.tokens[step]]))
            assert torch.allclose(tree.logits[node], logits, rtol=1e-5, atol=1e-5), node
            children = [c for c, p in enumerate(tree.parents) if p == node]
            best = torch.topk(logits, top_k).indices  # the node's likeliest children, by draft id
            assert [tree.tokens[c] for c in children] == head.target_ids(best).tolist()


@pytest.mark.parametrize("keep_chain", [False, True])
def test_each_level_expands_its_best_nodes(keep_chain: bool, target: torch.nn.Module, text: list[list[int]],
                                           trained: TrainResult) -> None:
    depth, top_k = 6, 2
    replaced = 0  # levels whose best nodes miss the chain's
    for features, tokens in contexts(target, text):
        tree = trained.head.grow(HeadCache(), features, tokens, depth, top_k, keep_chain)
        chain = trained.head.draft(HeadCache(), features, tokens, depth)
        assert [tree.tokens[i] for i in tree.chain] == chain[:len(tree.chain)]  # the greedy chain ...
        assert len(tree.chain) == depth if keep_chain else 1 <= len(tree.chain) <= depth  # ... all of it if kept
        depths = depths_of(tree.parents)
        for d in range(1, depth + 1):
            level = sorted((i for i, e in enumerate(depths) if e == d), key=lambda i: -tree.scores[i])
            assert len(level) == (top_k if d == 1 else top_k * top_k)
            chosen = {i for i in level if i in tree.logits}
            best = set(level[:top_k])
            if keep_chain and d < depth and tree.chain[d - 1] not in best:  # the chain's node takes the last place
                best = set(level[:top_k - 1]) | {tree.chain[d - 1]}
                replaced += 1
            assert chosen == (best if d < depth else set())  # the deepest level is never fed
        replaced += len(tree.chain) < depth
    assert replaced > 0  # the unsure tiny head's best nodes do leave its chain


@pytest.mark.parametrize("keep_chain", [False, True])
@pytest.mark.parametrize("depth,top_k,nodes", [(4, 2, 8), (5, 3, 10), (3, 3, 20), (6, 2, 3)])
def test_the_kept_tree_is_closed_within_budget_and_the_best(depth: int, top_k: int, nodes: int, keep_chain: bool,
                                                             target: torch.nn.Module, text: list[list[int]],
                                                             trained: TrainResult) -> None:
    head = trained.head
    shorter = 0
    for features, tokens in contexts(target, text):
        grown = head.grow(HeadCache(), features, tokens, min(depth, nodes), top_k, keep_chain)
        ids, parents, scores = head.expand(HeadCache(), features, tokens, depth, top_k, nodes, keep_chain)
        Draft(ids, None, 0, parents)  # parents come before their children
        depths = depths_of(parents)
        assert len(ids) == min(nodes, len(grown.tokens)) and max(depths) <= depth
        assert all(scores[i] <= scores[p] for i, p in enumerate(parents) if p >= 0)  # never above its parent
        for node in [-1, *range(len(ids))]:
            children = [c for c, p in enumerate(parents) if p == node]
            assert len(children) <= top_k and len({ids[c] for c in children}) == len(children)
            assert all(scores[children[0]] >= scores[c] for c in children)  # the first child is the best
        chain = head.draft(HeadCache(), features, tokens, min(depth, nodes))
        first = next((i for i, p in enumerate(parents) if p != i - 1), len(ids))  # the first branch: 0, 1, ..
        assert first >= 1 and ids[:first] == chain[:first]  # a prefix of the greedy chain ...
        assert first == len(chain) if keep_chain else first <= len(chain)  # ... all of it if kept
        shorter += first < len(chain)
        rest = sorted((s for i, s in enumerate(grown.scores) if not keep_chain or i not in grown.chain), reverse=True)
        kept = scores[first:] if keep_chain else scores
        assert len(kept) in (0, len(rest)) or min(kept) >= rest[len(kept)]  # the best nodes (besides the chain)
    if nodes == top_k * depth and not keep_chain:  # the loop's budget: the unsure tiny head's trees prefer a bushy top
        assert shorter > 0


def test_width_one_is_the_chain_and_depth_one_the_first_tokens(target: torch.nn.Module, text: list[list[int]],
                                                               trained: TrainResult) -> None:
    head = trained.head
    forwards: list[int] = []
    hook = head.register_forward_hook(lambda *_: forwards.append(1))
    try:
        for features, tokens in contexts(target, text):
            chain = head.draft(HeadCache(), features, tokens, 5)
            del forwards[:]
            ids, parents, _ = head.expand(HeadCache(), features, tokens, depth=5, top_k=1, nodes=8)
            assert (ids, parents) == (chain, [-1, 0, 1, 2, 3]) and len(forwards) == 5  # as many as the chain
            del forwards[:]
            ids, parents, _ = head.expand(HeadCache(), features, tokens, depth=1, top_k=3, nodes=8)
            logits = head.extend(HeadCache(), features, tokens)[1]  # [N]
            assert ids == head.target_ids(torch.topk(logits, 3).indices).tolist() and ids[0] == chain[0]
            assert parents == [-1, -1, -1] and len(forwards) == 2  # one to expand, one to compare
    finally:
        hook.remove()


def test_the_heads_cache_is_rolled_back_exactly(target: torch.nn.Module, text: list[list[int]],
                                                trained: TrainResult) -> None:
    head = trained.head
    for features, tokens in contexts(target, text):
        before, after = HeadCache(), HeadCache()
        head.extend(before, features, tokens)  # the verified pairs only
        head.expand(after, features, tokens, depth=4, top_k=3, nodes=10)
        assert after.length == before.length == len(tokens)
        assert torch.equal(after.keys, before.keys) and torch.equal(after.values, before.values)
        more = features[-1:], tokens[-1:] * 0 + 5  # the next pair follows at the next position either way
        assert head.draft(after, *more, 3) == head.draft(before, *more, 3)


@pytest.mark.parametrize("width,k,keep_chain", [(2, 3, False), (3, 5, False), (2, 4, True)])
def test_tree_proposals_follow_the_context_fp32(width: int, k: int, keep_chain: bool, target: torch.nn.Module,
                                                 text: list[list[int]], trained: TrainResult) -> None:
    """Through the loop on the fp32 target: what the head is fed at each proposal is the target's own features
    and its cache exactly the pairs before them (Checked), and the output is plain greedy's."""
    runner = HFRunner(target)
    trees = 0
    for prompt in prompts(text):
        drafter = Checked(trained.head, runner, model=target)
        drafter.keep_chain = keep_chain
        out = run(runner, prompt, STOP, drafter, k, tree=TreeShape(width, depth=k))
        assert_near_tie_parting(target, prompt, out.token_ids, run(runner, prompt, STOP).token_ids)
        trees += out.stats.tree_steps
    assert trees > 0


@pytest.mark.parametrize("keep_chain", [False, True])
def test_the_int8_heads_trees_are_bitwise_plain_greedy_int8(keep_chain: bool, text: list[list[int]],
                                                             trained: TrainResult) -> None:
    """The head as `specdec generate --head` runs it (its int8 inference form) drafting trees for the int8 target."""
    runner = LeanRunner(quantize_model(tiny_model("llama", seed=0)))
    head = FastHead(trained.head, "int8")
    trees = 0
    for prompt in prompts(text):
        out = run(runner, prompt, STOP, HeadDrafter(head, runner, keep_chain=keep_chain), 4, tree=TreeShape(2, depth=4))
        assert out.token_ids == run(runner, prompt, STOP).token_ids
        trees += out.stats.tree_steps
    assert trees > 0


class Leaves(HeadDrafter):
    """The head's trees before EAGLE-2's expansion: its greedy chain plus runner-up leaves (never continued)."""

    def propose_tree(self, context, k: int, width: int, nodes: int, source: str | None = None) -> Draft:
        rows: list[torch.Tensor] = []  # [V] each: the head's logits over the target's ids

        def choose(logits: torch.Tensor) -> torch.Tensor:  # [N] -> [] target id
            full = logits.new_full((self.target.vocab_size,), float("-inf"))  # [V]
            rows.append(full.index_copy(0, self.head.vocab, logits))
            return self.head.target_ids(logits.argmax())

        pairs = self._pairs(context, k)
        if pairs is None:
            return Draft([])
        chain = self.head.draft(self.cache, *pairs, k, choose)
        return tree_draft(alternatives(chain, rows, width, nodes), width, nodes, len(pairs[1]))


def test_dynamic_trees_accept_at_least_the_chain_and_leaves(text: list[list[int]], trained: TrainResult) -> None:
    """On the int8 target, same shape and budget: EAGLE-2's trees accept at least as many tokens per step as the
    chain with runner-up leaves (output plain greedy's for both)."""
    runner = LeanRunner(quantize_model(tiny_model("llama", seed=0)))
    shape = TreeShape(2, depth=4)
    totals = {}
    for kind in (Leaves, HeadDrafter):
        accepted = steps = 0
        for prompt in prompts(text) + [text[5][:3], [1, 9, 30]]:
            out = run(runner, prompt, STOP, kind(trained.head, runner), 4, tree=shape)
            assert out.token_ids == run(runner, prompt, STOP).token_ids
            accepted, steps = accepted + out.stats.accepted, steps + out.stats.draft_steps
        totals[kind.__name__] = accepted / steps
    assert totals["HeadDrafter"] >= totals["Leaves"], totals
