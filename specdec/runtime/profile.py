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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from specdec.backends.base import ModelRunner
from specdec.zoo import write_atomically

if TYPE_CHECKING:
    from specdec.algorithm.control import Costs

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
    fastest: bool = False,
) -> CostTable:
    """t(k) for each k in ks: the median ms of `repeats` forwards of k tokens after `prefix` cached tokens
    (fastest: the least, as measure_drafting takes)."""
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
    stat = min if fastest else statistics.median
    return CostTable({k: 1000 * stat(v) for k, v in times.items()}, prefix, repeats)


def decode_runs(
    runner: ModelRunner,
    tokens: int = 16,
    prefix: int = 128,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """ms per token of each of `repeats` runs of `tokens` one-token forwards in a row after `prefix` cached
    tokens (0: from an empty cache, as llama-bench's tg<tokens> decodes), rolled back after each run; one
    forward before them is not timed (first calls allocate)."""
    if prefix < 0 or prefix + tokens > runner.max_context:
        raise ValueError(f"a prefix of {prefix} and {tokens} one-token steps do not fit a window of {runner.max_context}")
    runner.reset()
    if prefix:
        runner.forward(_tokens(runner.vocab_size, prefix, seed=3), last_n=1)
    new = _tokens(runner.vocab_size, tokens, seed=4)
    runner.forward(new[:1])  # warm-up
    runner.rollback(prefix)
    per_token = []
    for _ in range(repeats):
        start = clock()
        for t in new:
            runner.forward([t])
        per_token.append(1000 * (clock() - start) / tokens)
        runner.rollback(prefix)
    runner.reset()
    return per_token


def measure_drafting(
    runner: ModelRunner,
    tokens: int = 16,
    prefix: int = 128,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """ms per drafted token: `tokens` one-token forwards in a row after `prefix` cached tokens, the
    fastest of `repeats` runs (decode_runs).  The fastest, not the median: what else the machine does only
    ever slows a run, and a drafter priced too high is never tried, so its cost would never be corrected
    online (a median of two runs once priced a draft at 1.6 times what it cost in the loop: BENCHMARKS.md)."""
    return min(decode_runs(runner, tokens, prefix, repeats, clock))


def step_bytes(runner: ModelRunner) -> int | None:
    """The weight bytes a one-token step of `runner` reads (every layer's linears and the output head; the
    embedding's one row aside), what bounds a memory-bound step: the packed weights of specdec's kernels, the
    GGUF file's tensors for llama.cpp, the parameters of a transformers model; None where unknown (its runtime
    says: specdec.runtime.runners)."""
    from specdec.runtime import runners

    return runners.step_bytes(runner)


@dataclass
class Roof:
    """A one-token step against the memory's roof: the weight bytes it reads over the measured read bandwidth
    (the medians of probes and steps taken in turn: the bandwidth of a shared machine moves)."""

    bandwidth: float  # GB/s
    bytes: int  # weight bytes a step reads
    step_ms: float  # a one-token step after the prefix

    @property
    def roof_ms(self) -> float:
        return self.bytes / self.bandwidth / 1e6

    @property
    def of_roof(self) -> float:
        """roof / step: 1.0 at the roof."""
        return self.roof_ms / self.step_ms

    def to_dict(self) -> dict:
        return {"read_gb_s": round(self.bandwidth, 2), "weight_bytes": self.bytes, "step_ms": round(self.step_ms, 3),
                "roof_ms": round(self.roof_ms, 3), "of_roof": round(self.of_roof, 3)}

    def line(self) -> str:
        return (f"step {self.step_ms:.1f} ms, roof {self.roof_ms:.1f} ms: {100 * self.of_roof:.0f}% "
                f"({self.bytes / 1e9:.2f} GB of weights a step at {self.bandwidth:.1f} GB/s read)")


def measure_roof(runner: ModelRunner, prefix: int = 128, rounds: int = 5, steps: int = 5) -> Roof | None:
    """The one-token step against its roof (see Roof): `rounds` of a bandwidth probe then `steps` one-token
    forwards after `prefix` tokens; None where the weight bytes or the bandwidth cannot be had."""
    from specdec.native.kernels.bandwidth import read_bandwidth

    size = step_bytes(runner)
    if not size or prefix + 1 > runner.max_context:
        return None
    rates, times = [], []
    probe = max(256 << 20, min(1 << 30, size))  # a buffer the size of the weights, within bounds
    for _ in range(rounds):
        rate = read_bandwidth(size=probe)
        if rate is None:
            return None
        rates.append(rate)
        times.append(measure_forwards(runner, [1], prefix=prefix, repeats=steps).ms[1])
    return Roof(statistics.median(rates), size, statistics.median(times))


PREFILL_LENGTHS = (512, 2048)


def measure_prefill(runner: ModelRunner, lengths: Sequence[int] = PREFILL_LENGTHS, repeats: int = 1) -> dict[int, float]:
    """Prefill tokens/s: a prompt of each length in one forward from an empty cache (the fastest of
    `repeats`); lengths beyond the runner's window are left out."""
    rates = {}
    for n in lengths:
        if n > runner.max_context:
            continue
        tokens = _tokens(runner.vocab_size, n, seed=5)
        best = float("inf")
        for _ in range(repeats):
            runner.reset()
            start = time.perf_counter()
            runner.forward(tokens, last_n=1)
            best = min(best, time.perf_counter() - start)
        rates[n] = n / best
    runner.reset()
    return rates


# What a step of the speculation controller (specdec.algorithm.control) costs, measured once per
# model / backend / dtype / threads / CPU and kept on disk: a few timed forwards, seconds.
CONTROL_PREFIX = 64
# Runs per timed n; the target's t(n) keeps the fastest (as the draft's timing does): what else the machine
# does only slows a forward, and a seeded sampled request prices its steps with this table alone (its costs
# are frozen: specdec.runtime.engine.Engine.speculation).  On the Zen 4 VM the table's t(2) / t(1) came out 1.03
# (median of two and fastest of three alike) where the loop measured 1.15-1.24: the VM's memory is faster
# some minutes than others, which no timing at start sees.
CONTROL_REPEATS = 3
LOOKUP_MS_PER_TOKEN = 0.01  # prompt lookup: a suffix search in Python, microseconds
SYNC_TOKENS = 32  # a draft model's catch-up is timed as one forward of this many tokens


# Part of every cached timing's key: bumped when a runner's kernels change, so that timings measured
# with the old ones are measured again (2: the weight-major fp32 verification product, fastlinear).
KERNELS_VERSION = 2


class Timed(Protocol):
    """What has timings to cache: a runner, or anything else that says what its timings depend on."""

    def identity(self) -> dict[str, Any]:
        """As ModelRunner.identity: at least "backend", "model" ("" for none: nothing cached) and "threads"."""
        ...


def runner_identity(runner: Timed) -> dict[str, object] | None:
    """What a runner's timings depend on (model, backend, dtype, threads, CPU), or None when the
    model has no name to key a cache with (e.g. a model built in memory)."""
    from specdec.machine import cpu_description

    who = runner.identity()
    if not who["model"]:
        return None
    return {**who, "cpu": cpu_description()}


def _cache_file(kind: str, runner: Timed, params: dict, cache_dir: Path | None) -> tuple[Path, str] | None:
    """(the file, the key it must hold) of a cached timing of `kind` for this runner's identity and `params`;
    None without a cache or a runner with no name to key one."""
    import hashlib
    import json

    identity = runner_identity(runner)
    if cache_dir is None or identity is None:
        return None
    key = json.dumps({"kind": kind, "kernels": KERNELS_VERSION, **identity, **params}, sort_keys=True)
    return Path(cache_dir) / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json", key


_Value = TypeVar("_Value")  # what a measurement gives: JSON values, as they are cached


def _cached(kind: str, runner: Timed, params: dict, measure: Callable[[], _Value],
            cache_dir: Path | None, still_true: Callable[[_Value], bool] | None = None) -> _Value:
    """measure(), or what it returned before for this runner's identity and these params (JSON on disk)
    if still_true(that) holds (a quick spot check against the machine now; measured afresh if not)."""
    import json

    where = _cache_file(kind, runner, params, cache_dir)
    if where is None:
        return measure()
    path, key = where
    try:
        record = json.loads(path.read_text())
        if record.get("key") == key and (still_true is None or still_true(record["value"])):
            return record["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = measure()
    write_atomically(path, json.dumps({"key": key, "value": value}))  # read-only: measured again next time
    return value


SPOT_REPEATS = 2  # the spot check of a cached timing: this many runs (their median for forwards, the fastest for drafting)
SPOT_TOLERANCE = 2.0  # a cached timing is kept while the machine now measures within this factor of it


def agrees(cached: float, now: float) -> bool:
    """Whether a cached timing still describes the machine: within SPOT_TOLERANCE of a spot measurement
    now.  Timings cached while the machine was busy with something else would otherwise price every
    later run (seen once: a profile taken beside a test run cached a draft token at ~40 times its quiet
    cost, and the controller then never drafted with the model again, in any later process;
    BENCHMARKS.md, Zen 3 component timings)."""
    return cached / SPOT_TOLERANCE <= now <= cached * SPOT_TOLERANCE


# A draft model's ms per token is timed over this many drafted tokens (at most max_k): what a model drafts
# in a step; the controller's larger k (up to specdec.runtime.engine.MAX_AUTO_K) are for free sources' long matches
DRAFT_TIMED_TOKENS = 8


def control_ks(max_k: int) -> list[int]:
    """Forward sizes timed for the controller: every n up to 4, then every other, and max_k + 1."""
    return sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16) if n <= max_k + 1} | {max_k + 1})


def _room(runner: ModelRunner, extra: int) -> int:
    """The prefix a timing of `extra` new tokens runs after: CONTROL_PREFIX, or what the window leaves."""
    return max(1, min(CONTROL_PREFIX, runner.max_context - extra - 1))


def _target_params(target: ModelRunner, max_k: int) -> dict[str, Any]:
    """What the target's cached t(n) table is measured with (part of its key)."""
    return {"ks": control_ks(max_k), "prefix": _room(target, max_k + 1), "repeats": CONTROL_REPEATS, "stat": "min"}


def forget_step_costs(target: ModelRunner, max_k: int, cache_dir: Path | None) -> bool:
    """Drop the target's cached t(n) table (step_costs measures it again at the next start); whether there was one."""
    where = _cache_file("target", target, _target_params(target, max_k), cache_dir)
    if where is None or not where[0].is_file():
        return False
    where[0].unlink(missing_ok=True)
    return True


def marginal_row_ms(runner: ModelRunner, n: int, prefix: int) -> float:
    """ms a row adds to a forward of `runner`: (t(n) - t(1)) / (n - 1) after `prefix` tokens (the fastest of
    CONTROL_REPEATS each): what a draft model's catch-up of n tokens costs per token beyond a steady step's one
    (specdec.algorithm.control.Costs.catch_up)."""
    table = measure_forwards(runner, [1, n], prefix=prefix, repeats=CONTROL_REPEATS, fastest=True).ms
    return max(table[n] - table[1], 0.0) / (n - 1)


def step_costs(
    target: ModelRunner,
    draft: ModelRunner | None = None,
    max_k: int = 8,
    lookup: bool = False,
    cache_dir: Path | None = None,
    renew: bool = False,
) -> Costs:
    """The controller's Costs: the target's t(n) for n = 1..max_k + 1 (a few points, interpolated),
    the draft's ms per proposed token (a draft model's one-token forwards; prompt lookup ~0) and per
    token of a catch-up (marginal_row_ms: what a forward of SYNC_TOKENS tokens costs more than one of 1).
    Measured once and cached in `cache_dir` per runner identity (model, backend, dtype, threads, kernel
    build, CPU: see runner_identity) and reused as it is: nothing is timed at a start that was timed before
    on this machine and build (but a cached draft token dearer than a target step, which is spot-checked).
    `specdec profile` renews the timings, and so does a start after a run whose steps cost more than twice
    or less than half what the cache says (Engine._check_step_costs, forget_step_costs).  renew: measure
    everything afresh and cache that (`specdec profile`)."""
    from specdec.algorithm.control import Costs

    def renewed(cached: object) -> bool:
        return not renew

    params = _target_params(target, max_k)
    ms = _cached("target", target, params,
                 lambda: {str(k): v for k, v in measure_forwards(target, params["ks"], prefix=params["prefix"],
                                                                 repeats=CONTROL_REPEATS, fastest=True).ms.items()},
                 cache_dir, renewed)
    if draft is not None:
        drafted = min(max_k, DRAFT_TIMED_TOKENS)
        d_prefix = _room(draft, drafted)

        def plausible(cached: float) -> bool:
            # A draft token dearer than a target step prices the draft out, and a draft never tried is never
            # corrected online: such a cached value (one timed beside a test run: 930 ms against 25 quiet) is
            # checked against the machine now; any other is reused as it is.
            if renew:
                return False
            return float(cached) < float(ms["1"]) or agrees(
                float(cached), measure_drafting(draft, tokens=2, prefix=d_prefix, repeats=SPOT_REPEATS))

        draft_ms = _cached("draft", draft, {"tokens": drafted, "prefix": d_prefix, "repeats": CONTROL_REPEATS,
                                            "stat": "min"},
                           lambda: measure_drafting(draft, tokens=drafted, prefix=d_prefix, repeats=CONTROL_REPEATS),
                           cache_dir, plausible)
        n = max(2, min(SYNC_TOKENS, draft.max_context - d_prefix - 1))
        sync_ms = _cached("draft-sync", draft, {"tokens": n, "prefix": d_prefix, "repeats": CONTROL_REPEATS,
                                                "stat": "marginal"},
                          lambda: marginal_row_ms(draft, n, d_prefix), cache_dir, renewed)
    else:
        draft_ms = LOOKUP_MS_PER_TOKEN if lookup else 0.0
        sync_ms = 0.0
    return Costs({int(k): float(v) for k, v in ms.items()}, float(draft_ms), sync_ms=float(sync_ms))
