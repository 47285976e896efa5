"""`specdec generate`: one prompt decoded, streamed to stdout with a summary line on stderr (or one JSON object),
and with --timings where the start-up's time went."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import typer

from specdec.cli.common import PullProgress, check_n_ctx_and_threads, err, fail, load_engine, quiet_libraries
from specdec.cli.options import engine_options, request_options
from specdec.constrain import Constraint
from specdec.drafters.choice import auto_note
from specdec.engine_config import EngineConfig, feeds_heads
from specdec.errors import SpecdecError
from specdec.request import RequestConfig


@engine_options()
@request_options()
def generate(
    prompt: str = typer.Argument(..., help="Text to continue (or the user message with --chat)."),
    # EngineConfig's options (--target, --draft, --dtype, ...): engine_options puts them here, and passes the
    # EngineConfig they make (never None, as `request` below)
    models: EngineConfig = None,  # type: ignore[assignment]
    # RequestConfig's options (-n, -k, --temperature, ...): request_options puts them here, and passes the
    # RequestConfig they make (never None; the default only makes the parameter optional for typer)
    request: RequestConfig = None,  # type: ignore[assignment]
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {text, token_ids, stats}."),
    timings: bool = typer.Option(False, "--timings", help="Print where the time went, start-up phase by phase."),
    json_schema: str = typer.Option(None, "--json-schema", help="Constrain the output to JSON that validates "
                                    "against this schema (a file, or the schema's JSON text). Speculation stays on."),
    grammar: str = typer.Option(None, "--grammar", help="Constrain the output to a grammar: a GBNF file or text "
                                "(llama.cpp's), or a Lark file (.lark; llguidance's dialect)."),
    regex: str = typer.Option(None, "--regex", help="Constrain the output to text that matches this regex whole."),
) -> None:
    """Generate text with speculative decoding (or plainly with --draft none)."""
    started = process_age()  # the interpreter's start and the CLI's own imports
    began = time.perf_counter()
    import specdec.runtime.engine  # noqa: F401  # the engine's imports, timed here: --timings' "imports"
    from specdec.algorithm.loop import Stats
    from specdec.text import TextStream, check_prompt

    imported = time.perf_counter() - began

    check_n_ctx_and_threads(models.n_ctx, models.threads)
    try:
        constraint = constraint_option(json_schema, grammar, regex)
    except SpecdecError as e:
        fail(str(e))
    if constraint is not None:
        request = dataclasses.replace(request, constraint=constraint)
    quiet_libraries()
    progress = PullProgress()
    try:
        check_prompt(prompt)  # before the models load
        draft_spec = models.draft
        engine = load_engine(models, progress)
        steps = engine.stream(prompt, request)
        if as_json:
            result = engine.generate_from(steps, request.stop)
            print(json.dumps(result.to_dict(), ensure_ascii=False))
            if timings:
                err.print(timings_line(started, imported, engine, result.stats), soft_wrap=True)
            return
        text = TextStream(engine.decode_text, request.stop)
        step, s = None, Stats()
        for step in steps:
            s.add(step)
            sys.stdout.write(text.push(step.tokens, final=step.finish_reason is not None))
            sys.stdout.flush()
        sys.stdout.write("\n")
        assert step is not None
        summary = (f"{s.new_tokens} tokens in {s.wall_s:.2f} s ({s.tokens_per_s:.1f} tok/s), finish: {step.finish_reason}"
                   f" · target {engine.target_name} {engine.dtype}")
        if draft_spec:
            summary += (
                f" · draft {engine.draft_name}{draft_backend_note(engine)}"
                f"{auto_note(draft_spec, models.target, feeds_heads(models.backend))} (k {request.k}: mean {s.mean_k:.1f},"
                f" {s.plain_fraction:.0%} plain steps) · acceptance {s.acceptance_rate:.0%}"
                f" · {s.tokens_per_target_forward:.2f} tokens/target forward"
            )
            if request.verify != "causal":
                summary += f" · {request.verify} verification"
        err.print(summary, soft_wrap=True)  # one line, whatever the width: logs stay greppable
        if timings:
            err.print(timings_line(started, imported, engine, s), soft_wrap=True)
    except SpecdecError as e:
        progress.close()
        fail(str(e))


def constraint_option(json_schema: str | None, grammar: str | None, regex: str | None) -> Constraint | None:
    """--json-schema / --grammar / --regex as a Constraint (at most one of them; None for none).  A schema or
    grammar is read from the file it names where one exists, else taken as the text itself."""
    given = [name for name, value in (("--json-schema", json_schema), ("--grammar", grammar), ("--regex", regex))
             if value is not None]
    if len(given) > 1:
        raise SpecdecError(f"give one of {', '.join(given)}, not several")
    if json_schema is not None:
        return Constraint("json_schema", _text_or_file(json_schema, "--json-schema"))
    if grammar is not None:
        kind = "lark" if grammar.endswith(".lark") else "gbnf"
        return Constraint(kind, _text_or_file(grammar, "--grammar"))
    return Constraint("regex", regex) if regex is not None else None


def _text_or_file(value: str, flag: str) -> str:
    """The text of the file `value` names, or `value` itself where it names none (inline JSON or grammar)."""
    path = Path(value)
    looks_inline = value.lstrip().startswith(("{", "root", "start")) or "\n" in value or "::=" in value
    if not looks_inline and (path.is_file() or path.suffix in (".json", ".gbnf", ".lark")):
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecdecError(f"{flag}: cannot read {value}: {e}") from None
    return value


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def timings_line(started: float | None, imported: float, engine: Any, stats: Any) -> str:
    """generate --timings: the start-up's phases (Python and the CLI, the engine's imports, each model's load,
    the controller's step costs, the prompt's prefill) and the decoding after, in seconds."""
    phases = [("python + CLI", started), ("imports", imported), *engine.timings.items(),
              ("prefill", stats.prefill_s), ("decode", stats.wall_s - stats.prefill_s), ("total", process_age())]
    return "timings: " + " · ".join(f"{name} {value:.2f} s" for name, value in phases if value is not None)


def draft_backend_note(engine) -> str:
    """" on llama.cpp" / " on transformers" (" on transformers int8", " on specdec int4") for the engine's
    draft model; nothing without one."""
    return "" if engine.draft_runner is None else f" on {engine.draft_runner.describe()}"
