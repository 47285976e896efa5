"""`specdec serve --replicas`: the server as Ray Serve replicas (specdec.serve.ray).

A local Ray cluster on 127.0.0.1 (2 CPUs, no dashboard) runs two replicas of the tiny models
(tests.serve.conftest), each decoding up to two requests in a batch.  Through the official openai
client: concurrent requests get exactly the texts one `specdec serve` process gives them; /health
and /metrics cover both replicas; a client that leaves cancels its generation.  Then one replica is killed (SIGKILL,
its process id from
/health) while it streams a long answer: every request, the streamed one included, ends within a
timeout with the single-process text or a clear error, the killed stream with an error (it was cut
mid-way, so it cannot have been answered), and the fleet keeps answering.

The replicas' draft model sleeps DELAY_S in each forward (a hook; the output is unchanged), so that
a long request is still running when the kill lands.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import openai
import pytest

from tests.conftest import require_ray
from tests.serve.conftest import MODEL, metric_samples, serve, streamed_text

require_ray()
pytestmark = pytest.mark.ray

from ray import cloudpickle  # noqa: E402

from specdec.request import RequestConfig  # noqa: E402
from specdec.runtime.engine import Engine  # noqa: E402
from specdec.serve.app import ServeOptions  # noqa: E402
from specdec.serve.connections import bind  # noqa: E402
from specdec.serve.ray import REPLICA_HEADER, connect, deploy  # noqa: E402
from specdec.serve.replicas import parse_replicas  # noqa: E402

# The replicas unpickle this module's functions by value: they need not import the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DELAY_S = 0.01  # the replicas' draft model sleeps this long in each forward
TIMEOUT_S = 90  # the most any request may take, kill or no kill
PROMPTS = ["for i in range", "def f(x):", "The quick brown", "Once upon a time", "print(", "a small model"]


def slow_engine(target: str, draft: str) -> Engine:
    """The tiny pair, its draft model sleeping DELAY_S in each forward (in a replica)."""
    import torch

    torch.set_num_threads(1)
    engine = Engine.load(target, draft, dtype="fp32")  # transformers runners: the hook sees every forward
    engine.draft_runner.model.register_forward_hook(lambda *_: time.sleep(DELAY_S))
    return engine


def request(i: int) -> dict:
    """The i-th request: completions or chat, greedy or seeded sampling, some with their own k."""
    body: dict = {"max_tokens": 8 + 6 * (i % 4)}
    if i % 4 == 3:
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    else:
        body["prompt"] = PROMPTS[i % len(PROMPTS)]
    if i % 3 == 2:
        body.update(temperature=0.8, seed=100 + i)  # seeded sampling: the same text on any replica
    else:
        body["temperature"] = 0
    if i % 5 == 1:
        body["speculative"] = {"k": 2}
    return body


def complete(client: openai.OpenAI, body: dict, stream: bool) -> tuple[str, str]:
    """(text, replica that answered) for `body`, streamed or not."""
    body = dict(body)
    extra = {"speculative": body.pop("speculative")} if "speculative" in body else None
    api = client.chat.completions if "messages" in body else client.completions
    if stream:
        with api.with_streaming_response.create(model=MODEL, stream=True, extra_body=extra, **body) as response:
            return streamed_text(list(response.parse())), response.headers.get(REPLICA_HEADER, "")
    response = api.with_raw_response.create(model=MODEL, extra_body=extra, **body)
    choice = response.parse().choices[0]
    return (choice.message.content if "messages" in body else choice.text), response.headers.get(REPLICA_HEADER, "")


BODIES = [request(i) for i in range(10)]
# The stream whose replica is killed, and the requests whose clients leave: the tiny target's greedy
# answer to this prompt runs the whole 200 tokens (to others it says EOS after 12-66 tokens)
LONG = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}


@pytest.fixture(scope="module")
def expected(engine) -> dict[str, str]:
    """Each request's text from one `specdec serve` process (tests.serve.conftest), by its JSON."""
    with serve(engine, k=3) as alone:
        client = alone.client()
        return {repr(b): complete(client, b, stream=False)[0] for b in [*BODIES, LONG]}


@pytest.fixture(scope="module")
def fleet(tiny_dirs):
    """Two replicas of the slowed tiny pair, max_batch 2 each, on a local cluster of 2 CPUs."""
    temp = tempfile.mkdtemp(prefix="sd-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    owns = connect(None, num_cpus=2, temp_dir=temp)
    fleet = None
    try:
        fleet = deploy(partial(slow_engine, tiny_dirs["target"], tiny_dirs["draft"]),
                       ServeOptions(served_names=(MODEL,), defaults=RequestConfig(k=3), max_batch=2),
                       parse_replicas("2", cpus=0.5), host="127.0.0.1", port=port)
        yield fleet
    finally:
        if fleet is not None:
            fleet.stop(shutdown_ray=owns)
        elif owns:
            import ray

            ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def client(fleet, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=retries, timeout=TIMEOUT_S)


def wait_for(condition, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.2)
    return value


def health(fleet) -> dict:
    response = httpx.get(fleet.url + "/health", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_replicas_answer_as_one_server_does(fleet, expected):
    with ThreadPoolExecutor(len(BODIES)) as pool:
        answers = list(pool.map(lambda i: complete(client(fleet), BODIES[i], stream=i % 2 == 0),
                                range(len(BODIES)), timeout=TIMEOUT_S))
    assert [text for text, _ in answers] == [expected[repr(b)] for b in BODIES]
    replicas = {replica for _, replica in answers}
    assert len(replicas) == 2, replicas  # two requests at most on each at once: both served

    # /health, from whichever replica answers, lists both, each healthy, with its process
    listed = wait_for(lambda: (h := health(fleet)) and len(h["replicas"]) == 2 and h["replicas"], "both are listed")
    assert set(listed) == replicas and all(r["status"] == "ok" and r["pid"] > 0 for r in listed.values())

    # /metrics: per replica (label `replica`), both in one page, every answer counted
    def counted() -> dict[str, float]:
        samples = metric_samples(httpx.get(fleet.url + "/metrics", timeout=10).text)
        per_replica: dict[str, float] = {}
        for (name, labels), value in samples.items():
            labels = dict(labels)
            if name == "specdec:requests_total" and labels.get("code") == "200":
                per_replica[labels["replica"]] = per_replica.get(labels["replica"], 0) + value
        return per_replica

    per_replica = wait_for(lambda: (c := counted()) and sum(c.values()) == len(BODIES) and c, "every answer counted")
    assert set(per_replica) == replicas


def test_a_client_that_leaves_cancels_its_generation(fleet):
    def total(name: str, **labels: str) -> float:  # over the replicas
        samples = metric_samples(httpx.get(fleet.url + "/metrics", timeout=10).text)
        return sum(value for (sample, sample_labels), value in samples.items()
                   if sample == "specdec:" + name and labels.items() <= dict(sample_labels).items())

    def on_replicas() -> float:  # requests running or queued on a replica (its handler holds them)
        return total("num_requests_running") + total("num_requests_waiting")

    before = {name: total(name) for name in ("request_disconnects_total", "request_success_total",
                                             "generation_tokens_total")}
    body = {"model": MODEL, **LONG}
    with httpx.stream("POST", fleet.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)  # the stream has begun; leaving the block hangs up
    wait_for(lambda: total("request_disconnects_total") == before["request_disconnects_total"] + 1, "the stream left")
    wait_for(lambda: on_replicas() == 0, "the stream's generation stopped", timeout=30)

    # A whole (not streamed) answer, its client leaving once the request runs on a replica: a client
    # that gives up while Serve still routes the request leaves nothing on any replica to count
    payload = json.dumps(body).encode()
    host, port = fleet.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
        wait_for(lambda: on_replicas() == 1, "the whole request runs on a replica", timeout=30)
        sock.setblocking(False)
        try:
            early = sock.recv(1)  # b"" would be the server hanging up first
        except BlockingIOError:
            early = None  # nothing yet: the answer is still being generated
        assert early is None, f"the server answered or hung up before the client left: {early!r}"
    # Serve cancels both on their replicas: both counted as left (499 for the whole one), neither ran to
    # its end, and together they generated less than one answer's worth
    wait_for(lambda: total("request_disconnects_total") == before["request_disconnects_total"] + 2, "both left",
             timeout=30)
    assert total("requests_total", code="499") == 1
    assert total("request_success_total") == before["request_success_total"]
    assert total("generation_tokens_total") - before["generation_tokens_total"] < LONG["max_tokens"]


def test_a_killed_replica_loses_no_request(fleet, expected):
    outcomes: dict[int, tuple[str, object]] = {}  # request -> ("text", text) | ("error", exception)

    def run(i: int) -> None:
        try:  # the client's own retries (connection errors, 5xx) are allowed: a retried request is not lost
            outcomes[i] = ("text", complete(client(fleet, retries=2), BODIES[i], stream=i % 2 == 1)[0])
        except Exception as e:  # noqa: BLE001 - judged below
            outcomes[i] = ("error", e)

    with client(fleet).completions.with_streaming_response.create(model=MODEL, stream=True, **LONG) as response:
        victim = response.headers[REPLICA_HEADER]
        pid = wait_for(lambda: health(fleet)["replicas"].get(victim, {}).get("pid"), "the streaming replica is listed")
        chunks = iter(response.parse())
        streamed = [next(chunks)]  # the long answer has begun on `victim`
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(BODIES))]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the others reach the replicas (two at most on each; the rest wait in Serve's queue)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIError) as cut:  # a stream cut mid-way is an error, not a short answer
            for chunk in chunks:
                streamed.append(chunk)
                assert time.monotonic() - started < TIMEOUT_S, "the killed stream hangs"
    assert str(cut.value), "the killed stream's error says nothing"
    assert streamed_text(streamed) != expected[repr(LONG)]

    for t in threads:
        t.join(max(1.0, TIMEOUT_S - (time.monotonic() - started)))
    assert not any(t.is_alive() for t in threads), "a request hung after the kill"
    assert len(outcomes) == len(BODIES)
    failed = []
    for i, (kind, value) in sorted(outcomes.items()):
        if kind == "text":
            assert value == expected[repr(BODIES[i])], f"request {i} came back wrong after the kill"
        else:  # failed: with an error of the API, saying what happened (not a timeout)
            assert isinstance(value, openai.APIError) and not isinstance(value, openai.APITimeoutError), repr(value)
            assert str(value), f"request {i} failed without a message"
            failed.append(i)
    # Only what ran on the killed replica could fail: beside the long stream, one request at most.
    assert len(failed) <= 1, {i: outcomes[i][1] for i in failed}

    # The fleet keeps serving, and stops listing the dead replica.
    assert complete(client(fleet), BODIES[0], stream=False)[0] == expected[repr(BODIES[0])]
    wait_for(lambda: victim not in health(fleet)["replicas"], "the killed replica drops out of /health")
