"""Chi-square tests of seeded decode runs against exact distributions, and the runs spread over processes.

The statistical tests run tens of thousands of seeded generations through the
real decode loop.  Each run is seeded by its own number, so a histogram does
not depend on how the seeds are split: :func:`seeded_runs` splits them over
worker processes (one per CPU, at most two) and adds up what they count, which
keeps every p-value a fixed number while both cores of a CI machine work.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled


def chi_square_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square(counts: Counter, probs: dict[tuple[int, ...], float]) -> tuple[float, int, float]:
    """Pearson's chi-square of observed sequence counts against exact probabilities: (stat, dof, p)."""
    impossible = {seq: c for seq, c in counts.items() if probs.get(seq, 0.0) == 0.0}
    assert not impossible, f"sequences the target cannot produce were emitted: {impossible}"
    n = sum(counts.values())
    cells, pooled = [], [0.0, 0]
    for seq, prob in probs.items():
        if prob > 0.0:
            expected, observed = n * prob, counts.get(seq, 0)
            if expected >= MIN_EXPECTED:
                cells.append([expected, observed])
            else:
                pooled[0] += expected
                pooled[1] += observed
    cells.sort()
    if pooled[0] > 0.0:
        if pooled[0] < MIN_EXPECTED:  # too small alone: merge it into the smallest cell
            cells[0][0] += pooled[0]
            cells[0][1] += pooled[1]
        else:
            cells.append(pooled)
    stat = sum((observed - expected) ** 2 / expected for expected, observed in cells)
    dof = len(cells) - 1
    return stat, dof, chi_square_sf(stat, dof)


def _one_thread() -> None:
    torch.set_num_threads(1)


def workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(2, cpus))


def seeded_runs(fn: Callable[[str, range], dict], case: str, runs: int) -> dict:
    """fn(case, seeds) over seeds 0..runs-1, split over worker processes; the parts' values are added
    (Counters and numbers alike).  `fn` must be a module-level function (it is pickled by name)."""
    n = workers()
    if n == 1:
        return fn(case, range(runs))
    bounds = [runs * i // n for i in range(n + 1)]
    with ProcessPoolExecutor(n, mp_context=get_context("spawn"), initializer=_one_thread) as pool:
        parts = list(pool.map(fn, [case] * n, [range(a, b) for a, b in zip(bounds, bounds[1:])]))
    total = parts[0]
    for part in parts[1:]:
        for key, value in part.items():
            total[key] = total[key] + value
    return total
