"""Measured forward costs of a runner: t(k), the time of one forward over k new tokens.

Speculative decoding pays off when verifying k draft tokens in one target
forward costs much less than k one-token forwards (Leviathan et al. 2023,
section 3.4: the expected speedup is a function of acceptance and of the cost
ratio).  That ratio is a property of the backend, dtype, kernel and CPU, not
of the algorithm, so specdec measures it instead of assuming it: after a
prefix of ``prefix`` tokens, each k in ``ks`` is timed ``repeats`` times (the
ks interleaved, so that a noisy neighbour hurts every k alike; median kept)
and rolled back after each measurement.  A draft model's cost is the cost of
drafting: one-token forwards, one after the other, per token.

``specdec profile`` prints these tables; the speculation controller uses them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specdec.backends.base import ModelRunner

DEFAULT_KS = tuple(range(1, 17))


@dataclass
class CostTable:
    """Median milliseconds per forward of k new tokens, after a prefix of `prefix` tokens."""

    ms: dict[int, float]
    prefix: int
    repeats: int
    info: dict[str, object] = field(default_factory=dict)  # backend, dtype, threads, model...

    def ratio(self, k: int) -> float:
        """t(k) / t(1): what verifying k tokens costs in one-token steps."""
        return self.ms[k] / self.ms[1]

    def to_dict(self) -> dict:
        return {**self.info, "prefix": self.prefix, "repeats": self.repeats,
                "ms": {str(k): round(v, 3) for k, v in sorted(self.ms.items())}}


def _tokens(vocab_size: int, n: int, seed: int) -> list[int]:
    """n token ids spread over the vocabulary (a deterministic stand-in for text)."""
    step = 7919  # a prime: successive ids land far apart
    usable = max(2, min(vocab_size, 32000))
    return [(seed * 104729 + i * step) % usable for i in range(n)]


def measure_forwards(
    runner: ModelRunner,
    ks: Sequence[int] = DEFAULT_KS,
    prefix: int = 128,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> CostTable:
    """t(k) for each k in ks: median ms of a forward of k tokens after `prefix` cached tokens."""
    ks = sorted(set(ks))
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive, got {ks}")
    if prefix + max(ks) > runner.max_context:
        raise ValueError(f"a prefix of {prefix} and k up to {max(ks)} do not fit a window of {runner.max_context}")
    runner.reset()
    runner.forward(_tokens(runner.vocab_size, prefix, seed=1), last_n=1)
    new = _tokens(runner.vocab_size, max(ks), seed=2)
    runner.forward(new[:1])  # warm-up: first calls allocate
    runner.rollback(prefix)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:
            start = clock()
            runner.forward(new[:k])
            times[k].append(clock() - start)
            runner.rollback(prefix)
    runner.reset()
    return CostTable({k: 1000 * statistics.median(v) for k, v in times.items()}, prefix, repeats)


def measure_drafting(
    runner: ModelRunner,
    tokens: int = 16,
    prefix: int = 128,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median ms per drafted token: `tokens` one-token forwards in a row after `prefix` cached tokens."""
    if prefix + tokens > runner.max_context:
        raise ValueError(f"a prefix of {prefix} and {tokens} draft tokens do not fit a window of {runner.max_context}")
    runner.reset()
    runner.forward(_tokens(runner.vocab_size, prefix, seed=3), last_n=1)
    new = _tokens(runner.vocab_size, tokens, seed=4)
    runner.forward(new[:1])  # warm-up
    runner.rollback(prefix)
    per_token = []
    for _ in range(repeats):
        start = clock()
        for t in new:
            runner.forward([t])
        per_token.append((clock() - start) / tokens)
        runner.rollback(prefix)
    runner.reset()
    return 1000 * statistics.median(per_token)
