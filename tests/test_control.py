"""The speculation controller's choices on synthetic costs and acceptances (specdec.control)."""

from __future__ import annotations

import pytest

from specdec.control import AutoK, Costs, FixedK, expected_tokens

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
    assert controller.probe_gap == 4  # drafting again: the next plain run is probed soon


def test_a_successful_probe_brings_drafting_back():
    controller = trained(AutoK(Costs(CPU, draft_ms=10), max_k=8, probe_every=4, probe_budget=1.0), accept_prob=0.1)
    assert controller.choose(8) == 0
    for _ in range(4):
        controller.observe(controller.choose(8), 0, 0.0, STEP_S)
    choices = []
    for _ in range(40):  # every probe, and every draft after them, is accepted: the estimate climbs back
        k = controller.choose(8)
        choices.append(k)
        controller.observe(k, k, 0.0, STEP_S)
    assert choices[:5] == [1, 0, 0, 0, 0]  # an accepted probe keeps the probing pace at probe_every
    assert choices[5] == 1 and all(k >= 1 for k in choices[5:])  # drafting every step again
    assert choices[-1] >= 4  # positions not drafted for a while drift to the pooled rate: k climbs back


def test_online_costs_follow_the_measured_times():
    controller = AutoK(Costs(CPU, draft_ms=10), max_k=8, cost_ewma=0.5)
    for _ in range(20):
        controller.observe(0, 0, 0.0, 0.2)  # one-token steps take 200 ms, twice the table's
    assert controller.costs.target_scale == pytest.approx(2.0, rel=1e-3)
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


def test_catch_up_costs_are_learnt_online():
    controller = AutoK(Costs(CPU, draft_ms=10, sync_ms=5), max_k=8, cost_ewma=0.5)
    for _ in range(20):
        controller.observe(2, 2, 0.02 + 0.4, 0.115, synced=40)  # 40 tokens caught up in 400 ms: 10 ms each
    assert controller.costs.sync_ms == pytest.approx(10, rel=1e-3)
    assert controller.costs.catch_up(40) == pytest.approx(400, rel=1e-3) and controller.costs.catch_up(2) == 0


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
