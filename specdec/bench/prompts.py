"""The benchmark's prompts: the named sets it ships, and :func:`load_prompts` reading a set or a file
(the file formats, Spec-Bench JSONL or plain text: specdec.prompt_files).

Two named sets ship as package data (``specdec/bench/prompts/``):

* ``builtin`` (the default), ``specdec-real.jsonl``: prompts shaped like
  users' requests — code completions with signatures and docstrings, long
  documents to summarize or answer questions from, questions, math word
  problems, paragraphs to translate, writing tasks and multi-turn chats
  (at least 8 per category; every record names its ``source``).
* ``short``, ``specdec-bench.jsonl``: the project's first set, 70 short
  one-turn prompts (code, summarization, qa, translation, math and chat,
  11–12 each), written for this project in Spec-Bench's format.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Protocol, TypeVar

from specdec.errors import SpecdecError
from specdec.prompt_files import Prompt, looks_like_jsonl, parse_jsonl, parse_text

BUILTIN = "builtin"
SHORT = "short"
# The named sets: name -> file under specdec/bench/prompts/ (package data).
NAMED_SETS = {BUILTIN: "specdec-real.jsonl", SHORT: "specdec-bench.jsonl"}
BUILTIN_FILE = NAMED_SETS[BUILTIN]


def builtin_path(name: str = BUILTIN) -> Path:
    """Path of a shipped prompt set (package data of ``specdec.bench``): ``builtin`` or ``short``."""
    return Path(str(resources.files("specdec.bench").joinpath("prompts", NAMED_SETS[name])))


class Categorized(Protocol):
    @property
    def category(self) -> str: ...


C = TypeVar("C", bound=Categorized)


def limit_per_category(prompts: Sequence[C], limit: int | None) -> list[C]:
    """The first `limit` prompts (or sessions) of every category, in file order (all of them when limit is None)."""
    if limit is None:
        return list(prompts)
    if limit < 1:
        raise SpecdecError(f"--limit-per-category must be >= 1, got {limit}")
    taken: dict[str, int] = {}
    out: list[C] = []
    for p in prompts:
        if taken.get(p.category, 0) < limit:
            taken[p.category] = taken.get(p.category, 0) + 1
            out.append(p)
    return out


def load_prompts(source: str | Path = BUILTIN, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file (or a named set, ``builtin`` or ``short``), optionally keeping `limit` prompts per category."""
    path = builtin_path(str(source)) if str(source) in NAMED_SETS else Path(source).expanduser()
    if not path.is_file():
        raise SpecdecError(f"prompts file '{source}' not found (give a .jsonl or .txt file, '{BUILTIN}' or '{SHORT}')")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read prompts file '{source}': {e}") from None
    lines = text.splitlines()
    if path.suffix.lower() == ".jsonl" or looks_like_jsonl(lines):
        prompts = parse_jsonl(lines, name=path.name)
    else:
        prompts = parse_text(lines)
    if not prompts:
        raise SpecdecError(f"prompts file '{source}' has no prompts")
    return limit_per_category(prompts, limit)
