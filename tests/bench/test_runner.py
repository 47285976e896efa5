"""Runner: interleaving and warm-up with fake methods; aggregation math on synthetic measurements."""

import math

import pytest

from specdec.algorithm.sampling import SamplingParams
from specdec.bench.methods import Measurement, Method
from specdec.bench.results import Record, aggregate, geometric_mean, per_prompt
from specdec.bench.runner import rotated, run_interleaved
from specdec.prompt_files import Prompt


class Fake(Method):
    """A method that records when it ran and returns canned token ids."""

    def __init__(self, name, log, tokens=(1, 2, 3), sampling=SamplingParams()):
        self.name, self.family, self.gamma = name, name, None
        self.log, self.tokens = log, list(tokens)
        self.sessions = 0
        self.sampling, self.base_seed = sampling, sampling.seed
        self.seeds = []

    def before_session(self):
        self.sessions += 1

    def generate(self, prompt_ids):
        self.log.append((self.name, tuple(prompt_ids)))
        self.seeds.append(self.sampling.seed)
        return Measurement(list(self.tokens))


def test_rotated():
    assert rotated("abc", 0) == list("abc")
    assert rotated("abc", 1) == list("bca")
    assert rotated("abc", 5) == list("cab")
    assert rotated([], 3) == []


def test_interleaved_order_warmup_and_identity():
    log = []
    methods = [Fake("plain", log), Fake("b", log), Fake("c", log, tokens=(9,))]
    prompts = [(Prompt("p0", "x", "t0"), [10]), (Prompt("p1", "y", "t1"), [11])]
    seen = []
    done = []
    records = run_interleaved(methods, prompts, repeats=2, advance=seen.append, on_prompt_done=done.append)
    # One warm-up per method on the first prompt, then per prompt and repeat a rotated order.
    assert log[:3] == [("plain", (10,)), ("b", (10,)), ("c", (10,))]
    order = [name for name, _ in log[3:]]
    assert order == ["plain", "b", "c", "b", "c", "plain", "c", "plain", "b", "plain", "b", "c"]
    assert len(seen) == 3 + 12 and seen[0] == "warm-up plain"
    assert len(records) == 12 and [len(d) for d in done] == [6, 6]
    assert {(r.method, r.identical_to_plain) for r in records} == {("plain", True), ("b", True), ("c", False)}
    assert all(r.measurement.wall_s > 0 for r in records)
    assert {r.repeat for r in records} == {0, 1}
    # A one-turn prompt is a session: before_session() before every run, the warm-up's included.
    assert [m.sessions for m in methods] == [1 + 2 * 2] * 3
    assert all(set(r.to_dict()).isdisjoint(Record.SESSION_KEYS) for r in records)  # rows as before


def test_no_warmup():
    log = []
    run_interleaved([Fake("plain", log)], [(Prompt("p", "x", "t"), [1])], warmup=False)
    assert len(log) == 1


def rec(pid, method, tokens, wall, cat="c", repeat=0, **counts):
    gamma = counts.pop("gamma", None)
    m = Measurement(list(tokens), wall_s=wall, **counts)
    return Record(pid, cat, method, method.split("-")[0], gamma, repeat, 5, m)


def test_geometric_mean():
    assert geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    assert geometric_mean([1.0, 4.0]) == pytest.approx(2.0)
    assert geometric_mean([]) is None


def test_speedup_is_the_geometric_mean_of_per_prompt_token_rate_ratios():
    records = [
        rec("a", "plain", range(10), 1.0),  # 10 tok/s
        rec("a", "spec", range(10), 0.5),  # 20 tok/s: 2x
        rec("b", "plain", range(20), 2.0),  # 10 tok/s
        rec("b", "spec", range(10), 2.0),  # 5 tok/s (fewer tokens: normalised per token): 0.5x
    ]
    summary = aggregate(records)
    spec = summary.method("spec").overall
    assert spec.speedup_vs_plain == pytest.approx(1.0)  # not the arithmetic mean 1.25
    assert (spec.speedup_min, spec.speedup_max) == pytest.approx((0.5, 2.0))
    assert spec.tokens_per_s == pytest.approx(20 / 2.5)  # pooled: all tokens / all time
    assert summary.method("plain").overall.speedup_vs_plain == pytest.approx(1.0)


def test_decode_speedup_leaves_the_prefill_out():
    # a: 11 tokens, the first after 1.0 s (the prefill) -> 10 tokens in 1.0 s against plain's 10 in 2.0 s: 2x
    # (3.0 s against 2.0 s of wall: 1.5x overall); b: assisted generation's first output holds 3 tokens
    records = [
        rec("a", "plain", range(11), 3.0, first_token_s=1.0),
        rec("a", "spec", range(11), 2.0, first_token_s=1.0),
        rec("b", "plain", range(11), 2.0, first_token_s=0.0),
        rec("b", "spec", range(11), 1.0, first_token_s=0.2, first_tokens=3),  # 8 tokens in 0.8 s: 10 tok/s, 2x
        rec("a", "hf", range(11), 2.0),  # no time to the first output: no decode speedup
        rec("b", "hf", range(11), 2.0),
    ]
    summary = aggregate(records)
    spec = summary.method("spec").overall
    assert spec.speedup_vs_plain == pytest.approx(math.sqrt(1.5 * 2.0))
    assert spec.decode_speedup_vs_plain == pytest.approx(2.0)
    assert summary.method("plain").overall.first_token_share == pytest.approx(1.0 / 5.0)
    assert summary.method("hf").overall.decode_speedup_vs_plain is None
    assert summary.method("hf").overall.first_token_share is None
    assert rec("c", "spec", [1], 1.0, first_token_s=1.0).measurement.decode_tokens_per_s is None  # nothing after it
    assert Measurement.from_dict(records[3].measurement.to_dict()) == records[3].measurement


def test_identical_rate():
    records = [
        rec("a", "plain", [1, 2], 1.0), rec("a", "spec", [1, 2], 1.0),
        rec("b", "plain", [3, 4], 1.0), rec("b", "spec", [3, 5], 1.0),
    ]
    summary = aggregate(records)
    assert summary.method("plain").overall.identical_rate == 1.0
    assert summary.method("spec").overall.identical_rate == 0.5
    # Sampling: outputs are not expected to match, so no rate at all (not 0%).
    sampled = aggregate(records, compare_outputs=False)
    assert sampled.method("spec").overall.identical_rate is None
    assert sampled.method("spec").overall.speedup_vs_plain is not None


def test_sampled_runs_are_not_marked_identical_or_not():
    log = []
    records = run_interleaved([Fake("plain", log), Fake("b", log)], [(Prompt("p", "x", "t"), [1])], warmup=False,
                              compare_outputs=False)
    assert [r.identical_to_plain for r in records] == [None, None]


def test_a_sampled_repeat_draws_with_seed_plus_repeat_and_greedy_keeps_its_settings():
    log = []
    sampled = [Fake(n, log, sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=5)) for n in ("plain", "b")]
    prompts = [(Prompt("p0", "x", "t0"), [10]), (Prompt("p1", "y", "t1"), [11])]
    run_interleaved(sampled, prompts, repeats=3, compare_outputs=False)
    for m in sampled:  # the warm-up with the given seed, then per prompt the repeats 0, 1, 2
        assert m.seeds == [5, 5, 6, 7, 5, 6, 7]
        assert m.sampling.temperature == 0.7 and m.sampling.top_p == 0.9
    greedy = Fake("plain", log)
    run_interleaved([greedy], prompts, repeats=2)
    assert greedy.seeds == [None] * 5 and greedy.sampling == SamplingParams()
    unseeded = Fake("plain", log, sampling=SamplingParams(temperature=1.0))
    run_interleaved([unseeded], prompts, repeats=2, warmup=False, compare_outputs=False)
    assert unseeded.seeds == [None] * 4


def test_speedup_by_repeat_is_each_repeats_geometric_mean_over_prompts():
    # two prompts, three repeats; plain 1 s, spec's walls per repeat differ
    walls = {("a", 0): 0.5, ("a", 1): 1.0, ("a", 2): 0.25, ("b", 0): 0.5, ("b", 1): 0.25, ("b", 2): 1.0}
    records = [rec(pid, "plain", [1] * 10, 1.0, cat=pid, repeat=r) for pid in "ab" for r in range(3)]
    records += [rec(pid, "spec", [1] * 10, w, cat=pid, repeat=r) for (pid, r), w in walls.items()]
    summary = aggregate(records, compare_outputs=False)
    assert summary.method("spec").overall.speedup_by_repeat == pytest.approx([2.0, 2.0, 2.0])
    assert summary.method("spec").by_category["a"].speedup_by_repeat == pytest.approx([2.0, 1.0, 4.0])
    assert summary.method("plain").overall.speedup_by_repeat == pytest.approx([1.0, 1.0, 1.0])
    one = aggregate([r for r in records if r.repeat == 0], compare_outputs=False)
    assert one.method("spec").overall.speedup_by_repeat is None  # one repeat: nothing to spread


def test_repeats_take_the_median_and_must_all_be_identical():
    walls = {"plain": [1.0, 3.0, 2.0], "spec": [0.5, 0.4, 10.0]}  # spec: one outlier repeat
    records = [rec("a", m, [1] * 10, w, repeat=r) for m, ws in walls.items() for r, w in enumerate(ws)]
    [plain, spec] = sorted(per_prompt(records), key=lambda p: p.method)
    assert plain.wall_s == 2.0 and plain.tokens_per_s == 5.0
    assert spec.wall_s == 0.5 and spec.tokens_per_s == 20.0
    assert spec.speedup == pytest.approx(4.0)
    records.append(rec("a", "spec", [1] * 9, 0.5, repeat=3))  # one repeat differs from plain
    assert aggregate(records).method("spec").overall.identical_rate == 0.0


def test_even_number_of_repeats_averages_the_middle_two():
    records = [rec("a", "plain", [1] * 4, w, repeat=r) for r, w in enumerate([1.0, 2.0, 4.0, 8.0])]
    assert per_prompt(records)[0].wall_s == 3.0


def test_draft_counts_are_pooled_and_missing_counts_give_none():
    records = [
        rec("a", "plain", [1] * 4, 1.0, target_forwards=4),
        rec("a", "spec", [1] * 4, 1.0, target_forwards=2, drafted=10, accepted=5, draft_steps=2,
            proposed_at=[2, 2, 2, 2, 2], accepted_at=[2, 2, 1, 0, 0]),
        rec("b", "plain", [1] * 4, 1.0, target_forwards=4),
        rec("b", "spec", [1] * 4, 1.0, target_forwards=1, drafted=3, accepted=3, draft_steps=1,
            proposed_at=[1, 1, 1], accepted_at=[1, 1, 1]),
    ]
    s = aggregate(records)
    spec, plain = s.method("spec").overall, s.method("plain").overall
    assert spec.acceptance_rate == pytest.approx(8 / 13)  # pooled, not the mean of 0.5 and 1.0
    assert spec.mean_accepted_per_step == pytest.approx(8 / 3)
    assert spec.tokens_per_target_forward == pytest.approx(8 / 3)
    assert spec.per_position_acceptance == pytest.approx([1.0, 1.0, 2 / 3, 0.0, 0.0])
    assert plain.acceptance_rate is None and plain.per_position_acceptance is None
    assert plain.tokens_per_target_forward == 1.0


def test_per_category_aggregates():
    records = [
        rec("a", "plain", [1] * 10, 1.0, cat="code"), rec("a", "spec", [1] * 10, 0.25, cat="code"),
        rec("b", "plain", [1] * 10, 1.0, cat="chat"), rec("b", "spec", [1] * 10, 1.0, cat="chat"),
    ]
    s = aggregate(records)
    assert s.categories == ["code", "chat"]
    spec = s.method("spec")
    assert spec.by_category["code"].speedup_vs_plain == pytest.approx(4.0)
    assert spec.by_category["chat"].speedup_vs_plain == pytest.approx(1.0)
    assert spec.overall.speedup_vs_plain == pytest.approx(2.0)
    assert spec.by_category["code"].prompts == 1


def test_without_plain_there_is_no_speedup_or_identity():
    s = aggregate([rec("a", "spec", [1], 1.0)])
    assert s.method("spec").overall.speedup_vs_plain is None
    assert s.method("spec").overall.identical_rate is None


def test_record_round_trip():
    r = rec("a", "spec", [1, 2], 0.5, gamma=3, drafted=2, accepted=1, draft_steps=1, target_forwards=2,
            proposed_at=[1, 1], accepted_at=[1, 0])
    r.identical_to_plain = True
    d = r.to_dict()
    assert list(d)[-1] == "token_ids" and d["gamma"] == 3 and d["acceptance_rate"] == 0.5
    assert Record.from_dict(d) == r
    assert not math.isnan(d["tokens_per_s"])


def test_controller_shares_mean_k_plain_steps_and_draft_time():
    records = [
        rec("a", "plain", [1] * 4, 1.0, target_forwards=4),
        rec("a", "spec-auto", [1] * 8, 2.0, drafted=6, accepted=3, draft_steps=2, plain_steps=2, draft_s=0.5),
        rec("b", "plain", [1] * 4, 1.0, target_forwards=4),
        rec("b", "spec-auto", [1] * 8, 2.0, drafted=0, accepted=0, draft_steps=0, plain_steps=4, draft_s=0.0),
    ]
    s = aggregate(records)
    auto, plain = s.method("spec-auto").overall, s.method("plain").overall
    assert auto.mean_k == pytest.approx(6 / 8)  # 6 draft tokens over 2 drafted + 6 plain steps
    assert auto.plain_fraction == pytest.approx(6 / 8)
    assert auto.draft_time_share == pytest.approx(0.5 / 4.0)
    assert s.method("spec-auto").by_category["c"].mean_k == pytest.approx(6 / 8)
    assert plain.mean_k is None and plain.plain_fraction is None and plain.draft_time_share is None
