"""What a draft is, to the algorithm: the drafter protocol, the sources a proposal comes from, a tree's shape.

The decode loop and the speculation controller (specdec.algorithm.loop, .control) work on these; the
drafters (specdec.drafters, specdec.head) implement them, a floor above.


A drafter proposes k tokens in the *target's* vocabulary, optionally with the
distribution q it sampled them from.  The decode loop verifies the proposal
with the target (see specdec.algorithm.verify) and reports back how many tokens were
accepted, which a drafter may use (e.g. to adapt k).

The protocol holds every method a caller asks of a drafter; a drafter subclasses
it and overrides what it does differently from its defaults: a token tree
(``propose_tree``; by default its chain), its sources and what they would cost
(``sources``, ``outlook``, ``lag``; by default one draft model that needs no
catch-up), how sure a proposal is (``grade``; by default ungraded), and what a
drafter that reads what the target computed hears: that the prompt's prefill
has just run (``prefilled``), before any other forward replaces what the runner
kept of it, and that a plain step has just run (``plain_step``); ``observe``
follows every verification, whichever of a hybrid's sources proposed.  A drafter
that recycles the target's own predictions (specdec.drafters.recycling) hears
the logits of every target forward (``target_logits``): the prefill's last row,
each plain step's row and every row of each verification, accepted or not.

A token tree's shape (:class:`TreeShape`, ``--tree WxD``) says how far a drafter's tree may grow; the
drafters' tree building is specdec.drafters.tree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specdec.errors import SpecdecError

if TYPE_CHECKING:  # torch only types a draft's q here: the CLI's options import this module without it
    import torch

# The sources a proposal comes from; the speculation controller (specdec.algorithm.control) keeps acceptance per
# source, and plans a step over the sources a drafter offers (Drafter.sources).
MODEL, LOOKUP = "model", "lookup"  # where a proposal comes from (a draft model costs time, a lookup ~none)
SHORT_LOOKUP = "lookup-short"  # a hybrid's lookup on a match shorter than its own (weaker evidence; ~free too)
SUFFIX = "suffix"  # suffix drafting over the context and recent requests' outputs (specdec.drafters.suffix; ~free)
SHORT_SUFFIX = "suffix-short"  # a hybrid's suffix drafts below its score threshold (weaker evidence; ~free)
RECYCLE = "recycle"  # the target's own top candidates from earlier forwards (specdec.drafters.recycling; ~free)
SHORT_RECYCLE = "recycle-short"  # a hybrid's recycled drafts below its margin threshold (weaker evidence; ~free)
FORCED = "forced"  # a step that verified only tokens a grammar forces (specdec.algorithm.processors; no proposal)


@dataclass(frozen=True)
class Draft:
    """A proposal of k tokens.

    tokens: k token ids in the target's vocabulary.
    q: [k, V_target] probabilities the tokens were sampled from, or None for a
       deterministic proposal (greedy drafting, n-grams, re-tokenised text);
       such a draft is verified as if q were one-hot on each token.
    parents: None for a chain (token i follows token i - 1); for a token tree (issue 39: several
       drafts verified in one target forward) parents[i] is the index of token i's parent in
       `tokens`, -1 for a child of the context's last token; parents[i] < i (a parent comes
       before its children).  q[i] is then the distribution node i was drawn from (its
       parent's draft distribution), None as for a chain.
    synced: context tokens the drafter fed its own model before drafting, to catch
       up with the context: 1-2 in steady state (the last step's bonus token), the
       prompt at a generation's first draft, the plain steps' tokens after plain
       steps; 0 for a drafter without a model.  The speculation controller keeps
       this catch-up out of its per-token drafting cost.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    synced: int = 0
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.q is not None and self.q.shape[0] != len(self.tokens):
            raise ValueError(f"q has {self.q.shape[0]} rows for {len(self.tokens)} draft tokens")
        if self.parents is not None:
            if len(self.parents) != len(self.tokens):
                raise ValueError(f"{len(self.parents)} parents for {len(self.tokens)} draft tokens")
            if any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError(f"a tree's parents must come before their children: {self.parents}")

    @property
    def is_tree(self) -> bool:
        """Whether some token has a sibling (a chain given with parents is still a chain)."""
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens to continue a context.  A drafter subclasses this protocol and so has its defaults
    for the methods it does not override (see the module docstring)."""

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        """Propose up to k tokens that continue `context` (prompt + generated so far), from `source` (one of
        sources(); None: the first of them; a drafter with one source ignores it)."""
        ...

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Feedback after verification: `num_accepted` of the proposal's tokens after `context` were kept."""
        ...

    def reset(self) -> None:
        """Forget all state from an earlier generation."""
        ...

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """A tree of paths up to k tokens deep, at most `width` children a node and `nodes` tokens
        (specdec.drafters.tree), from `source` as for propose; a drafter that makes no trees proposes its chain."""
        return self.propose(context, k, source)

    def sources(self, context: Sequence[int]) -> list[tuple[str, int]]:
        """[(source, lag), ...] of the next proposal for `context`, in the drafter's order of preference
        (specdec.algorithm.control.plan asks the controller for each in turn); by default its outlook alone."""
        return [self.outlook(context)]

    def outlook(self, context: Sequence[int]) -> tuple[str, int]:
        """(source, lag) of the next proposal for `context`: where it will come from (MODEL, LOOKUP,
        SUFFIX, ...) and how many context tokens the drafter will first feed its model to catch up (the
        bonus token in steady state, more after plain steps or at a generation's start); by default a
        model's, with its lag.  The speculation controller keeps acceptance per source and prices a
        catch-up before it drafts."""
        return MODEL, self.lag(context)

    def lag(self, context: Sequence[int]) -> int:
        """Context tokens a draft model must feed to catch up with `context` before it drafts; 0 by default
        (a drafter without a model)."""
        return 0

    def grade(self, context: Sequence[int], source: str) -> str | None:
        """The class of evidence behind the next proposal from `source` for `context`, or None (the default:
        every proposal alike).  A drafter that knows how sure it is says so: a suffix draft after a 20-token
        match of the context was right 98% of the time per token on the edit and agent workloads, one after
        a 1-token match whose count says 1 in 3, 10%; the controller keeps acceptance per source and grade
        (specdec.algorithm.control), so it drafts the first long and skips the second, where one rate per source
        drafted both alike."""
        return None

    def prefilled(self, prompt: Sequence[int]) -> None:
        """The target has just run the prefill of `prompt` (and nothing since): a drafter that reads what the
        target kept (a draft head: the prompt's last hidden states) reads it now; by default nothing."""
        return None  # a body, not just a docstring: mypy takes an empty protocol method for an abstract one

    def plain_step(self, context: Sequence[int]) -> None:
        """The target has just run a plain one-token step on `context`'s last (pending) token: a draft head
        reads that position's hidden state before the next forward replaces it; by default nothing."""
        return None

    def target_logits(self, fed: Sequence[int], logits: torch.Tensor) -> None:
        """The target has just run a forward over `fed` (the prefill's last token, a plain step's token, a
        verification's pending token and draft tokens, a tree's in its node order) and gave `logits`
        [len(fed), V]: row i is its prediction after fed[i] (in a tree, after the path to node i).  Every
        row is heard, accepted or not; the rows must not be changed.  By default nothing (a drafter that
        wants them pays for what it computes of them: specdec.drafters.recycling)."""
        return None


LENGTH_CLASSES = ("1", "2-3", "4-7", "8-15", "16+")  # a match's length in match_grade, powers of two


def match_grade(length: int, agreement: float) -> str:
    """The grade of a copying drafter's proposal (its ``grade(context, source)``, which the speculation
    controller keeps acceptance per: Drafter.grade): the length of the match it copies
    after, in powers of two, and the share of the match's occurrences whose next token is the proposal's
    first (all, at least half, fewer): "match 4-7 p=1"."""
    top = min(max(length, 1).bit_length(), len(LENGTH_CLASSES)) - 1
    sure = "p=1" if agreement >= 1.0 else "p>=.5" if agreement >= 0.5 else "p<.5"
    return f"match {LENGTH_CLASSES[top]} {sure}"


TREE_MODES = "off, auto or <width>x<depth> (e.g. 2x4)"


@dataclass(frozen=True)
class TreeShape:
    """How a draft tree may grow: at most `width` children per node (1: a chain), at most `nodes` draft
    tokens in all (None: width times the depth), `depth` tokens on a path (None: the controller's k)."""

    width: int = 2
    depth: int | None = None
    nodes: int | None = None

    def __post_init__(self) -> None:
        if self.width < 1 or (self.depth is not None and self.depth < 1) or (self.nodes is not None and self.nodes < 1):
            raise SpecdecError(f"a tree needs width, depth and nodes >= 1, got {self.width}x{self.depth} ({self.nodes})")

    def budget(self, k: int) -> int:
        """The most draft tokens for a tree whose deepest path is k tokens."""
        return self.nodes if self.nodes is not None else self.width * k

    def describe(self) -> str:
        return f"{self.width}x{self.depth if self.depth is not None else 'k'}"


def parse_tree(text: str | TreeShape | None) -> TreeShape | None:
    """`--tree`'s value -> a TreeShape, or None for off (chains only); a one-line SpecdecError else."""
    if text is None or isinstance(text, TreeShape):
        return text
    value = text.strip().lower()
    if value in ("off", "none", "chain", "1"):
        return None
    if value == "auto":
        return TreeShape(width=2)
    match = re.fullmatch(r"(\d+)\s*x\s*(\d+)", value)
    if not match:
        raise SpecdecError(f"--tree must be {TREE_MODES}, got '{text}'")
    width, depth = int(match[1]), int(match[2])
    if width < 1 or depth < 1 or width > 8 or depth > 32:
        raise SpecdecError(f"--tree wants a width of 1..8 and a depth of 1..32, got {width}x{depth}")
    return None if width == 1 else TreeShape(width=width, depth=depth)
