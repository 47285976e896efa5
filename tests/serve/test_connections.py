"""Slow and many clients, with real sockets on 127.0.0.1: a connection whose headers do not arrive in
time is closed while normal requests are served, and so is one whose headers grow too large; past
the connection limit a request gets a 503 at once.  Short timeouts, a bounded number of sockets; each wait has a
generous bound and nothing
asserts how long anything took."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from uvicorn.protocols.http import auto
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specdec.serve.connections import MAX_HEADER_BYTES, ConnectionLimits
from tests.serve.conftest import metric, metric_samples, serve
from tests.serve.test_errors import OK

SHORT = ConnectionLimits(header_timeout_s=0.5, keep_alive_s=5.0, max_connections=100)
BOUND_S = 20.0  # the most any wait below may take before the test fails
PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def protocol(request, monkeypatch):
    """uvicorn's "auto" protocol, as each of its two HTTP/1.1 implementations."""
    monkeypatch.setattr(auto, "AutoHTTPProtocol", request.param)
    return request.param


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    return sock


def closed_by_server(sock: socket.socket, trickle: bytes = b"") -> bool:
    """Whether the server closes `sock` within BOUND_S, while `trickle` is sent a byte at a time."""
    deadline = time.monotonic() + BOUND_S
    sock.settimeout(0.1)
    sent = 0
    while time.monotonic() < deadline:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_a_slow_header_socket_is_dropped_while_others_are_served(engine, protocol):
    with serve(engine, SHORT) as server:
        silent, slow, trickling = connect(server.port), connect(server.port), connect(server.port)
        slow.sendall(PARTIAL)  # headers begun, never finished
        assert httpx.post(server.url + "/v1/completions", json=OK).status_code == 200  # served meanwhile
        assert closed_by_server(silent)
        assert closed_by_server(slow)
        # a byte every 0.1 s (slowloris): each byte is progress, but the deadline is for all the headers
        assert closed_by_server(trickling, PARTIAL * 100)
        assert httpx.get(server.url + "/health").status_code == 200


def test_the_deadline_is_set_again_for_the_next_request_on_a_connection(engine, protocol):
    with serve(engine, SHORT) as server, connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's headers, never finished
        assert closed_by_server(sock)


def test_a_request_whose_headers_came_in_time_is_not_cut(engine, protocol):
    """Its body may take longer than the header deadline, and its answer too."""
    body = httpx.Request("POST", "/", json=OK).content
    with serve(engine, SHORT) as server, connect(server.port) as sock:
        sock.sendall(PARTIAL + b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), len(body) // 3 + 1):  # the body in three parts, over twice the deadline
            time.sleep(SHORT.header_timeout_s * 2 / 3)
            sock.sendall(body[i:i + len(body) // 3 + 1])
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_past_the_connection_limit_a_request_gets_a_503(engine, protocol):
    limits = ConnectionLimits(header_timeout_s=60.0, max_connections=4)
    with serve(engine, limits) as server:
        held = [connect(server.port) for _ in range(limits.max_connections)]  # idle sockets fill the limit
        wait_until(lambda: len(server.server.server_state.connections) >= limits.max_connections)
        refused = httpx.post(server.url + "/v1/completions", json=OK, timeout=BOUND_S)
        assert refused.status_code == 503  # at once, not a hang
        for sock in held:
            sock.close()
        wait_until(lambda: httpx.post(server.url + "/v1/completions", json=OK).status_code == 200)


def test_slow_sockets_over_the_limit_are_dropped_and_the_server_recovers(engine, protocol):
    limits = ConnectionLimits(header_timeout_s=0.5, max_connections=4)
    with serve(engine, limits) as server:
        held = [connect(server.port) for _ in range(8)]  # twice the limit, all silent
        for sock in held:
            assert closed_by_server(sock)
            sock.close()
        assert httpx.post(server.url + "/v1/completions", json=OK).status_code == 200


def wait_until(condition, bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.05)


def test_headers_over_the_limit_are_refused(engine, protocol):
    """httptools alone would read and keep any amount (20 MB were); h11 refuses past 16 KiB itself."""
    with serve(engine, SHORT) as server, connect(server.port) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 4096))
            answer = sock.recv(4096)
        except (ConnectionResetError, BrokenPipeError):  # closed while the headers were still being sent
            answer = b""
        assert answer == b"" or answer.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400"))
        assert closed_by_server(sock)
        big = httpx.get(server.url + "/health", headers={"X-Big": "a" * (MAX_HEADER_BYTES // 2 // 8)})
        assert big.status_code == 200  # large headers within the limit are fine
        body = httpx.post(server.url + "/v1/completions", json={**OK, "prompt": "x" * 500_000})
        assert body.status_code == 400 and body.json()["error"]["code"] == "context_length_exceeded"  # a body is no header


def test_a_request_body_broken_off_is_counted_as_the_client_leaving(engine, protocol):
    with serve(engine, SHORT) as server:
        before = metric_samples(httpx.get(server.url + "/metrics").text)
        with connect(server.port) as sock:
            sock.sendall(PARTIAL + b"Content-Length: 100\r\n\r\n{\"mod")
            time.sleep(0.2)  # the request has begun; then the client hangs up mid-body
        wait_until(lambda: count_gone(server) > count_gone(server, before))
        after = metric_samples(httpx.get(server.url + "/metrics").text)
        assert metric(after, "requests_total", endpoint="/v1/completions", code="500") == 0


def count_gone(server, samples=None) -> float:
    samples = samples if samples is not None else metric_samples(httpx.get(server.url + "/metrics").text)
    return metric(samples, "requests_total", endpoint="/v1/completions", code="499")
