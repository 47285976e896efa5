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

Trees (issue 39): specdec.algorithm.trees verifies a token tree, greedily or by recursive rejection sampling
(SpecInfer, Miao et al. 2024); specdec.algorithm.block verifies a chain as one block (Sun et al. 2024), an
option of SamplingVerifier.  The verifiers' `verify_tree` takes either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdec.algorithm.block import verify_block
from specdec.algorithm.draft import Draft
from specdec.algorithm.sampling import SamplingParams, make_generator, sample_from, warp_probs
from specdec.algorithm.trees import verify_tree_greedy, verify_tree_sampling
from specdec.algorithm.verdict import Verdict


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
        """Verify a chain draft against target_logits [k+1, V]."""
        ...

    def verify_tree(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        """Verify a tree draft (or a chain: parents None) against target_logits [n+1, V] of the forward over
        [pending, *draft.tokens] (row i + 1: after token i); the verdict's path is always filled."""
        ...


def _chain_only(draft: Draft) -> None:
    if draft.is_tree:
        raise ValueError("a tree draft is verified with verify_tree, not verify")


def _with_path(verdict: Verdict) -> Verdict:
    """A chain's verdict with its path filled: the first num_accepted indices."""
    return Verdict(verdict.num_accepted, verdict.next_token, tuple(range(verdict.num_accepted)))


class GreedyVerifier:
    """Target greedy decoding: argmax, and exact-match verification."""

    def choose(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def verify(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        _chain_only(draft)
        return verify_greedy(draft.tokens, target_logits)

    def verify_tree(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        return verify_tree_greedy(draft.tokens, draft.parents, target_logits)


class SamplingVerifier:
    """Target sampling with `params`, and lossless speculative-sampling verification.

    block: verify chains with block verification (specdec.algorithm.block; Sun et al. 2024), which accepts at least
    as many tokens on average; False (the default): token by token (verify_speculative).
    Trees: recursive rejection sampling (specdec.algorithm.trees); a draft whose parents form a chain goes through
    verify (token by token or block)."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None, block: bool = False) -> None:
        self.params = params
        self.generator = generator if generator is not None else make_generator(params.seed, stream=0)
        self.block = block

    def choose(self, logits: torch.Tensor) -> int:
        return sample_from(warp_probs(logits, self.params), self.generator)

    def verify(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        _chain_only(draft)
        p = warp_probs(target_logits, self.params)  # [k+1, V]
        if self.block:
            return verify_block(draft.tokens, draft.q, p, self.generator)
        return verify_speculative(draft.tokens, draft.q, p, self.generator)

    def verify_tree(self, draft: Draft, target_logits: torch.Tensor) -> Verdict:
        if not draft.is_tree:
            return _with_path(self.verify(draft, target_logits))
        p = warp_probs(target_logits, self.params)  # [n+1, V]
        return verify_tree_sampling(draft.tokens, draft.parents, draft.q, p, self.generator)


def make_verifier(params: SamplingParams, block: bool = False) -> Verifier:
    """The verifier that reproduces plain decoding with `params` (block: SamplingVerifier's block)."""
    return GreedyVerifier() if params.greedy else SamplingVerifier(params, block=block)
