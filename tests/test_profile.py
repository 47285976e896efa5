"""Cached step timings (specdec.profile): reused while a spot check agrees, measured afresh when not."""

from transformers import AutoModelForCausalLM

from specdec.backends.hf import HFRunner
from specdec.profile import SPOT_TOLERANCE, _cached, agrees
from tests.tiny import save_tiny


def test_agrees_within_the_tolerance_only():
    assert agrees(100.0, 100.0) and agrees(100.0, 100.0 * SPOT_TOLERANCE) and agrees(100.0, 100.0 / SPOT_TOLERANCE)
    assert not agrees(930.0, 25.0)  # a draft token cached while the machine was busy, measured quiet
    assert not agrees(25.0, 930.0)


def test_a_cached_timing_is_kept_while_it_agrees_and_measured_afresh_when_not(tmp_path):
    runner = HFRunner(AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "model")))  # a named model
    measured = iter([930.0, 25.0, 26.0])  # busy machine first, then quiet
    calls = []

    def measure():
        calls.append(1)
        return next(measured)

    now = 25.0  # what the spot check measures

    def spot(cached):
        return agrees(cached, now)

    cache = tmp_path / "profiles"
    assert _cached("draft", runner, {"n": 1}, measure, cache) == 930.0  # first use: measured and kept
    assert _cached("draft", runner, {"n": 1}, measure, cache) == 930.0  # no spot check asked: kept
    assert _cached("draft", runner, {"n": 1}, measure, cache, spot) == 25.0  # 37x off now: measured again
    assert _cached("draft", runner, {"n": 1}, measure, cache, spot) == 25.0  # agrees: reused from disk
    assert len(calls) == 2


def test_forwards_are_timed_by_their_median_or_their_fastest_run(tmp_path):
    from specdec.profile import measure_forwards

    runner = HFRunner(AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "model")))
    ticks = iter([0.0, 0.010, 0.0, 0.030, 0.0, 0.020] * 2)  # three runs of t(1): 10, 30 and 20 ms

    def clock():
        return next(ticks)

    assert measure_forwards(runner, [1], prefix=4, repeats=3, clock=clock).ms[1] == 20.0  # the median
    assert measure_forwards(runner, [1], prefix=4, repeats=3, clock=clock, fastest=True).ms[1] == 10.0
