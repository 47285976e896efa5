"""A server that listens while its models load (specdec.serve.deferred): /health says "loading" with a 503, every
other path a 503 in OpenAI's shape with Retry-After, then the built app answers; a failed build stops the server."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from specdec.errors import SpecdecError
from specdec.serve.connections import bind
from specdec.serve.deferred import Deferred, serve


def start(build):
    """serve() of a Deferred over `build` on a thread, on a free port: (the app, its base URL, the thread, the result)."""
    app = Deferred(build)
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("error", serve(app, sock, log_level="warning")))
    thread.start()
    return app, url, thread, result


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_it_answers_loading_until_the_app_is_built_then_the_app_answers():
    release, stopped = threading.Event(), threading.Event()

    def build():
        release.wait(30)
        built = FastAPI(lifespan=lifespan)

        @built.get("/health")
        def health():
            return {"status": "ok"}

        return built

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_):
        yield
        stopped.set()  # the built app's lifespan ends with the server

    app, url, thread, result = start(build)
    try:
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        models = httpx.get(f"{url}/v1/models", timeout=10)
        assert models.status_code == 503 and models.headers["retry-after"] == "1"
        assert models.json()["error"]["code"] == "model_loading"
        posted = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert posted.status_code == 503 and posted.json()["error"]["type"] == "server_overloaded"
        page = httpx.get(f"{url}/", timeout=10)  # a browser at the playground's address: a page that waits
        assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
        assert 'http-equiv="refresh"' in page.text and "loading" in page.text
        release.set()
        wait_for(lambda: app.app is not None)
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    finally:
        release.set()
        app.stop()
        thread.join(30)
    assert not thread.is_alive() and result["error"] is None and stopped.is_set()


@pytest.mark.parametrize("raised, message", [(SpecdecError("no model named 'x'"), "no model named 'x'"),
                                             (RuntimeError("boom"), "loading failed: RuntimeError: boom")])
def test_a_failed_build_stops_the_server_with_its_one_line_error(raised, message):
    def build():
        raise raised

    _, _, thread, result = start(build)
    thread.join(30)
    assert not thread.is_alive() and result["error"] == message
