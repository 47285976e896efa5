"""`specdec serve --max-batch N`: concurrent requests decoded in one batch give each its own text.

The tiny llama target and its draft (tests.serve.conftest), served with max_batch 3: eight clients at
once through the official openai client, greedy and seeded sampling, streamed and not, one that
hangs up early.  Every completed response equals the same request served alone (max_batch 1), and
the batch really ran several requests per forward.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from specdec.errors import SpecdecError
from specdec.request import RequestConfig
from specdec.serve.worker import Worker
from tests.serve.conftest import MODEL, metric, metric_samples, serve, streamed_text

PROMPTS = ["for i in range", "def f(x):", "The quick brown", "Once upon a time", "print(", "a small model"]


def _request(i: int) -> dict:
    body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8 + 5 * (i % 4)}
    if i % 3 == 2:
        body.update(temperature=0.8, seed=100 + i)  # seeded sampling: the same text whatever the neighbours
    else:
        body.update(temperature=0)
    if i % 4 == 1:
        body["speculative"] = {"k": 2}
    return body


def _complete(server, body: dict, stream: bool) -> str:
    client = server.client()
    body = dict(body)
    extra = {"speculative": body.pop("speculative")} if "speculative" in body else None
    if stream:
        return streamed_text(list(client.completions.create(stream=True, extra_body=extra, **body)))
    return client.completions.create(extra_body=extra, **body).choices[0].text


def test_batched_responses_equal_the_same_requests_served_alone(engine):
    bodies = [_request(i) for i in range(8)]
    with serve(engine, k="auto") as alone:
        expected = [_complete(alone, b, stream=False) for b in bodies]
    with serve(engine, k="auto", max_batch=3) as server:
        got: list = [None] * len(bodies)
        errors: list = []

        def client(i: int) -> None:
            try:
                got[i] = _complete(server, bodies[i], stream=i % 2 == 0)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def leaver() -> None:  # streams two chunks and hangs up
            with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                              json={**bodies[0], "max_tokens": 200, "stream": True}) as response:
                lines = response.iter_lines()
                next(lines)
                next(lines)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        threads.append(threading.Thread(target=leaver))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert not errors, errors[0]
        assert got == expected
        target = server.worker.engine.pool.target
        assert target.batched > target.forwards  # several requests shared forwards
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        samples = metric_samples(httpx.get(server.url + "/metrics", timeout=10).text)
        finished = sum(metric(samples, "request_success_total", finished_reason=r) for r in ("length", "stop"))
        assert finished >= len(bodies)  # and the leaver, if it finished before its cancel was seen


def test_batched_worker_refusals(engine):
    with pytest.raises(SpecdecError, match=">= 1"):
        Worker(engine, max_batch=0)
    with pytest.raises(SpecdecError, match="stairs"):
        Worker(engine, max_batch=2, defaults=RequestConfig(verify="stairs"))
