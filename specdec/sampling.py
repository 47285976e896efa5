"""Sampling parameters and the logits -> probabilities warp.

The same warp (temperature, then top-k, then top-p) is applied to the target's
logits (p) and to the draft's logits (q).  Speculative sampling (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling") is lossless with respect to whatever distribution p is, so warping p
exactly as plain sampling would is what keeps the output distribution equal to
plain sampling's.

Temperature 0 means greedy decoding: no probabilities are formed at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from a distribution.

    temperature: 0 = greedy (argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 = off.
    seed: seeds the random generators; None = nondeterministic.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise SpecdecError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecdecError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecdecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution.

    logits: [..., V] (any float dtype).  Returns [..., V] float32 probabilities
    that sum to 1 along the last axis; tokens removed by top-k / top-p get 0.
    Ties at the top-k / top-p boundary are kept (a token is removed only if it
    is strictly less likely than the boundary token), so the result does not
    depend on how a sort orders equal values.
    """
    if params.greedy:
        raise ValueError("warp_probs is for sampling; greedy has no distribution")
    scores = logits.float() / params.temperature  # [..., V]
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [..., V]
    if params.top_p < 1.0:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)  # [..., V]
        # Mass strictly before each sorted position: a token is kept while the
        # mass of the more likely tokens has not yet reached top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V]
        keep_sorted = mass_before < params.top_p  # [..., V]; the top token is always kept
        # The least likely kept probability is the threshold; ties with it are kept.
        num_kept = keep_sorted.sum(dim=-1, keepdim=True)  # [..., 1]
        threshold = torch.gather(sorted_probs, -1, num_kept - 1)  # [..., 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def make_generator(seed: int | None, stream: int = 0) -> torch.Generator:
    """A CPU generator for one random stream.

    The target's verification and the draft's sampling use different streams
    (stream 0 and 1) so that acceptance draws are independent of draft draws.
    """
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((seed * 1_000_003 + stream) % (2**63))
    return gen


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [V]."""
    return int(torch.multinomial(probs.float(), 1, generator=generator).item())
