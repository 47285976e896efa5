"""`specdec serve --memory-budget`: a request that can never fit is refused at once (413, with its numbers),
one that does not fit beside the running ones waits and then runs, /metrics counts the refusals by reason.

What runs when is the test's choice: the batch's forwards wait for permits the test hands out (no timing)."""

from __future__ import annotations

import threading

import httpx
import pytest

from specdec.runtime.memory import RETAIN_TOKENS
from tests.serve.conftest import MODEL, metric, metric_samples, serve
from tests.serve.test_concurrency import in_thread, wait_for

BODY = {"model": MODEL, "prompt": "for i in range", "temperature": 0, "max_tokens": 8}


def _room_for(engine, max_batch: int, requests: float, max_tokens: int = 8) -> int:
    """A budget with room for `requests` requests of BODY's size (a prompt of a few tokens) beside what the
    runners keep between requests."""
    engine.enable_batching(max_batch)
    target, draft = engine.pool.footprints()
    held = max_batch * RETAIN_TOKENS * (target.cache_bytes_per_token + draft.cache_bytes_per_token)
    need = engine.memory_need(len(engine.encode(BODY["prompt"])), max_tokens)
    engine.enable_batching(1)
    return held + int(requests * need.total)


def test_a_request_over_the_budget_is_refused_at_once_with_its_numbers(engine):
    budget = _room_for(engine, 1, 1.5)
    with serve(engine, k=3, memory_budget=budget) as server:
        ok = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60)
        assert ok.status_code == 200
        refused = httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 1000}, timeout=60)
        assert refused.status_code == 413
        error = refused.json()["error"]
        assert error["code"] == "memory_budget_exceeded" and error["type"] == "invalid_request_error"
        assert error["param"] is None
        prompt = len(engine.encode(BODY["prompt"]))
        assert f"of KV cache and activations for {prompt} + 1,000 tokens; --memory-budget is " in error["message"]
        samples = metric_samples(httpx.get(server.url + "/metrics", timeout=10).text)
        assert metric(samples, "requests_refused_total", reason="memory_budget") == 1
        assert metric(samples, "requests_refused_total", reason="queue_full") == 0
        assert metric(samples, "memory_budget_bytes") == budget
        assert 0 < metric(samples, "memory_reserved_bytes") < budget  # what the runners keep between requests


class Permits:
    """The batch's forwards, each waiting for a permit (a timeout fails it)."""

    def __init__(self, target) -> None:
        self.semaphore = threading.Semaphore(0)
        submit = target.submit

        def gated(slot, tokens, last_n):
            if not self.semaphore.acquire(timeout=30):
                raise RuntimeError("no permit for a forward within 30 s")
            return submit(slot, tokens, last_n)

        target.submit = gated  # SlotRunner.forward calls the batch's submit

    def release(self, n: int = 10_000) -> None:
        self.semaphore.release(n)


def test_a_request_that_fits_alone_waits_for_the_running_one_then_runs(engine):
    bodies = [{**BODY, "prompt": p} for p in ("for i in range", "def f(x):", "The quick brown", "print(")]
    with serve(engine, max_batch=2, speculative=False) as free:  # the same requests without a budget, one by one
        expected = [httpx.post(free.url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
                    for b in bodies[:3]]
    budget = _room_for(engine, 2, 1.5)  # one request at a time fits, two do not
    with serve(engine, max_batch=2, max_queue=1, memory_budget=budget, speculative=False) as server:
        worker = server.worker
        permits = Permits(worker.engine.pool.target)
        try:
            def post(body):
                return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

            first, first_out = in_thread(lambda: post(bodies[0]))
            wait_for(lambda: len(worker.active) == 1, "the first request runs")
            second, second_out = in_thread(lambda: post(bodies[1]))
            wait_for(lambda: worker._admitting is not None, "the second request waits for memory")
            assert len(worker.active) == 1  # a slot is free, but the memory is not
            third, third_out = in_thread(lambda: post(bodies[2]))  # queued behind the waiting one
            wait_for(lambda: worker.jobs.qsize() == 1, "the third request is queued")
            samples = metric_samples(httpx.get(server.url + "/metrics", timeout=10).text)
            assert metric(samples, "num_requests_waiting") == 2 and metric(samples, "num_requests_running") == 1
            refused = post(bodies[3])  # the queue is full: 503, not a wait
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
        finally:
            permits.release()
        for t in (first, second, third):
            t.join(60)
        outs = first_out + second_out + third_out
        assert [r.status_code for r in outs] == [200, 200, 200]
        assert [r.json()["choices"][0]["text"] for r in outs] == expected  # greedy: unchanged by the budget
        samples = metric_samples(httpx.get(server.url + "/metrics", timeout=10).text)
        assert metric(samples, "requests_refused_total", reason="queue_full") == 1
        assert metric(samples, "requests_refused_total", reason="memory_budget") == 0
        assert metric(samples, "memory_reserved_bytes") == worker.budget.held  # every request gave its memory back


def test_refusals_are_counted_by_reason(engine):
    with serve(engine, k=3, max_prompt_tokens=3) as server:
        long = httpx.post(server.url + "/v1/completions", json={**BODY, "prompt": "one two three four five six"},
                          timeout=60)
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        samples = metric_samples(httpx.get(server.url + "/metrics", timeout=10).text)
        assert metric(samples, "requests_refused_total", reason="context_length") == 1
        assert metric(samples, "memory_budget_bytes") == 0  # no budget


@pytest.mark.parametrize("max_batch", [1, 2])
def test_greedy_answers_are_unchanged_by_a_budget(engine, max_batch):
    bodies = [{**BODY, "prompt": p, "max_tokens": 12} for p in ("def f(x):", "Once upon a time", "a small model")]
    answers = []
    for budget in (None, _room_for(engine, max_batch, 1.2, max_tokens=12)):
        with serve(engine, k=3, max_batch=max_batch, memory_budget=budget) as server:
            answers.append([httpx.post(server.url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
                            for b in bodies])
    assert answers[0] == answers[1]
