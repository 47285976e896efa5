"""The logits -> probabilities warp, and the random draws of sampling (SamplingParams, the request's
sampling options, live in specdec.algorithm.params, without torch, and are re-exported here).

The same warp (temperature, then top-k, then top-p) is applied to the target's
logits (p) and to the draft's logits (q).  Speculative sampling (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling") is lossless with respect to whatever distribution p is, so warping p
exactly as plain sampling would is what keeps the output distribution equal to
plain sampling's.

The tree and block verifiers (specdec.algorithm.trees, specdec.algorithm.block) take their random decisions through a
:class:`Randomness`: a coin of a stated probability and a draw from a stated distribution.  A generator
gives them in production (:class:`GeneratorRandomness`); a test can script them instead and so
enumerate every outcome of a verifier exactly.

Temperature 0 means greedy decoding: no probabilities are formed at all.  Any
positive temperature works, down to the smallest subnormal float: where
logits / temperature would overflow float32, the logits are first shifted by
their maximum (softmax is unchanged by a shift), so the distribution tends to
the argmax as the temperature tends to 0, ties sharing its mass equally.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.algorithm.params import SamplingParams

__all__ = ["SamplingParams", "warp_probs", "nucleus_threshold", "scaled_logits", "limit_scores", "make_generator",
           "sample_from", "Randomness", "GeneratorRandomness", "as_randomness"]


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution.

    logits: [..., V] (any float dtype).  Returns [..., V] float32 probabilities
    that sum to 1 along the last axis; tokens removed by top-k / top-p get 0.
    Ties at the top-k / top-p boundary are kept (a token is removed only if it
    is strictly less likely than the boundary token), so the result does not
    depend on how a sort orders equal values.

    Nothing sorts the whole vocabulary: top-k takes a partial selection, and top-p finds its threshold
    among the most likely tokens only (:func:`nucleus_threshold`), the same threshold a sort of all V
    would give, so the same tokens are kept.
    """
    if params.greedy:
        raise ValueError("warp_probs is for sampling; greedy has no distribution")
    scores = scaled_logits(logits, params.temperature)  # [..., V]
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores.masked_fill_(scores < kth, float("-inf"))  # scores: scaled_logits' own new tensor
    probs = torch.softmax(scores, dim=-1)  # [..., V]
    if params.top_p < 1.0:
        # in place: probs is this call's own tensor, and a fresh [rows, V] per op costs page faults
        threshold = nucleus_threshold(probs, params.top_p)  # [..., 1]
        probs.masked_fill_(probs < threshold, 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


NUCLEUS_CANDIDATES = 64  # the most likely tokens top-p looks among first (four times more while the nucleus is larger)


def nucleus_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The least probability top-p keeps, per row of probs [..., V] -> [..., 1]: in the order of descending
    probability, a token is kept while the mass of the more likely tokens is below top_p (the top token
    always); ties with the last kept one are kept by the caller (probs >= threshold).

    Computed among the c most likely tokens (a partial selection, sorted), c = NUCLEUS_CANDIDATES and four
    times more until every row's candidates hold more than top_p by a margin of rounding: their running
    sums are the first c of a full sort's (a sequential cumulative sum over the same values in the same
    order: equal values in another order sum alike), and the margin makes every token beyond them one a
    full sort would drop too, so the threshold is a full sort's, bit for bit."""
    v = probs.shape[-1]
    c = min(v, NUCLEUS_CANDIDATES)
    while True:
        top = torch.topk(probs, c, dim=-1).values  # [..., c], descending
        total = torch.cumsum(top, dim=-1)  # [..., c]
        mass_before = total - top  # [..., c]: the mass strictly before each candidate
        # beyond the candidates a mass before is at least the candidates' total less a rounding or two
        if c == v or bool((total[..., -1] * (1.0 - 1e-6) > top_p).all()):
            break
        c = min(v, 4 * c)
    # At least the top token: a top_p below float32's range (5e-324) compares as 0 < 0.
    kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # [..., 1]
    return torch.gather(top, -1, kept - 1)  # [..., 1]


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature as float32 scores [..., V] whose softmax is well defined, for any
    temperature > 0.

    The plain division is kept whenever every row's largest score is finite (all the usual
    temperatures: the result is bit for bit what it always was).  Otherwise -- a temperature
    so small that the division overflows, logits of +inf, or NaN -- the row goes through
    :func:`limit_scores`, which gives the same distribution without overflowing.
    """
    scores = logits.float() / temperature  # [..., V]
    if bool(torch.isfinite(scores.amax(dim=-1)).all()):  # amax is NaN when a row holds a NaN
        return scores
    return limit_scores(logits, temperature)


def limit_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - max) / temperature, computed in float64 and returned as float32 [..., V].

    Each row's largest logit maps to exactly 0 and every other logit to a score <= 0 (-inf
    once the gap over the temperature exceeds float32's range), so softmax never sees inf - inf:
    as temperature -> 0 all the mass goes to the tokens tied at the maximum, shared equally.
    A NaN logit is never chosen; a row with +inf logits puts its mass on those, equally.
    """
    x = logits.double().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))  # [..., V]
    top = x.amax(dim=-1, keepdim=True)  # [..., 1]
    if not bool((top > float("-inf")).all()):
        raise ValueError("a row of logits has no finite value: there is no distribution to sample")
    shifted = torch.where(torch.isinf(top),  # a +inf maximum: its ties take all the mass
                          torch.where(x == float("inf"), 0.0, float("-inf")),
                          x - top)  # [..., V], <= 0; the inf - inf of a +inf row is discarded here
    # float64 holds every positive temperature (float32 would round 1e-300 to 0), and 0 / t stays 0.
    return (shifted / temperature).float()


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
    """Draw one token id from probs [V] (non-negative, not all zero; normalised by the draw): the first token
    whose running sum exceeds u times the total, u ~ U[0, 1) in float64 (inverse transform sampling).  The
    sums run in float64 over the tokens in order, so a token of probability 0 is never drawn; one pass over
    the vocabulary, where torch.multinomial took 3 ms for one draw from 151,936 probabilities (Zen 4)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [V]
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cdf[-1])
    token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))  # first cdf > u
    if token >= cdf.shape[0]:  # u rounded up to the total: the last token of positive probability
        token = int(torch.nonzero(probs > 0)[-1])
    return token


class Randomness(Protocol):
    """The random decisions a verifier takes: coins of a probability it states, and draws from a
    distribution it states (so a test can enumerate both exactly)."""

    def bernoulli(self, probability: float) -> bool:
        """True with `probability` (in [0, 1])."""
        ...

    def sample(self, probs: torch.Tensor) -> int:
        """A token id from probs [V] (non-negative, not all zero; normalised by the draw)."""
        ...


class GeneratorRandomness:
    """Randomness from a torch generator: a coin is one uniform draw in float64, a token one draw by
    :func:`sample_from`."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def bernoulli(self, probability: float) -> bool:
        u = float(torch.rand((), generator=self.generator, dtype=torch.float64))  # u ~ U[0, 1)
        return u < probability

    def sample(self, probs: torch.Tensor) -> int:
        return sample_from(probs, self.generator)


def as_randomness(source: torch.Generator | Randomness) -> Randomness:
    """A generator wrapped as Randomness; anything else is taken to be Randomness already."""
    return GeneratorRandomness(source) if isinstance(source, torch.Generator) else source
