"""`specdec serve` as a user runs it (a subprocess), under load on 127.0.0.1: 8 concurrent streaming
clients x 3 requests each, plus clients that leave mid-stream.  Every completed response equals
its sequential greedy result, nothing is lost, the server stays up, and its memory returns near
its baseline.  Bounded: 24 + 24 + 4 requests of at most 32 (200 for the leavers) tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.serve.conftest import MODEL, metric, metric_samples, streamed_text

CLIENTS, REQUESTS_EACH, LEAVERS = 8, 3, 4
PROMPTS = ["def fibonacci(n):", "Once upon a time", "for i in range(10):", "The quick brown fox",
           "Speculative decoding", "print(i * i)"]
RSS_SLACK = 64 * 2**20  # what the server may keep after the load, over its warmed-up baseline


def request_for(client: int, index: int) -> dict:
    """Client i's index-th request: a mix of prompts, lengths and endpoints, each one distinct."""
    n = client * REQUESTS_EACH + index
    prompt, max_tokens = PROMPTS[n % len(PROMPTS)], 16 + 8 * (n % 3)
    if n % 4 == 3:
        return {"chat": True, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    return {"chat": False, "prompt": prompt + " " * (n // len(PROMPTS)), "max_tokens": max_tokens}


def create(client: OpenAI, request: dict, stream: bool):
    body = {k: v for k, v in request.items() if k != "chat"}
    api = client.chat.completions if request["chat"] else client.completions
    return api.create(model=MODEL, temperature=0, stream=stream, **body)


def whole_text(response) -> str:
    choice = response.choices[0]
    return choice.message.content if hasattr(choice, "message") else choice.text


@pytest.fixture(scope="module")
def server_process(tiny_dirs, tmp_path_factory):
    """`python -m specdec.cli serve` on a free port; (url, process), stopped with SIGTERM at the end."""
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", tiny_dirs["target"],
               "--draft", tiny_dirs["target"], "--draft-dtype", "bf16", "-k", "3", "--threads", "1",
               "--host", "127.0.0.1", "--port", "0", "--served-model-name", MODEL, "--max-queue", "16"]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=os.environ.copy())
    deadline = time.monotonic() + 120
    url = None
    while url is None:
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        url = match.group(1) if match else None
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"specdec serve did not start:\n{log.read_text()}")
        time.sleep(0.1)
    while httpx.get(url + "/health").status_code != 200:  # the app is up once health answers
        time.sleep(0.05)
    yield url, process
    process.terminate()
    try:
        # a graceful shutdown: exit status 0 (uvicorn alone re-raises the signal it handled)
        assert process.wait(30) == 0, log.read_text()[-3000:]
        assert "Application shutdown complete" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()


def test_concurrent_streams_equal_sequential_results(server_process, capsys):
    url, process = server_process
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    requests = {(c, i): request_for(c, i) for c in range(CLIENTS) for i in range(REQUESTS_EACH)}

    t0 = time.monotonic()
    sequential = {key: whole_text(create(client, r, stream=False)) for key, r in requests.items()}
    sequential_s = time.monotonic() - t0
    memory = psutil.Process(process.pid)
    baseline = memory.memory_info().rss

    def streaming_client(c: int) -> list[tuple[tuple[int, int], str]]:
        return [((c, i), streamed_text(list(create(client, requests[(c, i)], stream=True))))
                for i in range(REQUESTS_EACH)]

    def leaver(n: int) -> int:
        """Starts a long stream, reads two chunks, hangs up."""
        time.sleep(0.3 * n)
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[n], max_tokens=200, temperature=0, stream=True)
        seen = sum(1 for _, _chunk in zip(range(2), stream))
        stream.close()
        return seen

    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS + LEAVERS) as pool:
        streams = [pool.submit(streaming_client, c) for c in range(CLIENTS)]
        leavers = [pool.submit(leaver, n) for n in range(LEAVERS)]
        results = dict(pair for future in streams for pair in future.result(timeout=120))
        assert [f.result(timeout=120) for f in leavers] == [2] * LEAVERS
    concurrent_s = time.monotonic() - t0

    assert results == sequential  # every request answered, each exactly as when it ran alone
    deadline = time.monotonic() + 30
    samples = metric_samples(httpx.get(url + "/metrics").text)
    while metric(samples, "num_requests_running") or metric(samples, "num_requests_waiting"):
        assert time.monotonic() < deadline, "the server did not drain"
        time.sleep(0.1)
        samples = metric_samples(httpx.get(url + "/metrics").text)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    total = 2 * len(requests)
    finished = sum(metric(samples, "request_success_total", finished_reason=r) for r in ("length", "stop"))
    # Each leaver's request is counted once: as a disconnect, or as finished where the tiny model (draft = target,
    # 4 tokens a step) wrote all 200 tokens before the hang-up reached the server (a fresh clone's full suite on
    # 2 cores once counted 49 finished of 48 + 1 such leaver); at least one must be seen leaving.
    early = finished - total
    disconnects = metric(samples, "request_disconnects_total")
    assert 0 <= early < LEAVERS and disconnects == LEAVERS - early
    served = sum(metric(samples, "requests_total", endpoint=e, code="200")
                 for e in ("/v1/completions", "/v1/chat/completions"))
    assert served == total + LEAVERS

    after = memory.memory_info().rss
    with capsys.disabled():
        print(f"\nload: {len(requests)} sequential requests in {sequential_s:.1f} s; {len(requests)} streamed by "
              f"{CLIENTS} concurrent clients + {LEAVERS} that left mid-stream in {concurrent_s:.1f} s; "
              f"server RSS {baseline / 2**20:.0f} MiB before the load, {after / 2**20:.0f} MiB after")
    assert after - baseline < RSS_SLACK
