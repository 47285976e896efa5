"""Hybrid drafting: prompt lookup where the context repeats itself, a draft model elsewhere.

Prompt lookup (specdec.drafters.lookup) costs microseconds and is often right
where an output copies its input (summaries, edits, extraction); a draft model
costs a forward per token and is right more often on fresh text.  The hybrid
asks the lookup first and falls back to the draft model when no n-gram of at
least ``min_ngram`` tokens matches (a one-token match is weak evidence, so the
default asks for two), as llama.cpp's and vLLM's n-gram proposers are used in
front of a draft model.  Each proposal comes from one source, so it is verified
exactly as that source's proposals are: a lookup proposal has no q (greedy:
exact match; sampling: the one-hot rule), a draft model's carries its q
(Leviathan et al. 2023; Chen et al. 2023) — both lossless.
"""

from __future__ import annotations

from typing import Sequence

from specdec.drafters.base import LOOKUP, Draft, Drafter, outlook
from specdec.drafters.lookup import LookupDrafter


class HybridDrafter:
    """Proposes from prompt lookup when it matches, else from `model` (any drafter)."""

    def __init__(self, model: Drafter, lookup: LookupDrafter | None = None) -> None:
        self.model = model
        self.lookup = lookup or LookupDrafter(max_ngram=4, min_ngram=2)
        self.last_source: str | None = None  # "lookup" or "model": where the last proposal came from
        self.proposals = {"lookup": 0, "model": 0}

    def propose(self, context: Sequence[int], k: int) -> Draft:
        draft = self.lookup.propose(context, k)
        self.last_source = "lookup"
        if not draft.tokens:
            draft = self.model.propose(context, k)
            self.last_source = "model"
        self.proposals[self.last_source] += 1
        return draft

    def outlook(self, context: Sequence[int]) -> tuple[str, int]:
        """The lookup's when it matches (nothing to catch up), else the model's."""
        if self.lookup.propose(context, 1).tokens:
            return LOOKUP, 0
        return outlook(self.model, context)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        source = self.model if self.last_source == "model" else self.lookup
        source.observe(context, num_accepted)

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        self.last_source = None
        self.proposals = {"lookup": 0, "model": 0}
