"""The drafter protocol: anything that proposes the next few tokens.

A drafter proposes k tokens in the *target's* vocabulary, optionally with the
distribution q it sampled them from.  The decode loop verifies the proposal
with the target (see specdec.verify) and reports back how many tokens were
accepted, which a drafter may use (e.g. to adapt k).  A drafter that reads
what the target computed may also hear that the prompt's prefill has just run
(an optional ``prefilled(prompt)``, :func:`tell_prefilled`), before any other
forward replaces what the runner kept of it, and that a plain step has just run
(an optional ``plain_step(context)``, :func:`tell_plain_step`); ``observe``
follows every verification, whichever of a hybrid's sources proposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch only types a draft's q here: the CLI's options import this module without it
    import torch


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
    """Proposes tokens to continue a context."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Propose up to k tokens that continue `context` (prompt + generated so far)."""
        ...

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Feedback after verification: `num_accepted` of the proposal's tokens after `context` were kept."""
        ...

    def reset(self) -> None:
        """Forget all state from an earlier generation."""
        ...


LENGTH_CLASSES = ("1", "2-3", "4-7", "8-15", "16+")  # a match's length in match_grade, powers of two


def match_grade(length: int, agreement: float) -> str:
    """The grade of a copying drafter's proposal (its optional ``grade(context, source)``, which the
    speculation controller keeps acceptance per: specdec.control.grade): the length of the match it copies
    after, in powers of two, and the share of the match's occurrences whose next token is the proposal's
    first (all, at least half, fewer): "match 4-7 p=1"."""
    top = min(max(length, 1).bit_length(), len(LENGTH_CLASSES)) - 1
    sure = "p=1" if agreement >= 1.0 else "p>=.5" if agreement >= 0.5 else "p<.5"
    return f"match {LENGTH_CLASSES[top]} {sure}"


def tell_prefilled(drafter: Drafter, prompt: Sequence[int]) -> None:
    """Tell `drafter` the target has just run the prefill of `prompt` (and nothing since): its optional
    ``prefilled(prompt)`` method, where it has one (a draft head reads the prompt's last hidden states)."""
    method = getattr(drafter, "prefilled", None)
    if method is not None:
        method(prompt)


def tell_plain_step(drafter: Drafter, context: Sequence[int]) -> None:
    """Tell `drafter` the target has just run a plain one-token step on `context`'s last (pending) token: its
    optional ``plain_step(context)`` method, where it has one (a draft head reads that position's hidden
    state before the next forward replaces it)."""
    method = getattr(drafter, "plain_step", None)
    if method is not None:
        method(context)
