"""What the `specdec` commands share: the stderr console and its one-line errors, the pull progress bar, the
quieted libraries and the engine loaded under a status line.

Nothing here imports torch or transformers at import time: `specdec --help` and the commands' error paths stay
fast (tests/test_structure.py).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console

from specdec.engine_config import EngineConfig

if TYPE_CHECKING:  # rich's progress bar loads when a pull starts
    from rich.progress import Progress, TaskID

err = Console(stderr=True, highlight=False, markup=False)  # plain text unless a print asks for markup: lines quote paths


def status(what: str) -> Any:
    """A spinner on stderr saying what runs; `what` is plain text (it quotes model names and paths)."""
    from rich.markup import escape

    return err.status(escape(what))


def fail(message: str) -> NoReturn:
    """Print a one-line error and exit with status 2.  The message is plain text, never markup: it may quote a
    user's path or input with brackets in it."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    raise typer.Exit(2)


class PullProgress:
    """A rich progress bar fed by the zoo's progress(stage, done, total) callback."""

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.progress is None:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                console=err, transient=False,
            )
            self.progress.start()
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total or None)
        self.progress.update(self.tasks[stage], completed=done, total=total or None)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def quiet_libraries() -> None:
    """Keep transformers' warnings and progress bars off the terminal, without importing it (half a second that a
    GGUF target with the lean tokenizer never needs): its environment variables, read when it is imported, and
    its settings when it already is.  A user's own TRANSFORMERS_VERBOSITY is kept."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def check_n_ctx_and_threads(n_ctx: int | None, threads: int | None) -> None:
    if n_ctx is not None and n_ctx < 1:
        fail(f"--n-ctx must be >= 1, got {n_ctx}")
    if threads is not None and threads < 1:
        fail(f"--threads must be >= 1, got {threads}")


def load_engine(models: EngineConfig, progress: PullProgress):
    """The Engine for a command's model options, loaded under a status line."""
    from specdec.runtime.engine import Engine

    with status(f"loading {models.target}" + (f" and {models.draft}" if models.draft else "")):
        engine = Engine.from_config(models, progress=progress)
    progress.close()
    return engine
