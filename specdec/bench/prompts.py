"""Prompt files for the benchmark: Spec-Bench JSONL or plain text, one prompt per line.

Two formats are read:

* **Spec-Bench JSONL** — one JSON object per line,
  ``{"question_id": 7, "category": "math", "turns": ["first user turn", ...]}``.
  Only the first turn is used.  ``category`` defaults to ``"default"`` and
  ``question_id`` to the line number.  A file ending in ``.jsonl`` is always
  read this way; another file is read this way when its first non-blank line
  is a JSON object with a ``"turns"`` list.
* **Plain text** — every non-blank line is one prompt, in category
  ``"default"``.  So that multi-line prompts (code) fit on one line, the
  escapes ``\\n`` (newline), ``\\t`` (tab) and ``\\\\`` (a backslash) are
  decoded; any other backslash is kept as it is.

``builtin`` names the project's own set, shipped as package data:
``specdec/bench/prompts/specdec-bench.jsonl`` (categories code,
summarization, qa, translation, math and chat, 11–12 prompts each, written for
this project in Spec-Bench's format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specdec.errors import SpecdecError

BUILTIN = "builtin"
BUILTIN_FILE = "specdec-bench.jsonl"
DEFAULT_CATEGORY = "default"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: an id unique in its file, a category, and the text (the first user turn)."""

    id: str
    category: str
    text: str


def builtin_path() -> Path:
    """Path of the shipped prompt set (package data of ``specdec.bench``)."""
    return Path(str(resources.files("specdec.bench").joinpath("prompts", BUILTIN_FILE)))


def unescape_line(line: str) -> str:
    """Decode the plain-text escapes: ``\\n`` -> newline, ``\\t`` -> tab, ``\\\\`` -> backslash."""
    out: list[str] = []
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line) and line[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[line[i + 1]])
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _looks_like_jsonl(lines: list[str]) -> bool:
    first = next((line for line in lines if line.strip()), "")
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("turns"), list)


def parse_jsonl(lines: list[str], name: str = "<prompts>") -> list[Prompt]:
    """Spec-Bench JSONL lines -> prompts (first turn of each record); blank lines are skipped."""
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise SpecdecError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SpecdecError(f"{where}: expected a JSON object with a \"turns\" list")
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise SpecdecError(f"{where}: expected a non-empty \"turns\" list of strings")
        if not turns[0].strip():
            raise SpecdecError(f"{where}: the first turn is empty")
        category = obj.get("category", DEFAULT_CATEGORY)
        if not isinstance(category, str) or not category.strip():
            raise SpecdecError(f"{where}: \"category\" must be a non-empty string")
        pid = str(obj.get("question_id", number))
        if pid in seen:
            raise SpecdecError(f"{where}: question_id {pid} appears twice")
        seen.add(pid)
        prompts.append(Prompt(pid, category.strip(), turns[0]))
    return prompts


def parse_text(lines: list[str]) -> list[Prompt]:
    """Plain-text lines -> prompts in category "default"; the id is the line number."""
    return [
        Prompt(str(number), DEFAULT_CATEGORY, unescape_line(line))
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]


def limit_per_category(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts of every category, in file order (all of them when limit is None)."""
    if limit is None:
        return list(prompts)
    if limit < 1:
        raise SpecdecError(f"--limit-per-category must be >= 1, got {limit}")
    taken: dict[str, int] = {}
    out: list[Prompt] = []
    for p in prompts:
        if taken.get(p.category, 0) < limit:
            taken[p.category] = taken.get(p.category, 0) + 1
            out.append(p)
    return out


def load_prompts(source: str | Path = BUILTIN, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file (or the builtin set), optionally keeping `limit` prompts per category."""
    path = builtin_path() if str(source) == BUILTIN else Path(source).expanduser()
    if not path.is_file():
        raise SpecdecError(f"prompts file '{source}' not found (give a .jsonl or .txt file, or '{BUILTIN}')")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read prompts file '{source}': {e}") from None
    lines = text.splitlines()
    if path.suffix.lower() == ".jsonl" or _looks_like_jsonl(lines):
        prompts = parse_jsonl(lines, name=path.name)
    else:
        prompts = parse_text(lines)
    if not prompts:
        raise SpecdecError(f"prompts file '{source}' has no prompts")
    return limit_per_category(prompts, limit)
