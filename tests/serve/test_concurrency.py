"""Queueing and cancellation, step by step: the target's forwards wait for permits the test hands
out, so what runs when is the test's choice, not the machine's speed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from specdec.backends.hf import HFRunner
from specdec.runtime.engine import Engine
from tests.serve.conftest import MODEL, metric, metric_samples, serve

BODY = {"model": MODEL, "prompt": "for i in range", "temperature": 0}


class GatedRunner(HFRunner):
    """An HFRunner whose every forward first takes a permit (a timeout fails the forward)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.permits = threading.Semaphore(0)
        self.forwards = 0

    def forward(self, new_tokens, last_n=None):
        if not self.permits.acquire(timeout=30):
            raise RuntimeError("no permit for a forward within 30 s")
        self.forwards += 1
        return super().forward(new_tokens, last_n)


@pytest.fixture
def gated(engine):
    """(engine whose target waits for permits, its runner); the draft is the usual one, ungated."""
    runner = GatedRunner(engine.target_runner.model)
    gated_engine = Engine(runner, engine.tokenizer, engine.draft_runner.model, engine.draft_tokenizer)
    yield gated_engine, runner
    runner.permits.release(10_000)  # nothing left waiting


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_a_full_queue_answers_503_and_loses_nothing(gated, engine):
    gated_engine, runner = gated
    expected = engine.generate("for i in range", max_new_tokens=6, num_speculative_tokens=3).text
    with serve(gated_engine, k=3, max_queue=1) as server:
        worker = server.worker
        def post():
            return httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 6}, timeout=60)

        running, running_out = in_thread(post)
        wait_for(lambda: worker.running is not None, "the first request runs")
        queued, queued_out = in_thread(post)
        wait_for(lambda: worker.jobs.qsize() == 1, "the second request waits")

        refused = post()
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"

        runner.permits.release(1000)
        running.join(30), queued.join(30)
        assert [r.status_code for r in running_out + queued_out] == [200, 200]
        assert all(r.json()["choices"][0]["text"] == expected for r in running_out + queued_out)
        samples = metric_samples(httpx.get(server.url + "/metrics").text)
        assert metric(samples, "requests_total", endpoint="/v1/completions", code="503") == 1
        assert metric(samples, "request_success_total", finished_reason="length") == 2


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_cancels_its_generation_within_one_step(gated, stream):
    gated_engine, runner = gated
    with serve(gated_engine, k=3) as server:
        worker = server.worker
        body = {**BODY, "max_tokens": 50, "stream": stream}
        runner.permits.release(2)  # the prefill and one more step, then the worker waits
        if stream:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
                assert response.status_code == 200
                # Keep the line iterator: a discarded one is closed at once, and closing it closes the
                # connection (the server would see the client leave before the second step).
                lines = response.iter_lines()
                first = next(lines)
                assert first.startswith("data: {")
                job = worker.running
                wait_for(lambda: runner.forwards == 2, "the worker has done its second forward")
            # leaving the block closed the connection mid-stream
        else:
            def job_running():
                wait_for(lambda: worker.running is not None and runner.forwards == 2, "the second forward")
                return worker.running

            waiter, jobs = in_thread(job_running)
            with pytest.raises(httpx.ReadTimeout):  # the client gives up while the worker waits
                httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
            waiter.join(30)
            job = jobs[0]
        assert job is not None
        wait_for(job.cancelled.is_set, "the server notices the client has gone")
        forwards_at_cancel = runner.forwards
        runner.permits.release(1000)
        wait_for(lambda: worker.running is None, "the worker is free again")
        # the step under way when the flag was set finishes (if its forward had not run yet, it does
        # now); no other starts
        assert runner.forwards - forwards_at_cancel <= 1
        samples = metric_samples(httpx.get(server.url + "/metrics").text)
        assert metric(samples, "request_disconnects_total") == 1
        assert metric(samples, "generation_tokens_total") < 20
        assert metric(samples, "request_success_total", finished_reason="length") == 0
        again = httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=30)
        assert again.status_code == 200


def test_a_request_whose_client_left_while_queued_never_runs(gated):
    gated_engine, runner = gated
    with serve(gated_engine, k=3) as server:
        worker = server.worker
        def post(**kw):
            return httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 4}, **kw)

        running, running_out = in_thread(lambda: post(timeout=60))
        wait_for(lambda: worker.running is not None, "the first request runs")
        with pytest.raises(httpx.ReadTimeout):
            post(timeout=httpx.Timeout(30, read=0.5))
        wait_for(lambda: httpx.get(server.url + "/metrics").text.count("request_disconnects_total 1.0") == 1,
                 "the server counts the disconnect")
        forwards_before = runner.forwards
        runner.permits.release(1000)
        running.join(30)
        assert running_out[0].status_code == 200
        wait_for(lambda: worker.running is None and worker.jobs.qsize() == 0, "the queue is empty")
        samples = metric_samples(httpx.get(server.url + "/metrics").text)
        assert metric(samples, "request_success_total", finished_reason="length") == 1
        assert metric(samples, "requests_total", endpoint="/v1/completions", code="499") == 1
        # every target forward after the release was the first request's: the second never started
        assert runner.forwards - forwards_before == running_out[0].json()["speculative_decoding"]["target_forwards"]


class Connected:
    """A request whose client never goes away by itself."""

    async def is_disconnected(self) -> bool:
        return False


@pytest.mark.parametrize("http", [Connected(), None], ids=["polled", "cancelled-by-the-host"])
def test_a_cancel_that_lands_with_an_event_still_cancels_the_job(http):
    """Ray Serve cancels a request's handler once, when its client leaves.  A cancel that lands in the
    same loop turn as the job's next event must still cancel the job: Python 3.11's asyncio.wait_for
    returned the event instead and the generation ran to its end for nobody."""
    import asyncio

    from specdec.serve.app import next_event
    from specdec.serve.worker import Job, StepEvent

    async def scenario() -> Job:
        job = Job(None, asyncio.get_running_loop())  # type: ignore[arg-type]  (the request is not read)
        waiting = asyncio.create_task(next_event(job, http))
        await asyncio.sleep(0.01)  # it waits for the job's next event
        job.events.put_nowait(StepEvent("x", "x", 0, 0, 1, None))
        waiting.cancel()  # in the same turn: both wake it
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return job

    assert asyncio.run(scenario()).cancelled.is_set()
