"""What verifying one draft decides: how many draft tokens are kept, and the token that follows them.

Its own module so that chain verification (specdec.algorithm.verify), tree verification (specdec.algorithm.trees) and block
verification (specdec.algorithm.block) can all return it without importing one another in a cycle;
specdec.algorithm.verify re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: `num_accepted` draft tokens kept, then `next_token`.

    path: for a tree draft, the indices of the accepted draft tokens (a root-to-node path,
    len == num_accepted); empty for a chain, whose accepted tokens are its first num_accepted.
    (The tree verifiers fill it for a chain too: (0, 1, ..., num_accepted - 1).)"""

    num_accepted: int
    next_token: int
    path: tuple[int, ...] = ()
