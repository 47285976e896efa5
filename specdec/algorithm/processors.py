"""Logits processors: what changes the target's distribution as a function of the prefix.

A :class:`LogitsProcessor` is an object a request passes to the decode loop (specdec.algorithm.loop.decode's
`processor`); the loop applies it to the target's logits at every position, in plain and speculative decoding
alike, before the verifier: the prefill's last row, a plain step's row, each of a verification's k + 1 rows
(row i after the pending token and draft[:i]) and each row of a token tree (after the path to its node).
Greedy and speculative sampling then verify against the processed distribution, so speculation stays lossless
with respect to it: the draft only proposes, and the processed target decides.

The contract that makes this exact:

- ``process(generated, paths, logits)`` returns new logits for rows whose prefix is
  ``prompt + generated + paths[r]`` (``prompt`` as given to ``start``), and each row's result must be a
  function of that prefix and of that row's logits only: not of which other rows share the call, nor of
  earlier calls.  A plain step's row and the same position inside a k-row verification then get the same
  bits (on a batch-invariant target, whose rows are themselves the same bits).  The input tensor is not
  changed (the drafter and the log-probabilities read the raw rows).
- ``start(prompt)`` comes once before the prefill; ``accept(tokens)`` after each step with the tokens it
  emitted (after a stop cut them short), so that ``prompt + every accepted token`` is the committed prefix.
  Rejected draft tokens are never accepted: a stateful processor (a grammar matcher) keeps its committed
  state at ``generated``, advances a scratch copy along ``paths[r]`` inside ``process`` and drops it (or
  rolls it back) before returning.  ``process`` is always called with ``generated`` equal to what was
  accepted so far, so a processor may also ignore ``accept`` and derive everything from the prefix, as the
  penalties here do.
- A token a processor bans gets ``-inf``; at least one token of each row must stay finite.

Constraints (a grammar: specdec.constrain.processor.GrammarProcessor) also implement :class:`ConstrainingProcessor`:
``valid(generated, tokens)``, how many of a draft's tokens the constraint allows in a row (the loop cuts a draft
there before verifying it, where that cannot change the output: a deterministic proposal, or greedy verification),
and ``forced(generated, limit)``, the tokens it allows alone next (fast-forward: the loop verifies them as drafts
that need no proposal, ahead of the drafter's own, so that the cache stays right; under a one-hot processed row
a forced token is always accepted, greedy or sampled).

Penalties as defined by OpenAI (presence, frequency: over the generated tokens), transformers / vLLM
(repetition: over the prompt and the generated tokens) and logit_bias (added to the raw logits first) are
:class:`Penalties` and :class:`LogitBias`; :func:`chain` composes processors in order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from specdec.errors import SpecdecError


class LogitsProcessor(Protocol):
    """What transforms the target's logits as a function of the prefix (see the module's contract)."""

    def start(self, prompt: Sequence[int]) -> None:
        """A new generation after `prompt` (before its prefill)."""
        ...

    def process(self, generated: Sequence[int], paths: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        """New logits [R, V] for logits [R, V] whose row r follows prompt + generated + paths[r]."""
        ...

    def accept(self, tokens: Sequence[int]) -> None:
        """The tokens a step emitted, appended to the committed prefix."""
        ...


@runtime_checkable
class ConstrainingProcessor(Protocol):
    """A processor that bans tokens by a language (a grammar): it can check drafts and say what it forces."""

    def valid(self, generated: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, are allowed in a row after prompt + generated."""
        ...

    def forced(self, generated: Sequence[int], limit: int) -> list[int]:
        """The tokens forced after prompt + generated, in order, at most `limit`: each one the only token the
        processor allows after the ones before it (an empty list: the next position has a choice)."""
        ...


class Chain:
    """Processors applied in order (the output of one is the input of the next)."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)

    def start(self, prompt: Sequence[int]) -> None:
        for p in self.processors:
            p.start(prompt)

    def process(self, generated: Sequence[int], paths: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            logits = p.process(generated, paths, logits)
        return logits

    def accept(self, tokens: Sequence[int]) -> None:
        for p in self.processors:
            p.accept(tokens)

    def valid(self, generated: Sequence[int], tokens: Sequence[int]) -> int:
        """The fewest tokens any of its constraints allows (all of them where it has none)."""
        return min([len(tokens), *(p.valid(generated, tokens) for p in self._constraints())])

    def forced(self, generated: Sequence[int], limit: int) -> list[int]:
        """The first constraint's forced tokens that every other one allows (none where it has none)."""
        constraints = self._constraints()
        if not constraints:
            return []
        tokens = constraints[0].forced(generated, limit)
        return tokens[: self.valid(generated, tokens)]

    def _constraints(self) -> list[ConstrainingProcessor]:
        return [p for p in self.processors if isinstance(p, ConstrainingProcessor)]


def chain(*processors: LogitsProcessor | None) -> LogitsProcessor | None:
    """The processors given (None ones left out) as one: None for none, the one itself for one."""
    kept = [p for p in processors if p is not None]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else Chain(kept)


class Penalties:
    """Presence, frequency and repetition penalties.

    presence (OpenAI's presence_penalty, -2..2): subtracted once from the logit of each token that occurs in
    the generated tokens so far (the draft path's included); frequency (frequency_penalty, -2..2): subtracted
    once per occurrence there (count * frequency).  repetition (transformers' and vLLM's repetition_penalty,
    > 0, 1 = off): a token that occurs in the prompt or the generated tokens has a positive logit divided by
    it and a negative one multiplied by it (the whole context, as transformers and vLLM count it, not
    llama.cpp's last 64 tokens).  Repetition is applied first, then presence and frequency (vLLM's order).
    A function of the prefix only: ``accept`` is not needed."""

    def __init__(self, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> None:
        if not repetition > 0.0:
            raise SpecdecError(f"the repetition penalty must be > 0, got {repetition}")
        self.presence, self.frequency, self.repetition = float(presence), float(frequency), float(repetition)
        self.prompt: list[int] = []

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0

    def start(self, prompt: Sequence[int]) -> None:
        self.prompt = list(prompt)

    def accept(self, tokens: Sequence[int]) -> None:
        return None

    def process(self, generated: Sequence[int], paths: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        out = logits[: len(paths)].clone()  # [R, V]
        vocab = out.shape[-1]
        # Only the tokens of the context change: each row's are gathered, changed and put back (not several [V]
        # passes per row at a 151,936-token vocabulary; the same bits); ids outside the logits have none to change.
        base = Counter(t for t in generated if 0 <= t < vocab)  # occurrences in the generated tokens
        in_prompt = {t for t in self.prompt if 0 <= t < vocab} if self.repetition != 1.0 else set()
        for r, path in enumerate(paths):  # row by row: each row's numbers its own prefix's alone
            counts = base.copy()
            counts.update(t for t in path if 0 <= t < vocab)
            touched = sorted(in_prompt | counts.keys())  # every token with a penalty (all of them for repetition)
            if not touched:
                continue
            ids = torch.tensor(touched, dtype=torch.int64)  # [n]
            values = out[r, ids]  # [n]
            if self.repetition != 1.0:
                values = torch.where(values > 0, values / self.repetition, values * self.repetition)
            count = torch.tensor([counts[t] for t in touched], dtype=out.dtype)  # [n]
            if self.frequency != 0.0:
                values = values - count * self.frequency
            if self.presence != 0.0:
                values = values - (count > 0).to(out.dtype) * self.presence
            out[r, ids] = values
        return out  # [R, V]


class LogitBias:
    """OpenAI's logit_bias: bias[token] added to that token's raw logit at every position (-100 bans it in
    practice, 100 forces it).  A token id outside the logits' vocabulary is refused (SpecdecError)."""

    def __init__(self, bias: Mapping[int, float]) -> None:
        self.bias = {int(token): float(value) for token, value in bias.items()}
        self._ids = torch.tensor(sorted(self.bias), dtype=torch.int64)  # [n]
        self._values = torch.tensor([self.bias[t] for t in sorted(self.bias)], dtype=torch.float32)  # [n]

    def start(self, prompt: Sequence[int]) -> None:
        return None

    def accept(self, tokens: Sequence[int]) -> None:
        return None

    def process(self, generated: Sequence[int], paths: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        if len(self._ids) and (int(self._ids[0]) < 0 or int(self._ids[-1]) >= vocab):
            bad = next(t for t in self.bias if not 0 <= t < vocab)
            raise SpecdecError(f"logit_bias: token id {bad} is not in the vocabulary (0..{vocab - 1})")
        out = logits[: len(paths)].clone()  # [R, V]
        out[:, self._ids] += self._values.to(out.dtype)  # [R, n]: the same addition on every row
        return out
