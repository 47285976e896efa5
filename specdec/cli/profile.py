"""`specdec profile`: where the hardware speaks.  The target's t(k) for k new tokens (beside llama-bench's where it
is built), its one-token step against the memory's read bandwidth, its prefill speed, the draft's and a draft
head's cost per drafted token; the controller's cached step costs renewed last."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from specdec.cli.common import PullProgress, fail, load_engine, quiet_libraries, status
from specdec.cli.options import engine_options
from specdec.engine_config import HF, EngineConfig
from specdec.errors import SpecdecError


@engine_options(
    "target", "draft", "dtype", "draft_dtype", "backend", "device", "draft_backend", "n_ctx", "threads", "draft_vocab",
    draft={"default": "none", "help": "Draft model to time per drafted token, 'head' or 'head:<dir>' (a draft head: timed anyway when one was trained for the target), or 'none'."},
    draft_dtype={"help": "The draft's dtype (default: --dtype)."},
    backend={"help": "Target's backend: hf or llamacpp."},
    draft_backend={"help": "Draft's backend, as for generate (the same default: auto)."},
    threads={"help": "CPU threads for torch and llama.cpp."},
)
def profile(
    models: EngineConfig = None,  # type: ignore[assignment]  # the model options (engine_options), no --suffix-memory
    ks: str = typer.Option("1-16", "--ks", help="Numbers of new tokens per target forward to time: a range (1-16) or a list (1,2,4,8)."),
    prefix: int = typer.Option(128, "--prefix", help="Tokens in the cache before each timed forward."),
    repeats: int = typer.Option(3, "--repeats", help="Timings per k (the rounds, where llama-bench runs beside); the median is reported."),
    prefill: str = typer.Option("512,2048", "--prefill", help="Prompt lengths whose prefill tokens/s to measure (a list, or 'none')."),
    roof: bool = typer.Option(True, "--roof/--no-roof", help="Measure the memory's read bandwidth and the one-token step against its roof."),
    llama_bench: bool | None = typer.Option(None, "--llama-bench/--no-llama-bench", help="Time llama.cpp's llama-bench pp1, pp2, pp4, pp8 on the target's GGUF file (same threads, --prefix as its depth) beside t(k), in --repeats rounds alternated with ours (default: where llama-bench is built and the target is a GGUF)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {target: {...}, draft: {...}}."),
) -> None:
    """Measure forward costs: the target's t(k) for k new tokens (beside llama-bench's where it is built), its
    one-token step against the memory's roof, its prefill speed, and the draft's cost per drafted token."""
    from specdec.bench.llamabench import profile_file
    from specdec.runtime.head_cost import split_head_spec

    quiet_libraries()
    progress = PullProgress()
    try:
        k_values, lengths = profile_plan(ks, prefill, prefix, repeats, models.threads)
        peer = profile_file(models.target, llama_bench, progress)
        draft_spec, _ = split_head_spec(models.draft)  # a head is timed below
        engine = load_engine(dataclasses.replace(models, draft=draft_spec), progress)
        found = measure_profile(engine, models, draft_spec, k_values, lengths, prefix, repeats, roof, peer)
    except (SpecdecError, ValueError) as e:
        progress.close()
        fail(str(e))
    if as_json:
        print(json.dumps(found.out))
        return
    print_profile(found, models.target, draft_spec)


def profile_plan(ks: str, prefill: str, prefix: int, repeats: int, threads: int | None) -> tuple[list[int], list[int]]:
    """profile's --ks and --prefill parsed, its counts checked: (the k values, the prefill lengths); a SpecdecError
    for anything else."""
    k_values = _parse_ks(ks)
    lengths = [] if prefill.strip().lower() == "none" else _parse_lengths(prefill, "--prefill")
    if prefix < 1 or repeats < 1:
        raise SpecdecError("--prefix and --repeats must be >= 1")
    if threads is not None and threads < 1:
        raise SpecdecError(f"--threads must be >= 1, got {threads}")
    return k_values, lengths


def _parse_ks(text: str) -> list[int]:
    """"1-16" or "1,2,4,8" -> [1, ..]; a SpecdecError for anything else."""
    ks: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise SpecdecError(f"--ks: '{part.strip()}' is not a number or a range like 1-16") from None
        if a < 1 or b < a:
            raise SpecdecError(f"--ks: '{part.strip()}' must be positive and increasing")
        ks.update(range(a, b + 1))
    return sorted(ks)


def _parse_lengths(text: str, option: str) -> list[int]:
    """"512,2048" -> [512, 2048]; a SpecdecError for anything but positive numbers."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise SpecdecError(f"{option}: '{text}' is not a list of numbers like 512,2048") from None
    if any(v < 1 for v in values):
        raise SpecdecError(f"{option}: lengths must be >= 1, got {text}")
    return sorted(set(values))


@dataclasses.dataclass
class Profiled:
    """What specdec profile measured; `out` is its JSON form."""

    table: Any  # specdec.runtime.profile.CostTable: the target's t(k), its `info` the machine and model
    roof: Any  # specdec.runtime.profile.Roof, or None (not measured, or not measurable here)
    rates: dict[int, float]  # prefill tokens/s by prompt length
    draft_ms: float | None  # the draft model's ms per drafted token
    head: dict[str, Any] | None  # the draft head's report (specdec.runtime.head_cost.profile_head)
    cpu: str
    out: dict
    beside: Any = None  # specdec.bench.llamabench.ForwardsBeside: llama-bench's pp(k) in the same rounds, or None


def measure_profile(engine: Any, models: EngineConfig, draft_spec: str | None, k_values: list[int], lengths: list[int],
                    prefix: int, repeats: int, roof: bool, peer: Path | None = None) -> Profiled:
    """profile's measurements on the loaded `engine` (`models`: its options; `draft_spec`: the draft model timed;
    `peer`: the GGUF file llama-bench times beside t(k), or None), each under a status line; the controller's
    cached step costs renewed last."""
    import torch

    from specdec.bench.llamabench import forwards_beside, peer_ks
    from specdec.machine import cpu_description
    from specdec.runtime.head_cost import profile_head
    from specdec.runtime.profile import measure_drafting, measure_forwards, measure_prefill, measure_roof

    cpu = cpu_description()
    target = models.target

    def describe(runner, name: str | None, backend_name: str, dtype_name: str | None) -> dict:
        return {"model": name, "backend": backend_name, "dtype": dtype_name if backend_name == HF else "gguf",
                "threads": runner.identity()["threads"] or torch.get_num_threads(),
                "cpu": cpu,
                "batch_invariant": runner.capabilities.batch_invariant}

    beside = None
    if peer is None:
        with status(f"timing {target}: k = {k_values[0]}..{k_values[-1]}, {repeats} repeats"):
            table = measure_forwards(engine.target_runner, k_values, prefix=prefix, repeats=repeats)
    else:
        threads = engine.target_runner.identity()["threads"] or torch.get_num_threads()
        with status(f"timing {target}: k = {k_values[0]}..{k_values[-1]}, then llama-bench's pp"
                    f"{','.join(map(str, peer_ks(k_values)))}, {repeats} rounds"):
            beside = forwards_beside(engine.target_runner, peer, k_values, prefix, repeats, threads)
        table = beside.table()
    table.info = describe(engine.target_runner, target, models.backend, engine.dtype)
    out: dict = {"target": table.to_dict()}
    if beside is not None:
        out["target"]["llama_bench"] = beside.to_dict()
    roof_found = None
    if roof:
        with status("measuring the read bandwidth and the one-token step"):
            roof_found = measure_roof(engine.target_runner, prefix=prefix)
        if roof_found is not None:
            out["target"]["roof"] = roof_found.to_dict()
    rates = {}
    if lengths:
        with status(f"timing prefills of {', '.join(map(str, lengths))} tokens"):
            rates = measure_prefill(engine.target_runner, lengths)
        out["target"]["prefill_tokens_per_s"] = {str(n): round(r, 1) for n, r in rates.items()}
    draft_ms = None
    if engine.draft_runner is not None:
        d_backend = models.draft_backend or models.backend
        with status(f"timing {draft_spec} per drafted token"):
            draft_ms = measure_drafting(engine.draft_runner, prefix=prefix, repeats=repeats)
        out["draft"] = {**describe(engine.draft_runner, draft_spec, d_backend, engine.draft_dtype),
                        "prefix": prefix, "repeats": repeats, "ms_per_token": round(draft_ms, 3)}
    with status("timing the draft head per drafted token"):
        head = profile_head(models.draft, target, engine.target_runner, prefix,
                            repeats, table.ms.get(1))
    if head is not None:
        out["head"] = head
    with status("renewing the controller's cached step costs"):
        from specdec.runtime.engine import MAX_AUTO_K
        from specdec.runtime.profile import step_costs
        from specdec.zoo import home

        step_costs(engine.target_runner, engine.draft_runner, MAX_AUTO_K, lookup=engine.copies,
                   cache_dir=home() / "profiles", renew=True)
    return Profiled(table, roof_found, rates, draft_ms, head, cpu, out, beside)


def print_profile(found: Profiled, target: str, draft_spec: str | None) -> None:
    """profile's tables and lines on stdout."""
    from rich.table import Table

    table, draft_ms, head, beside = found.table, found.draft_ms, found.head, found.beside
    t1 = table.ms[min(table.ms)]
    peer_ms, peer_ratio = (beside.peer_ms(), beside.peer_ratio()) if beside is not None else ({}, {})
    title = f"{target} ({table.info['backend']}, {table.info['dtype']}, {table.info['threads']} threads) on {found.cpu}"
    grid = Table("k", "ms per forward", "t(k) / t(1)",
                 *(["llama-bench ms", "llama-bench t(k) / t(1)"] if peer_ms else []),
                 *(["break-even tokens/step"] if draft_ms is not None else []), title=title)
    for k, ms in sorted(table.ms.items()):
        row = [str(k), f"{ms:.1f}", f"{ms / t1:.2f}"]
        if peer_ms:
            row += [f"{peer_ms[k]:.1f}", f"{peer_ratio[k]:.2f}"] if k in peer_ms else ["-", "-"]
        if draft_ms is not None:
            # a step drafting k-1 tokens and verifying k must emit this many tokens to match plain decoding
            row.append(f"{((k - 1) * draft_ms + ms) / t1:.2f}" if k > 1 else "-")
        grid.add_row(*row)
    Console().print(grid)
    if beside is not None:
        Console().print(beside_line(beside), markup=False, highlight=False, soft_wrap=True)
    if found.roof is not None:
        Console().print(f"roof: {found.roof.line()}")
    if found.rates:
        Console().print("prefill: " + ", ".join(f"{r:.0f} tokens/s at {n} tokens" for n, r in found.rates.items()))
    if draft_ms is not None:
        Console().print(f"draft {draft_spec}: {draft_ms:.1f} ms per drafted token ({draft_ms / t1:.2f} target steps)")
    if head is not None:
        Console().print(f"draft head {head['directory']} ({head['head']}, {head['draft_vocab']} draft tokens): "
                        f"{head['ms_per_token']:.2f} ms per drafted token ({head['ratio']:.3f} of the target's "
                        f"one-token step, {head['target_step_ms']:.1f} ms)")


def beside_line(beside: Any) -> str:
    """The line under profile's table on llama-bench's columns: what ran, how, or why it did not."""
    rounds = max(len(v) for v in beside.ours.values())
    if beside.error is not None and not beside.peer_ms():
        return f"llama-bench: {beside.error}"
    line = (f"llama-bench (build {beside.build or '?'}, the same file, {beside.threads} threads, depth {beside.prefix}): "
            f"`{beside.command}`, {rounds} rounds, each after ours; medians")
    return line + (f" (then it failed: {beside.error})" if beside.error else "")
