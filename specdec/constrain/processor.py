"""A grammar as the decode loop's logits processor (specdec.algorithm.processors): the mask on every row of target
logits, drafts cut at the first token the grammar forbids, and the tokens it forces offered as drafts.

`GrammarProcessor` walks one request's `Matcher` (specdec.constrain.grammar).  Its committed state follows the
accepted tokens (``accept``); ``process`` masks each verification row by walking a scratch continuation of that
state along the row's path and rolling it back, so a row's mask is a function of its prefix alone, as the
processor contract asks: plain and speculative decoding decide on the same masked rows, and speculation stays
lossless with respect to the masked distribution (greedy: identical to plain constrained decoding; sampling: the
constrained distribution, Leviathan et al. 2023 with p the masked target).

A row whose path the grammar forbids (a token tree's branch, a sampled draft's token kept so that it is rejected)
is left as it is: no verifier reaches it, since the forbidden token before it has probability 0 under the masked
row that judges it; so is a row after an EOS (the grammar allows nothing there), whose token the loop never emits
since the output ends at the EOS.  Forced tokens (`forced`: the grammar allows one token only, whatever the logits) are the
fixed text of a JSON schema (keys, quotes, braces) or a tool call's tags and name; the loop verifies them as
drafts that need no proposal (SGLang's jump-forward decoding, Zheng et al. 2024), so they cost a verification row
each instead of a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.constrain.grammar import Grammar, Matcher


class GrammarProcessor:
    """One request's grammar, as a LogitsProcessor and ConstrainingProcessor (specdec.algorithm.processors)."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.matcher: Matcher = grammar.matcher()

    def start(self, prompt: Sequence[int]) -> None:
        self.matcher = self.grammar.matcher()  # the prompt is not the grammar's: the output starts at its start

    def accept(self, tokens: Sequence[int]) -> None:
        if not self.matcher.consume(tokens):  # every emitted token came from a masked row
            raise RuntimeError(f"the grammar refused the tokens {list(tokens)} that its masked rows chose")

    def _synced(self, generated: Sequence[int]) -> None:
        if self.matcher.consumed != len(generated):
            raise RuntimeError(f"the grammar consumed {self.matcher.consumed} tokens, the output has {len(generated)}")

    def process(self, generated: Sequence[int], paths: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        self._synced(generated)
        out = logits[: len(paths)].clone()  # [R, V]
        masks: dict[tuple[int, ...], torch.Tensor] = {}  # a prefix of the paths -> allowed [V] bool after it
        for walk in sorted({tuple(p) for p in paths}, key=len, reverse=True):  # a chain: one walk, the longest
            if walk in masks:
                continue
            n, allowed = self.matcher.draft_masks(walk)  # allowed [n + 1, V]
            for i in range(n + 1):
                masks.setdefault(walk[:i], allowed[i])
        for r, path in enumerate(paths):
            allowed_r = masks.get(tuple(path))
            # else the grammar forbids the path, or the path ends the output (an EOS: nothing is allowed after it):
            # a row no verifier reaches, or whose token the loop drops (module doc)
            if allowed_r is not None and bool(allowed_r.any()):
                out[r].masked_fill_(~allowed_r, float("-inf"))
        return out  # [R, V]

    def forced(self, generated: Sequence[int], limit: int) -> list[int]:
        """The tokens the grammar forces after the output so far, at most `limit`."""
        self._synced(generated)
        return self.matcher.forced()[:max(limit, 0)]

    def valid(self, generated: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows in a row after the output so far."""
        self._synced(generated)
        return self.matcher.valid_prefix(tokens)
