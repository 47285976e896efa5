""""Stairs" verification: speculative greedy decoding with a target that only predicts the next token.

Stairs assisted greedy generation (Grigaliūnas & Lukoševičius, IVUS 2024,
arXiv 2407.19947): the draft proposes d1..dk; the target is asked only for
*next-token* predictions, on a batch shaped like a staircase

    row 0: prefix                 -> prediction for d1's position
    row 1: prefix d1              -> prediction for d2's position
    ...
    row k: prefix d1 .. dk        -> the bonus token

and validation walks up the stairs: d_j is kept while row j-1's argmax equals
d_j; at the first mismatch the target's own token is taken (or the bonus after
the top step).  Every emitted token is the target's greedy choice on an
accepted prefix, so the output is exactly plain greedy output.

The one thing asked of the target is :class:`NextTokenModel`: a batch of token
sequences -> next-token logits per sequence.  :class:`StairsRunner` turns such
a model into a :class:`~specdec.backends.base.ModelRunner` whose ``forward``
over k + 1 new tokens *is* the staircase batch (its rows are the cached tokens
plus 1, 2, ... k + 1 of the new ones) and whose rollback just forgets tokens,
so the decode loop and its greedy verification (:func:`specdec.algorithm.verify.verify_greedy`,
the walk up the stairs) run unchanged.

Two NextTokenModels:

- :class:`RunnerNextToken` over any ModelRunner (transformers, int8, llama.cpp).
  The rows share the accepted prefix's KV cache: the runner keeps the longest
  prefix common to its cache and the rows, so a step computes only the tokens
  past it.  The rows of a staircase are nested (each is the row below plus one
  token), so one causal forward over the top row's new tokens answers every
  row at once: k + 1 token positions per step, as causal verification.  With
  ``nested=False`` each row is computed on its own over the shared prefix
  (1 + 2 + ... + (k+1) positions), the paper's batch without its recomputation
  of the prefix; for measuring what the staircase costs when it is not folded.
- :class:`BlackBoxNextToken` over a transformers causal LM with no cache at
  all: every call recomputes every row from its first token, as an exported
  model that returns only the last position's logits must.  The rows are
  right-padded into one batch; under a causal mask the padding after a row's
  end cannot change that row's positions.  A step then costs
  (k + 1) x (context + k) token positions.

Greedy only: the paper's algorithm is greedy and the loop refuses sampling
with stairs (specdec.runtime.engine).  Exactness: on a batch-invariant target (int8,
llama.cpp exact mode) stairs output is bitwise plain output; in fp32 it is
as for causal verification (a near-tie may flip between batch shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.backends.base import (
    Capabilities,
    Footprint,
    ModelRunner,
    Refusals,
    cannot_clone,
    checked_new_tokens,
    common_prefix_length,
)


@runtime_checkable
class NextTokenModel(Protocol):
    """A target that predicts only the next token of each sequence of a batch."""

    vocab_size: int  # width V of the logits
    max_context: int  # the longest sequence it takes

    def next_logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """fp32 logits [B, V]: row b is the prediction for the token after rows[b] (each non-empty)."""
        ...

    def reset(self) -> None:
        """A new generation starts: a model with a cache empties it (one without has nothing to do)."""
        ...


def is_staircase(rows: Sequence[Sequence[int]]) -> bool:
    """Whether each row is the row before it plus exactly one token."""
    return all(
        len(b) == len(a) + 1 and list(b[: len(a)]) == list(a) for a, b in zip(rows, rows[1:])
    )


class RunnerNextToken:
    """Next-token predictions from a ModelRunner, reusing its KV cache for the prefix the rows share."""

    def __init__(self, runner: ModelRunner, nested: bool = True) -> None:
        self.runner = runner
        self.nested = nested  # fold a staircase into one forward (see the module docstring)
        self.vocab_size = runner.vocab_size
        self.max_context = runner.max_context
        self.positions = 0  # token positions the runner has computed (the cost of the queries)

    def next_logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        rows = [list(r) for r in rows]
        if not rows or any(not r for r in rows):
            raise ValueError("next_logits needs at least one non-empty row")
        # The cache may keep the prefix every row shares, but not a row's last token: its
        # logits are what is asked for, so that position must be computed now.
        shared = min(len(r) for r in rows) - 1
        for r in rows[1:]:
            shared = min(shared, common_prefix_length(rows[0], r))
        keep = min(common_prefix_length(self.runner.tokens, rows[0]), shared)
        self.runner.rollback(keep)
        if keep < shared:
            self._forward(rows[0][keep:shared], last_n=1)
        if self.nested and is_staircase(rows):
            top = rows[-1][shared:]  # [k+1] tokens: one causal forward answers every step
            return self._forward(top, last_n=len(rows))  # [B, V]
        out = []
        for i, r in enumerate(rows):  # each row on its own over the shared prefix
            if i:
                self.runner.rollback(shared)
            out.append(self._forward(r[shared:], last_n=1)[-1])
        return torch.stack(out)  # [B, V]; the cache keeps the last row

    def reset(self) -> None:
        """Forget the cache: a new request starts from a fresh prefill, as plain decoding does."""
        self.runner.reset()

    def _forward(self, tokens: Sequence[int], last_n: int) -> torch.Tensor:
        self.positions += len(tokens)
        return self.runner.forward(tokens, last_n=last_n)


class BlackBoxNextToken:
    """A transformers causal LM queried without any cache: every row recomputed from its start."""

    def __init__(self, model: Any, pad_token_id: int = 0) -> None:
        from specdec.backends.hf import model_max_context, model_vocab_size

        self.model = model.eval()
        self.pad_token_id = pad_token_id  # fills rows to the batch's width; never attended to
        self.device = next(model.parameters()).device
        self.vocab_size = model_vocab_size(model)
        self.max_context = model_max_context(model)
        self.positions = 0  # token positions computed, padding included

    def reset(self) -> None:
        """Nothing to forget: every row is recomputed from its start."""

    @torch.inference_mode()
    def next_logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        if not rows or any(not r for r in rows):
            raise ValueError("next_logits needs at least one non-empty row")
        width = max(len(r) for r in rows)
        batch = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)  # [B, W]
        for b, r in enumerate(rows):
            batch[b, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        self.positions += batch.numel()
        logits: torch.Tensor = self.model(input_ids=batch.to(self.device), use_cache=False).logits  # [B, W, V]
        last = torch.tensor([len(r) - 1 for r in rows], device=logits.device)  # [B]
        return logits[torch.arange(len(rows), device=logits.device), last].float().cpu()  # [B, V]


class StairsRunner(Refusals):  # no hidden states, no taps, no trees
    """A ModelRunner whose forward asks a NextTokenModel for the staircase of next-token predictions.

    ``forward(new)`` returns, for each of the last n new tokens, the prediction
    after the cached tokens plus the new ones up to and including it: row i is
    ``tokens + new[: i + 1]``.  Rollback forgets tokens; nothing else is kept.
    """

    model = None  # no transformers model of its own to share: it asks a NextTokenModel
    eos_token_ids: frozenset[int] = frozenset()  # a NextTokenModel names none (the engine adds the tokenizer's)

    def __init__(self, next_token: NextTokenModel) -> None:
        self.next_token = next_token
        self.vocab_size = next_token.vocab_size
        self.max_context = next_token.max_context
        # Rollback is forgetting tokens; every position's logits come from a staircase row.  No hidden_states:
        # a NextTokenModel gives logits only.
        self.capabilities = Capabilities(batch_invariant=False)
        self.tokens: list[int] = []

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        new_tokens = checked_new_tokens(new_tokens, len(self.tokens), self.max_context)
        n = len(new_tokens) if last_n is None else min(last_n, len(new_tokens))
        full = self.tokens + new_tokens
        rows = [full[: len(full) - n + 1 + i] for i in range(n)]  # the staircase: one more token per row
        logits = self.next_token.next_logits(rows)  # [n, V]
        self.tokens = full
        return logits

    def rollback(self, n: int) -> None:
        if n < 0 or n > len(self.tokens):
            raise ValueError(f"cannot roll back to {n} of {len(self.tokens)} tokens")
        del self.tokens[n:]

    def reset(self) -> None:
        self.tokens = []
        self.next_token.reset()  # a model with a cache starts afresh too

    def footprint(self) -> Footprint:
        """Nothing of its own: the runner it asks (the request's target) holds the cache (ModelRunner.footprint)."""
        return Footprint()

    def expect(self, tokens: int) -> None:
        """Nothing to make room for: it keeps token ids only."""

    def trim(self, tokens: int) -> int:
        """Keep the first `tokens` token ids (ModelRunner.trim): nothing to free."""
        del self.tokens[max(0, int(tokens)):]
        return 0

    def clone(self) -> StairsRunner:
        raise cannot_clone(self)

    def describe(self) -> str:
        return "stairs"

    def identity(self) -> dict[str, Any]:
        return {"backend": type(self).__name__, "model": "", "threads": torch.get_num_threads()}


def stairs_runner(target: ModelRunner | NextTokenModel, nested: bool = True) -> StairsRunner:
    """A StairsRunner over a NextTokenModel, or over a ModelRunner through RunnerNextToken."""
    if isinstance(target, StairsRunner):
        return target
    if isinstance(target, ModelRunner):
        return StairsRunner(RunnerNextToken(target, nested=nested))
    return StairsRunner(target)
