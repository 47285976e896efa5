"""Benchmark results: the records of a run, and their aggregation into a summary.

A :class:`Record` is one timed generation (a prompt × method × repeat, a row of results.jsonl).
Aggregation (:func:`aggregate`), per method, overall and per category:

* per prompt, the **median** over repeats of wall time and of tokens/s;
* ``speedup_vs_plain``: per prompt ``tokens/s(method) / tokens/s(plain)`` (a
  ratio of wall times normalised per token), then the **geometric mean** over
  prompts;
* ``tokens_per_s``: total new tokens / total (median) wall time;
* ``acceptance_rate``, ``mean_accepted_per_step``, ``tokens_per_target_forward``
  and ``per_position_acceptance``: pooled counts over prompts and repeats
  (e.g. all accepted / all drafted), None where a method has no drafts;
* ``decode_speedup_vs_plain``: the same over the decoding alone, from the first output on (per prompt
  the median over repeats of (new tokens - the first output's) / (wall time - time to the first
  output), over plain's): what speculative decoding speeds up, the prompt's prefill left out; and
  ``first_token_share``: the prefill's share of the wall time.  None where a method does not report
  its time to the first output;
* ``identical_rate``: the fraction of prompts whose token ids equal plain's
  (repeat 0) in every repeat;
* ``acceptance_by_source``: per draft source (model, lookup, suffix, ...: specdec.algorithm.control) its pooled
  draft steps, drafted and accepted tokens and acceptance rate, None where a method does not report it.

A workload's turn (:mod:`specdec.bench.sessions`) is a prompt here, in its
workload's category; its records also carry the session, the turn index and
whether the method's own earlier answers in the session equalled plain's
(``history_identical_rate``: the share of turns where they did in every
repeat).  Per method there are then aggregates per turn index too
(``by_turn``: "1", "2", ..., and "2+" for every turn after the first).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from specdec.bench.methods import REFERENCE, Measurement

ALL = "all"  # the category key of the overall aggregate
LATER = "2+"  # the by_turn key of every turn after a session's first


@dataclass
class Record:
    """One timed run: a prompt × method × repeat (a row of results.jsonl)."""

    prompt_id: str
    category: str
    method: str
    family: str
    gamma: int | None
    repeat: int
    prompt_tokens: int
    measurement: Measurement
    identical_to_plain: bool | None = None  # filled in once plain's output for the prompt is known
    session: str | None = None  # a workload's turn: its session's id, and its turn index from 1
    turn: int | None = None
    history_identical_to_plain: bool | None = None  # the method's earlier answers in the session equal plain's

    SESSION_KEYS = ("session", "turn", "history_identical_to_plain")

    def to_dict(self) -> dict[str, Any]:
        head = {k: v for k, v in asdict(self).items() if k != "measurement"}
        if self.session is None:  # a prompt of a prompt set: no session fields
            head = {k: v for k, v in head.items() if k not in self.SESSION_KEYS}
        return {**head, **self.measurement.to_dict()}  # token_ids last

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls(
            prompt_id=str(d["prompt_id"]), category=d["category"], method=d["method"], family=d["family"],
            gamma=d.get("gamma"), repeat=int(d["repeat"]), prompt_tokens=int(d["prompt_tokens"]),
            measurement=Measurement.from_dict(d), identical_to_plain=d.get("identical_to_plain"),
            **{k: d.get(k) for k in cls.SESSION_KEYS},
        )


def mark_identical(records: Sequence[Record], reference: str = REFERENCE) -> None:
    """Set identical_to_plain on records of one prompt (None when the reference did not run)."""
    ref = next((r for r in records if r.method == reference and r.repeat == 0), None)
    for r in records:
        r.identical_to_plain = None if ref is None else r.measurement.token_ids == ref.measurement.token_ids


@dataclass
class PromptResult:
    """One prompt × method after repeats: medians of the timings, pooled draft counts."""

    prompt_id: str
    category: str
    method: str
    new_tokens: float  # median over repeats
    wall_s: float  # median over repeats, seconds
    tokens_per_s: float  # median over repeats
    target_forwards: int | None  # summed over repeats (like the draft counts below)
    drafted: int | None
    accepted: int | None
    draft_steps: int | None
    proposed_at: list[int] | None
    accepted_at: list[int] | None
    generated: int  # new tokens summed over repeats (pairs with target_forwards)
    identical: bool | None  # every repeat equals plain's repeat 0
    speedup: float | None = None  # tokens_per_s / plain's tokens_per_s
    plain_steps: int | None = None  # summed over repeats
    draft_s: float | None = None  # summed over repeats
    wall_total_s: float = 0.0  # summed over repeats (pairs with draft_s)
    turn: int | None = None  # a workload's turn index
    history_identical: bool | None = None  # the method's history equalled plain's in every repeat
    by_source: dict[str, list[int]] | None = None  # summed over repeats: {source: [draft steps, drafted, accepted]}
    prompt_tokens: int = 0  # summed over repeats
    reused_prompt_tokens: int | None = None  # summed over repeats: taken from the cache (prefix reuse)
    first_token_s: float | None = None  # median over repeats: time to the first output (the prefill)
    decode_tokens_per_s: float | None = None  # median over repeats: tokens/s after the first output
    decode_speedup: float | None = None  # decode_tokens_per_s / plain's
    tokens_per_s_by_repeat: dict[int, float] = field(default_factory=dict)  # repeat -> tokens/s
    speedup_by_repeat: dict[int, float] = field(default_factory=dict)  # repeat -> tokens/s / plain's in that repeat


@dataclass
class Aggregate:
    """A method's numbers over a set of prompts (one category, or all)."""

    prompts: int
    new_tokens: float  # sum of per-prompt medians
    wall_s: float  # sum of per-prompt medians, seconds
    tokens_per_s: float  # new_tokens / wall_s
    speedup_vs_plain: float | None  # geometric mean of per-prompt speedups
    speedup_min: float | None
    speedup_max: float | None
    acceptance_rate: float | None
    mean_accepted_per_step: float | None
    tokens_per_target_forward: float | None
    per_position_acceptance: list[float] | None
    identical_rate: float | None
    mean_k: float | None = None  # draft tokens proposed per step after the prefill (plain steps count 0)
    plain_fraction: float | None = None  # share of those steps that drafted nothing
    draft_time_share: float | None = None  # share of the wall time spent in the drafter
    history_identical_rate: float | None = None  # workloads: share of turns whose history equalled plain's
    # {draft source: {draft_steps, drafted, accepted, acceptance_rate}}, pooled
    acceptance_by_source: dict[str, dict[str, float | None]] | None = None
    prompt_reused_share: float | None = None  # share of the prompts' tokens taken from the cache (prefix reuse)
    decode_speedup_vs_plain: float | None = None  # geometric mean of per-prompt decode speedups (prefill left out)
    first_token_share: float | None = None  # share of the wall time before the first output (the prefill)
    # per repeat (a sampled run: per seed), the geometric mean over the prompts of that repeat's speedups
    speedup_by_repeat: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MethodSummary:
    name: str
    family: str
    gamma: int | None
    overall: Aggregate
    by_category: dict[str, Aggregate] = field(default_factory=dict)
    by_turn: dict[str, Aggregate] = field(default_factory=dict)  # workloads: "1", "2+", "2", "3", ...

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "gamma": self.gamma, **self.overall.to_dict()}


@dataclass
class Summary:
    methods: list[MethodSummary]
    categories: list[str]  # in order of first appearance
    prompt_results: list[PromptResult]
    reference: str = REFERENCE
    turns: list[str] = field(default_factory=list)  # the by_turn keys: "1", "2+", "2", ... (workloads only)

    def method(self, name: str) -> MethodSummary:
        return next(m for m in self.methods if m.name == name)


def geometric_mean(values: Iterable[float]) -> float | None:
    """exp(mean(log v)) over positive values; None for none."""
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _median_optional(values: Sequence[float | None]) -> float | None:
    """The median, or None when any value is None (a repeat that did not report it)."""
    known = [v for v in values if v is not None]
    return None if not values or len(known) < len(values) else statistics.median(known)


_Number = TypeVar("_Number", int, float)  # what _sum_optional adds: counts, or seconds

def _sum_optional(values: Sequence[_Number | None]) -> _Number | int | None:
    """The sum, or None where any value is None (a method that could not report it)."""
    known = [v for v in values if v is not None]
    return None if len(known) < len(values) else sum(known)


def _sum_lists(lists: Sequence[list[int] | None]) -> list[int] | None:
    if any(x is None for x in lists):
        return None
    out: list[int] = []
    for xs in lists:
        assert xs is not None
        out.extend([0] * (len(xs) - len(out)))
        for i, x in enumerate(xs):
            out[i] += x
    return out


def _all_optional(values: Sequence[bool | None]) -> bool | None:
    return None if any(v is None for v in values) else all(values)


def _sum_sources(counts: Sequence[dict[str, list[int]] | None]) -> dict[str, list[int]] | None:
    """{source: [draft steps, drafted, accepted]} added up; None if any is None."""
    if any(c is None for c in counts):
        return None
    total: dict[str, list[int]] = {}
    for by_source in counts:
        for source, values in (by_source or {}).items():
            total[source] = [a + b for a, b in zip(total.get(source, [0, 0, 0]), values)]
    return total


def per_prompt(records: Sequence[Record], reference: str = REFERENCE, compare_outputs: bool = True) -> list[PromptResult]:
    """Collapse repeats: one PromptResult per (prompt, method), with its speedup over the reference.

    compare_outputs=False (sampling) leaves ``identical`` None.
    """
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.prompt_id, r.method), []).append(r)
    # Identical outputs: against the reference's repeat 0 for the prompt.
    ref_ids = {r.prompt_id: r.measurement.token_ids for r in records if r.method == reference and r.repeat == 0}
    results: list[PromptResult] = []
    for (pid, method), rs in groups.items():
        ms = [r.measurement for r in rs]
        results.append(
            PromptResult(
                prompt_id=pid,
                category=rs[0].category,
                method=method,
                new_tokens=statistics.median(m.new_tokens for m in ms),
                wall_s=statistics.median(m.wall_s for m in ms),
                tokens_per_s=statistics.median(m.tokens_per_s for m in ms),
                target_forwards=_sum_optional([m.target_forwards for m in ms]),
                drafted=_sum_optional([m.drafted for m in ms]),
                accepted=_sum_optional([m.accepted for m in ms]),
                draft_steps=_sum_optional([m.draft_steps for m in ms]),
                proposed_at=_sum_lists([m.proposed_at for m in ms]),
                accepted_at=_sum_lists([m.accepted_at for m in ms]),
                generated=sum(m.new_tokens for m in ms),
                plain_steps=_sum_optional([m.plain_steps for m in ms]),
                draft_s=_sum_optional([m.draft_s for m in ms]),
                wall_total_s=sum(m.wall_s for m in ms),
                by_source=_sum_sources([m.by_source for m in ms]),
                prompt_tokens=sum(r.prompt_tokens for r in rs),
                reused_prompt_tokens=_sum_optional([m.reused_prompt_tokens for m in ms]),
                identical=None if not compare_outputs or pid not in ref_ids else all(m.token_ids == ref_ids[pid] for m in ms),
                turn=rs[0].turn,
                history_identical=_all_optional([r.history_identical_to_plain for r in rs]),
                first_token_s=_median_optional([m.first_token_s for m in ms]),
                decode_tokens_per_s=_median_optional([m.decode_tokens_per_s for m in ms]),
                tokens_per_s_by_repeat={r.repeat: r.measurement.tokens_per_s for r in rs},
            )
        )
    ref_tps = {p.prompt_id: p.tokens_per_s for p in results if p.method == reference}
    ref_decode = {p.prompt_id: p.decode_tokens_per_s for p in results if p.method == reference}
    ref_by_repeat = {p.prompt_id: p.tokens_per_s_by_repeat for p in results if p.method == reference}
    for p in results:
        base_by_repeat = ref_by_repeat.get(p.prompt_id, {})
        p.speedup_by_repeat = {r: tps / base_by_repeat[r] for r, tps in p.tokens_per_s_by_repeat.items()
                               if base_by_repeat.get(r) and tps > 0}
        base = ref_tps.get(p.prompt_id)
        p.speedup = p.tokens_per_s / base if base and p.tokens_per_s > 0 else None
        base = ref_decode.get(p.prompt_id)
        p.decode_speedup = p.decode_tokens_per_s / base if base and p.decode_tokens_per_s else None
    return results


def identical_share(records: Sequence[Record], reference: str, family: str) -> dict[str, float]:
    """Per method of `family` (a method-family prefix) other than `reference`, the share of prompts whose token
    ids equal `reference`'s (per_prompt's own rule with that method as the reference): llama.cpp's speculation
    checked against llama.cpp's own plain server, as ours is against ours.  Empty when `reference` did not run."""
    members = [r for r in records if r.family.startswith(family)]
    if not any(r.method == reference for r in members):
        return {}
    same: dict[str, list[bool]] = {}
    for p in per_prompt(members, reference=reference):
        if p.method != reference and p.identical is not None:
            same.setdefault(p.method, []).append(p.identical)
    return {name: sum(flags) / len(flags) for name, flags in same.items()}


def combine(results: Sequence[PromptResult]) -> Aggregate:
    """One method's PromptResults (over some prompts) -> its Aggregate."""
    new_tokens = sum(p.new_tokens for p in results)
    wall = sum(p.wall_s for p in results)
    speedups = [p.speedup for p in results if p.speedup is not None]
    drafted = _sum_optional([p.drafted for p in results])
    accepted = _sum_optional([p.accepted for p in results])
    steps = _sum_optional([p.draft_steps for p in results])
    forwards = _sum_optional([p.target_forwards for p in results])
    proposed_at = _sum_lists([p.proposed_at for p in results])
    accepted_at = _sum_lists([p.accepted_at for p in results])
    identical = [p.identical for p in results if p.identical is not None]
    histories = [p.history_identical for p in results if p.history_identical is not None]
    has_drafts = bool(drafted)  # None or 0: the method never drafted
    plain_steps = _sum_optional([p.plain_steps for p in results])
    draft_s = _sum_optional([p.draft_s for p in results])
    wall_total = sum(p.wall_total_s for p in results)
    loop_steps = (steps or 0) + plain_steps if plain_steps is not None and drafted is not None else None
    by_source = _sum_sources([p.by_source for p in results])
    reused = _sum_optional([p.reused_prompt_tokens for p in results])
    prompt_tokens = sum(p.prompt_tokens for p in results)
    return Aggregate(
        prompts=len(results),
        new_tokens=new_tokens,
        wall_s=wall,
        tokens_per_s=new_tokens / wall if wall > 0 else 0.0,
        speedup_vs_plain=geometric_mean(speedups),
        speedup_min=min(speedups) if speedups else None,
        speedup_max=max(speedups) if speedups else None,
        acceptance_rate=accepted / drafted if drafted and accepted is not None else None,  # (drafted: has_drafts)
        mean_accepted_per_step=accepted / steps if has_drafts and accepted is not None and steps else None,
        tokens_per_target_forward=(
            sum(p.generated for p in results) / forwards if forwards else None
        ),
        per_position_acceptance=(
            [a / p if p else 0.0 for a, p in zip(accepted_at, proposed_at)]
            if has_drafts and proposed_at is not None and accepted_at is not None
            else None
        ),
        identical_rate=sum(identical) / len(identical) if identical else None,
        mean_k=drafted / loop_steps if loop_steps and drafted is not None else None,  # (loop_steps: drafted known)
        plain_fraction=plain_steps / loop_steps if loop_steps and plain_steps is not None else None,
        draft_time_share=draft_s / wall_total if draft_s is not None and wall_total > 0 else None,
        history_identical_rate=sum(histories) / len(histories) if histories else None,
        acceptance_by_source=None if not by_source else {
            source: {"draft_steps": n, "drafted": d, "accepted": a, "acceptance_rate": a / d if d else None}
            for source, (n, d, a) in sorted(by_source.items())},
        prompt_reused_share=reused / prompt_tokens if reused is not None and prompt_tokens else None,
        decode_speedup_vs_plain=geometric_mean(p.decode_speedup for p in results if p.decode_speedup is not None),
        first_token_share=first_token_share(results),
        speedup_by_repeat=speedup_by_repeat(results),
    )


def speedup_by_repeat(results: Sequence[PromptResult]) -> list[float] | None:
    """Per repeat, in order, the geometric mean over `results` of that repeat's speedups (None with fewer than
    two repeats, or where a prompt lacks a repeat)."""
    repeats = sorted({r for p in results for r in p.speedup_by_repeat})
    if len(repeats) < 2 or any(set(p.speedup_by_repeat) != set(repeats) for p in results):
        return None
    return [geometric_mean(p.speedup_by_repeat[r] for p in results) or 0.0 for r in repeats]


def first_token_share(results: Sequence[PromptResult]) -> float | None:
    """Time to the first output over wall time, summed over the prompts (None unless every prompt reports it)."""
    wall = sum(p.wall_s for p in results)
    if not results or wall <= 0 or any(p.first_token_s is None for p in results):
        return None
    return sum(p.first_token_s or 0.0 for p in results) / wall


def aggregate(records: Sequence[Record], reference: str = REFERENCE, compare_outputs: bool = True) -> Summary:
    """Records of a run -> per-method summaries, overall and per category (methods in first-run order).

    compare_outputs=False (sampling): no identical-output rates.
    """
    results = per_prompt(records, reference, compare_outputs)
    methods: dict[str, Record] = {}
    categories: dict[str, None] = {}
    for r in records:
        methods.setdefault(r.method, r)
        categories.setdefault(r.category, None)
    turns = turn_keys(p.turn for p in results)
    summaries = []
    for name, first in methods.items():
        mine = [p for p in results if p.method == name]
        by_cat = {c: combine([p for p in mine if p.category == c]) for c in categories if any(p.category == c for p in mine)}
        by_turn = {key: combine(group) for key in turns if (group := [p for p in mine if in_turn_group(p.turn, key)])}
        summaries.append(MethodSummary(name, first.family, first.gamma, combine(mine), by_cat, by_turn))
    return Summary(summaries, list(categories), results, reference, turns)


def turn_keys(turns: Iterable[int | None]) -> list[str]:
    """The by_turn keys for these turn indices: "1", "2+" (when a later turn ran), "2", "3", ...;
    none without turns (a prompt set)."""
    seen = sorted({t for t in turns if t is not None})
    keys = [str(t) for t in seen]
    return keys[:1] + ([LATER] if any(t > 1 for t in seen) else []) + keys[1:]


def in_turn_group(turn: int | None, key: str) -> bool:
    """Whether turn index `turn` belongs to the by_turn group `key` ("3", or "2+" for every turn after the first)."""
    if turn is None:
        return False
    return turn > 1 if key == LATER else str(turn) == key

