"""The speculation controller's choices on synthetic costs and acceptances (specdec.algorithm.control)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdec.algorithm.control import SYNC_SPLIT, AutoK, Costs, FixedK, expected_tokens, isotonic
from specdec.algorithm.draft import LOOKUP, MODEL, SHORT_LOOKUP, SUFFIX

FLAT = {1: 100.0, 16: 100.0}  # verifying 16 tokens costs one step (a GPU-like target)
CPU = {1: 100.0, 2: 115.0, 4: 170.0, 6: 230.0, 8: 290.0, 16: 600.0}  # grows with k (int8 on AVX2)


def trained(controller: AutoK, accept_prob: float, steps: int = 60, k: int = 4) -> AutoK:
    """Feed `steps` draft steps of k tokens whose tokens are each accepted with a deterministic rate."""
    credit = 0.0
    for _ in range(steps):
        accepted = 0
        while accepted < k:
            credit += accept_prob
            if credit < 1:
                break
            credit -= 1
            accepted += 1
        controller.observe(k, accepted, 0.0, 0.0)
    return controller


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 5, 5) == 6


def test_interpolated_costs():
    costs = Costs(CPU, draft_ms=10)
    assert costs.target(1) == 100 and costs.target(3) == pytest.approx(142.5)
    assert costs.target(20) == pytest.approx(600 + 4 * (600 - 290) / 8)  # extrapolated
    assert Costs({1: 50.0}, 0).target(4) == 200  # only t(1): no batching assumed
    assert costs.draft(3) == 30
    with pytest.raises(ValueError):
        Costs({2: 10.0}, 1)


def test_a_useless_draft_means_plain_steps():
    controller = trained(AutoK(Costs(CPU, draft_ms=10), max_k=8), accept_prob=0.0)
    assert controller.choose(8) == 0


def test_a_perfect_draft_with_flat_costs_drafts_the_most():
    controller = trained(AutoK(Costs(FLAT, draft_ms=1), max_k=8), accept_prob=1.0)
    assert controller.choose(8) == 8
    assert controller.choose(3) == 3  # never past the loop's limit
    assert controller.choose(0) == 0


def test_growing_costs_pick_a_middle_k():
    controller = trained(AutoK(Costs(CPU, draft_ms=15), max_k=8), accept_prob=0.8)
    k = controller.choose(8)
    assert 1 <= k < 8
    rates = [controller.rate(j) for j in range(9)]
    assert rates[k] == max(rates)


def test_an_expensive_draft_is_not_used_even_when_it_is_right():
    # Drafting a token costs as much as a target step and verification grows: plain is faster.
    controller = trained(AutoK(Costs(CPU, draft_ms=100), max_k=8), accept_prob=0.9)
    assert controller.choose(8) == 0


STEP_S = 0.1  # a plain step's time, as CPU's t(1)


def table_s(k: int) -> float:
    """What a step drafting k tokens takes on the target, as the CPU table says."""
    return Costs(CPU, draft_ms=0).target(k + 1) / 1000


def test_plain_steps_probe_ever_less_often_and_come_back():
    controller = trained(AutoK(Costs(CPU, draft_ms=10), max_k=8, probe_every=4, max_probe_gap=16,
                               probe_budget=1.0), accept_prob=0.0)
    choices = []
    for _ in range(4 + 1 + 8 + 1 + 16 + 1 + 16 + 1):
        k = controller.choose(8)
        choices.append(k)
        controller.observe(k, 0, 0.0, STEP_S)
    probes = [i for i, k in enumerate(choices) if k]
    assert all(choices[i] == 1 for i in probes)
    assert probes == [4, 4 + 1 + 8, 4 + 1 + 8 + 1 + 16, 4 + 1 + 8 + 1 + 16 + 1 + 16]  # gaps 4, 8, 16, 16
    trained(controller, accept_prob=1.0, steps=30)  # the text turned predictable
    assert controller.choose(8) >= 4
    assert controller.probe_state().gap == 4  # drafting again: the next plain run is probed soon


def test_a_hybrids_lookup_drafts_earn_the_draft_model_a_probe():
    # A useless draft model 64 tokens behind: a probe costs the catch-up 64 x 5 ms, a draft token and
    # the longer verification (345 ms), so at 3% of the time since the model last drafted it is due
    # after 115 steps' worth (t(1) = 100 ms).  Lookup drafts every other step: that is time the model
    # was not tried too (it used to reset the model's budget, so the model was never probed again).
    controller = trained(AutoK(Costs(CPU, draft_ms=10, sync_ms=5), max_k=8, probe_every=4), accept_prob=0.0)
    model_steps = []
    for step in range(300):
        if step % 2:
            k = controller.choose(8, 0, LOOKUP)
            assert k > 0  # the lookup's drafts are all accepted
            controller.observe(k, k, 0.0, table_s(k), source=LOOKUP)
        else:
            k = controller.choose(8, 64, MODEL)
            model_steps.append((step, k))
            controller.observe(k, 0, 0.0, table_s(k), source=MODEL)
    probes = [step for step, k in model_steps if k]
    assert all(k <= 1 for _, k in model_steps)  # never more than a probe
    assert len(probes) == 2 and 114 <= probes[0] <= 118 and 114 <= probes[1] - probes[0] <= 118, probes


def test_a_successful_probe_brings_drafting_back():
    controller = trained(AutoK(Costs(CPU, draft_ms=10), max_k=8, probe_every=4, probe_budget=1.0), accept_prob=0.1)
    assert controller.choose(8) == 0
    for _ in range(4):
        controller.observe(controller.choose(8), 0, 0.0, STEP_S)
    choices = []
    for _ in range(40):  # every probe, and every draft after them, is accepted: the estimate climbs back
        k = controller.choose(8)
        choices.append(k)
        controller.observe(k, k, 0.0, table_s(k))
    assert choices[:5] == [1, 0, 0, 0, 0]  # an accepted probe keeps the probing pace at probe_every
    assert choices[5] == 1 and all(k >= 1 for k in choices[5:])  # drafting every step again
    assert choices[-1] >= 4  # positions not drafted for a while drift to the pooled rate: k climbs back


def test_online_costs_follow_the_measured_times():
    controller = AutoK(Costs(CPU, draft_ms=10), max_k=8, cost_ewma=0.5)
    for _ in range(20):
        controller.observe(0, 0, 0.0, 0.2)  # one-token steps take 200 ms, twice the table's
    assert controller.costs.target(1) == pytest.approx(200, rel=1e-3)
    assert controller.costs.target(4) == pytest.approx(2 * 170, rel=1e-3)  # an n not measured moves alike
    for _ in range(20):
        controller.observe(4, 4, 0.08, 0.34, synced=1)  # 80 ms for 4 draft tokens: 40 ms on top of 4 x 10
    assert controller.costs.draft_overhead_ms == pytest.approx(40, rel=1e-3)
    assert controller.costs.draft(4) == pytest.approx(80, rel=1e-3)
    assert controller.costs.draft(1) == pytest.approx(50, rel=1e-3) and controller.costs.draft(0) == 0


def test_acceptance_is_estimated_per_position():
    controller = AutoK(Costs(CPU, draft_ms=10), max_k=4, forget=1.0)
    for _ in range(50):
        controller.observe(4, 1, 0.0, 0.0)  # the first token always kept, the second never
    a = controller.alphas()
    assert a[0] > 0.95 and a[1] < 0.05
    assert controller.choose(4) == 1


def test_reset_keeps_a_weaker_prior():
    controller = trained(AutoK(Costs(CPU, draft_ms=10)), accept_prob=0.0)
    before = sum(controller.trials["model"])
    controller.reset()
    assert sum(controller.trials["model"]) == pytest.approx(before / 2)
    assert controller.choose(8) == 0  # still believes the draft useless


def test_a_hybrids_short_matches_start_from_a_prior_of_their_own():
    # t(2) = 1.25 t(1): a free one-token draft pays at the default prior 0.6 (1.6 / 1.25 tokens a step), not at
    # the short matches' 0.2 (1.2 / 1.25): a fresh controller (a seeded sampled request's) skips them until
    # they earn it, where it drafted them at every step
    ctrl = AutoK(Costs({1: 10.0, 2: 12.5, 3: 25.0}, draft_ms=0.0), max_k=2)
    assert ctrl.choose(2, source=LOOKUP) == 1
    assert ctrl.choose(2, source=SHORT_LOOKUP) == 0
    assert ctrl.source_prior(SHORT_LOOKUP) == pytest.approx(0.2)
    assert ctrl.source_prior(SHORT_LOOKUP, "match 1 p=1") == pytest.approx(0.2)  # a grade starts from its source
    for _ in range(6):
        ctrl.choose(2, source=SHORT_LOOKUP)
        ctrl.observe(1, 1, 0.0, 0.0125, source=SHORT_LOOKUP)
    assert ctrl.choose(2, source=SHORT_LOOKUP) > 0  # right every time: the evidence wins over the prior
    with pytest.raises(ValueError, match="priors"):
        AutoK(Costs({1: 1.0}, draft_ms=0.0), source_priors={SHORT_LOOKUP: 1.0})


def test_fixed_k():
    assert FixedK(5).choose(8) == 5 and FixedK(5).choose(2) == 2
    with pytest.raises(ValueError):
        FixedK(0)
    with pytest.raises(ValueError):
        AutoK(Costs(CPU, 1), max_k=0)


def test_a_draft_models_catch_up_is_no_drafting_cost():
    controller = AutoK(Costs(CPU, draft_ms=10), max_k=8, cost_ewma=0.5)
    controller.observe(2, 2, 0.5, 0.115, synced=40)  # 500 ms: the draft model read the prompt first
    assert controller.costs.draft_overhead_ms == 0
    controller.observe(0, 0, 0.0, 0.1)
    controller.observe(1, 1, 0.03, 0.115, synced=2)  # 30 ms: the draft model caught up on the plain step
    controller.observe(1, 1, 0.2, 0.115, synced=9)  # 200 ms: ... on eight plain steps
    assert controller.costs.draft_overhead_ms == pytest.approx(0.5 * (30 - 10))  # only the first counts
    controller = AutoK(Costs(CPU, draft_ms=10), max_k=8, cost_ewma=0.5)
    controller.observe(2, 2, 0.0001, 0.14, synced=0)  # a prompt-lookup proposal (hybrid drafter): no model ran
    assert controller.costs.draft_overhead_ms == 0
    controller.observe(2, 2, 0.04, 0.14, synced=1)  # steady state: 40 ms, 20 more than the table's 2 x 10
    assert controller.costs.draft_overhead_ms == pytest.approx(10)


def test_probes_stay_within_their_budget():
    # A probe costs 25 ms over a plain step (a 10 ms draft, t(2) - t(1) = 15): with 3% of the plain
    # time to spend, the first probe waits for 25 / 0.03 = 833 ms of plain steps, not probe_every.
    controller = trained(AutoK(Costs(CPU, draft_ms=10), max_k=8, probe_every=4, probe_budget=0.03), accept_prob=0.0)
    choices = []
    for _ in range(30):
        k = controller.choose(8)
        choices.append(k)
        controller.observe(k, 0, 0.0, STEP_S)
    probes = [i for i, k in enumerate(choices) if k]
    assert probes and probes[0] == 9  # after 9 plain steps (900 ms >= 833)
    spent = sum(controller.probe_cost(0) for _ in probes)
    assert spent <= 0.03 * STEP_S * 1000 * (len(choices) - len(probes))


def test_a_catch_up_is_paid_only_when_drafting_wins_it_back():
    costs = Costs(CPU, draft_ms=10, sync_ms=5)
    controller = trained(AutoK(costs, max_k=8), accept_prob=0.9)
    k = controller.choose(200)
    assert k > 0 and controller.choose(200, lag=2) == k  # steady state: no catch-up to pay
    saving = controller.saving(k, 200)
    assert 0 < saving < costs.catch_up(2000)
    assert controller.choose(200, lag=40) == k  # a 200 ms catch-up, won back over 200 tokens
    assert controller.choose(200, lag=2000) == 0  # 10 s of catch-up: not worth it
    assert controller.choose(3, lag=40) == 0  # only 4 tokens left to win it back
    # A probe with a long catch-up waits for enough plain time: 40 tokens behind cost 200 ms
    controller = trained(AutoK(costs, max_k=8, probe_every=1), accept_prob=0.0)
    steps = 0
    while controller.choose(8, lag=40) == 0:
        controller.observe(0, 0, 0.0, STEP_S)
        steps += 1
    assert steps * STEP_S * 1000 * controller.probe_budget >= controller.probe_cost(40) > 200
    assert (steps - 1) * STEP_S * 1000 * controller.probe_budget < controller.probe_cost(40)


def test_a_catch_up_is_priced_over_what_recent_answers_had_left():
    # 200 tokens allowed, but the last answers ended after 12, 15 and 30 tokens: a 1 s catch-up (200
    # tokens behind) is won back over 200 tokens, not over the ~18 such an answer has left
    costs = Costs(CPU, draft_ms=10, sync_ms=5)
    controller = trained(AutoK(costs, max_k=8), accept_prob=0.9)
    controller.reset()
    k = controller.choose(200, lag=200)
    assert k > 0 and controller.span(200) == 201 and controller.remaining() is None  # no answers seen yet
    for tokens in (12, 15, 30):
        controller.finish(tokens)
    controller.reset()  # the next answer: its prefill's token so far
    assert controller.remaining() == pytest.approx((11 + 14 + 29) / 3)
    assert controller.span(200) == pytest.approx(18) and controller.span(10) == 11  # never past the limit
    assert controller.saving(k, 200) < costs.catch_up(200) and controller.choose(200, lag=200) == 0
    assert controller.choose(200, lag=20) == controller.best(200) > 0  # a 100 ms catch-up still pays over 18 tokens
    # past 14 tokens only one recent answer went on: too few to say, the limit bounds the span again
    controller.observe(8, 8, 0.0, 0.0)
    controller.observe(4, 4, 0.0, 0.0)
    assert controller.generated == 15 and controller.remaining() is None and controller.span(200) == 201
    # the window keeps the latest answers only
    for tokens in range(100):
        controller.finish(tokens)
    assert controller.lengths == list(range(100 - controller.length_window, 100))


def test_a_draft_model_in_a_hybrid_prices_its_catch_up_over_its_own_share_of_the_steps():
    # Suffix drafts cover 9 steps in 10; the model is an option (plan asks it) in one: its catch-up is
    # won back over its tenth of the span, the free source's is its whole span
    controller = trained(AutoK(Costs(CPU, draft_ms=10, sync_ms=5), max_k=8), accept_prob=0.9)
    assert controller.model_share == pytest.approx(1.0)
    for step in range(200):
        if step % 10 == 0:
            controller.choose(200, lag=2, source=MODEL)
            controller.observe(4, 4, 0.04, 0.17, synced=1, source=MODEL)
        else:
            controller.choose(200, source=SUFFIX)
            controller.observe(4, 3, 0.0, 0.17, source=SUFFIX)
    assert 0.05 < controller.model_share < 0.2
    assert controller.span(200, MODEL) == pytest.approx(201 * controller.model_share)
    assert controller.span(200, SUFFIX) == 201
    k = controller.best(200)
    assert controller.choose(200, lag=2) == k  # steady: nothing to win back
    assert controller.choose(200, lag=200) == 0  # 1 s of catch-up for the model's few steps: not worth it


def test_short_generations_still_earn_a_probe():
    # Each generation is 20 plain steps (2 s) and a probe must first catch up on 40 tokens of prompt
    # (200 ms + its draft): 3% of one generation's plain time never pays for it, so the plain time is
    # carried across generations and the drafter is tried again after a few of them, not never.
    controller = trained(AutoK(Costs(CPU, draft_ms=10, sync_ms=5), max_k=8, probe_every=1), accept_prob=0.0)
    first_probe = None
    for generation in range(10):
        controller.reset()
        for step in range(20):
            k = controller.choose(3, lag=40)  # 4 tokens left: drafting itself never wins the catch-up back
            if k and first_probe is None:
                first_probe = (generation, step)
            controller.observe(k, 0, 0.0, STEP_S)
    assert first_probe is not None and first_probe[0] >= 1  # not within one short generation
    needed = controller.probe_cost(40) / (controller.probe_budget * STEP_S * 1000)  # plain steps that pay for it
    assert first_probe[0] * 20 + first_probe[1] == pytest.approx(needed, abs=1.5)


def test_prospect_prices_a_source_with_its_catch_up():
    # A model right 90% of the time and a free lookup right 50%: in steady state the model is faster
    # per token; 41 tokens behind (200 ms: 40 past a steady step's one) with 8 tokens left, the lookup is.
    controller = AutoK(Costs(CPU, draft_ms=10, sync_ms=5), max_k=8)
    for _ in range(40):  # each step the loop weighs both sources (plan() asks prospect), then one drafts
        for source in (MODEL, "lookup-short"):
            controller.prospect(200, 0, source)
        controller.observe(4, 4, 0.04, 0.17, synced=1, source=MODEL)
        for source in (MODEL, "lookup-short"):
            controller.prospect(200, 0, source)
        controller.observe(2, 1, 0.0, 0.115, source="lookup-short")
    model, lookup = controller.prospect(200, 2, MODEL), controller.prospect(200, 0, "lookup-short")
    k = controller.best(200, source=MODEL)
    assert model == pytest.approx(1 / controller.rate(k)) and model < lookup
    assert controller.prospect(7, 41, MODEL) == pytest.approx(1 / controller.rate(controller.best(7)) + 200 / 8)
    assert controller.prospect(7, 41, MODEL) > controller.prospect(7, 0, "lookup-short")
    useless = trained(AutoK(Costs(CPU, draft_ms=10), max_k=8), accept_prob=0.0)
    assert useless.prospect(8) == pytest.approx(100)  # drafting does not pay: a plain step's t(1)


def test_catch_up_costs_are_learnt_online():
    controller = AutoK(Costs(CPU, draft_ms=10, sync_ms=5), max_k=8, cost_ewma=0.5)
    for _ in range(20):
        controller.observe(2, 2, 0.02 + 0.4, 0.115, synced=41)  # 41 tokens fed in 400 ms more: 10 ms each past the 1st
    assert controller.costs.sync_ms == pytest.approx(10, rel=1e-3)
    assert controller.costs.catch_up(41) == pytest.approx(400, rel=1e-3) and controller.costs.catch_up(2) == 0


def test_short_and_long_catch_ups_are_priced_apart():
    # A few rows share the weights' one pass (cheap per row); hundreds are a prefill.  Short catch-ups (the
    # frequent ones, after a step whose draft was cut) must not teach the price of a prompt's.
    controller = AutoK(Costs(CPU, draft_ms=10, sync_ms=1.5), max_k=8, cost_ewma=0.5)
    assert controller.costs.catch_up(5) == pytest.approx(4 * 1.5)  # nothing learnt: the measured rate
    for _ in range(20):
        controller.observe(2, 2, 0.02 + 0.0008, 0.115, synced=5)  # 0.8 ms more for 4 tokens past the first
    assert controller.costs.short_sync_ms == pytest.approx(0.2, rel=1e-3)
    assert controller.costs.sync_ms == 1.5  # the long rate untouched
    assert controller.costs.catch_up(5) == pytest.approx(0.8, rel=1e-3)
    assert controller.costs.catch_up(SYNC_SPLIT) == pytest.approx(1.5 * (SYNC_SPLIT - 1))
    assert controller.costs.catch_up(424) == pytest.approx(1.5 * 423)
    controller.observe(2, 2, 0.02 + 0.423 * 2.0, 0.115, synced=424)  # a prompt at 2 ms a token
    assert controller.costs.sync_ms == pytest.approx(1.75) and controller.costs.short_sync_ms == pytest.approx(0.2, rel=1e-3)


def answers(controller: AutoK, rates: list[float]) -> AutoK:
    """File one generation per rate in `rates` (the draft model's), each 20 draft steps of 2 tokens accepted at
    that rate."""
    for rate in rates:
        controller.reset()
        trained(controller, rate, steps=20, k=2)
        controller.finish(60)
    controller.reset()
    return controller


def test_a_catch_up_is_a_bet_on_the_poorer_answers():
    # The model's answers were right 80% of the time per token on average, but one in four only 40%: a
    # catch-up is paid before this answer shows which kind it is, so it must pay at the poorer answers' rate
    lag = 1000
    costs = Costs(CPU, draft_ms=10, sync_ms=1.0)  # a 999 ms catch-up
    fresh = answers(AutoK(costs, max_k=8), [0.9, 0.9, 0.4, 0.9, 0.9, 0.4, 0.9, 0.9])
    assert fresh.answers[MODEL] == pytest.approx([0.9, 0.9, 0.4, 0.9, 0.9, 0.4, 0.9, 0.9], abs=0.03)
    assert fresh.bet(MODEL, [0.8] * 8) == pytest.approx([0.4] * 8, abs=0.03)
    k = fresh.best(64)
    assert k > 0 and fresh.saving(k, 64) > costs.catch_up(lag)  # at the average it would pay ...
    assert fresh.choose(64, lag=lag) == 0  # ... at the poorer answers' it does not
    assert fresh.choose(64, lag=2) == k  # no catch-up: no bet, the average stands
    # once this answer has shown its own drafts (a hybrid's model, say, before a run of lookup steps), its
    # evidence prices the catch-up
    trained(fresh, 0.9, steps=5, k=2)
    assert fresh.bet(MODEL, [0.8] * 8) == [0.8] * 8 and fresh.choose(64, lag=lag) > 0
    # the saving must cover the catch-up catch_up_margin times over
    steady = answers(AutoK(costs, max_k=8), [0.9] * 8)
    k = steady.best(64)
    near = 2 + int(steady.saving(k, 64) / costs.sync_ms / 1.2)  # a catch-up 1.2 times smaller than the saving
    assert steady.saving(k, 64) > costs.catch_up(near) and steady.choose(64, lag=near) == 0
    assert replace(steady, catch_up_margin=1.0).choose(64, lag=near) == k
    # too few answers on record: nothing to bet on but the average

    few = answers(AutoK(costs, max_k=8), [0.9, 0.4, 0.9])
    assert few.bet(MODEL, [0.8] * 8) == [0.8] * 8 and few.choose(64, lag=lag) > 0
    # answers whose drafts tried fewer than MIN_TRIED tokens are not filed
    short = AutoK(costs, max_k=8)
    short.observe(2, 2, 0.0, 0.0)
    short.finish(3)
    assert short.answers == {}


def test_sources_keep_their_own_acceptance_and_costs():
    # The hybrid drafter's two sources: a lookup that is right and costs nothing, a model that is
    # as right but costs a target step per token.  Evidence of one never moves the other's estimate.
    controller = AutoK(Costs(CPU, draft_ms=100), max_k=8)
    for _ in range(40):
        controller.observe(4, 4, 0.0, 0.17, source="lookup")
    assert controller.alphas("lookup")[0] > 0.95 and controller.alphas("model")[0] == pytest.approx(controller.prior)
    assert controller.choose(8, source="lookup") >= 4
    for _ in range(40):
        controller.observe(4, 4, 0.4, 0.17, synced=1, source="model")
    assert controller.alphas("model")[0] > 0.95
    assert controller.choose(8, source="model") == 0  # right, but drafting costs more than it saves
    assert controller.choose(8, lag=40, source="lookup") >= 4  # a lookup never catches up


def test_grades_of_one_source_keep_their_own_acceptance():
    # A suffix drafter's proposals after long matches are right, after weak ones wrong; ungraded, one
    # rate per source would draft both alike.  Told the grade, choose() drafts the first long and the
    # second not at all, and what each grade learnt also counts for the source.
    slope = {1: 70.0, 2: 74.0, 9: 115.0, 25: 200.0}  # int8 1.5B on 2 Zen 4 cores, roughly
    controller = AutoK(Costs(slope, draft_ms=0), max_k=24, cost_ewma=0.0)
    for _ in range(30):
        assert controller.choose(24, 0, SUFFIX, "match 16+ p=1") > 0
        controller.observe(12, 12, 0.0, 0.0, source=SUFFIX)
        controller.choose(24, 0, SUFFIX, "match 1 p<.5")
        controller.observe(2, 0, 0.0, 0.0, source=SUFFIX)
    assert controller.alphas(SUFFIX, "match 16+ p=1")[0] > 0.95 and controller.alphas(SUFFIX, "match 1 p<.5")[0] < 0.1
    assert controller.choose(24, 0, SUFFIX, "match 16+ p=1") == 24
    assert controller.choose(24, 0, SUFFIX, "match 1 p<.5") == 0
    assert 0.3 < controller.alphas(SUFFIX)[0] < 0.7  # the source's own: both grades pooled
    # a grade not seen yet starts from the source's record
    assert controller.alphas(SUFFIX, "match 4-7 p=1")[0] == pytest.approx(controller.source_prior(SUFFIX), abs=0.1)
    assert controller.alphas(MODEL, "match 16+ p=1")[0] == pytest.approx(controller.prior)  # another source's


def test_the_cost_table_is_made_non_decreasing():
    # a profile taken on a busy machine (fp32 1.5B, 2-core AMD EPYC): t(4) < t(3), t(8) < t(6)
    measured = {1: 569.0, 2: 755.0, 3: 882.0, 4: 754.0, 6: 1044.0, 8: 1009.0, 9: 1326.0}
    assert isotonic(list(measured.values())) == pytest.approx([569, 755, 818, 818, 1026.5, 1026.5, 1326])
    costs = Costs(measured, draft_ms=0)
    assert costs.target(3) == costs.target(4) == pytest.approx(818)
    assert all(costs.target(n) <= costs.target(n + 1) for n in range(1, 12))
    assert isotonic([]) == [] and isotonic([3.0, 1.0, 2.0]) == pytest.approx([2, 2, 2])


def test_a_frozen_table_prices_a_row_at_least_at_its_average():
    # the table `specdec profile` cached in a slow-memory minute on the Zen 4 VM (qwen2.5-coder-1.5b, ms): rows 2-4
    # ride on the one row's wait for memory, and a frozen controller priced at it drafts junk lookups for free
    slow = {1: 30.5, 2: 31.6, 3: 31.3, 4: 31.1, 6: 35.6, 8: 41.7, 12: 64.5, 16: 82.7, 25: 136.7}
    measured = Costs(slow, draft_ms=9.0)
    floored = measured.with_row_floor()
    row = (136.7 - 30.5) / 24
    assert floored.target(1) == 30.5 and floored.target(25) == pytest.approx(136.7)
    assert floored.target(4) == pytest.approx(30.5 + 3 * row) and floored.target(4) / floored.target(1) > 1.4
    assert floored.target(16) == pytest.approx(max(82.7, 30.5 + 15 * row))
    assert floored.draft_ms == 9.0 and floored is not measured and measured.target_ms == slow  # a copy; the table kept
    # the controller then leaves a lookup right a tenth of the time alone, which the flat table drafts
    lookup_alphas = [0.1] * 8
    assert AutoK(Costs(slow, draft_ms=9.0)).best(8, lookup_alphas, source=LOOKUP) > 0
    assert AutoK(floored).best(8, lookup_alphas, source=LOOKUP) == 0
    # a convex table is raised to the line through its ends; a flat one (FLAT) or one of one size is kept
    assert Costs(CPU, draft_ms=0).with_row_floor().target_ms == pytest.approx({n: 100 + (n - 1) * 500 / 15 for n in CPU})
    assert Costs(FLAT, draft_ms=0).with_row_floor().target_ms == FLAT
    assert Costs({1: 50.0}, draft_ms=0).with_row_floor().target_ms == {1: 50.0}
    # a GPU-like table, flat for 16 rows and a little more at 25: barely moved
    gpu = Costs({1: 20.0, 4: 20.0, 16: 20.5, 25: 24.0}, draft_ms=0).with_row_floor()
    assert gpu.target(4) == pytest.approx(20.5) and gpu.target(16) == pytest.approx(22.5)


def test_measured_ratios_are_interpolated_toward_the_scale():
    costs = Costs(CPU, draft_ms=0, target_scale=2.0, shape={5: 1.2, 8: 1.4})  # CPU's points: 1, 2, 4, 6, 8, 16
    assert costs.ratio(1) == costs.ratio(4) == 2.0  # table points not measured in the loop: the scale
    assert costs.ratio(5) == pytest.approx(1.2) and costs.ratio(6) == 2.0
    assert costs.ratio(7) == pytest.approx(1.7) and costs.ratio(12) == pytest.approx(1.7)
    assert costs.ratio(20) == 2.0  # flat beyond the last point
    assert costs._target(7) == pytest.approx(260 * 1.7)
    assert costs.target(7) == pytest.approx(costs._target(6)) and costs._target(6) > 260 * 1.7  # t(6) is more
    assert Costs(CPU, draft_ms=0, target_scale=3.0).target(7) == pytest.approx(260 * 3)


def test_learnt_costs_stay_non_decreasing_in_n():
    # t(1) learnt from plain steps, t(2) from one-token drafts, each with its own noise: a t(2) below t(1)
    # must not make a one-token verification look cheaper than a plain step
    costs = Costs({1: 100.0, 2: 104.0, 4: 120.0}, draft_ms=26)
    costs.shape = {1: 1.22, 2: 1.13}  # t(1) 122 ms, t(2) 117.5 ms as learnt
    assert costs._target(2) < costs._target(1)
    assert costs.target(2) == pytest.approx(122.0) and costs.target(3) >= costs.target(2)
    assert all(costs.target(n) <= costs.target(n + 1) for n in range(1, 12))
    controller = AutoK(costs, max_k=4, prior=0.2, weight=100.0)  # a draft right 20% of the time, for sure
    # a one-token draft: 1.2 tokens for 26 ms of drafting + t(2): 123.3 ms a token with t(2) = t(1), worse
    # than plain's 122; with the learnt t(2) of 117.5 it would be 119.6, and it would draft
    assert controller.choose(4) == 0


def test_one_slow_step_moves_its_ratio_a_little_and_others_forget():
    costs = Costs(CPU, draft_ms=0)
    costs.learn_target(4, 1700.0, 0.2, 0.5)  # ten times the table, once
    assert costs.shape[4] == pytest.approx(1.25) and costs.target_scale == pytest.approx(1.25)
    for _ in range(40):
        costs.learn_target(1, 100.0, 0.2, 0.5)  # as the table
    assert costs.shape[4] == pytest.approx(1.0, abs=0.2)


def test_a_table_wrong_in_its_shape_is_corrected_by_the_loop():
    # the table says 8 tokens cost what 4 do; in the loop they take twice as long
    table = {1: 100.0, 4: 130.0, 8: 131.0, 16: 400.0}
    real = {n: (2 * 131.0 if n >= 8 else Costs(table, 0).target(n)) for n in range(1, 17)}
    controller = trained(AutoK(Costs(table, draft_ms=0), max_k=8, forget=1.0), accept_prob=0.8, k=8)
    hits = {s: list(v) for s, v in controller.hits.items()}
    trials = {s: list(v) for s, v in controller.trials.items()}
    assert controller.choose(8) >= 7  # the table makes a long draft look free
    for _ in range(6):
        k = controller.choose(8)
        controller.observe(k, 0, 0.0, real[k + 1] / 1000)
        controller.hits = {s: list(v) for s, v in hits.items()}  # the acceptance as trained: only costs change
        controller.trials = {s: list(v) for s, v in trials.items()}
    assert controller.choose(8) <= 6  # no more forwards of n >= 8 tokens, the ones the table got wrong
    assert controller.costs.target(8) > 1.2 * 131  # learnt from the long draft it made
    # frozen costs (a seeded request, a batch) learn nothing
    frozen = trained(AutoK(Costs(table, draft_ms=0), max_k=8, forget=1.0, cost_ewma=0.0), accept_prob=0.8, k=8)
    for _ in range(6):
        frozen.observe(7, 7, 0.0, 0.262)
    assert frozen.costs.shape == {} and frozen.costs.target_scale == 1.0 and frozen.choose(8) >= 7


def test_copied_costs_learn_on_their_own():
    from dataclasses import replace

    costs = Costs(CPU, draft_ms=0)
    copy = replace(costs)
    copy.learn_target(4, 255.0, 0.5, 0.5)
    assert costs.shape == {} and costs.target_scale == 1.0 and copy.shape


def test_one_rejected_probe_does_not_sink_a_sources_record():
    # The record a new answer starts from is shrunk toward the prior with the weight of record_weight tokens: one
    # rejected token moves the draft model's from 0.6 to 0.53, not to 0.4 (where short lookups won its steps)
    controller = AutoK(Costs(CPU, draft_ms=10), max_k=8)
    controller.observe(2, 0, 0.02, 0.115, synced=1)
    assert controller.source_prior() == pytest.approx(0.6 * 8 / 9)
    assert replace(controller, record_weight=2.0).source_prior() == pytest.approx(0.4)


def test_a_new_generation_starts_from_the_sources_record_not_from_the_prior():
    # A draft rejected the few times it was tried, then generations of plain steps: reset() halves the
    # evidence at every new generation, so shrunk toward the prior it drifted back to an optimistic 0.6
    # and each new generation paid a prompt catch-up to draft with it again.  It shrinks toward the
    # source's own record instead, which plain steps do not wash out.
    costs = Costs({1: 100.0, 2: 109.0, 4: 113.0, 8: 126.0}, draft_ms=35, sync_ms=5)
    assert AutoK(Costs(costs.target_ms, 35, sync_ms=5)).choose(64, lag=40) > 0  # the prior alone drafts
    controller = AutoK(costs)
    for _ in range(12):
        controller.observe(1, 0, 0.035, 0.109, synced=1)  # rejected
    for _ in range(6):
        controller.reset()
        for _ in range(5):
            assert controller.choose(64, lag=40) == 0
            controller.observe(0, 0, 0.0, 0.1)
    assert controller.source_prior() < 0.3 and controller.alphas()[0] < 0.3
    # a source that was mostly right drafts at once in the next generation, catch-up and all
    good = AutoK(Costs(costs.target_ms, 35, sync_ms=5))
    for _ in range(4):
        good.observe(1, 1, 0.035, 0.109, synced=1)
    for _ in range(6):
        good.reset()
    assert good.source_prior() > 0.7 and good.choose(64, lag=40) > 0


def test_trees_where_the_extra_rows_pay_and_chains_where_they_do_not():
    flat = AutoK(Costs({1: 10.0, 16: 11.0}, draft_ms=0.0), cost_ewma=0.0)  # extra rows nearly free
    assert flat.tree_nodes(3, 6, "lookup") == 6  # the prior gain (0.25 tokens) beats 0.4 ms
    steep = AutoK(Costs({1: 10.0, 16: 40.0}, draft_ms=0.0), cost_ewma=0.0, probe_every=4)  # 2 ms a row
    chosen = [steep.tree_nodes(3, 6, "lookup") for _ in range(10)]
    assert chosen == [3, 3, 3, 3, 6, 3, 3, 3, 3, 6]  # chains, and a tree tried after every 4 of them
    for _ in range(40):  # trees that rescue a token every step
        steep.observe_tree(7, 0.0, 1, "lookup")
    assert steep.tree_gain["lookup"] == pytest.approx(1.0, abs=0.02)
    assert steep.tree_nodes(3, 6, "lookup") == 6  # now worth 6 ms more
    for _ in range(60):
        flat.observe_tree(7, 0.0, 0, "lookup")  # trees that never beat the chain
    assert flat.tree_nodes(3, 6, "lookup") == 3
    assert flat.tree_nodes(3, 3, "lookup") == 3 and flat.tree_nodes(0, 6, "lookup") == 0


def test_tree_gains_are_kept_per_grade():
    """Trees from unsure proposals rescue a token, from sure ones none: the controller grows trees for the first
    and chains for the second; a grade not tried yet starts from the source's gain."""
    auto = AutoK(Costs({1: 10.0, 16: 40.0}, draft_ms=0.0), cost_ewma=0.0, probe_every=1000)  # 2 ms a row
    for _ in range(40):
        for grade, extra in (("q>=0.2", 1), ("q>=0.8", 0)):
            auto.choose(3, source="model", grade=grade)
            auto.observe_tree(7, 0.0, extra, "model")
    assert auto.tree_gain["model q>=0.2"] == pytest.approx(1.0, abs=0.02) and auto.tree_gain["model q>=0.8"] < 0.02
    assert 0.3 < auto.tree_gain["model"] < 0.7
    auto.choose(3, source="model", grade="q>=0.2")
    assert auto.tree_nodes(3, 6, "model") == 6
    auto.choose(3, source="model", grade="q>=0.8")
    assert auto.tree_nodes(3, 6, "model") == 3
    source = auto.tree_gain["model"]
    auto.choose(3, source="model", grade="q>=0.5")
    auto.observe_tree(7, 0.0, 1, "model")
    assert auto.tree_gain["model q>=0.5"] == pytest.approx(source + (1 - auto.forget) * (1 - source))
