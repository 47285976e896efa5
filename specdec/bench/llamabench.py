"""llama.cpp's own ``llama-bench`` beside specdec's timings of the same GGUF file, on the same threads.

A number against llama.cpp means little unless both were measured on one machine in one stretch of
time: a shared VM's memory and clock move by a quarter from one minute to the next (BENCHMARKS.md).  So
every comparison here alternates the two sides in rounds, each round ours then one llama-bench run,
and reports medians over the rounds:

* ``specdec profile`` (:func:`forwards_beside`): our t(k) for every k of ``--ks`` and llama-bench's
  ``-p 1,2,4,8 -n 0 -d <prefix>`` (the ks that ``--ks`` holds, its smallest too), ``--repeats`` rounds.  A
  ``pp<k>`` test of llama-bench is one forward of k new tokens after its depth, so its ms per forward is
  k / (its tokens/s), what t(k) is on our side.
* ``specdec bench --decode-vs-llama-bench R`` (:func:`run_decode_bench`): 64 one-token forwards in a row
  from an empty cache on our side, llama-bench's ``-p 0 -n 64`` (tg64) on its side, ``--repeats`` runs of
  each per round; ms per token, their medians and ratio.
* the bench's machine block (:func:`run_llama_bench`): pp512 / tg64, after the run's servers stopped.

llama-bench is never run while a process the bench started (a llama-server) is alive
(specdec.bench.llamaserver.running): an idle server still holds memory and wakes its threads.

Its ``-o json`` output is a list of tests, each with ``n_prompt``, ``n_gen``, ``n_depth``, ``n_threads``,
``samples_ns`` (one per repetition: a pp test's forward, a tg test's n_gen forwards), ``avg_ts``,
``build_commit`` and ``model_type`` (:func:`parse_rows`).
"""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.llamaserver import BENCH, require_tool, running
from specdec.errors import SpecdecError
from specdec.runtime.profile import CostTable, decode_runs, measure_forwards

TIMEOUT_S = 600.0  # one llama-bench run (its model load and warm-up included)
PROFILE_KS = (1, 2, 4, 8)  # llama-bench's pp(k) beside `specdec profile`'s t(k)
DECODE_TOKENS = 64  # llama-bench's tg64: its standard decode test


@dataclass(frozen=True)
class Row:
    """One test of llama-bench's ``-o json`` output."""

    n_prompt: int
    n_gen: int
    n_depth: int
    threads: int
    samples_ns: tuple[int, ...]  # one per repetition
    avg_ts: float  # its tokens/s, the mean over the repetitions
    build: str
    model_type: str

    @property
    def test(self) -> str:
        """Its name as llama-bench's table prints it: "pp512", "tg64", "pp4 @ d128"."""
        name = f"pp{self.n_prompt}" if self.n_prompt and not self.n_gen else f"tg{self.n_gen}"
        return name + (f" @ d{self.n_depth}" if self.n_depth else "")

    def ms_per_forward(self) -> list[float]:
        """Each repetition's ms per forward: a pp test's whole time (one forward of n_prompt tokens), a tg
        test's over its n_gen one-token forwards."""
        steps = 1 if self.n_prompt and not self.n_gen else max(1, self.n_gen)
        return [ns / 1e6 / steps for ns in self.samples_ns]


def parse_rows(text: str) -> list[Row]:
    """llama-bench's ``-o json`` stdout as rows; a one-line SpecdecError for anything else."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError:
        raise SpecdecError(f"{BENCH} printed no JSON") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise SpecdecError(f"{BENCH}'s JSON is not a list of tests")
    try:
        return [Row(int(t["n_prompt"]), int(t["n_gen"]), int(t.get("n_depth", 0)), int(t["n_threads"]),
                    tuple(int(ns) for ns in t["samples_ns"]), float(t["avg_ts"]), str(t.get("build_commit", "")),
                    str(t.get("model_type", ""))) for t in tests]
    except (KeyError, TypeError, ValueError) as err:
        raise SpecdecError(f"{BENCH}'s JSON lacks a test's {err}") from None


def shown(model: Path, args: Sequence[str]) -> str:
    """The command line as a user would type it: the binary and the model file by name."""
    return shlex.join([BENCH, "-m", model.name, *args, "-o", "json"])


def run(model: Path, args: Sequence[str], timeout_s: float = TIMEOUT_S) -> list[Row]:
    """llama-bench -m `model` `args` -o json: its tests; a one-line SpecdecError where it is missing, fails,
    or would run beside a process this bench started and has not stopped."""
    binary = require_tool(BENCH)
    alive = running()
    if alive:
        raise SpecdecError(f"{BENCH} not run: {', '.join(alive)} started by this bench still runs (stop it first)")
    try:
        done = subprocess.run([str(binary), "-m", str(model), *args, "-o", "json"], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise SpecdecError(f"{BENCH} took more than {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecdecError(f"{BENCH} failed ({done.returncode}): {tail[:300]}")
    return parse_rows(done.stdout)


Runner = Callable[[Path, Sequence[str]], list[Row]]  # run's shape: what the tests give instead of the binary


def run_llama_bench(model: Path, threads: int, prompt: int = 512, generate: int = 64, repeats: int = 3,
                    run_tool: Runner = run) -> dict[str, Any]:
    """llama-bench's pp<prompt> and tg<generate> (tokens/s, its mean over `repeats`) for `model` at `threads`:
    {"pp512": ..., "tg64": ..., "command": "...", "build": "..."}; a SpecdecError (one line) where it fails."""
    args = ["-t", str(threads), "-p", str(prompt), "-n", str(generate), "-r", str(repeats)]
    out: dict[str, Any] = {"command": shown(model, args)}
    for row in run_tool(model, args):
        out[row.test] = row.avg_ts
        out["build"] = row.build
    return out


# --- `specdec profile`: t(k) beside llama-bench's pp(k) ------------------------------------------------


@dataclass
class ForwardsBeside:
    """Our t(k) and llama-bench's pp(k) at the same depth, round by round (ours first in each): ms per
    forward of k new tokens."""

    ours: dict[int, list[float]]  # k -> our ms in each round
    peer: dict[int, list[float]]  # k -> llama-bench's, for the ks it ran
    prefix: int  # tokens cached before each forward: llama-bench's depth
    threads: int
    command: str
    build: str = ""
    error: str | None = None  # llama-bench's one line where a round failed; our rounds went on alone

    def table(self) -> CostTable:
        """Our side as `specdec profile` reports it: the median over the rounds."""
        rounds = max(len(v) for v in self.ours.values())
        return CostTable({k: statistics.median(v) for k, v in self.ours.items()}, self.prefix, rounds)

    def peer_ms(self) -> dict[int, float]:
        return {k: statistics.median(v) for k, v in self.peer.items() if v}

    def peer_ratio(self) -> dict[int, float]:
        """llama-bench's t(k) / t(smallest k): what verifying k tokens costs it in one-token steps."""
        ms = self.peer_ms()
        return {k: v / ms[min(ms)] for k, v in ms.items()} if ms else {}

    def to_dict(self) -> dict[str, Any]:
        ms, ratio = self.peer_ms(), self.peer_ratio()
        return {"command": self.command, "build": self.build, "threads": self.threads, "depth": self.prefix,
                "rounds": max(len(v) for v in self.ours.values()),
                "ms": {str(k): round(v, 3) for k, v in ms.items()},
                "ratio": {str(k): round(v, 3) for k, v in ratio.items()},
                "ms_by_round": {str(k): [round(x, 3) for x in v] for k, v in self.peer.items()},
                "ours_ms_by_round": {str(k): [round(x, 3) for x in v] for k, v in self.ours.items()},
                **({"error": self.error} if self.error else {})}


def peer_ks(ks: Sequence[int]) -> list[int]:
    """The ks llama-bench times beside `ks`: those of 1, 2, 4, 8 that `ks` holds, and its smallest (the ratios'
    base on both sides)."""
    return sorted({min(ks)} | (set(ks) & set(PROFILE_KS)))


def forwards_beside(runner: Any, model: Path, ks: Sequence[int], prefix: int, rounds: int, threads: int,
                    run_tool: Runner = run, tick: Callable[[str], None] | None = None) -> ForwardsBeside:
    """`rounds` rounds of our t(k) for every k of `ks` (one forward each, interleaved, after `prefix` tokens:
    measure_forwards) then one llama-bench run of pp(k) for peer_ks(ks) at depth `prefix` on `threads`."""
    wanted = peer_ks(ks)
    args = ["-t", str(threads), "-p", ",".join(map(str, wanted)), "-n", "0", "-d", str(prefix), "-r", "1"]
    found = ForwardsBeside({k: [] for k in sorted(set(ks))}, {k: [] for k in wanted}, prefix, threads,
                           shown(model, args))
    for r in range(rounds):
        if tick is not None:
            tick(f"round {r + 1} of {rounds}")
        for k, ms in measure_forwards(runner, ks, prefix=prefix, repeats=1).ms.items():
            found.ours[k].append(ms)
        if found.error is not None:
            continue
        try:
            rows = run_tool(model, args)
        except SpecdecError as err:
            found.error = str(err)
            continue
        for row in rows:
            if row.n_prompt in found.peer and not row.n_gen:
                found.peer[row.n_prompt] += row.ms_per_forward()
                found.build = row.build
    return found


# --- `specdec bench --decode-vs-llama-bench R`: the one-token step beside llama-bench's tg64 ----------------


def decode_rounds(runner: Any, model: Path, rounds: int, repeats: int, threads: int, run_tool: Runner = run,
                  tick: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """`rounds` records, each: our `repeats` runs of DECODE_TOKENS one-token forwards from an empty cache
    (decode_runs), then one llama-bench -p 0 -n DECODE_TOKENS -r `repeats`; ms per token on both sides."""
    args = ["-t", str(threads), "-p", "0", "-n", str(DECODE_TOKENS), "-r", str(repeats)]
    records = []
    for r in range(1, rounds + 1):
        if tick is not None:
            tick(f"round {r} of {rounds}")
        ours = decode_runs(runner, DECODE_TOKENS, prefix=0, repeats=repeats)
        tests = [row for row in run_tool(model, args) if row.n_gen == DECODE_TOKENS and not row.n_prompt]
        if not tests:
            raise SpecdecError(f"{BENCH} gave no tg{DECODE_TOKENS} test")
        records.append({"round": r, "specdec_ms_per_token": ours, "llama_bench_ms_per_token": tests[0].ms_per_forward(),
                        "llama_bench_samples_ns": list(tests[0].samples_ns), "llama_bench_build": tests[0].build})
    return records


def decode_summary(records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The medians over every run of each side, tokens/s, their ratio (llama-bench's ms per token over ours:
    above 1, our step is the faster) and each round's ratio (of the round's medians)."""
    ours = [x for r in records for x in r["specdec_ms_per_token"]]
    peer = [x for r in records for x in r["llama_bench_ms_per_token"]]
    by_round = [statistics.median(r["llama_bench_ms_per_token"]) / statistics.median(r["specdec_ms_per_token"])
                for r in records]
    ours_ms, peer_ms = statistics.median(ours), statistics.median(peer)
    return {"specdec": {"ms_per_token": ours_ms, "tokens_per_s": 1000 / ours_ms, "least": min(ours), "most": max(ours),
                        "runs": len(ours)},
            "llama_bench": {"ms_per_token": peer_ms, "tokens_per_s": 1000 / peer_ms, "least": min(peer),
                            "most": max(peer), "runs": len(peer)},
            "ratio": peer_ms / ours_ms, "ratio_by_round": by_round, "meta": meta}


def decode_markdown(summary: dict[str, Any], records: Sequence[dict[str, Any]]) -> str:
    """summary.md of the decode comparison."""
    m, ours, peer = summary["meta"], summary["specdec"], summary["llama_bench"]
    spread = summary["ratio_by_round"]
    lines = [f"# One-token decode: specdec beside llama-bench tg{DECODE_TOKENS} ({m['cpu']})", "",
             f"- target `{m['target']}`, file `{m['file']}` ({m['types']})",
             f"- specdec: {m['specdec']} on {m['threads']} threads; llama-bench build {m['build']} on {m['threads']} "
             f"threads: `{m['command']}`",
             f"- {m['rounds']} rounds, each {m['repeats']} run(s) of ours then one llama-bench run of {m['repeats']} "
             f"repetition(s): {DECODE_TOKENS} one-token forwards in a row from an empty cache on both sides "
             f"(llama-bench's own warm-up before its runs, one untimed step before ours); {m['date_utc']} UTC", "",
             "| | ms per token (median) | tokens/s | least | most | runs |", "|:---|---:|---:|---:|---:|---:|"]
    for name, side in (("specdec", ours), (f"llama-bench tg{DECODE_TOKENS}", peer)):
        lines.append(f"| {name} | {side['ms_per_token']:.2f} | {side['tokens_per_s']:.1f} | {side['least']:.2f} | "
                     f"{side['most']:.2f} | {side['runs']} |")
    lines += ["", f"llama-bench's ms per token ÷ specdec's: **{summary['ratio']:.2f}×** (above 1: specdec's step "
              f"is the faster); per round {min(spread):.2f}–{max(spread):.2f}.", "",
              "| round | specdec ms/token | llama-bench ms/token | ratio |", "|---:|---:|---:|---:|"]
    for record, ratio in zip(records, spread, strict=True):
        lines.append(f"| {record['round']} | {statistics.median(record['specdec_ms_per_token']):.2f} | "
                     f"{statistics.median(record['llama_bench_ms_per_token']):.2f} | {ratio:.2f}× |")
    return "\n".join(lines) + "\n"


@dataclass
class DecodeBench:
    """What `specdec bench --decode-vs-llama-bench` runs: the target's runner and file, and how."""

    runner: Any  # the target's ModelRunner
    model: Path  # the target's GGUF file, llama-bench's -m
    threads: int
    rounds: int
    repeats: int
    meta: dict[str, Any] = field(default_factory=dict)  # target, file, types, specdec's runner, cpu


def check_counts(rounds: int, repeats: int) -> None:
    if rounds < 1:
        raise SpecdecError(f"--decode-vs-llama-bench takes the number of rounds, at least 1; got {rounds}")
    if repeats < 1:
        raise SpecdecError(f"--repeats must be >= 1, got {repeats}")


def write_decode_bench(setup: DecodeBench, out: Path, run_tool: Runner = run,
                       tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the rounds; write results.jsonl (a record per round), summary.json and summary.md into `out`;
    return the summary."""
    check_counts(setup.rounds, setup.repeats)
    records = decode_rounds(setup.runner, setup.model, setup.rounds, setup.repeats, setup.threads, run_tool, tick)
    args = ["-t", str(setup.threads), "-p", "0", "-n", str(DECODE_TOKENS), "-r", str(setup.repeats)]
    meta = {**setup.meta, "threads": setup.threads, "rounds": setup.rounds, "repeats": setup.repeats,
            "tokens": DECODE_TOKENS, "command": shown(setup.model, args), "build": records[0]["llama_bench_build"],
            "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M")}
    summary = decode_summary(records, meta)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.jsonl").open("w", encoding="utf-8") as sink:
        for record in records:
            sink.write(json.dumps(record) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(decode_markdown(summary, records), encoding="utf-8")
    return summary


def target_file(target: str, progress: Any = None) -> Path:
    """The target's GGUF file (a zoo name, pulled on first use, or a .gguf path), which llama-bench reads; a
    one-line SpecdecError for a target that is none, or without llama-bench."""
    from specdec.runtime.loading import gguf_file, resolve

    require_tool(BENCH)
    if resolve(target)[0] not in ("zoo", "gguf"):
        raise SpecdecError(f"{BENCH} reads GGUF files: give the target as a zoo name or a .gguf file, not '{target}'")
    return gguf_file(target, progress)


def profile_file(target: str, wanted: bool | None, progress: Any = None) -> Path | None:
    """The GGUF file `specdec profile` times llama-bench on: None where not `wanted`, or by default (None) where
    llama-bench is not built or the target is no GGUF; a one-line SpecdecError where asked for and impossible."""
    if wanted is False:
        return None
    try:
        return target_file(target, progress)
    except SpecdecError:
        if wanted:
            raise
        return None


def run_decode_bench(config: Any, rounds: int, repeats: int, out: Path, tick: Callable[[str], None] | None = None,
                     progress: Any = None) -> dict[str, Any]:
    """`specdec bench --decode-vs-llama-bench`: `config`'s target (an EngineConfig's; its draft is not loaded)
    beside llama-bench on its GGUF file, on the same threads; the files in `out` (write_decode_bench)."""
    from dataclasses import replace

    import torch

    from specdec.machine import cpu_description
    from specdec.native.gguf import GGUFFile
    from specdec.runtime.engine import Engine

    check_counts(rounds, repeats)
    model = target_file(config.target, progress)
    if tick is not None:
        tick(f"loading {config.target}")
    engine = Engine.from_config(replace(config, draft=None), progress)
    runner = engine.target_runner
    who = runner.identity()
    meta = {"target": config.target, "file": str(model), "types": GGUFFile(model).weight_types(),
            "specdec": f"{who['backend']}, {engine.dtype}", "cpu": cpu_description()}
    setup = DecodeBench(runner, model, config.threads or torch.get_num_threads(), rounds, repeats, meta)
    return write_decode_bench(setup, out, tick=tick)
