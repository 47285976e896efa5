"""Slow and many clients: a deadline for a request's headers, an idle timeout, a connection limit.

uvicorn closes a keep-alive connection that stays idle ``timeout_keep_alive`` seconds after a
response, and past ``limit_concurrency`` open connections (or running requests) answers every new
request with a 503 at once.  But nothing of uvicorn's bounds how long a client may take to send a
request's line and headers: a socket that sends nothing, or a byte now and then (slowloris), is held
for ever, and enough of them fill the connection limit; nor, with httptools, how large the headers
may grow (20 MB of one header were read and kept).  :class:`HeaderDeadline` closes a connection
whose request headers are not all in within ``header_timeout_s`` of the connection's start, or of
the end of its previous response, and answers 431 to headers over MAX_HEADER_BYTES.

These apply to ``specdec serve``'s own uvicorn; under ``--replicas`` Ray Serve's proxy holds the
connections (its own timeouts apply).
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
from dataclasses import dataclass
from typing import Any

import uvicorn

from specdec.errors import SpecdecError

MAX_HEADER_BYTES = 64 * 1024  # a request line and headers larger than this are refused (431)


def too_large_response() -> bytes:
    """A whole HTTP 431 response, the body in OpenAI's error shape; the connection closes after it."""
    body = json.dumps({"error": {"message": f"the request's headers are over {MAX_HEADER_BYTES} bytes",
                                 "type": "invalid_request_error", "param": None, "code": "headers_too_large"}})
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body.encode()))


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take and how many may be connected at once."""

    header_timeout_s: float = 10.0  # from connecting (or the previous response) to a request's last header
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this long (uvicorn's default)
    max_connections: int = 100  # open connections (or running requests); past it, requests get a 503


class HeaderDeadline:
    """A mixin for uvicorn's HTTP/1.1 protocols (h11, httptools): closes the connection when a
    request's headers take longer than `header_timeout_s`.

    The deadline is set when the connection is made and again when a response has been sent (the
    connection then waits for its next request).  When it passes, the connection is closed if it is
    still waiting for headers -- no request yet, or the last one answered; one whose request is
    being read or answered is left alone (its headers came in time).
    """

    header_timeout_s: float = ConnectionLimits.header_timeout_s
    _header_deadline: asyncio.TimerHandle | None = None
    _header_bytes = 0  # received since the deadline was set, while still waiting for headers

    # uvicorn's protocols provide these.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    # super() below is uvicorn's protocol class, which guarded_protocol mixes this into and mypy cannot see:
    # the ignores
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._set_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._set_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if not self._waiting_for_headers():  # they are complete: what follows is a body
            self._header_bytes = 0
            return
        self._header_bytes += len(data)
        if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self.transport.write(too_large_response())
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._clear_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def _set_header_deadline(self) -> None:
        self._clear_header_deadline()
        self._header_bytes = 0
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _clear_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()

    def _waiting_for_headers(self) -> bool:
        """No request yet, or the last one answered (as uvicorn's own shutdown() tells)."""
        return self.cycle is None or self.cycle.response_complete


def guarded_protocol(header_timeout_s: float, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`base`, default the one its "auto" picks: httptools when
    installed, else h11) with a header deadline of `header_timeout_s`."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return type(f"HeaderDeadline{base.__name__}", (HeaderDeadline, base), {"header_timeout_s": header_timeout_s})


def server_config(app: Any, limits: ConnectionLimits = ConnectionLimits(), log_level: str = "info",
                  base: type[asyncio.Protocol] | None = None, graceful_s: float = 5.0) -> uvicorn.Config:
    """uvicorn's configuration for serving `app` within `limits`; `graceful_s`: how long a shutdown waits for
    the open connections before it cancels them."""
    return uvicorn.Config(app, log_level=log_level,
                          timeout_graceful_shutdown=graceful_s,  # type: ignore[arg-type]  # a float works
                          http=guarded_protocol(limits.header_timeout_s, base),
                          ws="none",  # no WebSocket routes: an upgrade is not a way around the deadline
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works
                          limit_concurrency=limits.max_connections)


LISTEN_BACKLOG = 2048  # connections the kernel queues before the server accepts them (uvicorn's default)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for the server, listening (a client that connects as soon as the
    "serving ... at" line is printed waits in the backlog until the server accepts, instead of being
    refused while the app starts); a SpecdecError when it cannot be had (in use...)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, socket.gaierror) as e:
        raise SpecdecError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        reason = "the address is already in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise SpecdecError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock
