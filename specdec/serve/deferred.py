"""A server that listens at once and answers while its models load (llama-server's convention).

`specdec serve` binds its port, starts uvicorn on a :class:`Deferred` app and builds the real one (the engine's
load, then specdec.serve.app.create_app) on a thread beside it.  Until then /health answers 503
``{"status": "loading"}`` and every other path 503 in OpenAI's error shape, with ``Retry-After``; then each
request goes to the built app, whose lifespan (its worker thread) this app runs.  A build that fails stops the
server, and the command prints its one-line error: a load balancer that polls /health sees "loading", never a
refused connection, and a client that sends too early gets an answer it can retry.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import uvicorn

from specdec.errors import SpecdecError
from specdec.serve.connections import ConnectionLimits, server_config

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

RETRY_AFTER_S = 1  # what a request that came too early is told to wait
# What a browser gets at / while the models load: it asks again each second, and shows the playground then
LOADING_PAGE = ("<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"1\">"
                "<title>specdec: loading</title></head><body><p>specdec is loading the models; this page opens the "
                "playground once they are ready.</p></body></html>")
GRACE_S = 5.0  # after a shutdown's timeout, how long the ended requests' last events have to reach their clients


class Deferred:
    """An ASGI app standing in for the one `build` returns (called once, on a thread of its own, at the
    server's start).  A build that raises leaves its one-line message in `error` and calls `stop()` (which
    serve() sets to end the server)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build = build
        self.app: Any = None  # the built app, once its lifespan has started
        self.error: str | None = None
        self.stop: Callable[[], None] = lambda: None
        self._stack = AsyncExitStack()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._loading(scope, send)

    def drain(self, timeout: float) -> None:
        """A shutdown began: the built app's worker drains (nothing to drain while the models load)."""
        if self.app is not None:
            self.app.state.worker.drain(timeout)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                done: asyncio.Future[Any] = loop.create_future()
                threading.Thread(target=self._build_on_thread, args=(loop, done), name="specdec-load",
                                 daemon=True).start()  # daemon: a server stopped while loading exits at once
                loop.create_task(self._start(done))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stack.aclose()  # the built app's lifespan: its worker stops
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _build_on_thread(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any]) -> None:
        try:
            app = self.build()
        except SpecdecError as e:
            loop.call_soon_threadsafe(_settle, done, None, str(e))
        except Exception as e:  # noqa: BLE001 -- a bug: said in one line, the server stops
            loop.call_soon_threadsafe(_settle, done, None, f"loading failed: {type(e).__name__}: {e}")
        else:
            loop.call_soon_threadsafe(_settle, done, app, None)

    async def _start(self, done: asyncio.Future[Any]) -> None:
        app, error = await done
        if error is not None:
            self.error = error
            self.stop()
            return
        await self._stack.enter_async_context(app.router.lifespan_context(app))
        self.app = app

    async def _loading(self, scope: Scope, send: Send) -> None:
        if scope["path"] == "/":  # the playground's address, opened in a browser: a page that waits for it
            kind, payload = b"text/html; charset=utf-8", LOADING_PAGE.encode()
        else:
            body = {"status": "loading"} if scope["path"] == "/health" else {"error": {
                "message": "the model is loading; retry shortly", "type": "server_overloaded", "param": None,
                "code": "model_loading"}}
            kind, payload = b"application/json", json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(payload)).encode()),
                                (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _settle(done: asyncio.Future[Any], app: Any, error: str | None) -> None:
    if not done.done():
        done.set_result((app, error))


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with a graceful shutdown: the first SIGTERM or SIGINT calls `draining()` (the worker
    takes no more requests and ends what still runs after its timeout with an error event, see
    specdec.serve.worker.Worker.drain) while uvicorn stops accepting connections and waits for the open ones;
    and a shutdown a signal asked for ends the process normally (status 0), where uvicorn re-raises the signal
    (143 for SIGTERM).  A second Ctrl-C still forces the exit."""

    def __init__(self, config: uvicorn.Config, draining: Callable[[], None]) -> None:
        super().__init__(config)
        self.draining = draining

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            self.draining()
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled: the shutdown was the signal's purpose


def serve(app: Deferred, sock: socket.socket, limits: ConnectionLimits = ConnectionLimits(),
          log_level: str = "info", shutdown_timeout: float = 30.0) -> str | None:
    """Serve `app` on a bound socket until interrupted, or until its build fails: then its one-line error.
    A SIGTERM or SIGINT lets the running requests go on for `shutdown_timeout` seconds (GracefulServer)."""
    server = GracefulServer(server_config(app, limits, log_level, graceful_s=shutdown_timeout + GRACE_S),
                            lambda: app.drain(shutdown_timeout))

    def stop() -> None:
        server.should_exit = True

    app.stop = stop
    server.run(sockets=[sock])
    return app.error
