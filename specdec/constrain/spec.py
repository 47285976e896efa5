"""What a request constrains its output to, as a value: :class:`Constraint` (torch- and llguidance-free, so that
the CLI's options and the server's request models hold one without loading either).

A constraint names a grammar kind and its text: a JSON schema (strict or not), any JSON object, a regex, a Lark
grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's).  `Constraint.grammar` compiles it for a tokenizer
(specdec.constrain.grammar.Grammar, cached); `from_response_format` reads OpenAI's ``response_format`` and its
extensions as llama-server and vLLM take them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.constrain.schema import parse_schema
from specdec.errors import SpecdecError

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
MAX_GRAMMAR_CHARS = 200_000  # a schema's or grammar's text: a request's must stay small (the server's bodies are bounded too)


@dataclass(frozen=True)
class Constraint:
    """The language a request's output must be in: `kind` (one of KINDS) and `text` (the schema's JSON text, the
    regex, the grammar; "" for json_object); `strict` (OpenAI's json_schema flag): a schema keyword the library
    cannot enforce is an error, not ignored.  Checked when made (a SpecdecError): the kind, the text's size, and a
    schema's being a JSON object; the grammar itself is checked when compiled."""

    kind: str
    text: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecdecError(f"a constraint is one of {', '.join(KINDS)}, not {self.kind!r}")
        if not isinstance(self.text, str) or (not self.text and self.kind not in ("json_object",)):
            raise SpecdecError(f"a {self.kind} constraint needs its text")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise SpecdecError(f"the {self.kind} is {len(self.text)} characters long; at most {MAX_GRAMMAR_CHARS}")
        if self.kind == "json_schema":
            parse_schema(self.text)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, strict: bool = True) -> Constraint:
        """A JSON schema (a mapping, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), strict)

    def describe(self) -> str:
        """A few words for a summary line: "json_schema", "regex", ..."""
        return self.kind if self.strict or self.kind != "json_schema" else "json_schema (not strict)"

    def grammar(self, tokenizer: Any, vocab_size: int | None = None, eos_token_ids: Sequence[int] | None = None) -> Any:
        """The compiled specdec.constrain.Grammar for `tokenizer` (cached); a one-line SpecdecError for a grammar
        the library refuses."""
        from specdec.constrain.grammar import Grammar  # torch and llguidance: only where a grammar is built

        how: dict[str, Any] = {"vocab_size": vocab_size, "eos_token_ids": eos_token_ids}
        if self.kind == "json_schema":
            return Grammar.from_json_schema(self.text, tokenizer, strict=self.strict, **how)
        if self.kind == "json_object":
            return Grammar.json_object(tokenizer, **how)
        if self.kind == "regex":
            return Grammar.regex(self.text, tokenizer, **how)
        if self.kind == "lark":
            return Grammar.lark(self.text, tokenizer, **how)
        return Grammar.gbnf(self.text, tokenizer, **how)

    @classmethod
    def from_response_format(cls, response_format: Any) -> Constraint | None:
        """OpenAI's ``response_format`` as a constraint (None: free text).  Taken: {"type": "text"};
        {"type": "json_object"} (with llama-server's optional "schema"); {"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}, "strict": true | false}}; and the extensions {"type": "regex", "regex": ...},
        {"type": "grammar", "grammar": ..., "syntax": "gbnf" | "lark"} (GBNF by default, as llama-server's
        "grammar" field).  A one-line SpecdecError naming what is wrong else."""
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise SpecdecError("response_format must be an object such as {\"type\": \"json_object\"}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = response_format.get("schema")
            if schema is None:
                return cls("json_object")
            if not isinstance(schema, Mapping):
                raise SpecdecError("response_format.schema must be a JSON schema (an object)")
            return cls.json_schema(schema)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping):
                raise SpecdecError("response_format.json_schema must be an object with a \"schema\"")
            schema = spec.get("schema", {"type": "object"})  # OpenAI's "schema" is optional: any object
            strict = spec.get("strict", False)
            if not isinstance(schema, Mapping):
                raise SpecdecError("response_format.json_schema.schema must be a JSON schema (an object)")
            if not isinstance(strict, bool) and strict is not None:
                raise SpecdecError("response_format.json_schema.strict must be true or false")
            return cls.json_schema(schema, strict=bool(strict))
        if kind == "regex":
            pattern = response_format.get("regex")
            if not isinstance(pattern, str) or not pattern:
                raise SpecdecError("response_format.regex must be a regular expression (a string)")
            return cls("regex", pattern)
        if kind == "grammar":
            text, syntax = response_format.get("grammar"), response_format.get("syntax", "gbnf")
            if not isinstance(text, str) or not text:
                raise SpecdecError("response_format.grammar must be a grammar (a string)")
            if syntax not in ("gbnf", "lark"):
                raise SpecdecError(f"response_format.syntax must be \"gbnf\" or \"lark\", not {syntax!r}")
            return cls(syntax, text)
        raise SpecdecError(f"response_format.type must be one of text, json_object, json_schema, regex, grammar; "
                           f"got {kind!r}")
