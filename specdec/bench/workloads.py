"""Bench workloads of repeated text: sessions whose turns run in order (`specdec bench --workload`).

Serving traffic repeats itself: a code-edit session rewrites its previous
answer with small changes, an agent loop re-emits tool calls around
observations that differ a little, templated generation fills one format
again and again.  Drafters that remember earlier requests — SuffixDecoding
(Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", arXiv 2411.04975) — gain on such traffic and on nothing that a
set of unrelated one-turn prompts measures.  A workload is a set of
**sessions**; a session is a list of user turns, each answered in order, each
turn's prompt holding the whole conversation so far, the answers the method
itself generated included (:mod:`specdec.bench.sessions` runs them).

Three workloads ship as package data (``specdec/bench/prompts/workload-<name>.jsonl``),
written for this project (every record says so in ``"source"``), 10 sessions of
3–6 turns each:

* ``edit`` — multi-turn code edits: the first turn asks for a function, class,
  schema, workflow or script; every later turn asks to change the previous
  answer (rename, add a parameter, error handling, a docstring, tests, types...).
* ``agent`` — agent loops: the first turn lists tools as JSON and sets a task;
  every later turn gives the last tool's observation as JSON and asks for the
  next tool call as JSON.
* ``template`` — templated generation: the first turn fixes a format (SQL over a
  schema, JSON product records, nginx blocks, Kubernetes YAML, dataclasses, commit
  messages, test stubs, emails, compose services, OpenAPI paths) and a first
  request; later turns are similar requests.

File format, one session per line::

    {"session_id": "edit-01", "category": "edit", "turns": ["user turn 1", ...],
     "source": "written for specdec"}

``category`` defaults to the workload's name (a file's stem for a file of one's
own) and ``source`` is optional.  With 128-token answers, every shipped
session's last prompt is at most about 1,400 tokens through Qwen2.5's chat template
(1,378 when measured with Qwen2.5-Coder's tokenizer: ``agent-01``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specdec.bench.prompts import limit_per_category
from specdec.errors import SpecdecError
from specdec.prompt_files import ASSISTANT, USER, Prompt, json_records

WORKLOADS = ("edit", "agent", "template")  # shipped: specdec/bench/prompts/workload-<name>.jsonl
SOURCE = "written for specdec"  # the "source" of every shipped session


@dataclass(frozen=True)
class Session:
    """A conversation's user turns, answered in order (turn 1 first); ``id`` unique in its workload."""

    id: str
    category: str
    turns: tuple[str, ...]
    source: str | None = None

    def prompt(self, turn: int, replies: Sequence[str]) -> Prompt:
        """Turn `turn` (1-based) as a Prompt, its history the earlier turns with `replies`, the answers
        given to them (one per earlier turn, oldest first).  Its id is "<session>/<turn>"."""
        if not 1 <= turn <= len(self.turns):
            raise ValueError(f"session {self.id} has turns 1..{len(self.turns)}, not {turn}")
        if len(replies) != turn - 1:
            raise ValueError(f"turn {turn} of session {self.id} needs {turn - 1} replies, got {len(replies)}")
        history = tuple(pair for u, a in zip(self.turns, replies) for pair in ((USER, u), (ASSISTANT, a)))
        return Prompt(f"{self.id}/{turn}", self.category, self.turns[turn - 1], history)


def workload_path(name: str) -> Path:
    """Path of a shipped workload's session file (package data of ``specdec.bench``)."""
    return Path(str(resources.files("specdec.bench").joinpath("prompts", f"workload-{name}.jsonl")))


def parse_sessions(lines: list[str], name: str, category: str) -> list[Session]:
    """JSONL lines -> sessions (blank lines skipped); `category` where a record names none."""
    sessions: list[Session] = []
    seen: set[str] = set()
    for number, where, obj in json_records(lines, name):
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise SpecdecError(f"{where}: expected a non-empty \"turns\" list of non-empty strings")
        if "replies" in obj:
            raise SpecdecError(f"{where}: a session has no \"replies\": the method under test writes them")
        sid = str(obj.get("session_id", number))
        if sid in seen:
            raise SpecdecError(f"{where}: session_id {sid} appears twice")
        seen.add(sid)
        cat = obj.get("category", category)
        source = obj.get("source")
        if not isinstance(cat, str) or not cat.strip():
            raise SpecdecError(f"{where}: \"category\" must be a non-empty string")
        if source is not None and not isinstance(source, str):
            raise SpecdecError(f"{where}: \"source\" must be a string")
        sessions.append(Session(sid, cat.strip(), tuple(turns), source))
    return sessions


def load_workload(name: str) -> list[Session]:
    """The sessions of a shipped workload (edit, agent, template) or of a .jsonl session file."""
    path = workload_path(name) if name in WORKLOADS else Path(name).expanduser()
    if name not in WORKLOADS and (path.suffix.lower() != ".jsonl" or not path.is_file()):
        raise SpecdecError(f"unknown workload '{name}': expected a comma-separated list of "
                           f"{', '.join(WORKLOADS)} or .jsonl session files")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read workload '{name}': {e}") from None
    sessions = parse_sessions(lines, path.name, name if name in WORKLOADS else path.stem)
    if not sessions:
        raise SpecdecError(f"workload '{name}' has no sessions")
    return sessions


def parse_workloads(text: str) -> list[str]:
    """"edit, agent,edit" -> ["edit", "agent"]: names (or files), duplicates dropped, checked."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise SpecdecError(f"--workload is empty: expected a comma-separated list of {', '.join(WORKLOADS)}")
    for name in names:
        if name not in WORKLOADS and not name.lower().endswith(".jsonl"):
            raise SpecdecError(f"unknown workload '{name}': expected a comma-separated list of "
                               f"{', '.join(WORKLOADS)} or .jsonl session files")
    return names


def load_workloads(text: str, limit: int | None = None) -> list[Session]:
    """The sessions of every workload in `text` ("edit,agent"), the first `limit` of each category
    (session ids must be unique across the workloads: a turn's id is "<session>/<turn>")."""
    sessions: list[Session] = []
    for name in parse_workloads(text):
        sessions += load_workload(name)
    ids = [s.id for s in sessions]
    if len(set(ids)) < len(ids):
        raise SpecdecError("--workload: two sessions share the id "
                           f"'{next(i for i in ids if ids.count(i) > 1)}': give each session_id once")
    return limit_per_category(sessions, limit)
