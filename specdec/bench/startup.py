"""`specdec bench --startup N`: how long a user waits before anything happens, beside llama.cpp's server.

Every case is a fresh process, timed by its wall clock from launch: a command until it exits, a server until
its ``/health`` answers 200 (polled every 50 ms; llama-server's convention, which ``specdec serve`` follows),
then stopped.  The cases, with the run's model options (``--target``, ``--draft``, ...):

- ``python -c "import specdec"`` and ``specdec --help``;
- ``specdec generate "def add(a, b):" -n 1``, with the run's drafter and with ``--draft none``;
- ``specdec serve``, both ways;
- where llama-server is built and the target is a GGUF: ``llama-server -m <target> -t <threads>`` and, where
  the draft model is a GGUF too, with ``-md <draft>`` (its own speculation) -- launched as a user types them,
  its other settings its defaults.

A warm-up round (every model pulled and every cache made) is not counted; then N rounds, each running every
case once in turn, so that the machine's drift over the minutes falls on every case alike (interleaved, as
the other benches compare methods).  Reported: each case's median, least and most seconds, the CPU named, and
the phases of one ``generate --timings`` run after the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdec.bench.llamaserver import SERVER, find_tool, free_port, last_words, spawn, stop, wait_healthy
from specdec.engine_config import EngineConfig, command_line, feeds_heads
from specdec.errors import SpecdecError

PROMPT = "def add(a, b):"
POLL_S = 0.05  # between two /health polls (each a request the loading server answers)
TIMEOUT_S = 600.0  # a case's most seconds (a first pull of a model, on two slow cores, is the warm-up's)


@dataclass(frozen=True)
class Case:
    """One thing a user launches: `command`, timed to its exit, or with `server` to its /health 200 (a free
    port given after `port_flags`)."""

    name: str
    command: tuple[str, ...]
    server: bool = False
    port_flags: tuple[str, ...] = ("--port",)


def specdec_command() -> tuple[str, ...]:
    """The `specdec` command as a user runs it: the console script beside this Python, else the module."""
    script = Path(sys.executable).with_name("specdec")
    return (str(script),) if script.is_file() else (sys.executable, "-m", "specdec.cli")


def cases(config: EngineConfig, llama_server: Path | None = None, target_gguf: Path | None = None,
          draft_gguf: Path | None = None, threads: int | None = None) -> list[Case]:
    """The cases for `config`'s models; llama-server's where its binary and the target's GGUF are given."""
    specdec = specdec_command()
    models = tuple(command_line(config))
    plain = tuple(command_line(replace(config, draft=None)))
    found = [Case('python -c "import specdec"', (sys.executable, "-c", "import specdec")),
             Case("specdec --help", (*specdec, "--help")),
             Case("specdec generate -n 1", (*specdec, "generate", PROMPT, "-n", "1", *models)),
             Case("specdec generate -n 1 --draft none", (*specdec, "generate", PROMPT, "-n", "1", *plain)),
             Case("specdec serve", (*specdec, "serve", *models), server=True),
             Case("specdec serve --draft none", (*specdec, "serve", *plain), server=True)]
    if config.draft is None:  # the run's drafter is none: its cases are the plain ones
        found = [case for case in found if not case.name.endswith("--draft none")]
    if llama_server is not None and target_gguf is not None:
        base = (str(llama_server), "-m", str(target_gguf), "-t", str(threads or os.cpu_count() or 1))
        found.append(Case("llama-server", base, server=True, port_flags=("--host", "127.0.0.1", "--port")))
        if draft_gguf is not None:
            found.append(Case("llama-server -md <draft>", (*base, "-md", str(draft_gguf)), server=True,
                              port_flags=("--host", "127.0.0.1", "--port")))
    return found


def _failed(case: Case, output: str, code: int | None) -> SpecdecError:
    return SpecdecError(f"start-up case '{case.name}' exited ({code}): {last_words(output) or 'no output'}")


def time_case(case: Case, timeout_s: float = TIMEOUT_S) -> float:
    """Seconds from launching `case` to its exit (a command) or to its /health 200 (a server, then stopped);
    a SpecdecError with its last words where it fails."""
    if not case.server:
        start = time.perf_counter()
        try:
            done = subprocess.run(case.command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise SpecdecError(f"start-up case '{case.name}' did not end in {timeout_s:.0f} s") from None
        took = time.perf_counter() - start
        if done.returncode != 0:
            raise _failed(case, done.stdout + done.stderr, done.returncode)
        return took
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:  # its output, read back only if it fails (a pipe could fill)

        def said() -> str:
            log.seek(0)
            return last_words(log.read())

        start = time.perf_counter()
        process = spawn([*case.command, *case.port_flags, str(port)], stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT)
        try:
            wait_healthy(process, f"http://127.0.0.1:{port}", timeout_s, POLL_S, f"start-up case '{case.name}'", said)
            return time.perf_counter() - start
        finally:
            stop(process, 30)


def check_rounds(rounds: int) -> None:
    if rounds < 1:
        raise SpecdecError(f"--startup takes the number of rounds, at least 1; got {rounds}")


def run_rounds(found: Sequence[Case], rounds: int, time_one: Callable[[Case], float] = time_case,
               tick: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Every case once per round, in turn, after a warm-up round that is not kept: case name -> seconds."""
    check_rounds(rounds)
    seconds: dict[str, list[float]] = {case.name: [] for case in found}
    for r in range(rounds + 1):
        if tick is not None:  # once a round: the bench's own process stays quiet while a case runs
            tick("warm-up round (what a first run pulls and caches)" if r == 0 else f"round {r} of {rounds}")
        for case in found:
            took = time_one(case)
            if r > 0:
                seconds[case.name].append(took)
    return seconds


def phases(config: EngineConfig) -> str | None:
    """The `timings:` line of one `generate --timings` run (where start-up went), None where it gave none."""
    try:
        done = subprocess.run([*specdec_command(), "generate", PROMPT, "-n", "1", "--timings", *command_line(config)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None
    lines = [line for line in done.stderr.splitlines() if line.startswith("timings:")]
    return lines[-1] if lines else None


def summarize(seconds: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [{"case": name, "median_s": statistics.median(runs), "min_s": min(runs), "max_s": max(runs),
             "runs": len(runs)} for name, runs in seconds.items() if runs]


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Start-up, every model cached ({meta['cpu']}, {meta['cpus']} CPUs: {', '.join(meta['features'])})", "",
             f"Wall seconds from launch to exit, or to `/health` 200 for a server; {meta['rounds']} interleaved "
             f"rounds after a warm-up one. Models: `{' '.join(meta['models']) or 'the defaults'}`.", "",
             "| case | median | least | most |", "|---|---:|---:|---:|"]
    lines += [f"| `{r['case']}` | {r['median_s']:.2f} s | {r['min_s']:.2f} s | {r['max_s']:.2f} s |" for r in rows]
    if meta.get("phases"):
        lines += ["", f"Phases of one `generate -n 1 --timings`: `{meta['phases']}`"]
    return "\n".join(lines) + "\n"


def run_startup_bench(config: EngineConfig, rounds: int, out: Path,
                      tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The start-up bench for `config`'s models (see the module doc); summary.md and summary.json in `out`."""
    from specdec.bench.runner import server_files
    from specdec.drafters.spec import resolve_drafter, split_drafter
    from specdec.machine import cpu_info

    check_rounds(rounds)
    llama_server, target_gguf, draft_gguf = find_tool(SERVER), None, None
    if llama_server is not None:
        _, draft_model, _ = split_drafter(resolve_drafter(config.draft, config.target, feeds_heads(config.backend)))
        try:
            target_gguf, draft_gguf = server_files(["llama-server"], config.target, draft_model)
        except SpecdecError:  # a target that is no GGUF: no llama-server cases
            pass
    found = cases(config, llama_server, target_gguf, draft_gguf, config.threads)
    seconds = run_rounds(found, rounds, tick=tick)
    info = cpu_info()
    meta = {"cpu": info["name"], "cpus": info["cpus"], "features": info["features"], "rounds": rounds,
            "models": command_line(config), "phases": phases(config),
            "commands": {case.name: list(case.command) for case in found}}
    rows = summarize(seconds)
    data = {"meta": meta, "rows": rows, "seconds": seconds}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))
    (out / "summary.md").write_text(markdown(rows, meta))
    return data

