"""Token trees: their shape, and verifying a tree draft against the target in one step (issue 39).

A tree draft (specdec.algorithm.draft.Draft with `parents`) holds n tokens; parents[i] is the index of
token i's parent, -1 for a child of the pending token (the context's last, which the target's forward
starts with), and parents come before their children.  The target's forward over [pending, *tokens]
with tree attention gives logits [n + 1, V]: row 0 is the prediction after the pending token (for the
children of -1), row i + 1 the prediction after token i (for the children of i).  So node -1..n-1 reads
row node + 1, and ``children(parents)[node + 1]`` lists its children.

Greedy (SpecInfer, Miao et al. 2024, arXiv 2305.09781): walk from the root, each time into the first
child whose token is the target's argmax at the current node's row; stop where none is; the next token
is that argmax.  The emitted tokens are exactly the target's greedy continuation (a later sibling with
the same token as an earlier one is never entered).

Sampling: multi-draft speculative sampling by recursive rejection sampling, RRS (SpecInfer, Miao et al.
2024, arXiv 2305.09781, its "multi-step speculative sampling").  At a node with children c_1..c_m
(tokens x_j) and target distribution r = p[row] (warped):
for j = 1..m accept c_j with probability min(1, r(x_j) / q_j(x_j)) and descend into it; on rejection
r <- norm(max(0, r - q_j)) and try the next child; if all are rejected the next token is drawn from r.
An accepted node without children gives the bonus token from its own row.
- q None (deterministic candidates: lookup continuations, the top-w of a greedy draft): q_j is one-hot
  on x_j, so c_j is accepted with probability r(x_j) and a rejection removes x_j from r (renormalised).
  This holds for any tree, however it was chosen.
- q given: q_j = q[c_j], the distribution c_j was drawn from.  SpecInfer's setting is children drawn
  i.i.d. from the parent's draft distribution: every child of a node has that same row.

What holds, for the emitted tokens to be distributed exactly as the target's: every row q[i] must be the
law of token i given every token drawn before it (tokens drawn in index order, a child after its parent).
By induction on m, whatever r is: P(emit x) = min(r, q_1)(x) + (1 - sum(min(r, q_1))) norm(max(0, r - q_1))(x)
= r(x), because given x_1 and its rejection the remaining children are again such a scheme, and the new r
does not depend on x_1.  So i.i.d. children (one common row), children from different drafters drawn
independently (each its own row), and children drawn without replacement (row j: the draft distribution
without the earlier siblings' tokens, renormalised) are all exact.  A drafter that draws i.i.d. and then
drops duplicate siblings while keeping the common row is not (tests/algorithm/test_trees_sampling.py shows it): it
must keep the duplicates (a rejected token's residual is 0, so its duplicate is never accepted) or say
what it did in q.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.algorithm.sampling import Randomness, as_randomness
from specdec.algorithm.verdict import Verdict
from specdec.errors import SpecdecError


def chain_parents(k: int) -> list[int]:
    """The parents of a chain of k tokens: token i follows token i - 1 (the first follows the context)."""
    return list(range(-1, k - 1))


def check_tree(tokens: Sequence[int], parents: Sequence[int], distinct: bool = False) -> None:
    """A SpecdecError unless `parents` is a tree over `tokens` (one parent each, parents before their
    children); with `distinct`, also unless siblings have distinct tokens."""
    if len(parents) != len(tokens):
        raise SpecdecError(f"{len(parents)} parents for {len(tokens)} tree tokens: one each")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise SpecdecError(f"token {i}'s parent must be -1 or an earlier token, got {parent}")
    if distinct:
        seen = {(parent, token) for parent, token in zip(parents, tokens)}
        if len(seen) < len(tokens):
            raise SpecdecError("two siblings of the tree have the same token")


def children(parents: Sequence[int]) -> list[list[int]]:
    """kids such that kids[node + 1] lists node's children in index order (kids[0]: the root's, node -1)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        kids[parent + 1].append(i)
    return kids


def depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth: 0 for a child of -1, one more than its parent's otherwise."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent == -1 else out[parent] + 1)
    return out


def tree_parents(tokens: Sequence[int], parents: Sequence[int] | None) -> list[int]:
    """`parents`, or a chain's when None; checked (check_tree)."""
    parents = chain_parents(len(tokens)) if parents is None else list(parents)
    check_tree(tokens, parents)
    return parents


def _check_rows(rows: torch.Tensor, n: int, what: str) -> None:
    if rows.shape[0] < n + 1:
        raise ValueError(f"{what} has {rows.shape[0]} rows for a tree of {n} tokens (needs {n + 1})")


def verify_tree_greedy(tokens: Sequence[int], parents: Sequence[int] | None, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification of a tree: the deepest path the target's argmax follows.

    tokens: n ids; parents: n parent indices (None: a chain).  target_logits: [n + 1, V], row node + 1
    the target's prediction after node.  For a chain the verdict is verify_greedy's, with its path filled.
    """
    parents = tree_parents(tokens, parents)
    _check_rows(target_logits, len(tokens), "target_logits")
    kids = children(parents)
    choice = target_logits[: len(tokens) + 1].argmax(dim=-1).tolist()  # [n + 1]
    path: list[int] = []
    node = -1
    while True:
        want = choice[node + 1]
        step = next((child for child in kids[node + 1] if tokens[child] == want), None)
        if step is None:
            return Verdict(len(path), want, tuple(path))
        path.append(step)
        node = step


def acceptance(p_x: float, q_x: float) -> float:
    """min(1, p_x / q_x): 0 where the target gives the token no mass, 1 where the draft gave it less."""
    if p_x <= 0.0:
        return 0.0
    return 1.0 if q_x <= p_x else p_x / q_x


def _reject(r: torch.Tensor, token: int, q_row: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, r - q_row)) for r [V], q_row [V] (None: one-hot on token); r itself where that has
    no mass (only where the rejection had probability 0 up to rounding, or q_row never gave token)."""
    if q_row is None:
        residual = r.clone()  # [V]
        residual[token] = 0.0
    else:
        residual = torch.clamp(r - q_row, min=0.0)  # [V]
    total = float(residual.sum())
    return residual / total if total > 0.0 else r


def verify_tree_sampling(
    tokens: Sequence[int],
    parents: Sequence[int] | None,
    q: torch.Tensor | None,
    p: torch.Tensor,
    rng: torch.Generator | Randomness,
) -> Verdict:
    """Recursive rejection sampling over a tree (see the module doc): lossless for the target p.

    tokens: n ids; parents: n parent indices (None: a chain).
    q: [n, V] the distribution each token was drawn from, or None (deterministic candidates).
    p: [n + 1, V] target probabilities (already warped), row node + 1 after node.
    rng: a generator, or Randomness (tests script it).
    """
    parents = tree_parents(tokens, parents)
    _check_rows(p, len(tokens), "p")
    rng = as_randomness(rng)
    kids = children(parents)
    path: list[int] = []
    node = -1
    while True:
        r = p[node + 1].double()  # [V]
        for child in kids[node + 1]:
            token = tokens[child]
            q_row = None if q is None else q[child].double()  # [V]
            if rng.bernoulli(acceptance(float(r[token]), 1.0 if q_row is None else float(q_row[token]))):
                path.append(child)
                node = child
                break
            r = _reject(r, token, q_row)
        else:  # no child accepted (or none at all: the bonus from this node's row)
            return Verdict(len(path), rng.sample(r), tuple(path))
