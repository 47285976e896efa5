"""The playground page at / in a real headless Chromium: it loads, streams a completion, and colours
each piece of text by how it came (accepted draft tokens or the target's own).

Skipped where no chromium binary exists, except in CI (CI=true), where .ci/run installs Debian's
chromium and a missing browser fails the test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from importlib import resources
from urllib.parse import urlencode

import pytest
import uvicorn

from specdec.runtime.engine import Engine
from specdec.serve.connections import bind
from tests.conftest import in_ci
from tests.serve.conftest import MODEL, serve

QUERY = {"prompt": "Once upon a time", "max_tokens": 32, "k": 4, "temperature": 0, "autorun": 1}


def chromium() -> str:
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if binary is None:
        why = "no chromium binary (apt-get install chromium)"
        pytest.fail(why) if in_ci() else pytest.skip(why)
    return binary


def headless(url: str, profile, *args: str) -> subprocess.CompletedProcess:
    """Chromium on `url`; virtual time runs until the page's requests have finished (the playground
    streams with XMLHttpRequest, which holds virtual time until the body is complete)."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=30000", *args, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Page(HTMLParser):
    """The state of a dumped playground page: body data-state, the coloured spans (by the element
    holding them), the chat transcript's turns, each element's text and attributes by id."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.state: str | None = None
        self.mode: str | None = None
        self.pieces: list[tuple[str, str, str]] = []  # (holder's id, kind, text) of each coloured span
        self.turns: list[list[str]] = []  # [role, text] of each transcript turn
        self.ids: dict[str, str] = {}  # element id -> its text (its descendants' included)
        self.attrs: dict[str, dict[str, str | None]] = {}  # element id -> its attributes
        # per open element: (span kind, id, "turn" for a turn, "said" within a turn's text, else "")
        self._open: list[tuple[str | None, str | None, str]] = []
        self.feed(html)

    @property
    def spans(self) -> list[tuple[str, str]]:
        """The coloured spans of the completion output box."""
        return self.spans_in("out")

    def spans_in(self, holder: str) -> list[tuple[str, str]]:
        return [(kind, text) for h, kind, text in self.pieces if h == holder]

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.state, self.mode = attrs.get("data-state"), attrs.get("data-mode")
        if attrs.get("id"):
            self.attrs[attrs["id"]] = attrs
        classes = (attrs.get("class") or "").split()
        if "turn" in classes:
            self.turns.append([next(c for c in classes if c != "turn"), ""])
        kind = next((c for c in ("accepted", "target") if c in classes), None) if "tok" in classes else None
        parent = self._open[-1][2] if self._open else ""
        where = "turn" if "turn" in classes else "said" if parent == "said" or (
            parent == "turn" and "text" in classes) else ""
        if kind:
            holder = next((i for _, i, _ in reversed(self._open) if i), None)
            self.pieces.append((holder, kind, ""))
        if tag not in VOID:
            self._open.append((kind, attrs.get("id"), where))

    def handle_endtag(self, tag):
        if tag not in VOID and self._open:
            self._open.pop()

    def handle_data(self, data):
        kind = self._open[-1][0] if self._open else None
        if kind:
            holder, _, text = self.pieces[-1]
            self.pieces[-1] = (holder, kind, text + data)
        if self._open and self._open[-1][2] == "said":
            self.turns[-1][1] += data
        for _, element, _ in self._open:
            if element:
                self.ids[element] = self.ids.get(element, "") + data


@pytest.fixture(scope="module")
def playground(tiny_dirs):
    """A server whose draft (the target's bf16 copy) is accepted mostly but not always."""
    engine = Engine.load(tiny_dirs["target"], tiny_dirs["target"], draft_dtype="bf16")
    with serve(engine, k=4) as server:
        yield server


def dump(server, query: dict, tmp_path) -> Page:
    """The page at `server` with `query`, as Chromium leaves it once its requests have finished."""
    run = headless(f"{server.url}/?{urlencode(query, doseq=True)}", tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    return Page(run.stdout)


def test_the_page_streams_a_coloured_completion(playground, tmp_path):
    chromium()
    page = dump(playground, QUERY, tmp_path)
    assert page.state == "done", (page.state, page.ids.get("error"))
    assert page.mode == "completion"  # ?prompt= is a completion, as before chat existed
    kinds = {kind for kind, _ in page.spans}
    assert kinds == {"accepted", "target"}, page.spans  # both colours appear
    expected = playground.client().completions.create(
        model=MODEL, prompt=QUERY["prompt"], max_tokens=32, temperature=0, extra_body={"speculative": {"k": 4}})
    assert "".join(text for _, text in page.spans) == expected.choices[0].text
    assert page.ids["s-tokens"] == str(expected.usage.completion_tokens)
    assert page.ids["s-finish"] == expected.choices[0].finish_reason
    assert page.ids["s-rate"].endswith("%") and page.ids["model"] == MODEL


def test_chat_mode_keeps_a_conversation(playground, tmp_path):
    """Each ?message= is a user's turn, sent after the previous answer with the conversation so far."""
    chromium()
    first, second = "Write a haiku about the sea.", "Now one about the hills."
    query = {"message": [first, second], "max_tokens": 12, "k": 4, "temperature": 0, "autorun": 1}
    page = dump(playground, query, tmp_path)
    assert page.state == "done", (page.state, page.ids.get("error"))
    assert page.mode == "chat"
    client = playground.client()

    def answer(messages):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                               extra_body={"speculative": {"k": 4}})
        return reply.choices[0].message.content

    one = answer([{"role": "user", "content": first}])
    two = answer([{"role": "user", "content": first}, {"role": "assistant", "content": one},
                  {"role": "user", "content": second}])
    assert page.turns == [["user", first], ["assistant", one], ["user", second], ["assistant", two]]
    assert {kind for _, kind, _ in page.pieces} <= {"accepted", "target"} and page.pieces  # coloured answers
    assert page.ids["s-finish"] == "length" and "hidden" in page.attrs["completion-box"]


def test_compare_with_plain(playground, tmp_path):
    """With no prompt in the query the page opens in chat (the model has a chat template); compare
    runs the message speculatively, then plainly, and shows both, the speedup and that they match."""
    chromium()
    page = dump(playground, {"compare": 1, "max_tokens": 24, "k": 4, "temperature": 0, "autorun": 1}, tmp_path)
    assert page.state == "done", (page.state, page.ids.get("error"))
    assert page.mode == "chat" and "hidden" not in page.attrs["cmp"] and "hidden" in page.attrs["stats"]
    spec, plain = (page.spans_in(pane) for pane in ("cmp-spec", "cmp-plain"))
    assert {kind for kind, _ in spec} == {"accepted", "target"}  # drafts accepted in one pane...
    assert {kind for kind, _ in plain} == {"target"}  # ...none in the plain one
    assert "".join(t for _, t in spec) == "".join(t for _, t in plain) != ""
    assert re.fullmatch(r"\d+\.\d\d\u00d7", page.ids["cmp-speedup"]), page.ids["cmp-speedup"]
    assert page.attrs["cmp-same"]["data-verdict"] == "identical" and "identical" in page.ids["cmp-same"]
    for pane in ("cmp-spec-figs", "cmp-plain-figs"):
        assert "tokens/s" in page.ids[pane] and "wall" in page.ids[pane]
    assert "acceptance" in page.ids["cmp-spec-figs"] and "mean accepted" in page.ids["cmp-spec-figs"]
    assert "acceptance" not in page.ids["cmp-plain-figs"]
    # The transcript keeps the (speculative) answer.
    assert [role for role, _ in page.turns] == ["user", "assistant"]
    assert page.turns[1][1] == "".join(t for _, t in spec)


def test_the_page_opens_as_a_first_visitor_expects(playground, tiny_dirs, tmp_path):
    """No query: chat mode where the model has a chat template, k at the server's own default."""
    chromium()
    page = dump(playground, {}, tmp_path)
    assert page.mode == "chat" and page.state in (None, "idle"), (page.mode, page.state)
    assert page.attrs["k"].get("data-server") == "4"  # the fixture's server runs -k 4
    with serve(Engine.load(tiny_dirs["target"], "lookup")) as server:  # the server's default, -k auto
        page = dump(server, {}, tmp_path)
        assert server.client().models.list().data[0].model_extra["k"] == "auto"
    assert page.mode == "chat" and page.attrs["k"].get("data-server") == "auto"


def test_a_model_without_a_chat_template_opens_in_completion(tiny_dirs, tmp_path):
    """The page finds out (a chat request that generates nothing) and says why chat is off."""
    chromium()
    with serve(Engine.load(tiny_dirs["draft"])) as server:  # saved without a chat template
        page = dump(server, {"message": "Hello", "autorun": 1}, tmp_path)
    assert page.mode == "completion" and page.state == "idle"  # nothing ran
    assert "disabled" in page.attrs["mode-chat"] and "no chat template" in page.ids["mode-note"]
    assert not page.ids.get("error")


def test_a_server_that_wants_an_api_key(tmp_path):
    """A 401 asks for the key (a stand-in server: the page, and 401 for everything else)."""
    chromium()
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse

    app = FastAPI()
    page_html = resources.files("specdec.serve").joinpath("static/index.html").read_text("utf-8")
    app.get("/")(lambda: HTMLResponse(page_html))

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
    def refuse(rest: str) -> JSONResponse:
        return JSONResponse({"error": {"message": "invalid API key", "type": "invalid_request_error",
                                       "param": None, "code": "invalid_api_key"}}, status_code=401)

    with stand_in(app) as url:
        run = headless(f"{url}/?prompt=hi&autorun=1", tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    page = Page(run.stdout)
    assert page.state == "needs-key" and "API key" in page.ids["error"], page.ids.get("error")


@contextmanager
def stand_in(app) -> Iterator[str]:
    """`app` under uvicorn in a thread, at the URL this yields."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the stand-in server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_screenshot_of_the_page(playground, tmp_path):
    chromium()
    shot = tmp_path / "playground.png"
    run = headless(f"{playground.url}/?{urlencode(QUERY)}", tmp_path / "profile", "--hide-scrollbars",
                   "--window-size=1000,600", f"--screenshot={shot}")
    assert run.returncode == 0, run.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.fixture(scope="module")
def locked_playground(tiny_dirs):
    """The same server, wanting an API key."""
    engine = Engine.load(tiny_dirs["target"], tiny_dirs["target"], draft_dtype="bf16")
    with serve(engine, k=4, api_keys=("secret",)) as server:
        yield server


def test_the_page_asks_for_the_key(locked_playground, tmp_path):
    chromium()
    run = headless(f"{locked_playground.url}/?{urlencode(QUERY)}", tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    page = Page(run.stdout)
    assert page.state == "needs-key" and not page.spans


def test_the_page_streams_with_the_key(locked_playground, tmp_path):
    chromium()
    url = f"{locked_playground.url}/?{urlencode(QUERY)}#key=secret"  # a fragment: never sent to the server
    run = headless(url, tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    page = Page(run.stdout)
    assert page.state == "done", (page.state, page.ids.get("error"))
    expected = locked_playground.client(default_headers={"Authorization": "Bearer secret"}).completions.create(
        model=MODEL, prompt=QUERY["prompt"], max_tokens=32, temperature=0, extra_body={"speculative": {"k": 4}})
    assert "".join(text for _, text in page.spans) == expected.choices[0].text
