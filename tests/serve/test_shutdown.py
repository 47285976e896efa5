"""A graceful shutdown (specdec.serve.deferred.GracefulServer, Worker.drain): after SIGTERM the running streams go on
for --shutdown-timeout, then each ends with an error event in OpenAI's shape and [DONE] instead of a cut
connection; requests that waited get a 503; the server then ends, and `specdec serve` exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from specdec.backends.hf import HFRunner
from specdec.request import RequestConfig
from specdec.runtime.engine import Engine
from specdec.serve import ServeOptions
from specdec.serve.app import create_app
from specdec.serve.connections import bind, server_config
from specdec.serve.deferred import Deferred, GracefulServer
from specdec.serve.worker import SHUTTING_DOWN
from tests.serve.conftest import MODEL


class SlowRunner(HFRunner):
    """An HFRunner whose forwards take at least `delay` seconds: a stream of 60 tokens lasts seconds."""

    delay = 0.05

    def forward(self, new_tokens, last_n=None):
        time.sleep(self.delay)
        return super().forward(new_tokens, last_n)


def events(response: httpx.Response) -> list[object]:
    """A stream's server-sent events, parsed ([DONE] as the string)."""
    out: list[object] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sigterm_lets_streams_finish_or_end_with_an_error_event(engine):
    slow = Engine(SlowRunner(engine.target_runner.model), engine.tokenizer)
    app = Deferred(lambda: create_app(slow, ServeOptions(served_names=(MODEL,), defaults=RequestConfig(k=1),
                                                         max_batch=1, max_queue=8)))
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = GracefulServer(server_config(app, log_level="warning", graceful_s=10), lambda: app.drain(1.0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        results: list[list[object]] = [[] for _ in range(4)]

        def client(i: int) -> None:  # one runs (with max_batch 1), three wait in the queue
            body = {"model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": 60, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                if response.status_code == 200:
                    results[i] = [200, *events(response)]
                else:
                    response.read()
                    results[i] = [response.status_code, response.json()]

        clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for c in clients:
            c.start()
        while app.app is None or app.app.state.worker.running is None:
            time.sleep(0.01)
        time.sleep(0.3)  # the first stream has sent some chunks
        server.handle_exit(signal.SIGTERM, None)  # as the signal does
        for c in clients:
            c.join(30)
        thread.join(30)
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
    for result in results:
        status, *rest = result
        if status == 200:  # a stream: it finished, or ended with the shutdown's error event; [DONE] either way
            assert rest[-1] == "[DONE]", rest[-3:]
            last = rest[-2]
            finished = bool(last.get("choices")) and last["choices"][0].get("finish_reason")
            assert finished or last["error"]["code"] == SHUTTING_DOWN, last
        else:  # one that waited: refused in OpenAI's shape
            assert status == 503 and result[1]["error"]["code"] == SHUTTING_DOWN, result
    assert any(r[0] == 200 and isinstance(r[-2], dict) and "error" in r[-2] for r in results)  # one was cut short
