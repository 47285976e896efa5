"""llama.cpp's own server as a peer in ``specdec bench``: the process, its HTTP API, its tools.

A CPU user who wants faster decoding today runs ``llama-server``, plain or with its own speculation: a
draft model (``-md``; speculative decoding, Leviathan et al. 2023) or n-gram drafts taken from the text
itself (``--spec-type ngram-mod``; prompt lookup, Saxena 2023).  The bench starts one such server per
method, once per run, on 127.0.0.1, and sends it the very token ids our methods get (the prompt after the
chat template) through its ``/completion`` endpoint, one request at a time, as a single client would:

* greedy (temperature 0) or the run's sampling settings, with llama.cpp's other samplers turned off
  (its defaults add top-k 40 and min-p 0.05, which would sample another distribution than ours);
* ``cache_prompt`` off: every request prefills its whole prompt, as our methods do (the bench's
  ``before_session`` empties our caches);
* timed around the whole HTTP call by the harness; prefill and decode from the server's own
  ``timings`` (``prompt_ms``), drafted and accepted tokens from ``draft_n`` / ``draft_n_accepted``.

The binaries come from ``scripts/install-llamacpp.sh --server`` (built from the llama.cpp tree that
llama-cpp-python vendors, into ``$SPECDEC_HOME/bin``) or from PATH.  ``llama-bench`` is run by
:mod:`specdec.bench.llamabench`, never beside a server started here (:func:`running`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specdec import zoo
from specdec.algorithm.sampling import SamplingParams
from specdec.errors import SpecdecError

SERVER = "llama-server"
BENCH = "llama-bench"
BUILD_HINT = "build it with scripts/install-llamacpp.sh --server (into $SPECDEC_HOME/bin) or put it on PATH"
START_TIMEOUT_S = 300.0  # loading a 1.5B and its draft, and llama-server's warm-up run, on two slow cores
REQUEST_TIMEOUT_S = 1800.0
SERVER_CTX = 8192  # the KV cache the server allocates: the bench's longest prompt and answer, with room


def find_tool(name: str) -> Path | None:
    """`name` (llama-server, llama-bench) as the install script leaves it in $SPECDEC_HOME/bin, else on PATH."""
    built = zoo.home() / "bin" / name
    if built.is_file() and os.access(built, os.X_OK):
        return built
    found = shutil.which(name)
    return Path(found) if found else None


def require_tool(name: str) -> Path:
    path = find_tool(name)
    if path is None:
        raise SpecdecError(f"{name} not found: {BUILD_HINT}")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The /completion fields that make llama.cpp sample what our warp samples (specdec.algorithm.sampling): greedy at
    temperature 0; else temperature, top-k (0 = off) and top-p alone, every other sampler of its chain off."""
    if sampling.greedy:
        return {"temperature": 0.0}
    fields: dict[str, Any] = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                              "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                              "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
                              "top_n_sigma": -1.0}
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    return fields


def last_words(output: str) -> str:
    """What a process that failed said last: its last line naming an error, else its last line (300 characters
    at most); "" for no output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[-1][:300]


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float, poll_s: float, name: str,
                 log: Callable[[], str]) -> None:
    """Return once `url`/health answers 200 (llama-server's convention, which specdec serve follows), polled
    every `poll_s`; a one-line SpecdecError naming `name`, with log()'s last words, where the process exits or
    `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SpecdecError(f"{name} exited ({process.returncode}) before it was ready: {log() or 'no output'}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while it loads
        time.sleep(poll_s)
    raise SpecdecError(f"{name} was not ready after {timeout_s:.0f} s: {log() or 'no output'}")


# The processes a bench started with spawn() and has not stopped: llama-bench times the machine only once
# none runs (specdec.bench.llamabench), as an idle llama-server still holds its threads' memory and wakes.
_STARTED: dict[int, tuple[subprocess.Popen, str]] = {}  # pid -> (the process, its binary's name)


def spawn(command: Sequence[str], **options: Any) -> subprocess.Popen:
    """subprocess.Popen(command, **options), kept among the processes started (running()) until stop()."""
    process = subprocess.Popen(list(command), **options)
    _STARTED[process.pid] = (process, Path(command[0]).name)
    return process


def running() -> list[str]:
    """The names of the processes spawn() started that have not ended (stopped or not)."""
    for pid, (process, _) in list(_STARTED.items()):
        if process.poll() is not None:
            del _STARTED[pid]
    return [name for _, name in _STARTED.values()]


def stop(process: subprocess.Popen, timeout_s: float = 15) -> None:
    """Terminate `process` if it still runs, killed where it has not ended after `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    _STARTED.pop(process.pid, None)


class LlamaServer:
    """One llama-server process on 127.0.0.1: started at construction (ready when /health says 200),
    stopped by close().  `args`: its arguments after the binary, the port left to this class."""

    def __init__(self, binary: Path, args: Sequence[str], start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.port = free_port()
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.command = [str(binary), *self.args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
        self.process: subprocess.Popen[bytes] | None = spawn(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def shown_command(self) -> str:
        """The command line as a user would type it (the binary by name, the port as chosen)."""
        return shlex.join([Path(self.command[0]).name, *self.args])

    def _last_log_line(self) -> str:
        try:
            return last_words(Path(self.log.name).read_text(errors="replace"))
        except OSError:
            return ""

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        wait_healthy(self.process, self.url, timeout_s, 0.25, SERVER, self._last_log_line)

    def complete(self, prompt_ids: Sequence[int], n_predict: int, sampling: SamplingParams) -> dict[str, Any]:
        """POST /completion with the prompt's token ids; the server's JSON answer."""
        body = {"prompt": list(prompt_ids), "n_predict": n_predict, "cache_prompt": False, "return_tokens": True,
                "stream": False, **sampling_fields(sampling)}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise SpecdecError(f"{SERVER} answered {err.code}: {err.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as err:
            raise SpecdecError(f"{SERVER} stopped answering ({err}): {self._last_log_line()}") from None

    def close(self) -> None:
        if self.process is not None:
            stop(self.process)
        self.process = None
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

