"""Tool calls in a chat answer: parsed from the generated text into OpenAI's ``tool_calls`` (whole, or streamed as
OpenAI streams them), and the grammar that a ``tool_choice`` of "required" or a named function constrains the
answer with.

The format is Hermes' (Qwen2.5's chat template asks for it): each call is a JSON object between tags,
``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``, several in a row
(a newline between them).  `parse_tool_calls` reads a whole answer; `ToolCallStream` is fed the answer's text
deltas and gives the deltas of OpenAI's streaming chunks (`merged_delta`: those of one decode step as one chunk's),
and the two agree wherever the text is cut.  The rules
both keep:

- a block whose inside is not a JSON object with a string ``name`` and an object ``arguments`` (or no
  arguments: ``{}``) is no call: it stays in the content, tags and all, as the model wrote it (so does a block
  that the answer never closes, cut at max_tokens);
- whitespace between a call and the content next to it is dropped (a newline before, between and after the
  blocks), nothing else of the content; the content is None where only calls remain;
- a call's ``arguments`` is the object's JSON text (``json.dumps``, non-ASCII kept), its id ``call_`` and 24
  random hex digits (`call_id`; tests pass their own).

Streaming holds back text that may be the start of ``<tool_call>`` and the whitespace before it, and a block
until it closes (only then is it known to be a call): a call comes as two deltas, the first with its index, id,
type, name and empty arguments, the second with the whole arguments text.

`tool_choice_grammar`: for "required" (any of the tools; one call, or one or more with parallel_tool_calls) and
for a named function, a Lark grammar (specdec.constrain, llguidance) whose language is exactly that format, each
call's arguments held by the function's ``parameters`` schema: the arguments are valid by construction, and
the fixed text (tags, ``"name"``, a single tool's name) is forced, drafts that need no proposal (issue 75).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.errors import SpecdecError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# llguidance's JSON options for arguments, as specdec.constrain writes JSON (one separator each, no free
# whitespace: the Qwen template's own spacing); lenient: a keyword it cannot enforce is left out, not an error
ARGUMENT_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def call_id(index: int) -> str:
    """A new tool call's id, as OpenAI's look: ``call_`` and 24 random hex digits (`index` unused)."""
    return "call_" + secrets.token_hex(12)


def _call(inside: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a block's inside, or None where it is not a call (see the module doc)."""
    try:
        value = json.loads(inside)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _openai(name: str, arguments: str, id_: str) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ParsedAnswer:
    """A chat answer split: its `content` (None where only calls remain) and its OpenAI `tool_calls`."""
    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_tool_calls(text: str, make_id: Callable[[int], str] = call_id) -> ParsedAnswer:
    """The tool calls in a whole answer, and the content around them (see the module doc for the rules)."""
    pieces: list[str] = []
    calls: list[dict[str, Any]] = []
    pos, after_call = 0, False
    while (start := text.find(OPEN, pos)) >= 0 and (end := text.find(CLOSE, start + len(OPEN))) >= 0:
        found = _call(text[start + len(OPEN):end])
        piece = text[pos:start] if found else text[pos:end + len(CLOSE)]  # a block that is no call: content
        piece = piece.lstrip() if after_call else piece
        if found:
            pieces.append(piece.rstrip())
            calls.append(_openai(*found, make_id(len(calls))))
        else:
            pieces.append(piece)
        after_call = found is not None  # a block that is no call is content: text between it and the next call
        pos = end + len(CLOSE)
    tail = text[pos:]  # no more closed blocks: content (an unclosed one among it)
    pieces.append(tail.lstrip() if after_call else tail)
    content = "".join(pieces)
    return ParsedAnswer(None if calls and not content else content, calls)


class ToolCallStream:
    """A streamed answer's text deltas in, OpenAI chat-chunk deltas out: ``{"content": text}`` and
    ``{"tool_calls": [...]}`` (see the module doc).  `feed` each text delta, then `finish` once; `tool_calls`
    holds the calls made so far (the finish reason is "tool_calls" where there are some)."""

    def __init__(self, make_id: Callable[[int], str] = call_id) -> None:
        self.make_id = make_id
        self.tool_calls: list[dict[str, Any]] = []
        self._pending = ""  # text not yet placed: outside a block, or the inside of an open block
        self._in_block = False
        self._space = ""  # whitespace held after the content emitted: dropped if a call follows
        self._after_call = False  # right after a call: leading whitespace is dropped

    def _content(self, text: str, out: list[dict[str, Any]], final: bool = False) -> None:
        """Emits `text` as content, less the whitespace the rules drop or may yet drop (held in _space)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._space + text
        body = text if final else text.rstrip()
        self._space = text[len(body):]
        if body:
            out.append({"content": body})

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The chunk deltas that `delta`, added to the text so far, makes certain (maybe none)."""
        out: list[dict[str, Any]] = []
        self._pending += delta
        while True:
            if self._in_block:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out  # the block is open: nothing of it is known yet
                inside, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._in_block = False
                found = _call(inside)
                if found is None:
                    self._content(OPEN + inside + CLOSE, out)
                    continue
                self._space, self._after_call = "", True
                index = len(self.tool_calls)
                call = _openai(*found, self.make_id(index))
                self.tool_calls.append(call)
                out.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                            "function": {"name": found[0], "arguments": ""}}]})
                out.append({"tool_calls": [{"index": index, "function": {"arguments": found[1]}}]})
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                self._content(self._pending[:start], out)
                self._pending, self._in_block = self._pending[start + len(OPEN):], True
                continue
            # hold the longest tail that may begin OPEN; the rest is content
            held = next((k for k in range(min(len(OPEN) - 1, len(self._pending)), 0, -1)
                         if OPEN.startswith(self._pending[-k:])), 0)
            text, self._pending = self._pending[:len(self._pending) - held], self._pending[len(self._pending) - held:]
            self._content(text, out)
            return out

    def finish(self) -> list[dict[str, Any]]:
        """The last deltas: what was held back (an unclosed block is content)."""
        out: list[dict[str, Any]] = []
        rest = (OPEN if self._in_block else "") + self._pending
        self._pending, self._in_block = "", False
        self._content(rest, out, final=True)
        return out


def merged_delta(deltas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several of `ToolCallStream`'s deltas as one chunk's delta (the server sends one chunk a decode step): the
    content joined, the pieces of each call (by index) put together, its arguments' text concatenated.  {} for
    none."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"index": piece["index"]})
            for key, value in piece.items():
                if key != "function":
                    call[key] = value
                    continue
                function = call.setdefault("function", {})
                for name, text in value.items():
                    function[name] = function.get(name, "") + text if name == "arguments" else text
    out: dict[str, Any] = {}
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{name: parameters schema} of a request's tools (specdec.chat.check_tools has checked their shape)."""
    return {t["function"]["name"]: dict(t["function"].get("parameters") or {"type": "object"}) for t in tools}


def chosen_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> dict[str, dict[str, Any]] | None:
    """The tools that `tool_choice` makes the answer call, {name: parameters schema}; None where the answer is
    free ("auto", "none", or no choice).  A one-line SpecdecError for a choice that names no tool given."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    listed = _tool_names(tools or [])
    if tool_choice == "required":
        if not listed:
            raise SpecdecError('tool_choice "required" needs some tools')
        return listed
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise SpecdecError('tool_choice must be "none", "auto", "required" or '
                           '{"type": "function", "function": {"name": ...}}')
    if name not in listed:
        raise SpecdecError(f"tool_choice names the function {name!r}, which is not among the tools")
    return {name: listed[name]}


def _tag(text: str, tokenizer: Any) -> str:
    """A tag in Lark: the tokenizer's own token where the tag is one (Qwen's <tool_call>, an added token that
    llguidance matches by id only), else the text."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    token = backend.token_to_id(text) if hasattr(backend, "token_to_id") else None
    return f"<[{token}]>" if token is not None else json.dumps(text)


def tool_call_lark(functions: Mapping[str, Mapping[str, Any]], tokenizer: Any, parallel: bool = True) -> str:
    """The Lark grammar (llguidance's dialect) of one call -- or, `parallel`, one or more -- to one of
    `functions` ({name: parameters schema}) in the Hermes format, the arguments held by their schema."""
    rules = []
    for i, (name, schema) in enumerate(functions.items()):
        head = '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        tail = "}\n"
        rules.append(f"call{i}: {_tag(OPEN, tokenizer)} {json.dumps(head)} args{i} {json.dumps(tail)} {_tag(CLOSE, tokenizer)}")
        # the schema's own keys first: an "x-guidance" of the caller's is replaced by the options above
        rules.append(f"args{i}: %json {json.dumps({**schema, 'x-guidance': ARGUMENT_OPTIONS})}")
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, "call: " + " | ".join(f"call{i}" for i in range(len(functions))), *rules]) + "\n"


def tool_choice_grammar(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, tokenizer: Any, *,
                        parallel: bool = True, vocab_size: int | None = None,
                        eos_token_ids: Sequence[int] | None = None) -> Any:
    """The specdec.constrain Grammar that `tool_choice` holds the answer to (see `tool_call_lark`), or None where
    the answer is free.  `vocab_size`, `eos_token_ids`: as Grammar's.  A one-line SpecdecError for a bad choice or
    a parameters schema the library cannot compile."""
    functions = chosen_tools(tools, tool_choice)
    if functions is None:
        return None
    from specdec.constrain import Grammar  # torch and llguidance: only where a grammar is built

    return Grammar.lark(tool_call_lark(functions, tokenizer, parallel), tokenizer, vocab_size=vocab_size,
                        eos_token_ids=eos_token_ids)
