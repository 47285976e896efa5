"""The playground page at / in a real headless Chromium: it loads, streams a completion, and colours
each piece of text by how it came (accepted draft tokens or the target's own).

Skipped where no chromium binary exists, except in CI (CI=true), where .ci/run installs Debian's
chromium and a missing browser fails the test.
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from urllib.parse import urlencode

import pytest

from specdec.engine import Engine
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


class Page(HTMLParser):
    """The state of a dumped playground page: body data-state, the coloured spans, the stats."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.state: str | None = None
        self.spans: list[tuple[str, str]] = []  # (kind, text) in the output box
        self.ids: dict[str, str] = {}  # element id -> its text
        self._open: list[tuple[str | None, str | None]] = []  # (span kind, element id) per open element
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.state = attrs.get("data-state")
        classes = (attrs.get("class") or "").split()
        kind = next((c for c in ("accepted", "target") if c in classes), None) if "tok" in classes else None
        self._open.append((kind, attrs.get("id")))
        if kind and any(i == "out" for _, i in self._open):
            self.spans.append((kind, ""))

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        kind, element = self._open[-1] if self._open else (None, None)
        if kind and self.spans and any(i == "out" for _, i in self._open):
            self.spans[-1] = (kind, self.spans[-1][1] + data)
        if element:
            self.ids[element] = self.ids.get(element, "") + data


@pytest.fixture(scope="module")
def playground(tiny_dirs):
    """A server whose draft (the target's bf16 copy) is accepted mostly but not always."""
    engine = Engine.load(tiny_dirs["target"], tiny_dirs["target"], draft_dtype="bf16")
    with serve(engine, default_k=4) as server:
        yield server


def test_the_page_streams_a_coloured_completion(playground, tmp_path):
    chromium()
    url = f"{playground.url}/?{urlencode(QUERY)}"
    run = headless(url, tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    page = Page(run.stdout)
    assert page.state == "done", (page.state, page.ids.get("error"))
    kinds = {kind for kind, _ in page.spans}
    assert kinds == {"accepted", "target"}, page.spans  # both colours appear
    expected = playground.client().completions.create(
        model=MODEL, prompt=QUERY["prompt"], max_tokens=32, temperature=0, extra_body={"speculative": {"k": 4}})
    assert "".join(text for _, text in page.spans) == expected.choices[0].text
    assert page.ids["s-tokens"] == "32" and page.ids["s-finish"] == "length"
    assert page.ids["s-rate"].endswith("%") and page.ids["model"] == MODEL


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
    with serve(engine, default_k=4, api_keys=("secret",)) as server:
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
