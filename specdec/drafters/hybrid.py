"""Hybrid drafting: prompt lookup where the context repeats itself, a draft model elsewhere.

Prompt lookup (specdec.drafters.lookup) costs microseconds and is often right
where an output copies its input (summaries, edits, extraction); a draft model
costs a forward per token and is right more often on fresh text.  The hybrid
asks the lookup first and falls back to the draft model when no n-gram of at
least ``min_ngram`` tokens matches (a one-token match is weak evidence, so the
default asks for two), as llama.cpp's and vLLM's n-gram proposers are used in
front of a draft model.  Where the draft model does not pay (the speculation
controller gives it k = 0: a text it predicts badly, a catch-up too dear), a
lookup on a shorter match (``short``, down to one token, as transformers'
prompt lookup also falls back to) is the last source before a plain step:
free, and on a text that copies its input right often enough to pay.  The
sources are offered in that order through ``sources(context)``; the decode
loop asks the controller for each in turn, fastest first when the controller
prices them (specdec.algorithm.control.plan, AutoK.prospect).

Suffix drafting (specdec.drafters.suffix: the context and recent requests'
outputs) takes prompt lookup's place in ``suffix+<model>``: it goes first when
its proposal's score (the tokens its counts expect accepted) reaches
HYBRID_MIN_SCORE, as the suffix drafter goes before a speculator in
ArcticInference; a proposal below that is the last source (``suffix-short``),
as the short lookup is for prompt lookup.

Token Recycling (specdec.drafters.recycling: the target's own top candidates from earlier forwards)
does the same in ``recycle+<model>``: it goes first where its first token led the target's second
choice by HYBRID_MIN_MARGIN logits when the target computed it, and the rest of its proposals are the
last source (``recycle-short``).

Each proposal comes from one source, so it is verified exactly as that
source's proposals are: a lookup proposal has no q (greedy: exact match;
sampling: the one-hot rule), a draft model's carries its q (Leviathan et al.
2023; Chen et al. 2023) — both lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specdec.algorithm.draft import MODEL, Draft, Drafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.suffix import SuffixDrafter

if TYPE_CHECKING:
    import torch

    from specdec.drafters.recycling import RecyclingDrafter

    First = LookupDrafter | SuffixDrafter | RecyclingDrafter  # a model-free drafter that goes first


class HybridDrafter(Drafter):
    """Proposes from `lookup` (prompt lookup, a suffix drafter or a recycling one) when it matches, else
    from `model` (any drafter), else (with `short_matches`) from `lookup`'s shorter() fallback: a lookup on
    the matches shorter than its min_ngram, the suffix drafts below its score threshold, the recycled
    drafts below its margin."""

    def __init__(self, model: Drafter, lookup: First | None = None, short_matches: bool = True) -> None:
        self.model = model
        self.lookup: First = lookup or LookupDrafter(max_ngram=4, min_ngram=2)
        self.first = self.lookup.source  # LOOKUP, SUFFIX or RECYCLE
        fallback = self.lookup.shorter() if short_matches else None
        self.short_source: str | None
        self.short: First | None
        self.short_source, self.short = fallback if fallback is not None else (None, None)
        sources = ((self.first, self.lookup), (MODEL, self.model), (self.short_source, self.short))
        self.by_source = {name: drafter for name, drafter in sources if drafter is not None}
        self.last_source: str | None = None  # where the last proposal came from
        self.proposals = dict.fromkeys(self.by_source, 0)

    def sources(self, context: Sequence[int]) -> list[tuple[str, int]]:
        """[(source, lag)] in order of preference: the lookup alone when it matches, else the model
        (lag: what it must catch up on) and then the short lookup when that matches."""
        if self.lookup.matches(context):
            return [(self.first, 0)]
        options = [self.model.outlook(context)]
        if self.short is not None and self.short_source is not None and self.short.matches(context):
            options.append((self.short_source, 0))
        return options

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        """Up to k tokens from `source` (one of sources()); None: the first of sources() (the lookup if it
        matches, else the model)."""
        source = source or self.sources(context)[0][0]
        if source not in self.by_source:
            raise ValueError(f"no source '{source}' in this hybrid drafter")
        self.last_source = source
        self.proposals[source] += 1
        return self.by_source[source].propose(context, k)

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """As propose, as a tree where the source makes trees (Drafter.propose_tree)."""
        source = source or self.sources(context)[0][0]
        if source not in self.by_source:
            raise ValueError(f"no source '{source}' in this hybrid drafter")
        self.last_source = source
        self.proposals[source] += 1
        return self.by_source[source].propose_tree(context, k, width, nodes)

    def grade(self, context: Sequence[int], source: str) -> str | None:
        """The class of evidence behind `source`'s proposal for `context`, as that source's drafter grades
        it (Drafter.grade); None for a source that does not."""
        return self.by_source[source].grade(context, source)

    def outlook(self, context: Sequence[int]) -> tuple[str, int]:
        """The lookup's when it matches (nothing to catch up), else the model's."""
        return self.sources(context)[0]

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """The model hears every verification, its own and the lookups' (a draft head reads the features of
        the accepted positions from any of them)."""
        self.model.observe(context, num_accepted)

    def prefilled(self, prompt: Sequence[int]) -> None:
        """The target has just run the prompt's prefill: the model hears it (Drafter.prefilled)."""
        self.model.prefilled(prompt)

    def plain_step(self, context: Sequence[int]) -> None:
        """The target has just run a plain step: the model hears it (Drafter.plain_step)."""
        self.model.plain_step(context)

    def target_logits(self, fed: Sequence[int], logits: torch.Tensor) -> None:
        """The model and the first source hear the target's logits (Drafter.target_logits), whichever
        proposed; the short fallback shares what its first source keeps (a recycled drafts' matrix)."""
        self.model.target_logits(fed, logits)
        self.lookup.target_logits(fed, logits)

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        if self.short is not None:
            self.short.reset()
        self.last_source = None
        self.proposals = dict.fromkeys(self.by_source, 0)
