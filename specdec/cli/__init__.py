"""The `specdec` command line: generate text, serve it, measure it, train a draft head, manage the offline model zoo.

Every user mistake (bad option, unknown model, prompt too long...) ends with a
one-line ``error: ...`` on stderr and exit status 2, never a traceback.
Streamed text and ``--json`` output go to stdout; progress and summaries go to
stderr, so stdout can be piped.

A module per command group: generate, serve, bench (bench and quality), profile, train_drafter, models (models
and models pull).  What they share: options (the options made from RequestConfig's and EngineConfig's fields)
and common (the one-line errors, the progress bar, the engine loaded under a status line).  This module
registers the commands on `app`, in the order --help lists them, and runs them (`main`, the `specdec` entry
point; ``python -m specdec.cli`` runs it too).
"""

from __future__ import annotations

import os
import sys

import typer

from specdec.cli import bench, generate, models, profile, serve, train_drafter

# the commands, in the order --help lists them (typer lists them as registered, the models group after them)
app = typer.Typer(add_completion=False, no_args_is_help=True, help="Lossless speculative decoding.")
app.command()(generate.generate)
app.command()(serve.serve)
app.command()(bench.bench)
app.command()(profile.profile)
app.command()(bench.quality)
app.command("train-drafter")(train_drafter.train_drafter)
models_app = typer.Typer(help="The offline model zoo: list models, pull them; and the draft heads trained here.")
models_app.callback(invoke_without_command=True)(models.models)
models_app.command("pull")(models.models_pull)
app.add_typer(models_app, name="models")


def main() -> None:
    """The `specdec` command.  It ends with os._exit once its output is flushed and the atexit handlers have run
    (the packed weights' cache writes among them): the interpreter's own teardown -- freeing torch's modules and
    the models' memory object by object -- took ~1 s on the 2-core Zen 4 after the answer was printed (llama.cpp
    exits at once).  An exception a command lets through still ends the normal way, with its traceback."""
    import atexit

    try:
        app()
        code: int = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    atexit._run_exitfuncs()
    os._exit(code)
