"""How the next token is chosen: :class:`SamplingParams` (temperature, top-k, top-p, seed), without torch.

A request's sampling options (specdec.request.RequestConfig.sampling) are one; the warp and the draws that
apply them are specdec.algorithm.sampling, which re-exports the class.  It lives apart from them so that the
request's options, which the command line and the server read before anything loads, need no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # also rejects NaN
            raise SpecdecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecdecError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecdecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
