"""`specdec serve`'s one-line errors (its serving itself: test_load.py runs it as a subprocess)."""

from __future__ import annotations

import socket
import sys

import pytest
from typer.testing import CliRunner

from specdec.cli import app

runner = CliRunner()


def serve(*args: str):
    return runner.invoke(app, ["serve", *args])


def assert_user_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert fragment in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_without_the_serve_extra_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if it were not installed
    assert_user_error(serve("--target", "whatever"), "pip install 'specdec[serve]'")


def test_a_port_in_use_fails_before_any_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the target does not exist: the port is checked first
        assert_user_error(serve("--target", "no-such-model", "--port", str(port)), "already in use")


@pytest.mark.parametrize("args, fragment", [
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit must be >= 1"),
    (["--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["-k", "0"], "--num-speculative-tokens"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid"),
])
def test_bad_options(args, fragment):
    assert_user_error(serve("--target", "no-such-model", *args), fragment)
