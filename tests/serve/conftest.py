"""Servers for the tests: the real app under uvicorn, on a free 127.0.0.1 port, in a thread.

Tiny random models only (tests.tiny): a target with a small chat template, a draft of its own
(mostly rejected), and the target's bf16 copy as a draft (mostly accepted).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")

import uvicorn  # noqa: E402
from openai import OpenAI  # noqa: E402

from specdec.request import RequestConfig, field_names  # noqa: E402
from specdec.runtime.engine import Engine  # noqa: E402
from specdec.serve.app import ServeOptions, create_app  # noqa: E402
from specdec.serve.connections import (  # noqa: E402
    ConnectionLimits,
    bind,  # noqa: E402
    server_config,
)
from tests.tiny import save_tiny  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<bos>assistant:{% endif %}")
MODEL = "tiny"  # the name the test servers serve
REQUEST_FIELDS = set(field_names())  # options of serve() that are the requests' defaults


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """Saved tiny models: "target" (with a chat template) and "draft" (another random model)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("serve-tiny")
    target = save_tiny(root / "target", "llama", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target)
    return {"target": target, "draft": save_tiny(root / "draft", "llama", seed=1)}


class ServerThread:
    """The app for `engine` served by uvicorn in a thread, on 127.0.0.1 and a port of its own."""

    def __init__(self, engine: Engine, limits: ConnectionLimits = ConnectionLimits(), **options) -> None:
        """options: ServeOptions' fields, and the requests' defaults (RequestConfig's fields: k=3, verify=...)."""
        defaults = RequestConfig(**{name: options.pop(name) for name in list(options) if name in REQUEST_FIELDS})
        self.app = create_app(engine, ServeOptions(served_names=(MODEL,), defaults=defaults, **options))
        self.worker = self.app.state.worker
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(server_config(self.app, limits, log_level="warning"))  # as `specdec serve` runs
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kwargs) -> OpenAI:
        """The official client, without retries (a 503 must be seen, not retried)."""
        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60, **kwargs)


@contextmanager
def serve(engine: Engine, limits: ConnectionLimits = ConnectionLimits(), **options) -> Iterator[ServerThread]:
    with ServerThread(engine, limits, **options) as server:
        yield server


@pytest.fixture(scope="module")
def engine(tiny_dirs) -> Engine:
    """The tiny target with the other random model as its draft (mostly rejected drafts), in fp32: the
    server's tests were written against these models' fp32 answers (the Ray replicas' too); the
    default dtype's own tests are in tests/test_defaults.py."""
    return Engine.load(tiny_dirs["target"], tiny_dirs["draft"], dtype="fp32")


@pytest.fixture(scope="module")
def server(engine) -> Iterator[ServerThread]:
    with serve(engine, k=3) as s:
        yield s


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics text -> {(sample name, sorted labels): value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get(("specdec:" + name, tuple(sorted(labels.items()))), 0.0)


def streamed_text(chunks: Sequence) -> str:
    """The text of streamed completion or chat chunks, joined."""
    out = []
    for chunk in chunks:
        for choice in chunk.choices:
            out.append(choice.text if hasattr(choice, "text") else (choice.delta.content or ""))
    return "".join(out)
