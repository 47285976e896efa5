"""Prompt lookup: a model-free drafter that copies what followed the last n tokens earlier in the context.

Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``,
vLLM's n-gram proposer, llama.cpp's lookup decoding): outputs often repeat
spans of their input — code being edited, a document being summarised, names,
numbers, boilerplate.  So the drafter takes the last n tokens of the context
(prompt + generated), finds their most recent earlier occurrence, and proposes
the tokens that followed it.  It tries the longest n first (``max_ngram`` down
to ``min_ngram``) and proposes nothing when no n matches.

Worked example, ``max_ngram=3``, k = 3::

    context:  The cat sat on the mat . The cat sat on
                                        ^^^^^^^^^^^^^^ last 3 tokens: "cat sat on"
    earlier occurrence at positions 1..3, followed by: "the mat ."
    proposal: ["the", "mat", "."]

The proposal carries no probabilities (``q = None``), so it is verified as a
deterministic draft: exact under greedy decoding, distribution-preserving
under sampling.  Finding a match costs a dictionary lookup: the drafter keeps
an index from every n-gram (n in min..max) to the latest positions where it was
followed by a token, and extends it as the context grows.

Each proposal is graded (``grade``: the match's length, followed back past the n-gram up to
16 tokens, and how many of the n-gram's latest occurrences go on with the same token), and the
speculation controller keeps acceptance per grade (Drafter.grade): a long copy of the
prompt drafts long, a one-token match whose occurrences disagree not at all.

As a tree (``propose_tree``, specdec.drafters.tree) it proposes the continuations of
several earlier occurrences of the longest matching n-gram at once, the most recent
first, merged where they agree: lookup has several candidates for free.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.algorithm.draft import LOOKUP, SHORT_LOOKUP, Draft, Drafter, match_grade
from specdec.drafters.tree import tree_draft

MATCHES = 8  # earlier occurrences of an n-gram remembered for trees and grades (the latest ones)
GRADE_LENGTH = 16  # grade(): how far back a match with the latest occurrence is followed


class LookupDrafter(Drafter):
    """Proposes the continuation of the latest earlier occurrence of the context's last n tokens."""

    source = LOOKUP

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []  # the context indexed so far
        # n-gram -> starts of its latest occurrences (up to MATCHES, oldest first) that are followed by
        # at least one token
        self._index: dict[tuple[int, ...], list[int]] = {}

    def _sync(self, context: Sequence[int]) -> None:
        """Index `context`, extending the index when it continues the last one, else rebuilding it."""
        known = len(self._tokens)
        if len(context) < known or list(context[:known]) != self._tokens:
            self.reset()
            known = 0
        for p in range(max(known, 1), len(context)):
            # token p now follows every n-gram that ends at p - 1: remember where each starts
            for n in range(self.min_ngram, self.max_ngram + 1):
                start = p - n
                if start < 0:
                    break
                starts = self._index.setdefault(tuple(context[start:p]), [])
                starts.append(start)
                if len(starts) > MATCHES:
                    del starts[0]
        self._tokens = list(context)

    def _matches(self, context: Sequence[int]) -> tuple[int, list[int]]:
        """(n, starts) of the longest n-gram ending the context that occurred earlier, its latest
        occurrences first; (0, []) when none does."""
        self._sync(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            starts = self._index.get(tuple(context[-n:]))
            if starts:
                return n, starts[::-1]
        return 0, []

    def matches(self, context: Sequence[int]) -> bool:
        """Whether a proposal for `context` would hold a token (an n-gram of min_ngram..max_ngram matches)."""
        return bool(self._matches(context)[1])

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        n, starts = self._matches(context)
        if k <= 0 or not starts:
            return Draft([])
        follow = starts[0] + n
        return Draft(list(context[follow : follow + k]))

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """The continuations (up to k tokens) of the longest match's latest occurrences, most recent first,
        merged into a tree (at most `width` children per node, `nodes` tokens); its first path is
        propose()'s chain."""
        n, starts = self._matches(context)
        if k <= 0 or not starts:
            return Draft([])
        return tree_draft([context[s + n : s + n + k] for s in starts], width, nodes)

    def grade(self, context: Sequence[int], source: str = LOOKUP) -> str | None:
        """The class of evidence behind the proposal for `context` (Drafter.grade; None for no
        proposal): how long the match with its latest occurrence really is (the n-gram, extended
        backwards up to GRADE_LENGTH tokens: a long copy of the prompt matches far back) and how many of
        the n-gram's remembered occurrences go on with the proposal's first token."""
        n, starts = self._matches(context)
        if not starts:
            return None
        latest, end = starts[0], len(context) - n
        length = n
        while length < GRADE_LENGTH and latest + n - length - 1 >= 0 \
                and context[latest + n - length - 1] == context[end - (length - n) - 1]:
            length += 1
        first = context[latest + n]
        agreement = sum(context[s + n] == first for s in starts) / len(starts)
        return match_grade(length, agreement)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to learn: the index grows with the context at the next proposal."""

    def outlook(self, context: Sequence[int]) -> tuple[str, int]:
        """A lookup proposal: no model to catch up."""
        return LOOKUP, 0

    def shorter(self) -> tuple[str, LookupDrafter] | None:
        """A hybrid's fallback for the matches this drafter leaves out: a lookup on the shorter ones
        (source SHORT_LOOKUP, down to one token), None when min_ngram is already 1."""
        if self.min_ngram <= 1:
            return None
        return SHORT_LOOKUP, LookupDrafter(max_ngram=self.min_ngram - 1, min_ngram=1)
