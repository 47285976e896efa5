"""Token trees as drafts: several continuations verified in one target forward (issue 39).

A chain of k draft tokens uses a verification's spare rows only while its first guesses are right; a
tree spends some of them on second choices where the drafter is unsure (SpecInfer, Miao et al. 2024,
arXiv 2305.09781; Medusa, Cai et al. 2024; EAGLE-2's dynamic trees, Li et al. 2024, arXiv 2406.16858).
A tree draft is a :class:`specdec.algorithm.draft.Draft` with ``parents``; the target verifies every node
in one forward with tree attention (specdec.backends.base.ModelRunner.forward_tree) and keeps the longest accepted path.

How far a tree may grow is a :class:`specdec.algorithm.draft.TreeShape` (``--tree WxD``: at most W children
per node, paths at most D tokens deep; ``auto``: the speculation controller's k is the depth), which the
loop and the controller read too.  This module holds what the drafters share:

- :func:`trie`: candidate continuations (each a list of tokens, most promising first) merged into one
  tree: shared prefixes become one path, at most `width` children per node, at most `nodes` tokens;
- :func:`alternatives`: a greedy chain drafted by a model plus its runner-up tokens, ranked as EAGLE-2
  ranks nodes (the draft's probability of the whole path up to the node), as branches for :func:`trie`;
- :func:`rerank`: EAGLE-2's reranking of a grown tree: its best nodes by path score, in draft order;
- a drafter makes its tree in ``Drafter.propose_tree`` (by default its chain), from these.

Lookup proposes the continuations of several earlier matches (specdec.drafters.lookup); a draft model
its greedy chain and runner-ups; a draft head EAGLE-2's dynamic tree, grown level by level with one head
forward per level (specdec.head.model.DraftHead.expand).  Only greedy drafts are trees here: a sampled
draft (with q) stays a chain, so sampling through a tree uses deterministic candidates (specdec.algorithm.trees).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specdec.algorithm.draft import Draft

if TYPE_CHECKING:
    import torch


def trie(branches: Sequence[Sequence[int]], width: int, nodes: int) -> tuple[list[int], list[int]]:
    """Merge candidate continuations (most promising first) into one tree: (tokens, parents), parents[i] < i,
    -1 for a child of the context's end.  A branch shares the nodes of its prefix already in the tree; it
    is cut where a node would get more than `width` children or the tree more than `nodes` tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[int, dict[int, int]] = {-1: {}}  # node -> its children by token
    for branch in branches:
        node = -1
        for token in branch:
            below = children[node]
            if token in below:
                node = below[token]
                continue
            if len(below) >= width or len(tokens) >= nodes:
                break
            tokens.append(int(token))
            parents.append(node)
            below[token] = len(tokens) - 1
            node = len(tokens) - 1
            children[node] = {}
    return tokens, parents


def alternatives(chain: Sequence[int], logits: Sequence[torch.Tensor], width: int, nodes: int) -> list[list[int]]:
    """A greedy chain and its runner-ups as branches for :func:`trie`: the chain first, then for each
    position i the draft's next-best tokens after chain[:i] (up to width - 1 of them), ranked by the draft's
    probability of the whole path (the chain's tokens before i, then the runner-up), as EAGLE-2 ranks the
    nodes it expands.  logits[i] [V]: the draft's logits for position i (the chain's token is its argmax
    or close to it); at most nodes - len(chain) runner-ups."""
    scored: list[tuple[float, int, list[int]]] = []
    reach = 0.0  # log probability of the chain up to position i
    for i, (token, row) in enumerate(zip(chain, logits)):
        logp = row.float().log_softmax(dim=-1)  # [V]
        top = logp.topk(min(width, logp.shape[-1]))
        runner_ups = [(float(v), int(t)) for v, t in zip(top.values, top.indices) if int(t) != token][: width - 1]
        scored.extend((reach + v, i, list(chain[:i]) + [t]) for v, t in runner_ups)
        reach += float(logp[token])
    scored.sort(key=lambda s: (-s[0], s[1]))
    return [list(chain)] + [branch for _, _, branch in scored[: max(nodes - len(chain), 0)]]


def tree_draft(branches: Sequence[Sequence[int]], width: int, nodes: int, synced: int = 0) -> Draft:
    """The Draft of merged branches: a chain when no node has a sibling (parents None)."""
    tokens, parents = trie(branches, width, nodes)
    draft = Draft(tokens, None, synced, parents)
    return draft if draft.is_tree else Draft(tokens, None, synced)


def rerank(parents: Sequence[int], scores: Sequence[float], nodes: int,
           keep: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """EAGLE-2's reranking of a grown tree (parents[i] < i, -1: a child of the context's end; scores: path
    scores, a child's never above its parent's): keep the `nodes` best nodes, ties to the shallower node, then
    the earlier one, so the kept set holds every kept node's parent; `keep`: a path from the root kept first
    whatever its scores (a greedy chain).  Returns (the kept nodes in draft order, their parents as indices
    into that order): the best path first (from the root, each node's best kept child: a greedy drafter's
    chain as far as the tree kept it, which the loop counts as the first branch), then the rest by depth,
    then score; parents come before children and each node's best child is its first."""
    depth: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"a tree's parents must come before their children: {list(parents)}")
        if parent >= 0 and scores[i] > scores[parent]:
            raise ValueError(f"node {i} scores {scores[i]} above its parent's {scores[parent]}")
        depth.append(1 if parent < 0 else depth[parent] + 1)
    if any(parents[node] != above for node, above in zip(keep, [-1, *keep])):
        raise ValueError(f"nodes {list(keep)} are not a path from the root")
    pinned = set(keep)
    ranked = sorted(range(len(parents)), key=lambda i: (i not in pinned, -scores[i], depth[i], i))[:max(nodes, 0)]
    rank = {node: r for r, node in enumerate(ranked)}
    best: dict[int, int] = {}  # node (-1: the root) -> its best kept child
    for node in ranked:
        best.setdefault(parents[node], node)
    path: list[int] = []
    node = -1
    while node in best:
        node = best[node]
        path.append(node)
    on_path = set(path)
    order = path + sorted((i for i in ranked if i not in on_path), key=lambda i: (depth[i], rank[i]))
    index = {node: j for j, node in enumerate(order)}
    return order, [index[parents[i]] if parents[i] >= 0 else -1 for i in order]
