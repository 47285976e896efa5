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
specdec.runtime.profile, then kept current from the loop's own timings), d the draft's
cost per proposed token (measured), c what a proposal costs on top of its
tokens (learnt from the loop's timings), and α_j the probability that draft token j is
accepted given that token j - 1 was (estimated online, per position, with
exponential forgetting, and at each new generation shrunk toward the drafter's
own record over its recent draft steps, not toward a fixed prior).  Each step
takes the k in 0..K with the highest rate; **k = 0 is a plain one-token step**,
so a drafter that does not pay costs nothing but the occasional probe (a
one-token draft after `probe_every` steps in which that source did not draft,
then after twice as many each time a probe is rejected, up to `max_probe_gap`;
kept per source, so a hybrid drafter's lookup steps count as time the draft
model was not tried), which lets the controller come back when the text turns
predictable.  A draft model's catch-up (the prompt at the first draft, the
tokens of the plain steps it did not see) is kept out of the per-token drafting
cost: it is paid once per switch, not per drafted token, so it is priced as
one: with the drafter `lag` tokens behind, drafting starts only when the time
it is expected to save over the next `horizon` tokens exceeds the catch-up
(lag · s, s measured per token, one rate for catch-ups of fewer than SYNC_SPLIT
tokens and one for longer: a few rows share the weights' pass, hundreds are a
prefill), and a probe is made only when its cost stays
within `probe_budget` of the time spent since that source last drafted.  A
catch-up is paid before it can be known whether this answer is one its drafts
repay, so it is priced as a bet (AutoK.bet, catch_up_margin): until the answer
has shown its own drafts, the saving is reckoned at the acceptance of the
source's poorer recent answers, and it must cover the catch-up one and a half
times over.  On a CPU a
catch-up is expensive (a sixth of a target step per token for a 0.5B draft of a
1.5B target), so without this a controller that falls back to plain
decoding pays for the draft model's whole context anyway, at every probe.

**A drafter with several sources** (the hybrid: prompt lookup, a draft model, a
lookup on shorter matches) has them ranked each step by prospect(): the
expected ms per token of drafting from each at its best k, a model's catch-up
spread over the tokens it buys; the loop drafts from the first the controller
gives k > 0 (plan, below).  So a draft model that costs more per
token than a free lookup on the same text is passed over, catch-up and all
(on summaries the 0.5B draft's prompt catch-up, several target steps, bought drafts
that were right less often than the lookup's).

**Grades.**  A drafter that knows how sure it is of a proposal classes it
(grade(): a suffix draft by its match's length and its first token's count, a
draft head by its own probability of its first token),
and α_j is then estimated per source and grade, shrunk toward the source's
own record: long verbatim matches (an edit that rewrites the previous answer)
draft up to 24 tokens a step (specdec.runtime.engine.MAX_AUTO_K) where each is right
98% of the time, and weak one-token matches draft nothing, where one rate per
source drafted both at its average.

**In a batch** (specdec.runtime.batching) one target forward serves several requests,
so a request's draft tokens lengthen everyone's step.  There each request's
controller is given the load of the others in the step: their tokens n_o,
their expected emitted tokens e_o and their drafting time d_o, and picks the k
that maximises the batch's rate,
(e_o + E[tokens | k]) / (d_o + draft(k) + t(n_o + k + 1)), with t measured over
packed forwards of up to a whole batch.  With no others this is the rate
above; as the batch grows, t(n_o + ...) climbs out of the flat region where a
draft token is nearly free, and k falls towards 0 -- plain batched decoding
(vLLM sets this by hand: num_speculative_tokens per batch size, "disable by
batch size").

The controller only chooses how many tokens to propose; verification is
unchanged, so greedy output stays identical to plain decoding and sampling
keeps the target's distribution (k depends on the history of acceptances,
never on the token being verified).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import NamedTuple, Protocol, runtime_checkable

# what a draft is (its sources: MODEL, ...; the protocol; a tree's shape); the controller keeps acceptance per source
from specdec.algorithm.draft import (
    MODEL,
    RECYCLE,
    SHORT_LOOKUP,
    SHORT_RECYCLE,
    SHORT_SUFFIX,
    Draft,
    Drafter,
    TreeShape,
)
from specdec.errors import SpecdecError

AUTO = "auto"  # num_speculative_tokens: the cost-model controller chooses k each step
# Recent generations (AutoK.lengths) that must have gone on past this one's length so far before what they
# had left bounds the span a catch-up is priced over
MIN_LENGTHS = 3
# A source's answers on record (AutoK.answers) before a catch-up is priced at its poorer ones' acceptance, and the
# draft tokens an answer must have tried to count as one (and to price its own catch-ups by its own evidence)
MIN_ANSWERS = 4
MIN_TRIED = 8
# Tokens a draft model feeds to catch up between two consecutive draft steps: the bonus token, and
# the last draft token when every token was accepted (it was proposed, never fed).
STEADY_SYNC = 2
# Catch-ups of at least this many tokens are priced at (and teach) Costs.sync_ms, shorter ones short_sync_ms: a
# forward's cost per row climbs with its rows, from the weights' pass shared by a few to a prefill's arithmetic
SYNC_SPLIT = 16


@runtime_checkable
class Controller(Protocol):
    """Asked by the decode loop, each step, how many tokens to draft.  A controller subclasses this protocol
    and so has its defaults for what it does not override: no pricing of sources or trees, nothing learnt
    from a generation's length or a tree step."""

    def choose(self, limit: int, lag: int = 0, source: str = MODEL, grade: str | None = None) -> int:
        """Draft tokens to propose now, in 0..limit (0: a plain step).  `source`, `lag`: where the
        proposal would come from and how many context tokens the drafter would first feed its model
        to catch up (see outlook); `grade`: the drafter's class of this proposal's evidence (see
        grade()), None for an ungraded one."""
        ...

    def observe(self, drafted: int, accepted: int, draft_s: float, target_s: float, synced: int = 0,
                source: str = MODEL) -> None:
        """What the step did: `drafted` tokens proposed (0 for a plain step), `accepted` of them kept,
        the drafter's and the target's wall time in seconds, how many context tokens the drafter
        fed its model to catch up before drafting (Draft.synced; part of draft_s), and the source
        choose() was told."""
        ...

    def reset(self) -> None:
        """A new generation starts (estimates may carry over as its prior)."""
        ...

    def prospect(self, limit: int, lag: int = 0, source: str = MODEL, grade: str | None = None) -> float:
        """Expected ms per emitted token if the next steps draft from `source` (plan ranks a drafter's
        sources by it, fastest first); by default 0 for every source: the drafter's order stands."""
        return 0.0

    def tree_nodes(self, k: int, budget: int, source: str = MODEL) -> int:
        """Draft tokens for this step's proposal of depth k where the tree's size is the controller's to
        choose (a tree shape without a fixed depth): `budget` (a tree) or k (the chain); by default the tree."""
        return budget

    def observe_tree(self, rows: int, target_s: float, extra: int, source: str = MODEL) -> None:
        """A tree step's verification: `rows` tokens in `target_s` seconds, `extra` tokens emitted beyond what
        its first branch would have; by default nothing is learnt of it."""
        return None  # a body, not just a docstring: mypy takes an empty protocol method for an abstract one

    def finish(self, tokens: int) -> None:
        """A generation ended after `tokens` tokens (the decode loop says so, before its last step);
        by default nothing is learnt of it."""
        return None


def graded(source: str, grade: str | None) -> str:
    """The key of `source`'s proposals of `grade` in the controller's evidence ("suffix 8+", say)."""
    return source if grade is None else f"{source} {grade}"


def plan(drafter: Drafter, context: Sequence[int], controller: Controller, limit: int) -> tuple[str, int]:
    """(source, k) of the next step: the first of `drafter`'s sources for `context` from which the
    controller drafts k > 0 tokens (controller.choose(limit, lag, source, grade), with the drafter's
    grade of that source's proposal); (the first source, 0) for a plain step.  The drafter lists them
    (Drafter.sources: [(source, lag), ...] in its order of preference; then it takes the chosen one in
    ``propose(context, k, source)``); the controller reorders them by its prospect (expected ms per token),
    fastest first (ties keep the drafter's order: all of them, where it does not price them)."""
    ranked = [(source, lag, drafter.grade(context, source)) for source, lag in drafter.sources(context)]
    if len(ranked) > 1:
        ranked = sorted(ranked, key=lambda option: controller.prospect(limit, option[1], option[0], option[2]))
    for source, lag, level in ranked:
        k = controller.choose(limit, lag, source, level)
        if k > 0:
            return source, k
    return ranked[0][0], 0


def propose(drafter: Drafter, context: Sequence[int], k: int, source: str, tree: TreeShape | None = None) -> Draft:
    """`drafter`'s proposal of up to k tokens from `source` (as plan() chose it); with `tree` (a
    specdec.drafters.tree.TreeShape) a tree of paths up to k tokens deep where the drafter makes trees."""
    if tree is not None:
        return drafter.propose_tree(context, k, tree.width, tree.budget(k), source)
    return drafter.propose(context, k, source)


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
class FixedK(Controller):
    """A fixed draft length γ, as in the papers: every step proposes min(γ, limit) tokens."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"a fixed draft length must be >= 1, got {self.k}")

    def choose(self, limit: int, lag: int = 0, source: str = MODEL, grade: str | None = None) -> int:
        return min(self.k, limit)

    def observe(self, drafted: int, accepted: int, draft_s: float, target_s: float, synced: int = 0,
                source: str = MODEL) -> None:
        pass

    def reset(self) -> None:
        pass

    def describe(self) -> str:
        return str(self.k)


SHAPE_STEP = 1.25  # a cost ratio moves by at most this factor per measurement
SHAPE_FORGET = 0.05  # per measurement, the other measured n's move this far back toward target_scale


def _step(value: float, weight: float, toward: float) -> float:
    """An exponentially weighted step from `value` toward `toward`, by at most a factor SHAPE_STEP."""
    return min(max(value + weight * (toward - value), value / SHAPE_STEP), value * SHAPE_STEP)


def interpolate(points: list[tuple[int, float]], n: int, extrapolate: bool) -> float:
    """The piecewise-linear function through the sorted (x, y) `points` at n; outside them, the end
    segments' lines (extrapolate) or the end values."""
    if not extrapolate and (n <= points[0][0] or n >= points[-1][0]):
        return points[0][1] if n <= points[0][0] else points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if n <= x1 or x1 == points[-1][0]:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    raise AssertionError("unreachable: interpolate needs two points to extrapolate")


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


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
    a forward over more tokens never costs less, so the table is first made non-decreasing (a
    least-squares isotonic fit: two noisy timings out of order are pooled), and so is what is
    learnt from it (target(n) is a running maximum over n); values between and beyond are
    interpolated linearly.  Two online corrections follow the loop's measured times:
    target_scale, the ratio of every measured time to the table (a machine that gets busier, a
    context that grows, moves every estimate alike), and shape, the ratio at each n the loop
    measured (interpolated toward target_scale at the table's other points), for a table wrong in
    its shape (a profile taken while the machine was busy with something else once priced t(8)
    40% below what it ran in the loop, and the controller kept drafting 7 tokens that a 3-token
    draft beat).  draft_ms: ms per proposed draft token (the draft
    model's one-token forward); draft_overhead_ms: what a proposal costs on top of that, learnt
    online (synchronising the draft's cache, the first forward over the bonus token, the drafter's
    own work): a draft of k tokens costs draft_overhead_ms + k · draft_ms.  sync_ms: what the draft
    model spends per token when it catches up on context it has not seen (measured, then learnt
    online): a switch from plain steps to drafting costs lag · sync_ms once.  A catch-up's price per
    token depends on its size: a few rows ride on the weights' one pass (nearly free on a CPU whose
    step is the memory stream), hundreds are a prefill, bound by arithmetic.  So sync_ms prices (and
    learns from) catch-ups of at least SYNC_SPLIT tokens, short_sync_ms the shorter ones (None: not
    learnt yet, sync_ms stands for it).
    """

    target_ms: Mapping[int, float]
    draft_ms: float
    target_scale: float = 1.0
    draft_overhead_ms: float = 0.0
    sync_ms: float = 0.0  # ms per context token a draft model catches up on (a batched forward)
    short_sync_ms: float | None = None  # the same for catch-ups of fewer than SYNC_SPLIT tokens
    shape: dict[int, float] = field(default_factory=dict)  # n -> measured time / table, learnt online

    def __post_init__(self) -> None:
        if 1 not in self.target_ms or any(n < 1 or v <= 0 for n, v in self.target_ms.items()):
            raise ValueError(f"target costs need n = 1 and positive times, got {dict(self.target_ms)}")
        if self.draft_ms < 0 or self.sync_ms < 0:
            raise ValueError(f"draft costs must be >= 0, got {self.draft_ms}, {self.sync_ms}")
        ns = sorted(self.target_ms)
        self._points = list(zip(ns, isotonic([self.target_ms[n] for n in ns])))
        self.shape = dict(self.shape)  # a copy (dataclasses.replace) learns on its own
        self._key: tuple | None = None  # the learnt state _learnt() last saw

    def with_row_floor(self) -> Costs:
        """A copy whose table prices every row beyond the first at least at the table's average price of a row,
        t'(n) = max(t(n), t(1) + (n - 1) · s) with s = (t(N) - t(1)) / (N - 1), N its largest size: for a
        controller that cannot learn the table's shape (a seeded sampled request's: its costs are frozen so
        that its k depends on its seed and tokens only).  A timing at start sees the memory of that minute:
        in a minute when this VM's memory is slow (Zen 4, 33 GB/s), one row waits on it and the rows beside
        it ride along, and the table said t(2..4) = t(1) (35.3 / 37.7 / 35.0 / 35.1 ms) where a fast minute
        has 1.42 at 4 rows and 2.19 at 8.  Priced by such a table every lookup looks free, and seeded
        controllers drafted two-token matches right 0-8% of the time for 14-21 steps of a translation (0.94x
        plain).  The large sizes are bound by arithmetic in either minute, so s is about a row's arithmetic:
        4.4 ms from that table, which puts t(4) / t(1) at 1.44 and t(8) / t(1) at 2.0.  A convex table is
        raised to the line through its ends: this VM's AVX2 path (arithmetic-bound, its memory no matter)
        has t(2..8) 3-7% under it, and a seeded request there prices short drafts a little high, the
        cheaper error (at 60% acceptance the best k is the same).  A table flat until its largest sizes
        (a GPU's) has a small s, and the floor changes little."""
        pts = self._points
        (_, first), (last, top) = pts[0], pts[-1]
        if last == 1:
            return replace(self)
        slope = (top - first) / (last - 1)
        return replace(self, target_ms={n: max(t, first + (n - 1) * slope) for n, t in self.target_ms.items()})

    def base_target(self, n: int) -> float:
        """The table's t(n) in ms, interpolated (and extrapolated from the last two points)."""
        pts = self._points
        if len(pts) == 1:
            return pts[0][1] * n  # only t(1) known: assume no saving from batching
        return max(interpolate(pts, n, extrapolate=True), 1e-6)

    def ratio(self, n: int) -> float:
        """Measured time / table at n: the loop's own ratio where it measured n (shape), the overall
        target_scale at the table's other points, interpolated linearly between them (flat beyond)."""
        if not self.shape:
            return self.target_scale
        return interpolate(self._learnt()[0], n, extrapolate=False)

    def _learnt(self) -> tuple[list[tuple[int, float]], list[int], list[float]]:
        """What the learnt state implies, recomputed only when it changed (choose() asks for t(n) a
        dozen times a step): the ratio's points, and the breakpoints of t (table and measured n) with
        t's running maximum at each."""
        key = (self.target_scale, tuple(self.shape.items()))
        if key != self._key:
            points = sorted({**{m: self.target_scale for m, _ in self._points}, **self.shape}.items())
            breaks = sorted({*(m for m, _ in self._points), *self.shape})
            # t at each breakpoint, as _target computes it (with no shape every point is target_scale)
            peaks = list(accumulate((self.base_target(m) * interpolate(points, m, extrapolate=False) for m in breaks), max))
            self._key, self._learnt_cache = key, (points, breaks, peaks)
        return self._learnt_cache

    def _target(self, n: int) -> float:
        return self.base_target(n) * self.ratio(n)

    def target(self, n: int) -> float:
        """t(n) in ms: the table times the learnt ratio, never below t(m) for any m < n.  The ratios at
        different n are learnt from different steps (t(1) from plain steps, t(2) from one-token drafts),
        each with its own noise; without the running maximum a noisy t(1) above t(2) says a one-token
        verification is cheaper than a plain step, and the controller drafts with a draft it knows to be
        almost always wrong (seen: a 135M draft at 13-20% acceptance drafted one token a step for
        whole translations because t(2) had come out a few ms below t(1))."""
        # the piecewise-linear t's maximum over [1, n] is at a breakpoint (table or learnt) or at n
        _, breaks, peaks = self._learnt()
        below = bisect_left(breaks, n)  # breakpoints < n
        return max(self._target(n), peaks[below - 1]) if below else self._target(n)

    def learn_target(self, n: int, ms: float, weight: float, shape_weight: float) -> None:
        """Move the estimates toward a forward of n tokens measured at `ms`: target_scale with `weight`,
        the ratio at n with `shape_weight`, each by at most a factor SHAPE_STEP per measurement (one
        slow step is not a slower machine nor a table error); the other measured n's drift back toward
        target_scale by SHAPE_FORGET (an n the controller stopped choosing for a bad timing is tried
        again in time)."""
        seen, old = ms / self.base_target(n), self.ratio(n)
        self.target_scale = _step(self.target_scale, weight, seen)
        if shape_weight <= 0:
            return
        for m in self.shape:
            if m != n:
                self.shape[m] += SHAPE_FORGET * (self.target_scale - self.shape[m])
        self.shape[n] = _step(old, shape_weight, seen)

    def draft(self, k: int) -> float:
        """ms to propose k tokens (0 for none)."""
        return max(self.draft_overhead_ms + self.draft_ms * k, 0.0) if k > 0 else 0.0

    def catch_up(self, lag: int) -> float:
        """ms a drafter `lag` tokens behind spends catching up beyond a steady step (0 when steady): the tokens
        its first forward feeds beyond the one a steady step feeds, at sync_ms each (the marginal cost of a row
        in a forward of many: a draft forward of n rows costs about t(1) + (n - 1) sync_ms, issue 61's
        measurement: 1 / 2 / 3 / 4 rows of the int4 0.5B 12.4 / 13.7 / 17.9 / 30.4 ms, which a price of
        sync_ms for every token, the first included, got wrong for short catch-ups).  A short catch-up (under
        SYNC_SPLIT tokens) is priced at short_sync_ms.  One rate for both, learnt online mostly from the frequent
        short ones (3-9 tokens, 0.03-0.9 ms a token for the 0.5B on Zen 4), priced a 423-token prompt's
        catch-up at a third of what it cost (1.6-1.9 ms a token), and the draft model caught up on prompts
        whose answers it could not repay."""
        if lag <= STEADY_SYNC:
            return 0.0
        rate = self.short_sync_ms if lag < SYNC_SPLIT and self.short_sync_ms is not None else self.sync_ms
        return rate * (lag - 1)

    def learn_catch_up(self, synced: int, per_token_ms: float, weight: float) -> None:
        """Move the rate of catch-ups of `synced` tokens' size (see catch_up) toward `per_token_ms`."""
        if synced >= SYNC_SPLIT:
            self.sync_ms = max(self.sync_ms + weight * (per_token_ms - self.sync_ms), 0.0)
        else:
            old = self.sync_ms if self.short_sync_ms is None else self.short_sync_ms
            self.short_sync_ms = max(old + weight * (per_token_ms - old), 0.0)


class Load(NamedTuple):
    """What the other requests of a batch put into the same step (specdec.runtime.batching)."""

    tokens: int = 0  # tokens they feed the target forward
    expected: float = 0.0  # tokens they are expected to emit
    draft_ms: float = 0.0  # ms they spend drafting


NO_LOAD = Load()


@dataclass
class Probe:
    """One source's probing state (AutoK): steps since it last drafted, their estimated ms, and how many
    such steps to wait before the next probe (probe_every .. max_probe_gap)."""

    run: int = 0
    ms: float = 0.0
    gap: int = 0


@dataclass
class AutoK(Controller):
    """The cost-model controller: each step the k in 0..max_k with the most expected tokens per second.

    prior: acceptance assumed before anything was seen; weight: how many observations the prior is
    worth.  forget: per-observation decay of old acceptance evidence (0.9 ~ the last ten steps).
    cost_ewma: weight of each new timing in the online cost scale; shape_ewma: its weight in the cost
    table's shape at its own n (see Costs; neither learns when cost_ewma is 0).  probe_every: after
    this many steps in a row in which a source did not draft (plain steps, or the other source's drafts in
    a hybrid), one 1-token draft from it is tried so a drafter that starts paying is noticed; each
    rejected probe doubles that source's wait, up to max_probe_gap.  A drafter that must first catch up
    (lag > STEADY_SYNC) starts drafting only if the time saved over the next `horizon` tokens beats the
    catch-up, and probes only while probes cost at most `probe_budget` of the time since it last drafted.
    """

    costs: Costs
    max_k: int = 8
    prior: float = 0.6
    # per source, a prior of its own where the default `prior` does not fit it: the short matches a hybrid
    # falls back to were right 15-26% of the time per token on the built-in set (Zen 4, greedy and sampled),
    # and a controller that starts from 0.6 for each of their grades (a seeded sampled request's, fresh each
    # time) drafts them for a dozen steps before its evidence says otherwise; recycled drafts (Token Recycling,
    # specdec.drafters.recycling) were right 10% of the time per token at k = 5 (29% their first token) on the
    # built-in set (qwen2.5-coder-1.5b, greedy), their short ones (a hybrid's fallback) less often still
    source_priors: dict[str, float] = field(default_factory=lambda: {SHORT_LOOKUP: 0.2, SHORT_SUFFIX: 0.2,
                                                                     RECYCLE: 0.2, SHORT_RECYCLE: 0.2})
    weight: float = 2.0
    forget: float = 0.9
    cost_ewma: float = 0.2
    shape_ewma: float = 0.5
    probe_every: int = 8
    max_probe_gap: int = 64
    horizon: int = 256
    probe_budget: float = 0.03
    # the other requests of a batch in this step (specdec.runtime.batching); None: decoding alone
    load: Callable[[], Load] | None = None
    # what the last choose() planned: (tokens fed to the target, expected tokens emitted, draft ms)
    planned: Load = field(default_factory=lambda: Load(1, 1.0, 0.0))
    # per source (MODEL, LOOKUP, SUFFIX, ...: a draft model, prompt lookup, suffix drafts; any name), and per
    # source and grade (graded(): the drafter's class of a proposal's evidence), per position j (0-based):
    # decayed counts of acceptances and of trials
    hits: dict[str, list[float]] = field(default_factory=dict)
    trials: dict[str, list[float]] = field(default_factory=dict)
    # per source: the steps since it last drafted, their estimated time, and the wait for its next probe
    probes: dict[str, Probe] = field(default_factory=dict)
    # per source (and per source and grade): [accepted, tried] draft tokens over its recent draft steps
    # (decayed by record_forget per step of that source or grade, never halved by reset): what it is like
    # across generations, which its per-generation evidence shrinks toward (see alphas)
    records: dict[str, list[float]] = field(default_factory=dict)
    record_forget: float = 0.98
    # what the prior is worth in a record, in draft tokens tried: one rejected probe (one token tried) moved a
    # draft model's record from 0.6 to 0.4 at the prior's worth of 2, and on the next answers it lost the
    # plan to short lookups right 8% of the time (two qa prompts at 0.97-1.00x plain on the built-in set)
    record_weight: float = 8.0
    # token trees (specdec.drafters.tree): per source, the extra tokens a tree step emitted over what its
    # first branch (the chain) would have, decayed; and the steps since a tree was last tried
    tree_gain: dict[str, float] = field(default_factory=dict)
    tree_wait: dict[str, int] = field(default_factory=dict)
    tree_prior: float = 0.25  # extra tokens a tree is assumed to buy before one was verified
    # What is left of an answer, the span over which a catch-up must pay (span()): the lengths of recent
    # generations (finish(); the list the batch's controllers share), and this generation's tokens so far
    lengths: list[int] = field(default_factory=list)
    length_window: int = 32
    generated: int = 0
    # the share of recent steps in which a source that costs time (MODEL) was an option at all: in a
    # hybrid, the steps its free source (prompt lookup, suffix drafts) left to the model
    model_share: float = 1.0
    # A catch-up is a bet on this answer's drafts, paid before any of them is seen: until the answer has tried
    # MIN_TRIED of a source's tokens, its catch-up must be repaid at the acceptance of the source's poorer recent
    # answers (the catch_up_quantile of `answers`: per source, accepted / tried in each recent generation that
    # tried at least MIN_TRIED of its tokens, filed by finish(); the dict the batch's controllers share), not at
    # its average (see bet)
    answers: dict[str, list[float]] = field(default_factory=dict)
    catch_up_quantile: float = 0.25
    # ... and the saving it expects must cover it this many times over: that saving is the difference of two
    # estimates that move with every step's timing (on a 423-token chat prompt it went from 364 to 865 ms in
    # five tokens while the catch-up's price stayed at 770-780 ms, and the draft caught up at the high one)
    catch_up_margin: float = 1.5
    _answer: dict[str, list[float]] = field(default_factory=dict, repr=False)  # this generation's [accepted, tried]
    _model_asked: bool = field(default=False, repr=False)
    _chosen: tuple[str, str | None] = field(default=(MODEL, None), repr=False)  # the last choose()'s source, grade

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not all(0 < p < 1 for p in (self.prior, *self.source_priors.values())):
            raise ValueError(f"priors must be in (0, 1), got {self.prior} and {self.source_priors}")

    def probe_state(self, source: str = MODEL) -> Probe:
        """`source`'s probing: steps since it last drafted, their time, the wait for its next probe."""
        if source not in self.probes:
            self.probes[source] = Probe(gap=self.probe_every)
        return self.probes[source]

    def _evidence(self, source: str) -> tuple[list[float], list[float]]:
        if source not in self.hits:
            self.hits[source] = [0.0] * self.max_k
            self.trials[source] = [0.0] * self.max_k
        return self.hits[source], self.trials[source]

    def source_prior(self, source: str = MODEL, grade: str | None = None) -> float:
        """`source`'s acceptance over its recent draft steps, whatever generation they were in (shrunk
        toward the prior): what a new generation expects of it before it drafts again.  With a grade,
        that grade's record, shrunk toward the source's."""
        prior = self.source_priors.get(source, self.prior) if grade is None else self.source_prior(source)
        accepted, tried = self.records.get(graded(source, grade), (0.0, 0.0))
        return (accepted + self.record_weight * prior) / (tried + self.record_weight)

    def alphas(self, source: str = MODEL, grade: str | None = None) -> list[float]:
        """α_j for j = 1..max_k of `source`'s proposals (of `grade`: the drafter's class of their evidence,
        grade()): each position's evidence, shrunk toward the pooled rate, and that toward the source's
        (grade's) own record (source_prior).  reset() halves the evidence at each new generation; shrunk
        toward the prior instead, a source that was not tried for a few generations would drift back to
        an optimistic 0.6 and every new generation would pay a catch-up of its prompt to draft with it
        again (for a 270M draft, about five target steps in 30-token answers)."""
        hits, trials = self._evidence(graded(source, grade))
        pooled = (sum(hits) + self.weight * self.source_prior(source, grade)) / (sum(trials) + self.weight)
        return [(h + self.weight * pooled) / (t + self.weight) for h, t in zip(hits, trials)]

    def draft_cost(self, k: int, source: str = MODEL) -> float:
        """ms to propose k tokens: a lookup's (any source but a model) cost nothing, a model's are the
        measured ones."""
        return self.costs.draft(k) if source == MODEL else 0.0

    def rate(self, k: int, alphas: list[float] | None = None, source: str = MODEL, load: Load = NO_LOAD) -> float:
        """Expected tokens per ms when drafting k tokens from `source` (with `load`: the whole batch's
        tokens per ms of the step)."""
        alphas = self.alphas(source) if alphas is None else alphas
        return self._per_ms(expected_tokens(alphas, k), k, source, load)

    def _per_ms(self, emitted: float, k: int, source: str, load: Load) -> float:
        """rate(k) for a step expected to emit `emitted` tokens (E[tokens | k])."""
        return ((load.expected + emitted)
                / (load.draft_ms + self.draft_cost(k, source) + self.costs.target(load.tokens + k + 1)))

    def best(self, limit: int, alphas: list[float] | None = None, source: str = MODEL, load: Load = NO_LOAD) -> int:
        """The k in 0..min(max_k, limit) with the highest steady-state rate (ties: the smaller k)."""
        alphas = self.alphas(source) if alphas is None else alphas
        top = min(self.max_k, limit)
        survival = accumulate(alphas[:top], lambda survive, alpha: survive * alpha)  # Π_{j<=i} α_j
        emitted = accumulate(survival, initial=1.0)  # E[tokens | k] for k = 0..top, summed as k grows
        rates = [self._per_ms(e, k, source, load) for k, e in enumerate(emitted)]
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def finish(self, tokens: int) -> None:
        """A generation ended after `tokens` tokens (the decode loop says so): the next generations
        price their catch-ups over what such answers have left (span), and at what its sources' drafts were
        right (bet)."""
        self.lengths.append(tokens)
        del self.lengths[: -self.length_window]
        for source, (accepted, tried) in self._answer.items():
            if tried >= MIN_TRIED:
                answers = self.answers.setdefault(source, [])
                answers.append(accepted / tried)
                del answers[: -self.length_window]
        self._answer = {}

    def remaining(self) -> float | None:
        """Tokens this generation is expected to have left: the mean of what the recent generations that
        went on past this one's length so far had left at that point (their lengths as the loop ended
        them: one cut at max_new_tokens counts as that long); None while fewer than MIN_LENGTHS did."""
        left = [n - self.generated for n in self.lengths if n > self.generated]
        return sum(left) / len(left) if len(left) >= MIN_LENGTHS else None

    def span(self, limit: int, source: str = MODEL) -> float:
        """Tokens over which drafting from `source` must repay a catch-up: the next min(limit + 1, horizon),
        no more than what recent answers had left at this length (remaining), and for a draft model only
        its share of the steps (model_share: a hybrid's free source drafts the others).  A 256-token horizon
        priced a 0.5B draft's catch-up of each new agent observation against tool calls of 40 tokens that
        suffix drafts mostly covered: the catch-ups took a quarter of the time and lost to suffix drafts
        alone."""
        tokens = float(min(limit + 1, self.horizon))
        left = self.remaining()
        if left is not None:
            tokens = min(tokens, left)
        return tokens * self.model_share if source == MODEL else tokens

    def saving(self, k: int, limit: int, alphas: list[float] | None = None, source: str = MODEL,
               load: Load = NO_LOAD) -> float:
        """ms that drafting k tokens a step is expected to save over plain steps, over the next
        span(limit, source) tokens (alone: 1 / rate(0) = t(1))."""
        return self.span(limit, source) * (1.0 / self.rate(0, alphas, source, load)
                                           - 1.0 / self.rate(k, alphas, source, load))

    def probe_cost(self, lag: int, source: str = MODEL, load: Load = NO_LOAD) -> float:
        """ms a one-token probe costs over a plain step: the catch-up, the draft, the longer verification."""
        return (self.costs.catch_up(lag) + self.draft_cost(1, source)
                + self.costs.target(load.tokens + 2) - self.costs.target(load.tokens + 1))

    def prospect(self, limit: int, lag: int = 0, source: str = MODEL, grade: str | None = None) -> float:
        """Expected ms per emitted token if the next steps draft from `source` at its best k, with a
        catch-up of `lag` tokens spread over the span(limit, source) tokens it buys (a plain step's
        t(1) if drafting from it does not pay).  The decode loop ranks a drafter's sources by it
        (plan)."""
        self._model_asked |= source == MODEL
        load = self.load() if self.load is not None else NO_LOAD
        alphas = self.alphas(source, grade)
        k = self.best(limit, alphas, source, load) if limit > 0 else 0
        if k == 0:
            return 1.0 / self.rate(0, alphas, source, load)
        return 1.0 / self.rate(k, alphas, source, load) + self.costs.catch_up(lag) / max(self.span(limit, source), 1.0)

    def _step_grade(self, source: str) -> str | None:
        """The grade choose() was last told for `source`'s proposal (this step's), None for another source."""
        return self._chosen[1] if self._chosen[0] == source else None

    def choose(self, limit: int, lag: int = 0, source: str = MODEL, grade: str | None = None) -> int:
        self._model_asked |= source == MODEL
        self._chosen = (source, grade)
        load = self.load() if self.load is not None else NO_LOAD
        alphas = self.alphas(source, grade)
        k = self._choose(limit, lag, source, load, alphas)
        self.planned = Load(k + 1, expected_tokens(alphas, k), self.draft_cost(k, source))
        return k

    def _choose(self, limit: int, lag: int, source: str, load: Load, alphas: list[float]) -> int:
        if limit <= 0:
            return 0
        k = self.best(limit, alphas, source, load)
        probe = self.probe_state(source)
        if k > 0 and self._repays(k, limit, lag, source, load, alphas):
            probe.gap = self.probe_every  # drafting pays: after the next plain run, probe soon
            return k
        if probe.run >= probe.gap and self.probe_cost(lag, source, load) <= self.probe_budget * probe.ms:
            probe.gap = min(2 * probe.gap, self.max_probe_gap)  # back to probe_every if accepted
            return 1
        return 0

    def bet(self, source: str, alphas: list[float]) -> list[float]:
        """The α_j a catch-up of `source` is priced with: `alphas`, each no higher than the catch_up_quantile of
        the source's recent answers' acceptance while this answer has tried fewer than MIN_TRIED of its tokens
        (and MIN_ANSWERS answers are on record).  A catch-up is paid once, before the answer shows how its
        drafts fare, and the answers differ more than the average says: on the built-in set the 0.5B's drafts
        were right 30-96% of the time per answer, and one priced at the average caught up on a 423-token chat
        prompt, drafted right 53% of the time and lost 9% to plain decoding."""
        answers = self.answers.get(source, [])
        if len(answers) < MIN_ANSWERS or self._answer.get(source, [0.0, 0.0])[1] >= MIN_TRIED:
            return alphas
        low = sorted(answers)[int(self.catch_up_quantile * (len(answers) - 1))]
        return [min(alpha, low) for alpha in alphas]

    def _repays(self, k: int, limit: int, lag: int, source: str, load: Load, alphas: list[float]) -> bool:
        """Whether drafting k tokens a step from `source` (its best at `alphas`) saves catch_up_margin times its
        catch-up of `lag` tokens over the span it has, at the α_j the bet allows, and at the k best for those (no
        catch-up: whether drafting k saves anything)."""
        cost = self.costs.catch_up(lag)
        if cost > 0:
            alphas = self.bet(source, alphas)
            k = self.best(limit, alphas, source, load)
        return k > 0 and self.saving(k, limit, alphas, source, load) > self.catch_up_margin * cost

    def observe(self, drafted: int, accepted: int, draft_s: float, target_s: float, synced: int = 0,
                source: str = MODEL) -> None:
        w = self.cost_ewma  # times <= 0 mean "not measured" and leave the scales alone
        self.generated += accepted + 1
        asked = self._model_asked or (drafted > 0 and source == MODEL)  # plan() asked, or a model drafted
        self.model_share += (1 - self.forget) * (asked - self.model_share)
        self._model_asked = False
        if target_s > 0:  # frozen costs (cost_ewma 0) learn no shape either
            self.costs.learn_target(drafted + 1, 1000 * target_s, w, self.shape_ewma if w > 0 else 0.0)
        # Every step is time in which the sources that did not draft were not tried: their probe budgets
        # grow by a plain step's estimated time (the estimate, not the timing: frozen costs stay
        # deterministic).  In a hybrid, prompt lookup's drafts are such time for the draft model.
        probe = self.probe_state(source) if drafted else None
        for state in self.probes.values():
            if state is not probe:
                state.run += 1
                state.ms += self.costs.target(1)
        if probe is None:
            return
        probe.run, probe.ms = 0, 0.0
        if accepted:
            probe.gap = self.probe_every  # the draft is right again: probe at the usual pace
        # A draft model that first caught up on more than the last step's bonus token (the prompt, or
        # plain steps' tokens, in one batched forward) paid a one-time cost, not the steady one; a
        # proposal that fed no model (prompt lookup, also inside the hybrid drafter) says nothing
        # of the model's cost.  Such steps leave the draft's overhead estimate alone.
        if draft_s > 0 and 0 < synced <= STEADY_SYNC:
            overhead = 1000 * draft_s - self.costs.draft_ms * drafted
            self.costs.draft_overhead_ms += w * (overhead - self.costs.draft_overhead_ms)
        elif draft_s > 0 and synced > STEADY_SYNC:  # a catch-up: what each token past a steady step's first cost
            per_token = (1000 * draft_s - self.costs.draft(drafted)) / (synced - 1)
            self.costs.learn_catch_up(synced, per_token, w)
        # Every position's evidence fades with each draft step, tried or not (a position no longer
        # drafted drifts to the pooled rate instead of keeping a stale one); position j was tried if
        # every earlier token was accepted: j = 0..min(accepted, drafted - 1).  The source's evidence
        # learns from every step of it, a grade's from that grade's steps (what choose() was told).
        tried = min(accepted + 1, drafted)
        answer = self._answer.setdefault(source, [0.0, 0.0])
        answer[0] += accepted
        answer[1] += tried
        for key in {source, graded(source, self._step_grade(source))}:
            hits, trials = self._evidence(key)
            for j in range(self.max_k):
                hits[j] *= self.forget
                trials[j] *= self.forget
            for j in range(tried):
                hits[j] += j < accepted
                trials[j] += 1.0
            record = self.records.setdefault(key, [0.0, 0.0])  # the same counts, never halved by reset
            record[0] = self.record_forget * record[0] + accepted  # accepted <= tried
            record[1] = self.record_forget * record[1] + tried

    def tree_nodes(self, k: int, budget: int, source: str = MODEL) -> int:
        """Draft tokens for this step's proposal of depth k: `budget` (a tree) when its expected tokens per
        ms beat the chain's, from the measured t(n) and the extra tokens trees from `source` have bought
        (tree_gain), else k (the chain).  A source whose trees do not pay tries one again after
        probe_every chains, so a text where they start to pay is noticed.  Gains are kept per grade of
        the step's proposal too (choose()'s grade; a grade not tried yet starts from its source's): a head
        unsure of its first token gains from a second branch where a sure one does not."""
        if budget <= k or k <= 0:
            return k
        load = self.load() if self.load is not None else NO_LOAD
        chain = load.expected + expected_tokens(self.alphas(source, self._step_grade(source)), k)
        fixed = load.draft_ms + self.draft_cost(k, source)
        key = graded(source, self._step_grade(source))
        gain = self.tree_gain.get(key, self.tree_gain.get(source, self.tree_prior))
        tree_rate = (chain + gain) / (fixed + self.costs.target(load.tokens + budget + 1))
        chain_rate = chain / (fixed + self.costs.target(load.tokens + k + 1))
        waited = self.tree_wait.get(key, 0)
        if tree_rate > chain_rate or waited >= self.probe_every:
            self.tree_wait[key] = 0
            self.planned = Load(budget + 1, chain + gain, self.planned.draft_ms)
            return budget
        self.tree_wait[key] = waited + 1
        return k

    def observe_tree(self, rows: int, target_s: float, extra: int, source: str = MODEL) -> None:
        """A tree step's verification: `rows` tokens in `target_s` seconds (the target's cost at that n is
        learnt as any step's), `extra` tokens emitted beyond what its first branch would have."""
        if target_s > 0 and self.cost_ewma > 0:
            self.costs.learn_target(rows, 1000 * target_s, self.cost_ewma, self.shape_ewma)
        start = self.tree_gain.get(source, self.tree_prior)  # a grade's first tree starts from its source's gain
        for key in dict.fromkeys([source, graded(source, self._step_grade(source))]):
            old = self.tree_gain.get(key, start)
            self.tree_gain[key] = old + (1 - self.forget) * (extra - old)

    def reset(self) -> None:
        """Keep what the last generation learnt, at half weight, as the next one's prior (each source's
        record stays whole: see alphas).  The probe states go on across generations: a probe's budget
        is a share of the time since that source last drafted, and a stream of short requests must earn
        one too (else a drafter priced out once, with a catch-up of a whole prompt to pay, would never
        be tried again)."""
        for counts in (*self.hits.values(), *self.trials.values()):
            counts[:] = [c / 2 for c in counts]
        self._answer = {}
        self.generated = 1  # the prefill's token
        self._model_asked = False

    def describe(self) -> str:
        return f"auto (<= {self.max_k})"
