"""Token Recycling: drafts made of the target's own earlier top candidates, at no cost.

Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling", arXiv 2408.08696): every target forward computes a distribution
over the vocabulary at each position it is fed, and decoding keeps one token of it.  The rest is
"trash" that predicts well what follows the same token later on.  So the drafter keeps an adjacency
matrix (:class:`RecycleMatrix`): for each token t, ``M[t]`` is the target's ``WIDTH`` (8) most likely
next tokens the last time t was fed to it, anywhere: the prefill's last position, a plain step, and
every position of a verification, accepted or rejected (specdec.algorithm.draft.Drafter.target_logits).
A draft follows the matrix from the context's last token:

- **a chain** (``propose``): ``M[t][0]``, then ``M[M[t][0]][0]``, ..., up to k tokens, stopping at a
  token that was never fed;
- **a tree** (``propose_tree``, specdec.drafters.tree): the chain first, then more nodes best first,
  a node's candidates taken from its token's row of the matrix (at most `width` of them).  A node's
  score is the product, along its path, of the chance that a row's candidate of that rank is the
  target's next token (``RANK_PRIOR``, measured).  The paper fixes a tree template (which ranks to
  expand at which depth) and fills it from the matrix breadth first; ranking by these priors gives
  such a template too, cut to the loop's width, node budget and depth.

The matrix persists across requests (the paper's "hot start"): the engine holds one
(``Engine.recycle_matrix``) that all its requests read and write, as it holds the suffix store.  A
seeded sampled request gets a matrix of its own, empty at its start: what it drafts decides which random
numbers verification draws, so its text must depend on its seed and its own tokens only, never on what
other requests fed the target (specdec.drafters.spec._recycle).

Worked example, WIDTH = 2 (tokens are words), an empty matrix, k = 3::

    prefill "the cat sat on the":  M[the] = [mat, floor]     the first token: "mat"
    "mat" was never fed:           a plain step over "mat":  M[mat] = [., and]    next: "."
    "." was never fed:             a plain step over ".":    M[.] = [the, it]     next: "the"
    from "the", the chain:         M[the][0], M[mat][0], M[.][0] = ["mat", ".", "the"]
    as a tree (width 2, 5 nodes):  the chain, then "floor" beside "mat" and "and" beside "."
    the verification's forward over ["the", "mat", ".", "the"]: four rows, each its token's new row
    (two for "the": the last one's)

What it buys, measured on the built-in prompts (qwen2.5-coder-1.5b gguf, greedy, -n 64, one prompt per
category, in the bench's order, one engine): recycled chains of k = 5 gave 1.11 tokens per target forward
(prompt lookup 1.47), trees of 2x5, 4x5 and 8x6 (48 nodes, near the paper's 80) 1.22, 1.34 and 1.73 (lookup's
2x5 1.52); with the matrix first warmed on the 70 prompts of the short set (1,968 tokens then had a row),
1.14, 1.31, 1.48 and 1.76.  The matrix knows only tokens the target was fed, so most steps of a young
engine find no row; and a CPU pays for every row it verifies, where the paper's GPU verifies 80 for
about the price of one.

A proposal carries no probabilities (``q = None``): verified as a deterministic draft, exactly greedy's
output under greedy decoding and the target's distribution under sampling.  What the drafter pays is
a top-8 of each row the target computes (:func:`top_candidates`: ~0.2 ms for 9 rows of Qwen2.5's
151,936 logits on one core, where torch.topk takes 1.6 ms) and a list lookup per drafted token.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence

import torch

from specdec.algorithm.draft import RECYCLE, SHORT_RECYCLE, Draft, Drafter
from specdec.drafters.tree import tree_draft

WIDTH = 8  # candidates kept per token (the paper keeps the top 8)
BLOCK = 128  # top_candidates: logits per block whose maximum is taken first
# A tree's ranking (propose_tree): the chance that the target's next token after a token is that token's row's
# candidate of rank r, measured over every row verified on the built-in prompts (qwen2.5-coder-1.5b, greedy,
# -n 64, chains; 32% the first candidate, 52% one of the eight)
RANK_PRIOR = (0.32, 0.07, 0.045, 0.02, 0.02, 0.015, 0.015, 0.015)
MARGINS = (1.0, 2.0, 4.0)  # grade(): classes of the first candidate's margin over the second, in logits
HYBRID_MIN_MARGIN = 4.0  # in a hybrid, recycled drafts go first where the first candidate led by this much


def margin_grade(margin: float) -> str:
    """The grade of a recycled proposal whose first token led the target's second choice by `margin` logits
    (RecyclingDrafter.grade): "margin 0-1", "margin 1-2", "margin 2-4", "margin 4+"."""
    for low, high in zip((0.0, *MARGINS), MARGINS):
        if margin < high:
            return f"margin {low:g}-{high:g}"
    return f"margin {MARGINS[-1]:g}+"


def top_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[n, min(k, V)] the indices of each row's k largest `logits` [n, V], largest first: torch.topk's
    (ties may be broken otherwise), found by a faster route on a large vocabulary.  The row is cut into
    blocks of BLOCK logits; the k blocks with the largest maxima hold the row's k largest logits (a block
    that holds one of them has a maximum at least the k-th largest, and at most k blocks do, as each holds
    one of them; ties aside), so a top-k of the block maxima and one of those k blocks' logits give them,
    reading the row once."""
    rows, vocab = logits.shape
    k = min(k, vocab)
    blocks = vocab // BLOCK
    if blocks < 4 * k:  # a small vocabulary: torch.topk is as fast
        return torch.topk(logits, k, dim=-1).indices
    body = logits[:, : blocks * BLOCK].reshape(rows, blocks, BLOCK)  # [n, blocks, BLOCK]
    best = body.amax(dim=-1).topk(k, dim=-1).indices  # [n, k] the blocks with the largest maxima
    columns = (best.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).reshape(rows, k * BLOCK)  # [n, k * BLOCK]
    if blocks * BLOCK < vocab:  # the tail that fills no block is a candidate too
        tail = torch.arange(blocks * BLOCK, vocab).expand(rows, -1)  # [n, V mod BLOCK]
        columns = torch.cat([columns, tail], dim=1)
    picked = logits.gather(1, columns).topk(k, dim=-1).indices  # [n, k] into columns
    return columns.gather(1, picked)


class RecycleMatrix:
    """The adjacency matrix M: for each token, the target's `width` most likely next tokens the last time
    it was fed (its most likely first), or nothing for a token never fed.  Sized to the target's
    vocabulary at the first update ([V, width] int32: 4.9 MB for Qwen2.5's); a lock makes it safe for a
    server's worker threads."""

    def __init__(self, width: int = WIDTH) -> None:
        if width < 1:
            raise ValueError(f"a recycling matrix keeps at least 1 candidate a token, got {width}")
        self.width = width
        self._next: torch.Tensor | None = None  # [V, width] int32 candidates, -1 in the rows of tokens never fed
        self._margin: torch.Tensor | None = None  # [V] the first candidate's logit minus the second's (inf: no second)
        self._lock = threading.Lock()
        self.updates = 0  # forwards heard

    def update(self, fed: Sequence[int], logits: torch.Tensor) -> None:
        """Row i of `logits` [len(fed), V] is the target's prediction after fed[i]: M[fed[i]] becomes its top
        candidates.  A token fed twice in one forward keeps its last row's (deterministic, whatever the
        order torch writes rows in)."""
        if not len(fed):
            return
        top = top_candidates(logits, self.width)  # [n, w]
        best = logits.gather(1, top[:, :2]).float()  # [n, min(w, 2)] the two best logits
        margin = best[:, 0] - best[:, 1] if best.shape[1] > 1 else torch.full_like(best[:, 0], float("inf"))  # [n]
        last = {int(token): row for row, token in enumerate(fed)}  # each token's last row
        tokens = torch.tensor(list(last), dtype=torch.long)  # [m]
        rows = torch.tensor(list(last.values()), dtype=torch.long)  # [m]
        with self._lock:
            if self._next is None or self._margin is None:
                self._next = torch.full((logits.shape[-1], self.width), -1, dtype=torch.int32)
                self._margin = torch.zeros(logits.shape[-1])
            self._next[tokens, : top.shape[1]] = top[rows].to(torch.int32)
            self._margin[tokens] = margin[rows]
            self.updates += 1

    def candidates(self, token: int) -> list[int]:
        """M[token]: the target's most likely next tokens after `token` when it was last fed, most likely
        first; [] for a token never fed."""
        with self._lock:
            if self._next is None or not 0 <= token < self._next.shape[0]:
                return []
            row = self._next[token].tolist()
        return [t for t in row if t >= 0]

    def margin(self, token: int) -> float | None:
        """How far the target preferred M[token]'s first candidate to its second, in logits, when `token` was
        last fed (inf for a vocabulary of one); None for a token never fed."""
        with self._lock:
            if self._next is None or self._margin is None or not 0 <= token < self._next.shape[0] \
                    or int(self._next[token, 0]) < 0:
                return None
            return float(self._margin[token])

    @property
    def known(self) -> int:
        """Tokens that have a row (were fed at least once)."""
        with self._lock:
            return 0 if self._next is None else int((self._next[:, 0] >= 0).sum())

    def copy(self) -> RecycleMatrix:
        """A matrix of its own with the same rows."""
        twin = RecycleMatrix(self.width)
        with self._lock:
            twin._next = None if self._next is None else self._next.clone()
            twin._margin = None if self._margin is None else self._margin.clone()
            twin.updates = self.updates
        return twin


class RecyclingDrafter(Drafter):
    """Proposes the path the target's own earlier top candidates give from the context's last token
    (Token Recycling; see the module doc), over `matrix` (None: a matrix of its own).

    min_margin: propose only where the target preferred the first token to its second choice by at least
    this many logits when it computed the row (a hybrid's first source asks for HYBRID_MIN_MARGIN; its
    :meth:`shorter` proposes the rest)."""

    source = RECYCLE

    def __init__(self, matrix: RecycleMatrix | None = None, min_margin: float = 0.0) -> None:
        self.matrix = matrix if matrix is not None else RecycleMatrix()
        self.min_margin = min_margin

    def target_logits(self, fed: Sequence[int], logits: torch.Tensor) -> None:
        """Every row the target computed updates the matrix (RecycleMatrix.update)."""
        self.matrix.update(fed, logits)

    def chain(self, token: int, k: int) -> list[int]:
        """Up to k tokens after `token`, each its predecessor's first candidate; shorter where a token was
        never fed."""
        out: list[int] = []
        while len(out) < k:
            row = self.matrix.candidates(token)
            if not row:
                break
            token = row[0]
            out.append(token)
        return out

    def matches(self, context: Sequence[int]) -> bool:
        """Whether a proposal for `context` would hold a token: its last token has a row, whose first
        candidate led by at least min_margin."""
        margin = self.matrix.margin(context[-1]) if context else None
        return margin is not None and margin >= self.min_margin

    def grade(self, context: Sequence[int], source: str = RECYCLE) -> str | None:
        """The class of evidence behind the proposal for `context` (Drafter.grade), None for no proposal:
        how far its first token led the target's second choice when the row was computed (margin_grade).
        On the built-in prompts (qwen2.5-coder-1.5b) a first token that led by 4 logits or more was the
        target's next token 45% of the time, one that led by less than 2, 22%."""
        if not self.matches(context):
            return None
        margin = self.matrix.margin(context[-1])
        return None if margin is None else margin_grade(margin)

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        if k <= 0 or not self.matches(context):
            return Draft([])
        return Draft(self.chain(context[-1], k))

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """propose()'s chain first, then the best other paths over the matrix, best first by the product of
        their candidates' RANK_PRIOR, merged into a tree: at most `width` children per node (a row's first
        `width` candidates), `nodes` tokens, k deep."""
        if k <= 0 or not self.matches(context):
            return Draft([])
        chain = self.chain(context[-1], k)
        if not chain:
            return Draft([])
        order = itertools.count()  # ties go to the path found first
        heap: list[tuple[float, int, list[int]]] = []

        def offer(path: list[int], score: float, taken: int | None) -> None:
            """Queue the children of the node at the end of `path` (the context's last token for []), but
            `taken` (the chain's next token, already in the tree)."""
            if len(path) >= k:
                return
            row = self.matrix.candidates(path[-1] if path else context[-1])[:width]
            for rank, token in enumerate(row):
                if token != taken:
                    prior = RANK_PRIOR[min(rank, len(RANK_PRIOR) - 1)]
                    heapq.heappush(heap, (-score * prior, next(order), path + [token]))

        for depth in range(len(chain) + 1):
            offer(chain[:depth], RANK_PRIOR[0] ** depth, chain[depth] if depth < len(chain) else None)
        branches = [chain]
        while heap and len(chain) + len(branches) - 1 < nodes:
            negative, _, path = heapq.heappop(heap)
            branches.append(path)
            offer(path, -negative, None)
        return tree_draft(branches, width, nodes)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to learn here: the matrix hears the verification's logits (target_logits)."""

    def reset(self) -> None:
        """A new generation: the matrix stays (the paper's hot start); a drafter that must not share it is
        built over a matrix of its own."""

    def outlook(self, context: Sequence[int]) -> tuple[str, int]:
        """A model-free proposal: no model to catch up."""
        return self.source, 0

    def shorter(self) -> tuple[str, RecyclingDrafter] | None:
        """A hybrid's fallback for the proposals this drafter leaves out: recycled drafts over the same
        matrix whatever their margin (source SHORT_RECYCLE), None when min_margin already lets all through."""
        if self.min_margin <= 0:
            return None
        return SHORT_RECYCLE, RecyclingDrafter(self.matrix)
