"""`specdec serve`: an OpenAI-compatible HTTP server with speculative decoding.

app.py (routes, OpenAI shapes), worker.py (the one thread that owns the Engine: a bounded queue,
cancellation between decode steps), metrics.py (Prometheus names and their vLLM / llama.cpp
equivalents), protocol.py (request bodies, OpenAI-style errors), access.py (API keys, JSON-only
bodies, CORS), connections.py (header deadline, idle timeout, connection limit), static/index.html (the playground page at /); ray.py (`specdec serve --replicas`: the same app as Ray Serve replicas, the
optional `ray` extra) and replicas.py (what --replicas asks of Ray Serve, checked without Ray).

Needs the optional `serve` extra (FastAPI, uvicorn, prometheus-client): see missing_extra().
"""

from __future__ import annotations

INSTALL_HINT = "pip install 'specdec[serve]'"
API_KEY_ENV = "SPECDEC_API_KEY"  # the API keys, kept off the command line (specdec.serve.access)
REQUIRED = ("fastapi", "uvicorn", "prometheus_client")


def missing_extra() -> list[str]:
    """The modules of the `serve` extra that are not installed."""
    import importlib.util

    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]
