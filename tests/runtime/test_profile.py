"""Cached step timings (specdec.runtime.profile): reused while a spot check agrees, measured afresh when not."""

from transformers import AutoModelForCausalLM

from specdec.backends.hf import HFRunner
from specdec.runtime.profile import SPOT_TOLERANCE, _cached, agrees
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
    from specdec.runtime.profile import measure_forwards

    runner = HFRunner(AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "model")))
    ticks = iter([0.0, 0.010, 0.0, 0.030, 0.0, 0.020] * 2)  # three runs of t(1): 10, 30 and 20 ms

    def clock():
        return next(ticks)

    assert measure_forwards(runner, [1], prefix=4, repeats=3, clock=clock).ms[1] == 20.0  # the median
    assert measure_forwards(runner, [1], prefix=4, repeats=3, clock=clock, fastest=True).ms[1] == 10.0


def test_step_costs_are_reused_as_cached_renewed_on_demand_and_forgotten(tmp_path, monkeypatch):
    from specdec.runtime import profile

    runner = HFRunner(AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "model")))
    timed = []
    real = profile.measure_forwards

    def counting(*args, **kwargs):
        timed.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile, "measure_forwards", counting)
    cache = tmp_path / "profiles"
    first = profile.step_costs(runner, max_k=3, lookup=True, cache_dir=cache)
    assert len(timed) == 1
    again = profile.step_costs(runner, max_k=3, lookup=True, cache_dir=cache)
    assert len(timed) == 1 and dict(again.target_ms) == dict(first.target_ms)  # nothing timed at a warm start
    profile.step_costs(runner, max_k=3, lookup=True, cache_dir=cache, renew=True)
    assert len(timed) == 2  # specdec profile
    assert profile.forget_step_costs(runner, 3, cache) and not profile.forget_step_costs(runner, 3, cache)
    profile.step_costs(runner, max_k=3, lookup=True, cache_dir=cache)
    assert len(timed) == 3  # measured again after a run found it off


def test_an_engine_drops_cached_step_costs_its_steps_found_twice_off(tmp_path, monkeypatch):
    from specdec.runtime import engine as engine_module
    from specdec.runtime.engine import Engine

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    engine = Engine.load(save_tiny(tmp_path / "model"), "lookup", dtype="fp32")
    engine.generate("a b a b a b", max_new_tokens=4, k="auto")  # the controller's costs measured and cached
    [cached] = (tmp_path / "home" / "profiles").glob("target-*.json")
    auto = engine.auto_controller()
    auto.costs.target_scale = 1.5  # within 2x: kept
    engine._check_step_costs(engine_module.RENEW_AFTER_STEPS)
    assert cached.is_file()
    auto.costs.target_scale = 3.0
    engine._check_step_costs(engine_module.RENEW_AFTER_STEPS - 1)  # too short a run to say
    assert cached.is_file()
    engine._check_step_costs(engine_module.RENEW_AFTER_STEPS)
    assert not cached.is_file()
