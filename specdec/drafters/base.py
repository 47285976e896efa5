"""The drafter protocol: anything that proposes the next few tokens.

A drafter proposes k tokens in the *target's* vocabulary, optionally with the
distribution q it sampled them from.  The decode loop verifies the proposal
with the target (see specdec.verify) and reports back how many tokens were
accepted, which a drafter may use (e.g. to adapt k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from specdec.control import Controller


@dataclass(frozen=True)
class Draft:
    """A proposal of k tokens.

    tokens: k token ids in the target's vocabulary.
    q: [k, V_target] probabilities the tokens were sampled from, or None for a
       deterministic proposal (greedy drafting, n-grams, re-tokenised text);
       such a draft is verified as if q were one-hot on each token.
    synced: context tokens the drafter fed its own model before drafting, to catch
       up with the context: 1-2 in steady state (the last step's bonus token), the
       prompt at a generation's first draft, the plain steps' tokens after plain
       steps; 0 for a drafter without a model.  The speculation controller keeps
       this catch-up out of its per-token drafting cost.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    synced: int = 0

    def __post_init__(self) -> None:
        if self.q is not None and self.q.shape[0] != len(self.tokens):
            raise ValueError(f"q has {self.q.shape[0]} rows for {len(self.tokens)} draft tokens")


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens to continue a context."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Propose up to k tokens that continue `context` (prompt + generated so far)."""
        ...

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Feedback after verification: `num_accepted` of the last proposal's tokens were kept."""
        ...

    def reset(self) -> None:
        """Forget all state from an earlier generation."""
        ...


MODEL, LOOKUP = "model", "lookup"  # where a proposal comes from (a draft model costs time, a lookup ~none)
SHORT_LOOKUP = "lookup-short"  # a hybrid's lookup on a match shorter than its own (weaker evidence; ~free too)


def outlook(drafter: Drafter, context: Sequence[int]) -> tuple[str, int]:
    """(source, lag) of `drafter`'s next proposal for `context`: where it will come from (MODEL or
    LOOKUP) and how many context tokens the drafter will first feed its model to catch up (the bonus
    token in steady state, more after plain steps or at a generation's start).

    A drafter says so with an ``outlook(context)`` method, or a ``lag(context)`` method (a model);
    one with neither is taken for a model that needs no catch-up.  The speculation controller
    keeps acceptance per source and prices a catch-up before it drafts.
    """
    method = getattr(drafter, "outlook", None)
    if method is not None:
        return method(context)
    lag = getattr(drafter, "lag", None)
    return MODEL, int(lag(context)) if lag is not None else 0


def plan(drafter: Drafter, context: Sequence[int], controller: "Controller", limit: int) -> tuple[str, int]:
    """(source, k) of the next step: the first of `drafter`'s sources for `context` from which the
    controller drafts k > 0 tokens (controller.choose(limit, lag, source)); (the first source, 0) for a
    plain step.  A drafter lists them with ``sources(context)`` -> [(source, lag), ...] in its order of
    preference (and then takes the chosen one in ``propose(context, k, source)``), else its outlook is
    the only source.  A controller with a ``prospect(limit, lag, source)`` (expected ms per token)
    reorders them, fastest first (ties keep the drafter's order)."""
    method = getattr(drafter, "sources", None)
    options = method(context) if method is not None else [outlook(drafter, context)]
    prospect = getattr(controller, "prospect", None)
    if len(options) > 1 and prospect is not None:
        options = sorted(options, key=lambda option: prospect(limit, option[1], option[0]))
    for source, lag in options:
        k = controller.choose(limit, lag, source)
        if k > 0:
            return source, k
    return options[0][0], 0


def propose(drafter: Drafter, context: Sequence[int], k: int, source: str) -> Draft:
    """`drafter`'s proposal of up to k tokens from `source` (as plan() chose it)."""
    if getattr(drafter, "sources", None) is not None:
        return drafter.propose(context, k, source)  # type: ignore[call-arg]
    return drafter.propose(context, k)
