"""Verification of a draft against the target's logits: pure functions.

Terms (as in vLLM's rejection sampler):
- *accepted*: the leading draft tokens the target keeps;
- *recovered*: the token emitted in place of the first rejected draft token;
- *bonus*: the extra token from the target when every draft token is accepted.
Either way one step emits ``num_accepted + 1`` tokens.

Greedy: a draft token is accepted while it equals the target's argmax at its
position; the next token is the target's argmax after the accepted prefix.
The result is exactly the target's own greedy continuation.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023):
draft token x_i, drawn from q_i, is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the recovered token is
drawn from norm(max(0, p_i - q_i)); if all k are accepted the bonus token is
drawn from p_{k+1}.  Every emitted token is then distributed exactly as under
p.  A draft without q (a deterministic proposal) is treated as if q_i were
one-hot on x_i: accept with probability p_i(x_i), else draw from p_i with x_i
removed and renormalised — still exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specdec.drafters.base import Draft
from specdec.sampling import SamplingParams, make_generator, sample_from, warp_probs


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: `num_accepted` draft tokens kept, then `next_token`.

    path: for a tree draft, the indices of the accepted draft tokens (a root-to-node path,
    len == num_accepted); empty for a chain, whose accepted tokens are its first num_accepted."""

    num_accepted: int
    next_token: int
    path: tuple[int, ...] = ()


def verify_greedy(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """Greedy verification.

    draft_tokens: k ids.  target_logits: [k+1, V]; row i is the target's
    prediction for the position of draft token i (row k: after the last one).
    """
    k = len(draft_tokens)
    target_choice = target_logits[: k + 1].argmax(dim=-1).tolist()  # [k+1]
    n = 0
    while n < k and draft_tokens[n] == target_choice[n]:
        n += 1
    return Verdict(n, target_choice[n])


def verify_speculative(
    draft_tokens: Sequence[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative-sampling verification (lossless for any q).

    draft_tokens: k ids.
    q: [k, V] draft probabilities each token was drawn from, or None (one-hot).
    p: [k+1, V] target probabilities (already warped: temperature, top-k, top-p).
    """
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        p_x = float(p[i, x])
        q_x = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))  # u ~ U[0, 1)
        if u * q_x < p_x:  # accepted with probability min(1, p_x / q_x)
            continue
        if q is None:
            residual = p[i].clone()  # [V]
            residual[x] = 0.0  # max(0, p - onehot(x))
        else:
            residual = torch.clamp(p[i] - q[i], min=0.0)  # [V]
        if float(residual.sum()) <= 0.0:
            # Only reachable when p_i == q_i up to rounding, where rejection has
            # probability ~0; p_i itself is then the right distribution.
            residual = p[i]
        return Verdict(i, sample_from(residual / residual.sum(), generator))
    return Verdict(k, sample_from(p[k], generator))


class Verifier(Protocol):
    """How the target turns its logits into tokens: the plain choice and draft verification."""

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from logits [V] (a plain decoding step)."""
        ...

    def verify(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        """Verify a draft against target_logits [k+1, V]."""
        ...


class GreedyVerifier:
    """Target greedy decoding: argmax, and exact-match verification."""

    def choose(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def verify(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        return verify_greedy(draft.tokens, target_logits)


class SamplingVerifier:
    """Target sampling with `params`, and lossless speculative-sampling verification."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None) -> None:
        self.params = params
        self.generator = generator if generator is not None else make_generator(params.seed, stream=0)

    def choose(self, logits: torch.Tensor) -> int:
        return sample_from(warp_probs(logits, self.params), self.generator)

    def verify(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        p = warp_probs(target_logits, self.params)  # [k+1, V]
        return verify_speculative(draft.tokens, draft.q, p, self.generator)


def make_verifier(params: SamplingParams) -> Verifier:
    """The verifier that reproduces plain decoding with `params`."""
    return GreedyVerifier() if params.greedy else SamplingVerifier(params)
