"""Log-probabilities of the emitted tokens: the target's own, from the raw logits of the rows that chose them.

What they are: log_softmax of the target's logits, before any logits processor (penalties, logit_bias, a
grammar's mask) and before temperature, top-k and top-p, which is what OpenAI documents (the model's
log-probability of the token) and what vLLM returns by default; they do not depend on the request's sampling
options, and a token a processor forced still shows what the model thought of it.

Each row is turned into log-probabilities alone (a [V] tensor), so a token's numbers depend only on its row of
logits: on a batch-invariant target (int8, gguf) they are bitwise the same whether the row came from a plain
step, a k-row verification, a tree or the prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability, and the `top` most likely tokens at its position (id, logprob),
    most likely first (ties in id order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of tokens[i] under row i of logits [>= len(tokens), V], with `top` alternatives."""
    out = []
    for i, token in enumerate(tokens):
        row = torch.log_softmax(logits[i].float(), dim=-1)  # [V], row i alone
        alternatives: tuple[tuple[int, float], ...] = ()
        if top > 0:
            values, ids = torch.topk(row, min(top, row.shape[-1]))  # [top] each
            # sorted by (-logprob, id): a fixed order where values tie, whatever order topk gives them in
            alternatives = tuple(sorted(zip(ids.tolist(), values.tolist()), key=lambda pair: (-pair[1], pair[0])))
        out.append(TokenLogprob(token, float(row[token]), alternatives))
    return out
