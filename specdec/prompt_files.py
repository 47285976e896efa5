"""Prompt files: Spec-Bench JSONL or plain text, one prompt per line, read alike by the bench's prompt sets
(specdec.bench.prompts) and ``specdec train-drafter --prompts`` (specdec.training.data).

Two formats are read:

* **JSONL** — one JSON object per line,
  ``{"question_id": 7, "category": "math", "turns": ["first user turn", ...]}``
  (Spec-Bench's format).  Only the first turn is used (Spec-Bench's later
  turns follow up on the model's own first answer).  ``category``
  defaults to ``"default"`` and ``question_id`` to the line number.  A record
  may also carry the assistant's earlier answers,
  ``"replies": ["assistant reply 1", ...]``, one fewer than ``turns``: it is then
  a conversation whose last user turn is pending, and every turn is used.  An
  optional ``"source"`` string records where the text came from.  A file
  ending in ``.jsonl`` is always read this way; another file is read this way
  when its first non-blank line is a JSON object with a ``"turns"`` list.
* **Plain text** — every non-blank line is one prompt, in category
  ``"default"``.  So that multi-line prompts (code) fit on one line, the
  escapes ``\\n`` (newline), ``\\t`` (tab) and ``\\\\`` (a backslash) are
  decoded; any other backslash is kept as it is.

With a chat template (``specdec bench --chat``) a conversation is encoded
through the template; without one it is rendered as plain text,
``"User: …\\n\\nAssistant: …\\n\\nUser: …\\n\\nAssistant:"``
(:attr:`Prompt.plain_text`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from specdec.errors import SpecdecError

DEFAULT_CATEGORY = "default"
USER, ASSISTANT = "user", "assistant"

# (role, content) pairs, oldest first, as a chat template takes them.
Messages = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a file: an id unique in the file, a category, and the text (the pending user turn).

    ``history`` holds the turns before ``text`` of a conversation, alternately
    user and assistant, oldest first; it is empty for a one-turn prompt.
    """

    id: str
    category: str
    text: str
    history: Messages = ()

    @property
    def messages(self) -> Messages:
        """The whole conversation as (role, content) pairs, ending with the pending user turn."""
        return (*self.history, (USER, self.text))

    @property
    def plain_text(self) -> str:
        """The prompt for a model without a chat template: the text itself for one turn, else
        the conversation as "User: …\\n\\nAssistant: …\\n\\nUser: …\\n\\nAssistant:"."""
        return conversation_text(self.messages) if self.history else self.text


def conversation_text(messages: Messages) -> str:
    """A conversation for a model without a chat template:
    "User: …\\n\\nAssistant: …\\n\\nUser: …\\n\\nAssistant:" (the assistant's turn opened)."""
    names = {USER: "User", ASSISTANT: "Assistant"}
    parts = [f"{names[role]}: {content}" for role, content in messages]
    return "\n\n".join([*parts, "Assistant:"])


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


def looks_like_jsonl(lines: list[str]) -> bool:
    """Whether the first non-blank line is a JSON object with a "turns" list: a prompt file in this format,
    whatever its name."""
    first = next((line for line in lines if line.strip()), "")
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("turns"), list)


def _history(obj: dict, turns: list, where: str) -> Messages:
    """The turns before the pending one of a record with "replies" (empty without them), checked."""
    if "replies" not in obj:
        return ()
    if not all(isinstance(t, str) for t in turns):
        raise SpecdecError(f"{where}: expected a non-empty \"turns\" list of strings")
    replies = obj["replies"]
    if not isinstance(replies, list) or not all(isinstance(r, str) for r in replies):
        raise SpecdecError(f"{where}: \"replies\" must be a list of strings")
    if len(replies) != len(turns) - 1:
        raise SpecdecError(f"{where}: \"replies\" needs one entry fewer than \"turns\" "
                           f"({len(turns)} turns, {len(replies)} replies)")
    for kind, texts in (("turn", turns), ("reply", replies)):
        empty = next((i for i, t in enumerate(texts, start=1) if not t.strip()), None)
        if empty is not None:
            raise SpecdecError(f"{where}: {kind} {empty} is empty")
    # user 1, assistant 1, user 2, ..., assistant n-1; the last user turn is the pending text
    return tuple(pair for u, a in zip(turns, replies) for pair in ((USER, u), (ASSISTANT, a)))


def json_records(lines: list[str], name: str) -> Iterator[tuple[int, str, dict]]:
    """(line number, "<name> line <n>", object) for each non-blank line, a JSON object with a "turns" list
    expected (a one-line SpecdecError for a line that is not a JSON object)."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SpecdecError(f"{where}: expected a JSON object with a \"turns\" list")
        yield number, where, obj


def parse_jsonl(lines: list[str], name: str = "<prompts>") -> list[Prompt]:
    """JSONL lines -> prompts: the first turn of each record, or the whole conversation of a
    record with "replies"; blank lines are skipped."""
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, where, obj in json_records(lines, name):
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise SpecdecError(f"{where}: expected a non-empty \"turns\" list of strings")
        if not turns[0].strip():
            raise SpecdecError(f"{where}: the first turn is empty")
        history = _history(obj, turns, where)
        source = obj.get("source")
        if source is not None and not isinstance(source, str):
            raise SpecdecError(f"{where}: \"source\" must be a string")
        category = obj.get("category", DEFAULT_CATEGORY)
        if not isinstance(category, str) or not category.strip():
            raise SpecdecError(f"{where}: \"category\" must be a non-empty string")
        pid = str(obj.get("question_id", number))
        if pid in seen:
            raise SpecdecError(f"{where}: question_id {pid} appears twice")
        seen.add(pid)
        text = turns[-1] if history else turns[0]
        prompts.append(Prompt(pid, category.strip(), text, history))
    return prompts


def parse_text(lines: list[str]) -> list[Prompt]:
    """Plain-text lines -> prompts in category "default"; the id is the line number."""
    return [
        Prompt(str(number), DEFAULT_CATEGORY, unescape_line(line))
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
