"""Speculation control: how many tokens to draft at each step.

Speculative decoding saves time only when what a step is expected to emit
outweighs what it costs (Leviathan et al. 2023, section 3.4: with acceptance
rate α and a draft costing c target steps per token, γ tokens give
(1 - α^(γ+1)) / ((1 - α)(γc + 1)) times the speed).  Their analysis assumes a
verification of γ + 1 tokens costs one step; on a CPU it does not, so the
controller here uses measured costs instead of that assumption:

    rate(k) = E[tokens | k] / (c + k · d + t(k + 1))  (k ≥ 1; rate(0) = 1 / t(1)),
    E[tokens | k] = 1 + Σ_{i=1..k} Π_{j≤i} α_j,

where t(n) is the target's time for a forward of n new tokens (measured by
specdec.profile, then kept current from the loop's own timings), d the draft's
cost per proposed token (measured), c what a proposal costs on top of its
tokens (learnt from the loop's timings), and α_j the probability that draft token j is
accepted given that token j - 1 was (estimated online, per position, with
exponential forgetting).  Each step takes the k in 0..K with the highest rate;
**k = 0 is a plain one-token step**, so a drafter that does not pay costs
nothing but the occasional probe (a one-token draft after `probe_every` plain
steps, then after twice as many each time a probe is rejected, up to
`max_probe_gap`), which lets the controller come back when the text turns
predictable.  A draft model's catch-up (the prompt at the first draft, the
tokens of the plain steps it did not see) is kept out of the per-token drafting
cost: it is paid once per switch, not per drafted token.

The controller only chooses how many tokens to propose; verification is
unchanged, so greedy output stays identical to plain decoding and sampling
keeps the target's distribution (k depends on the history of acceptances,
never on the token being verified).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

from specdec.errors import SpecdecError

AUTO = "auto"  # num_speculative_tokens: the cost-model controller chooses k each step
# Tokens a draft model feeds to catch up between two consecutive draft steps: the bonus token, and
# the last draft token when every token was accepted (it was proposed, never fed).
STEADY_SYNC = 2


@runtime_checkable
class Controller(Protocol):
    """Asked by the decode loop, each step, how many tokens to draft."""

    def choose(self, limit: int) -> int:
        """Draft tokens to propose now, in 0..limit (0: a plain step)."""
        ...

    def observe(self, drafted: int, accepted: int, draft_s: float, target_s: float, synced: int = 0) -> None:
        """What the step did: `drafted` tokens proposed (0 for a plain step), `accepted` of them kept,
        the drafter's and the target's wall time in seconds, and how many context tokens the drafter
        fed its model to catch up before drafting (Draft.synced; part of draft_s)."""
        ...

    def reset(self) -> None:
        """A new generation starts (estimates may carry over as its prior)."""
        ...


def parse_speculation(k: int | str) -> int | str:
    """A number of speculative tokens as a user gives it -> an int >= 1 or AUTO; a SpecdecError else."""
    if isinstance(k, str):
        if k.strip().lower() == AUTO:
            return AUTO
        try:
            k = int(k)
        except ValueError:
            raise SpecdecError(f"must be 'auto' or a number >= 1, got '{k}'") from None
    if k < 1:
        raise SpecdecError(f"must be >= 1 (or 'auto'), got {k}")
    return k


@dataclass
class FixedK:
    """A fixed draft length γ, as in the papers: every step proposes min(γ, limit) tokens."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"a fixed draft length must be >= 1, got {self.k}")

    def choose(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, drafted: int, accepted: int, draft_s: float, target_s: float, synced: int = 0) -> None:
        pass

    def reset(self) -> None:
        pass

    def describe(self) -> str:
        return str(self.k)


def expected_tokens(alphas: list[float], k: int) -> float:
    """E[tokens emitted | k drafted] = 1 + Σ_{i≤k} Π_{j≤i} α_j (the bonus or recovered token is the 1)."""
    total, survive = 1.0, 1.0
    for i in range(k):
        survive *= alphas[i]
        total += survive
    return total


@dataclass
class Costs:
    """What a step costs: the target's forward time per number of new tokens, the draft's per token.

    target_ms: {n: ms of a target forward over n new tokens}, measured at a few n (at least n = 1);
    values between and beyond are interpolated linearly, and scaled online by the ratio of the
    loop's measured times to the table (target_scale), so a machine that gets busier, or a context
    that grows, moves every estimate alike.  draft_ms: ms per proposed draft token (the draft
    model's one-token forward); draft_overhead_ms: what a proposal costs on top of that, learnt
    online (synchronising the draft's cache, the first forward over the bonus token, the drafter's
    own work): a draft of k tokens costs draft_overhead_ms + k · draft_ms.
    """

    target_ms: Mapping[int, float]
    draft_ms: float
    target_scale: float = 1.0
    draft_overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        if 1 not in self.target_ms or any(n < 1 or v <= 0 for n, v in self.target_ms.items()):
            raise ValueError(f"target costs need n = 1 and positive times, got {dict(self.target_ms)}")
        if self.draft_ms < 0:
            raise ValueError(f"the draft cost must be >= 0, got {self.draft_ms}")
        self._points = sorted(self.target_ms.items())

    def base_target(self, n: int) -> float:
        """The table's t(n) in ms, interpolated (and extrapolated from the last two points)."""
        pts = self._points
        if len(pts) == 1:
            return pts[0][1] * n  # only t(1) known: assume no saving from batching
        for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
            if n <= n1 or (n1, v1) == pts[-1]:
                return max(v0 + (v1 - v0) * (n - n0) / (n1 - n0), 1e-6)
        raise AssertionError("unreachable")

    def target(self, n: int) -> float:
        return self.target_scale * self.base_target(n)

    def draft(self, k: int) -> float:
        """ms to propose k tokens (0 for none)."""
        return max(self.draft_overhead_ms + self.draft_ms * k, 0.0) if k > 0 else 0.0


@dataclass
class AutoK:
    """The cost-model controller: each step the k in 0..max_k with the most expected tokens per second.

    prior: acceptance assumed before anything was seen; weight: how many observations the prior is
    worth.  forget: per-observation decay of old acceptance evidence (0.9 ~ the last ten steps).
    cost_ewma: weight of each new timing in the online cost scales.  probe_every: after this many
    plain steps in a row, one 1-token draft is tried so a drafter that starts paying is noticed; each
    rejected probe doubles the wait, up to max_probe_gap (a probe costs the
    draft model's catch-up on the plain steps' tokens).
    """

    costs: Costs
    max_k: int = 8
    prior: float = 0.6
    weight: float = 2.0
    forget: float = 0.9
    cost_ewma: float = 0.2
    probe_every: int = 8
    max_probe_gap: int = 64
    # per position j (0-based): decayed counts of acceptances and of trials
    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    plain_run: int = 0
    probe_gap: int = 0  # plain steps before the next probe (probe_every .. max_probe_gap)

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 0 < self.prior < 1:
            raise ValueError(f"prior must be in (0, 1), got {self.prior}")
        self.hits = self.hits or [0.0] * self.max_k
        self.trials = self.trials or [0.0] * self.max_k
        self.probe_gap = self.probe_gap or self.probe_every

    def alphas(self) -> list[float]:
        """α_j for j = 1..max_k: each position's evidence, shrunk toward the pooled rate (and that to the prior)."""
        pooled = (sum(self.hits) + self.weight * self.prior) / (sum(self.trials) + self.weight)
        return [(h + self.weight * pooled) / (t + self.weight) for h, t in zip(self.hits, self.trials)]

    def rate(self, k: int, alphas: list[float] | None = None) -> float:
        """Expected tokens per ms when drafting k tokens."""
        alphas = self.alphas() if alphas is None else alphas
        return expected_tokens(alphas, k) / (self.costs.draft(k) + self.costs.target(k + 1))

    def best(self, limit: int) -> int:
        alphas = self.alphas()
        top = min(self.max_k, limit)
        return max(range(top + 1), key=lambda k: (self.rate(k, alphas), -k))

    def choose(self, limit: int) -> int:
        if limit <= 0:
            return 0
        k = self.best(limit)
        if k > 0:
            self.probe_gap = self.probe_every  # drafting pays: after the next plain run, probe soon
        elif self.plain_run >= self.probe_gap:
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)  # back to probe_every if accepted
            return 1
        return k

    def observe(self, drafted: int, accepted: int, draft_s: float, target_s: float, synced: int = 0) -> None:
        w = self.cost_ewma  # times <= 0 mean "not measured" and leave the scales alone
        if target_s > 0:
            table_ms = self.costs.base_target(drafted + 1)
            self.costs.target_scale += w * (1000 * target_s / table_ms - self.costs.target_scale)
        if drafted == 0:
            self.plain_run += 1
            return
        self.plain_run = 0
        if accepted:
            self.probe_gap = self.probe_every  # the draft is right again: probe at the usual pace
        # A draft model that first caught up on more than the last step's bonus token (the prompt, or
        # plain steps' tokens, in one batched forward) paid a one-time cost, not the steady one; a
        # proposal that fed no model (prompt lookup, also inside the hybrid drafter) says nothing
        # of the model's cost.  Such steps leave the draft's overhead estimate alone.
        if draft_s > 0 and 0 < synced <= STEADY_SYNC:
            overhead = 1000 * draft_s - self.costs.draft_ms * drafted
            self.costs.draft_overhead_ms += w * (overhead - self.costs.draft_overhead_ms)
        # Every position's evidence fades with each draft step, tried or not (a position no longer
        # drafted drifts to the pooled rate instead of keeping a stale one); position j was tried if
        # every earlier token was accepted: j = 0..min(accepted, drafted - 1).
        self.hits = [self.forget * h for h in self.hits]
        self.trials = [self.forget * t for t in self.trials]
        for j in range(min(accepted + 1, drafted)):
            self.hits[j] += j < accepted
            self.trials[j] += 1.0

    def reset(self) -> None:
        """Keep what the last generation learnt, at half weight, as the next one's prior."""
        self.hits = [h / 2 for h in self.hits]
        self.trials = [t / 2 for t in self.trials]
        self.plain_run = 0
        self.probe_gap = self.probe_every

    def describe(self) -> str:
        return f"auto (<= {self.max_k})"
