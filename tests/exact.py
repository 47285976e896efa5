"""Exact distributions of what a tree or block verifier emits: every random decision enumerated, none sampled.

Those verifiers take their random decisions through specdec.algorithm.sampling.Randomness: coins of a
probability they state, and one final draw from a distribution they state.  :func:`outcomes` runs a
verifier with a scripted Randomness: the coins come from a script; where the script ends, the run stops
and is repeated once for each way that coin can fall, weighted by the probability the verifier stated;
the final draw hands over its distribution.  So what is enumerated is the verifier's own arithmetic
(every acceptance probability and residual), and a wrong formula shows as a wrong distribution.
(That a GeneratorRandomness coin really comes up with its probability is checked by the chi-square tests.)

A toy model supplies the distributions: seeded float64 rows, the target's P[prefix] and the draft's
Q[prefix] for every prefix (within one step) up to a depth.  :func:`assert_target_distribution`
(:func:`target_deviation` below 1e-9) checks that emitted token sequences, each continued by the target where it is
shorter, are distributed
as the target's own chain: for every m up to the depth + 1, the first m tokens, to 1e-9.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from specdec.algorithm.sampling import Randomness
from specdec.algorithm.verdict import Verdict

TOL = 1e-9
PLACEHOLDER = -7  # what the scripted final draw returns: the verdict must carry it as next_token
Dist = dict[tuple[int, ...], float]  # emitted token sequence -> probability


class Fork(Exception):
    """The run reached a coin its script does not decide."""

    def __init__(self, probability: float) -> None:
        super().__init__(probability)
        self.probability = probability


class Scripted:
    """Randomness whose coins follow a script (see the module doc)."""

    def __init__(self, script: Sequence[bool]) -> None:
        self.script = list(script)
        self.drawn: torch.Tensor | None = None  # the final draw's distribution [V], normalised

    def bernoulli(self, probability: float) -> bool:
        probability = float(probability)
        assert 0.0 <= probability <= 1.0, f"a coin of probability {probability}"
        assert self.drawn is None, "a coin after the final draw"
        if not self.script:
            raise Fork(probability)
        return self.script.pop(0)

    def sample(self, probs: torch.Tensor) -> int:
        assert self.drawn is None, "a second draw"
        probs = probs.double()
        assert bool((probs >= 0).all()) and float(probs.sum()) > 0.0, probs
        self.drawn = probs / probs.sum()
        return PLACEHOLDER


def outcomes(run: Callable[[Randomness], Verdict]) -> list[tuple[float, Verdict, torch.Tensor]]:
    """Every way run's coins can fall: (probability, verdict, the final draw's distribution [V])."""
    found = []
    pending: list[tuple[tuple[bool, ...], float]] = [((), 1.0)]
    while pending:
        script, weight = pending.pop()
        rng = Scripted(script)
        try:
            verdict = run(rng)
        except Fork as fork:
            t = fork.probability
            if t > 0.0:
                pending.append((script + (True,), weight * t))
            if t < 1.0:
                pending.append((script + (False,), weight * (1.0 - t)))
            continue
        assert not rng.script and rng.drawn is not None and verdict.next_token == PLACEHOLDER
        found.append((weight, verdict, rng.drawn))
    return found


def emitted(run: Callable[[Randomness], Verdict], accepted: Callable[[Verdict], tuple[int, ...]]) -> Dist:
    """The exact distribution of the token sequences run emits: accepted(verdict), then the next token."""
    out: Dist = defaultdict(float)
    for weight, verdict, drawn in outcomes(run):
        prefix = accepted(verdict)
        assert len(prefix) == verdict.num_accepted
        for token, w in enumerate(drawn.tolist()):
            if w > 0.0:
                out[prefix + (token,)] += weight * w
    return dict(out)


def mix(parts: Iterator[tuple[float, Dist]]) -> Dist:
    """sum_i weight_i * dist_i."""
    out: Dist = defaultdict(float)
    for weight, dist in parts:
        for seq, prob in dist.items():
            out[seq] += weight * prob
    return dict(out)


# --------------------------------------------------------------------------- the toy model


def make_rows(kind: str, logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Probability rows [count, V] (float64) of a kind: dense, peaked (nearly one-hot), zeros (random
    exact zeros, one token left at least), top2 (two tokens)."""
    if kind == "dense":
        return torch.softmax(logits, dim=-1)
    if kind == "peaked":
        return torch.softmax(logits / 0.1, dim=-1)
    if kind == "zeros":
        zero = torch.rand(logits.shape, generator=gen) < 0.4
        zero[torch.arange(logits.shape[0]), logits.argmax(dim=-1)] = False
        return torch.softmax(logits.masked_fill(zero, float("-inf")), dim=-1)
    if kind == "top2":
        kth = torch.topk(logits, 2, dim=-1).values[:, -1:]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    raise ValueError(kind)


@dataclass
class Toy:
    """The target's P[prefix] for prefixes up to `depth` tokens, the draft's Q[prefix] up to depth - 1."""

    vocab: int
    depth: int
    target: dict[tuple[int, ...], torch.Tensor]  # prefix -> [V] float64
    draft: dict[tuple[int, ...], torch.Tensor]  # prefix -> [V] float64

    def chain_prob(self, prefix: tuple[int, ...], continuation: tuple[int, ...]) -> float:
        """P_target(continuation | prefix)."""
        prob = 1.0
        for j, token in enumerate(continuation):
            prob *= float(self.target[prefix + continuation[:j]][token])
        return prob


def make_toy(seed: int, vocab: int, depth: int, target_kind: str, draft_kind: str) -> Toy:
    """draft_kind: a row kind (independent logits), "near:<kind>" (the target's logits plus noise),
    or "same" (Q = P)."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [pre for n in range(depth + 1) for pre in itertools.product(range(vocab), repeat=n)]
    logits = torch.randn(len(prefixes), vocab, generator=gen, dtype=torch.float64) * 1.5  # [prefixes, V]
    target = dict(zip(prefixes, make_rows(target_kind, logits, gen)))
    short = [pre for pre in prefixes if len(pre) < depth]  # prefixes is ordered by length
    if draft_kind == "same":
        return Toy(vocab, depth, target, {pre: target[pre] for pre in short})
    if draft_kind.startswith("near:"):
        noisy = logits[: len(short)] + torch.randn(len(short), vocab, generator=gen, dtype=torch.float64)
        return Toy(vocab, depth, target, dict(zip(short, make_rows(draft_kind[5:], noisy, gen))))
    other = torch.randn(len(short), vocab, generator=gen, dtype=torch.float64) * 1.5
    return Toy(vocab, depth, target, dict(zip(short, make_rows(draft_kind, other, gen))))


def target_deviation(toy: Toy, dist: Dist) -> float:
    """How far emitted sequences, continued by the target to depth + 1 tokens, are from the target's
    chain: the largest difference of the probability of the first m tokens, over m <= depth + 1."""
    length = toy.depth + 1
    assert all(1 <= len(seq) <= length for seq in dist)
    completed: Dist = defaultdict(float)
    for seq, prob in dist.items():
        for rest in itertools.product(range(toy.vocab), repeat=length - len(seq)):
            completed[seq + rest] += prob * toy.chain_prob(seq, rest)
    worst = abs(sum(dist.values()) - 1.0)
    for m in range(1, length + 1):
        prefix: Dist = defaultdict(float)
        for seq, prob in completed.items():
            prefix[seq[:m]] += prob
        worst = max([worst] + [abs(prefix.get(s, 0.0) - toy.chain_prob((), s))
                               for s in itertools.product(range(toy.vocab), repeat=m)])
    return worst


def assert_target_distribution(toy: Toy, dist: Dist, tol: float = TOL) -> None:
    """target_deviation below `tol`: the step emits exactly the target's distribution."""
    worst = target_deviation(toy, dist)
    assert worst < tol, f"the emitted tokens differ from the target's by {worst:.3g}"


def distance(a: Dist, b: Dist) -> float:
    """The largest difference of one sequence's probability."""
    return max(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))
