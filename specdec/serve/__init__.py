"""`specdec serve`: an OpenAI-compatible HTTP server with speculative decoding.

app.py (routes, OpenAI shapes), worker.py (the one thread that owns the Engine: a bounded queue,
cancellation between decode steps), metrics.py (Prometheus names and their vLLM / llama.cpp
equivalents), protocol.py (request bodies, OpenAI-style errors), access.py (API keys, JSON-only
bodies, CORS), connections.py (header deadline, idle timeout, connection limit, the bound socket), deferred.py
(the server listening while its models load), static/index.html (the playground page at /); ray.py (`specdec serve
--replicas`: the same app as Ray Serve replicas, the
optional `ray` extra) and replicas.py (what --replicas asks of Ray Serve, checked without Ray).

Needs the optional `serve` extra (FastAPI, uvicorn, prometheus-client): see missing_extra().
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.request import RequestConfig

INSTALL_HINT = "pip install 'specdec[serve]'"
API_KEY_ENV = "SPECDEC_API_KEY"  # the API keys, kept off the command line (specdec.serve.access)
REQUIRED = ("fastapi", "uvicorn", "prometheus_client")


def missing_extra() -> list[str]:
    """The modules of the `serve` extra that are not installed."""
    import importlib.util

    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


@dataclass(frozen=True)
class ServeOptions:
    """What `specdec serve` fixes for every request."""

    served_names: tuple[str, ...] = ("specdec",)
    # what a request does not say: its per-request options (-k, --draft-mode, ...; OpenAI's fields map onto the rest)
    defaults: RequestConfig = RequestConfig()
    max_queue: int = 16  # requests waiting behind the running ones; one more is answered 503
    max_batch: int = 1  # requests decoded together, one target forward per step (specdec.runtime.batching)
    max_tokens_limit: int = 2048  # the most a request may ask for
    # the longest prompt a request may send, in tokens (None: the model's context window); one request's long
    # prefill holds the others back (with one worker, all of it; in a batch, a chunk a round)
    max_prompt_tokens: int | None = None
    max_body_bytes: int = 1 << 20  # a larger body is answered 413
    # bytes the running requests' KV caches and activations may take together (specdec.runtime.memory): a request that
    # needs more is answered 413, one that does not fit beside the running ones waits; None: no budget (`specdec
    # serve` sets one, by default a share of the memory available once the models are loaded)
    memory_budget: int | None = None
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: anyone may call the API (specdec.serve.access)
    metrics_need_key: bool = True  # with api_keys: /metrics wants one too
    allowed_origins: tuple[str, ...] = ()  # origins whose pages may call the API from a browser (CORS)
