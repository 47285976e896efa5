"""`specdec bench --startup` (specdec.bench.startup): launches timed to their exit or their /health 200, in
interleaved rounds after a warm-up one, with the run's model options; a failing launch is one line."""

import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.bench.startup import Case, cases, run_rounds, summarize, time_case
from specdec.cli import app
from specdec.engine_config import EngineConfig
from specdec.errors import SpecdecError

FAKE_SERVER = str(Path(__file__).with_name("fake_llama_server.py"))
SERVER_PORT = ("--host", "127.0.0.1", "--port")


def test_a_command_is_timed_to_its_exit():
    took = time_case(Case("sleep", (sys.executable, "-c", "import time; time.sleep(0.3)")))
    assert 0.3 <= took < 30


def test_a_server_is_timed_to_its_health_200_then_stopped(monkeypatch):
    launched = []
    import subprocess

    real = subprocess.Popen

    def popen(command, **kwargs):
        launched.append(command)
        return real(command, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    took = time_case(Case("fake", (sys.executable, FAKE_SERVER, "-m", "model.gguf"), server=True,
                          port_flags=SERVER_PORT))
    assert 0 < took < 60
    port = launched[0][-1]
    time.sleep(0.2)
    with pytest.raises((urllib.error.URLError, OSError)):  # stopped: nothing listens there any more
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)


def test_a_failing_launch_is_one_line_with_its_last_words(monkeypatch):
    with pytest.raises(SpecdecError, match="'boom' exited \\(1\\): no such model"):
        time_case(Case("boom", (sys.executable, "-c", "import sys; sys.exit('no such model')")))
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "fail")
    with pytest.raises(SpecdecError, match="'fake' exited \\(1\\) before it was ready: llama_model_load: error loading model"):
        time_case(Case("fake", (sys.executable, FAKE_SERVER, "-m", "x"), server=True, port_flags=SERVER_PORT))


def test_rounds_are_interleaved_after_a_warm_up_that_is_not_kept():
    ran, ticks = [], []
    clock = iter(range(100))
    found = [Case("a", ("a",)), Case("b", ("b",))]
    seconds = run_rounds(found, 2, time_one=lambda case: ran.append(case.name) or float(next(clock)),
                         tick=ticks.append)
    assert ran == ["a", "b"] * 3
    assert seconds == {"a": [2.0, 4.0], "b": [3.0, 5.0]}  # the warm-up's 0 and 1 dropped
    assert ticks == ["warm-up round (what a first run pulls and caches)", "round 1 of 2", "round 2 of 2"]
    assert summarize(seconds)[0] == {"case": "a", "median_s": 3.0, "min_s": 2.0, "max_s": 4.0, "runs": 2}
    with pytest.raises(SpecdecError, match="at least 1"):
        run_rounds(found, 0)


def test_the_cases_carry_the_runs_models_and_llama_servers_where_it_runs():
    config = EngineConfig(target="t.gguf", draft="lookup", threads=2)
    found = {case.name: case for case in cases(config)}
    assert set(found) == {'python -c "import specdec"', "specdec --help", "specdec generate -n 1",
                          "specdec generate -n 1 --draft none", "specdec serve", "specdec serve --draft none"}
    generate = found["specdec generate -n 1"].command
    assert generate[-6:] == ("--target", "t.gguf", "--draft", "lookup", "--threads", "2")
    assert found["specdec serve --draft none"].command[-6:] == ("--target", "t.gguf", "--draft", "none", "--threads", "2")
    assert found["specdec serve"].server and not found["specdec --help"].server
    servers = {case.name: case for case in cases(config, Path("llama-server"), Path("t.gguf"), Path("d.gguf"), 2)}
    assert servers["llama-server"].command == ("llama-server", "-m", "t.gguf", "-t", "2")
    assert servers["llama-server -md <draft>"].command[-2:] == ("-md", "d.gguf")
    assert "llama-server -md <draft>" not in {case.name for case in cases(config, Path("s"), Path("t.gguf"))}
    plain = [case.name for case in cases(EngineConfig(draft="none"))]  # no drafter: no second plain case
    assert plain == ['python -c "import specdec"', "specdec --help", "specdec generate -n 1", "specdec serve"]


def test_a_case_that_does_not_end_is_one_line():
    with pytest.raises(SpecdecError, match="'hang' did not end in 1 s"):
        time_case(Case("hang", (sys.executable, "-c", "import time; time.sleep(30)")), timeout_s=1)


def test_the_cli_takes_rounds_and_refuses_what_does_not_go_with_them(tmp_path, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--startup", "1", "--concurrency", "1,2"])
    assert result.exit_code == 2 and "--startup times launches" in result.output
    import specdec.bench.startup as startup

    monkeypatch.setattr(startup, "find_tool", lambda name: pytest.fail("no work before the rounds are checked"))
    result = runner.invoke(app, ["bench", "--startup", "0", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "at least 1; got 0" in result.output
