"""The ModelRunner protocol: one model with a KV cache that can be rolled back.

A runner holds exactly the tokens its cache holds (``tokens``).  ``forward``
appends new tokens and returns the logits at each new position; ``rollback``
drops cached tokens from the end, which is how rejected draft tokens are
forgotten (as in gpt-fast, rollback is moving a position pointer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the decode loop refuses clearly what it cannot."""

    rollback: bool = True  # can drop cached tokens from the end
    logits_all_positions: bool = True  # forward returns logits for every new token
    batching: bool = False  # several sequences per forward
    # A token's logits are bitwise the same whether it is evaluated alone or inside a
    # forward of several tokens, so verifying a draft in one forward is exact.
    batch_invariant: bool = False


@runtime_checkable
class ModelRunner(Protocol):
    tokens: list[int]  # exactly what the KV cache holds, in order
    capabilities: Capabilities
    vocab_size: int  # width V of the logits
    max_context: int  # the most tokens the cache may hold

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        """Append `new_tokens` to the cache; return fp32 logits [n, V] for the last n of them
        (n = last_n, or all of them when last_n is None)."""
        ...

    def rollback(self, n: int) -> None:
        """Keep only the first n cached tokens."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...


def checked_new_tokens(new_tokens: Sequence[int], cached: int, max_context: int, what: str = "tokens") -> list[int]:
    """`new_tokens` as a list, after the checks every forward makes: at least one token, and the
    `cached` tokens plus the new ones within the model's window (a one-line SpecdecError)."""
    new_tokens = list(new_tokens)
    if not new_tokens:
        raise ValueError("forward needs at least one token")
    if cached + len(new_tokens) > max_context:
        raise SpecdecError(
            f"context of {cached + len(new_tokens)} {what} exceeds the model's window of {max_context}"
        )
    return new_tokens


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
