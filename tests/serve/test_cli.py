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


def test_the_bound_socket_listens_before_the_server_starts():
    # the "serving ... at" line is printed once the socket is bound: a client that connects at once is
    # queued until the server accepts, not refused (seen: a test's first /health refused while uvicorn started)
    from specdec.serve.connections import bind

    sock = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()


@pytest.mark.parametrize("args, fragment", [
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit must be >= 1"),
    (["--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["-k", "0"], "--num-speculative-tokens"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid"),
    (["--memory-budget", "lots"], "--memory-budget: not a size: 'lots'"),
    (["--memory-budget", "4XB"], "--memory-budget: not a size"),
    (["--memory-budget", "0"], "--memory-budget: a size must be > 0"),
])
def test_bad_options(args, fragment):
    assert_user_error(serve("--target", "no-such-model", *args), fragment)


def test_replicas_without_ray_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the ray extra were not installed
    result = serve("--target", "no-such-model", "--replicas", "2")
    assert_user_error(result, "pip install 'specdec[ray]'")
    assert "--replicas needs Ray Serve" in result.output


@pytest.mark.parametrize("args, fragment", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "-1"], "--replicas takes a count N or a range MIN-MAX"),
    (["--replicas", "two"], "--replicas takes a count N or a range MIN-MAX"),
    (["--replicas", "1.5"], "--replicas takes a count N or a range MIN-MAX"),
    (["--replicas", "4-2"], "the maximum is below the minimum"),
    (["--replicas", "0-2"], "--replicas must be >= 1"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be > 0"),
    (["--ray-address", "auto"], "--ray-address and --replica-cpus go with --replicas"),
    (["--replica-cpus", "0.5"], "--ray-address and --replica-cpus go with --replicas"),
])
def test_bad_replica_options(args, fragment):
    assert_user_error(serve("--target", "no-such-model", *args), fragment)


def test_replicas_need_a_fixed_port():
    pytest.importorskip("ray.serve")
    assert_user_error(serve("--target", "no-such-model", "--replicas", "2", "--port", "0"), "needs a fixed --port")


def test_replicas_check_the_models_and_the_cpus_before_starting_ray(tiny_dirs):
    pytest.importorskip("ray.serve")
    # a local cluster: the model names and the CPUs are checked here, before Ray starts
    assert_user_error(serve("--target", "no-such-model", "--replicas", "2"), "no-such-model")
    assert_user_error(serve("--target", tiny_dirs["target"], "--draft", "none", "--replicas", "1-4096"),
                      "4096 replicas of 1 CPU each need 4096 CPUs")


def test_an_exposed_server_without_a_key_is_warned_of():
    # the target does not exist: the server never starts (the socket is only bound, then closed)
    result = serve("--target", "no-such-model", "--host", "0.0.0.0", "--port", "0")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "warning: listening on 0.0.0.0 without an API key" in result.output


@pytest.mark.parametrize("args, env", [
    (["--api-key", "secret"], {}),
    ([], {"SPECDEC_API_KEY": "secret other"}),
])
def test_a_key_silences_the_warning(args, env):
    result = runner.invoke(app, ["serve", "--target", "no-such-model", "--host", "0.0.0.0", "--port", "0", *args],
                           env=env)
    assert result.exit_code == 2 and "warning" not in result.output


def test_a_loopback_server_is_not_warned_of():
    assert "warning" not in serve("--target", "no-such-model", "--port", "0").output


def test_an_empty_key_is_refused():
    assert_user_error(serve("--target", "no-such-model", "--api-key", " , "), "--api-key is empty")


@pytest.mark.parametrize("args, fragment", [
    (["--header-timeout", "0"], "--header-timeout must be a number of seconds > 0"),
    (["--header-timeout", "nan"], "--header-timeout must be a number of seconds > 0"),
    (["--keep-alive-timeout", "-1"], "--keep-alive-timeout must be a number of seconds > 0"),
    (["--max-connections", "0"], "--max-connections must be >= 1"),
])
def test_bad_connection_options(args, fragment):
    assert_user_error(serve("--target", "no-such-model", *args), fragment)
