"""`specdec train-drafter`: a draft head (EAGLE-style) distilled from its target on this CPU; the training itself is
specdec.training."""

from __future__ import annotations

import typer

from specdec.cli.common import err, fail, quiet_libraries
from specdec.cli.options import engine_options
from specdec.engine_config import EngineConfig
from specdec.errors import SpecdecError


@engine_options("target", target={"default": ..., "long_only": True,
                                  "help": "The model to train a draft head for (zoo name, directory, .gguf, hub id)."})
def train_drafter(
    models: EngineConfig = None,  # type: ignore[assignment]  # --target, required here (engine_options)
    minutes: float = typer.Option(60.0, "--minutes", min=0.1, help="Time budget of the whole run after loading."),
    text: list[str] = typer.Option([], "--text", help="Your own training text: a file or a directory (repeatable)."),
    prompts: list[str] = typer.Option([], "--prompts", help="Your own chat prompts, answered by the target first and a tenth of them held out to measure the agreement (repeatable): .jsonl (a string, {\"prompt\": ...} or {\"messages\": [...]} a line), .json (a list of them), or a bench prompt file (Spec-Bench \"turns\" records, or one prompt a line with \\n escapes)."),
    builtin: bool = typer.Option(True, "--builtin/--no-builtin", help="Also the built-in offline material."),
    out: str | None = typer.Option(None, "--out", help="Where to save (default $SPECDEC_HOME/drafters/<target>-head/)."),
    draft_vocab: int | None = typer.Option(None, "--draft-vocab", min=16, help="Draft vocabulary: the N most frequent tokens (default 16384)."),
    seed: int = typer.Option(0, "--seed"),
    fuse_layers: str | None = typer.Option(None, "--fuse-layers", help="The target's layers the head reads besides its final hidden state (EAGLE-3's fused features): none (the default), auto (a low and a middle layer) or 0-based indices such as 2,14."),
    resume: bool = typer.Option(False, "--resume", help="Go on training the head saved in --out (or the default directory) for --minutes more, from the material its runs did not reach; its shape is kept."),
) -> None:
    """Train a draft head (EAGLE-style) for TARGET on this CPU: the target's own answers and text, distilled."""
    from specdec.training.command import train_drafter as run_training

    quiet_libraries()
    try:
        manifest = run_training(models.target, minutes, tuple(text), out, builtin, draft_vocab, seed,
                                prompt_files=tuple(prompts), fuse_layers=fuse_layers, resume=resume)
    except SpecdecError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted: the last checkpoint (if any) is kept")
    agree = ", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(manifest["agreement_by_position"]) if a is not None)
    runs = int(manifest.get("runs", 1))
    err.print(f"saved {manifest['directory']}: {manifest['tokens_seen']:,} training tokens in "
              f"{manifest['training_seconds'] / 60:.1f} min{f' over {runs} runs' if runs > 1 else ''}; "
              f"held-out agreement by position {agree}")
