"""Who may come in: API keys, JSON-only request bodies, cross-origin browsers.

- **API keys** (``--api-key``, or the ``SPECDEC_API_KEY`` environment variable so that keys stay off
  the command line; several keys allowed): the API routes want ``Authorization: Bearer <key>`` and
  answer a missing or wrong one with a 401 in OpenAI's error shape.  /health is always open, the
  playground page too (it asks for the key), /metrics unless the server says otherwise.
- **JSON only**: a POST body must be ``application/json`` (a 415 otherwise).  A web page can make a
  browser send a "simple" cross-site POST -- text/plain, a form, or a body with no type -- with no
  CORS preflight at all; refusing every such body means no page the user visits can start a
  generation on a server on their machine.
- **CORS** is off unless origins are named (``--allowed-origins``): a JSON POST from another origin
  needs a preflight, which only then succeeds.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import socket
from collections.abc import Iterable, Mapping

from fastapi import FastAPI

from specdec.serve import API_KEY_ENV
from specdec.serve.protocol import APIError

JSON_TYPE = "application/json"


def split_values(values: Iterable[str] | None) -> tuple[str, ...]:
    """The items of `values` (API keys, origins), each value holding one or several separated by commas
    or whitespace (as an environment variable does)."""
    return tuple(item for value in values or () for item in re.split(r"[,\s]+", value) if item)


def check_key(headers: Mapping[str, str], keys: tuple[str, ...]) -> None:
    """A 401 unless `headers` carry ``Authorization: Bearer <one of keys>``; nothing when no keys are set."""
    if not keys:
        return
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                       None, "missing_api_key", {"WWW-Authenticate": "Bearer"})
    given = token.strip().encode()
    matched = False
    for key in keys:  # every key compared, each in constant time: the timing tells nothing
        matched |= hmac.compare_digest(given, key.encode())
    if not matched:
        raise APIError(401, "the API key is not valid on this server", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})


def check_json(headers: Mapping[str, str]) -> None:
    """A 415 unless the body is declared ``application/json`` (parameters such as charset allowed)."""
    declared = headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != JSON_TYPE:
        shown = f"'{declared[:80]}'" if declared else "none"
        raise APIError(415, f"the body must be JSON, sent with 'Content-Type: {JSON_TYPE}' (got {shown})",
                       None, "unsupported_media_type")


def allow_origins(app: FastAPI, origins: tuple[str, ...]) -> None:
    """Let web pages from `origins` call the API from a browser (CORS); none when empty."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"], max_age=600)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}  # (an IP address: a str)
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def exposure_warning(host: str, keys: tuple[str, ...]) -> str | None:
    """The warning for a server that others can reach and that lets anyone in; None otherwise."""
    if keys or is_loopback(host):
        return None
    return (f"warning: listening on {host} without an API key: anyone who can reach this port can generate. "
            f"Set one with --api-key or the {API_KEY_ENV} environment variable.")
