"""Grammars and their per-request matchers, on llguidance (see the package doc).

`grammar_tokenizer` turns a tokenizer (a transformers fast tokenizer or specdec's LeanTokenizer: anything with a
``backend_tokenizer``, or a ``tokenizers.Tokenizer``) into llguidance's view of it: each token's bytes, the
end-of-sequence ids, and the model's vocabulary size, which may be larger than the tokenizer's (Qwen2.5's
151,936 logits for the 151,665 tokens of its transformers tokenizer): the ids past the tokenizer's are never
allowed.  (The zoo's tokenizers, converted from GGUF files, fill those ids with placeholder tokens instead: see
`_placeholders_special`.)  Building one reads the whole vocabulary (1-4 s for Qwen2.5 on a shared 2-core Zen 4),
so it is kept per tokenizer, vocabulary size and EOS ids.

A `Grammar` is compiled once (llguidance builds its parser and lexer when a matcher is made) and kept as a
prototype matcher that each request's `Matcher` copies; grammars are cached per (tokenizer, kind, text).
JSON comes out in one fixed layout, ``{"a": 1, "b": [2, 3]}`` (json.dumps' separators, no other whitespace): a
model may not pad it with whitespace runs that never end, and more of the output is forced.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from specdec.constrain.schema import parse_schema
from specdec.errors import SpecdecError

# llguidance's JSON options: one separator each, no free whitespace (see the module doc)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept (a server sees the same few schemas again and again)
PLACEHOLDER = re.compile(r"\[PAD[0-9]+\]")  # a padding row's token (see `_placeholders_special`)
ERROR_CHARS = 300  # a grammar error is cut to this many characters: it becomes a one-line message (a 400)

_LOCK = threading.Lock()
# (id of the tokenizers.Tokenizer, model vocabulary size, EOS ids) -> (that tokenizer, kept alive so that its id is
# not reused, and llguidance's tokenizer)
_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, llguidance.LLTokenizer]] = {}
_GRAMMARS: OrderedDict[tuple[int, str, str], Grammar] = OrderedDict()  # (id of the LLTokenizer, kind, text)


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind `tokenizer`."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise SpecdecError(f"constrained decoding needs a fast (tokenizers) tokenizer, not {type(tokenizer).__name__}")
    return backend


def grammar_tokenizer(tokenizer: Any, vocab_size: int | None = None,
                      eos_token_ids: Sequence[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`, with `vocab_size` ids (the model's logits; default: the tokenizer's
    own count) and `eos_token_ids` as the ends of the output (default: the tokenizer's EOS); built once per
    (tokenizer, size, EOS ids)."""
    backend = _backend(tokenizer)
    size = int(backend.get_vocab_size(with_added_tokens=True))
    vocab = size if vocab_size is None else int(vocab_size)
    if vocab < size:
        raise SpecdecError(f"the model has {vocab} logits, fewer than its tokenizer's {size} tokens")
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_token_ids = [] if eos is None else [int(eos)]
    eos_ids = tuple(sorted({int(t) for t in eos_token_ids}))
    if not eos_ids or not all(0 <= t < size for t in eos_ids):
        raise SpecdecError(f"constrained decoding needs the end-of-sequence token ids (got {list(eos_ids)})")
    key = (id(backend), vocab, eos_ids)
    with _LOCK:
        if key not in _TOKENIZERS:
            own = copy.copy(backend)  # padding and truncation are switched off on a copy: the model's is shared
            own.no_padding()
            own.no_truncation()
            built = llguidance.LLTokenizer(_placeholders_special(own.to_str()), n_vocab=vocab, eos_token=list(eos_ids))
            _TOKENIZERS[key] = (backend, built)
        return _TOKENIZERS[key][1]


def _placeholders_special(tokenizer_json: str) -> str:
    """The tokenizer's JSON with its padding placeholders (``[PAD151665]``..., the rows a GGUF's vocabulary pads to
    the model's logits with, which transformers' GGUF loader keeps as ordinary tokens) declared special tokens:
    llguidance never lets a special token stand for text, so a string cannot be written with them."""
    spec = json.loads(tokenizer_json)
    vocab = (spec.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        return tokenizer_json
    added = spec.setdefault("added_tokens", [])
    known = {entry["id"] for entry in added}
    pads = [(text, i) for text, i in vocab.items() if PLACEHOLDER.fullmatch(text) and i not in known]
    if not pads:
        return tokenizer_json
    added.extend({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for text, i in sorted(pads, key=lambda p: p[1]))
    return json.dumps(spec, ensure_ascii=False)


def _one_line(message: str) -> str:
    """A library error as one line of at most ERROR_CHARS characters."""
    line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    return line if len(line) <= ERROR_CHARS else line[:ERROR_CHARS - 3] + "..."


class Grammar:
    """A compiled grammar for one tokenizer and vocabulary size; `matcher()` starts a request's walk of it.  Made
    by the class methods (`from_json_schema`, `json_object`, `regex`, `lark`, `gbnf`), which cache it."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, source: str, kind: str) -> None:
        self.tokenizer = tokenizer
        self.kind = kind
        self.vocab_size: int = tokenizer.vocab_size  # the model's logits: the mask's length
        self.eos_token_ids: list[int] = list(tokenizer.eos_tokens)
        self._prototype = llguidance.LLMatcher(tokenizer, source, log_level=0)  # compiles; errors are a state
        if self._prototype.is_error():
            raise SpecdecError(f"invalid {kind}: {_one_line(self._prototype.get_error())}")
        # a grammar whose language is empty (``start: start``) compiles, and fails at its first mask: found here
        probe = self._prototype.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            reason = probe.get_error().strip().splitlines()[0]  # the library's reason, before its state dump
            raise SpecdecError(f"invalid {kind}: no output can satisfy it (its language is empty: {reason})")

    @classmethod
    def _cached(cls, tokenizer: Any, kind: str, text: str, source: Any, vocab_size: int | None,
                eos_token_ids: Sequence[int] | None) -> Grammar:
        """The grammar of `kind` and `text` (its cache key) for `tokenizer`, compiled from ``source()`` the first
        time it is asked for."""
        lltok = grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)
        key = (id(lltok), kind, text)
        with _LOCK:
            found = _GRAMMARS.get(key)
            if found is not None:
                _GRAMMARS.move_to_end(key)
                return found
        grammar = cls(lltok, source(), kind)
        with _LOCK:
            _GRAMMARS[key] = grammar
            while len(_GRAMMARS) > GRAMMAR_CACHE_SIZE:
                _GRAMMARS.popitem(last=False)
        return grammar

    @classmethod
    def from_json_schema(cls, schema: dict[str, Any] | str, tokenizer: Any, *, strict: bool = True,
                         vocab_size: int | None = None, eos_token_ids: Sequence[int] | None = None) -> Grammar:
        """JSON that validates against `schema` (a dict, or its JSON text).  `strict` (OpenAI's flag): a keyword the
        library cannot enforce is an error; not strict, it is ignored (the output then follows the rest)."""
        schema = parse_schema(schema)
        text = json.dumps(schema, sort_keys=True)
        options = {**JSON_OPTIONS, "lenient": not strict}

        def source() -> str:
            try:
                return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]
            except ValueError as e:
                raise SpecdecError(f"invalid JSON schema: {_one_line(str(e))}") from None

        return cls._cached(tokenizer, f"JSON schema{'' if strict else ' (not strict)'}", text, source,
                           vocab_size, eos_token_ids)

    @classmethod
    def json_object(cls, tokenizer: Any, *, vocab_size: int | None = None,
                    eos_token_ids: Sequence[int] | None = None) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.from_json_schema({"type": "object"}, tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    @classmethod
    def regex(cls, pattern: str, tokenizer: Any, *, vocab_size: int | None = None,
              eos_token_ids: Sequence[int] | None = None) -> Grammar:
        """Text that matches `pattern` whole (Rust regex syntax, as llguidance reads it)."""
        return cls._cached(tokenizer, "regex", pattern, lambda: llguidance.LLMatcher.grammar_from_regex(pattern),
                           vocab_size, eos_token_ids)

    @classmethod
    def lark(cls, text: str, tokenizer: Any, *, vocab_size: int | None = None,
             eos_token_ids: Sequence[int] | None = None) -> Grammar:
        """Text in the language of a Lark grammar (llguidance's dialect: ``start: ...``)."""
        return cls._cached(tokenizer, "Lark grammar", text, lambda: llguidance.LLMatcher.grammar_from_lark(text),
                           vocab_size, eos_token_ids)

    @classmethod
    def gbnf(cls, text: str, tokenizer: Any, *, vocab_size: int | None = None,
             eos_token_ids: Sequence[int] | None = None) -> Grammar:
        """Text in the language of a GBNF grammar (llama.cpp's ``root ::= ...``), translated to Lark by
        llguidance."""
        from llguidance.gbnf_to_lark import gbnf_to_lark

        def source() -> str:
            try:
                return str(llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text)))
            except Exception as e:  # the translator raises its own parse errors (and plain ones) on a bad grammar
                raise SpecdecError(f"invalid GBNF grammar: {_one_line(str(e))}") from None

        return cls._cached(tokenizer, "GBNF grammar", text, source, vocab_size, eos_token_ids)

    def matcher(self) -> Matcher:
        """A new walk of this grammar from its start (one per request)."""
        return Matcher(self)


class Matcher:
    """One request's position in a `Grammar`: which tokens may come next, and the tokens consumed so far (which
    may be rolled back).  Not thread-safe: one request, one thread at a time."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.vocab_size = grammar.vocab_size
        self._m = grammar._prototype.deep_copy()
        self._consumed = 0  # tokens consumed and not rolled back
        self._eos = frozenset(grammar.eos_token_ids)
        self._ended = False  # an EOS was consumed (the last token): nothing may follow it
        self._words = torch.empty((self.vocab_size + 31) // 32, dtype=torch.int32)  # [ceil(V/32)] the mask's bits

    def _check(self) -> None:
        if self._m.is_error():  # a resource limit of the library, met mid-output (tokens are checked by the mask first)
            raise SpecdecError(f"the {self.grammar.kind} could not be followed: {_one_line(self._m.get_error())}")

    @property
    def consumed(self) -> int:
        """How many tokens have been consumed (and not rolled back)."""
        return self._consumed

    def bitmask(self) -> torch.Tensor:
        """[ceil(V/32)] int32: bit ``t % 32`` of word ``t // 32`` is set when token t may come next (EOS only where
        the grammar accepts the output as it is; nothing after EOS).  The matcher's own buffer, overwritten by the
        next call."""
        if self._ended:
            return self._words.zero_()
        self._m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        self._check()
        return self._words

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens that may come next (a new tensor)."""
        return self._unpacked(self.bitmask())

    def _unpacked(self, words: torch.Tensor) -> torch.Tensor:
        """[V] bool from the mask's [ceil(V/32)] int32 words: their bytes, little-endian (x86, arm64), unpacked low
        bit first, so that token t is bit t of the buffer."""
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")  # [32 * ceil(V/32)] uint8
        return torch.from_numpy(bits[: self.vocab_size]).view(torch.bool)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [..., V] with every token the grammar forbids next set to -inf, in place (and returned)."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} tokens for a grammar of {self.vocab_size}")
        return logits.masked_fill_(~self.allowed(), float("-inf"))

    def _step(self, token: int, row: list[torch.Tensor] | None = None) -> bool:
        """Consume `token` if the mask allows it here (else nothing); the mask, unpacked, is appended to `row`."""
        words = self.bitmask()
        if row is not None:
            row.append(self._unpacked(words))
        # the mask decides, not llguidance's token check: that one also takes a token that is not how the tokenizer
        # writes a forced text ("a" where the key's text "antity" is written "an"...), which the mask leaves out
        if not 0 <= token < self.vocab_size or not (int(words[token >> 5]) >> (token & 31)) & 1:
            return False
        if token in self._eos:
            self._ended = True  # EOS never reaches llguidance: nothing follows it here (`bitmask`)
        elif not self._m.consume_token(token):
            self._check()
            raise RuntimeError(f"llguidance refused token {token}, which its mask allowed")
        self._consumed += 1
        return True

    def _walk(self, tokens: Sequence[int], rows: list[torch.Tensor] | None = None) -> int:
        """Consume tokens while the mask allows them; how many it took."""
        n = 0
        for t in tokens:
            if not self._step(int(t), rows):
                return n
            n += 1
        if rows is not None:
            rows.append(self.allowed())  # the mask after the last
        return n

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the mask allows in a row from here (consumes none): a draft is cut
        there before verification.  An EOS counts where the output before it is complete; nothing after it."""
        n = self._walk(tokens)
        self.rollback(n)
        return n

    def draft_masks(self, tokens: Sequence[int]) -> tuple[int, torch.Tensor]:
        """``n, allowed``: the first n of `tokens` the mask allows in a row from here, and allowed [n + 1, V] bool,
        the mask before each of them and after the last: the masks a verification of the n applies.  Consumes
        none."""
        rows: list[torch.Tensor] = []
        n = self._walk(tokens, rows)
        self.rollback(n)
        return n, torch.stack(rows[: n + 1])  # [n + 1, V]

    def consume(self, tokens: Sequence[int]) -> bool:
        """Consume `tokens` if the mask allows them all, in order, and return True; else consume none and return
        False (the matcher is as it was)."""
        n = self._walk(tokens)
        if n < len(tokens):
            self.rollback(n)
            return False
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` tokens consumed (rejected drafts)."""
        if not 0 <= n <= self._consumed:
            raise ValueError(f"cannot roll back {n} tokens of {self._consumed} consumed")
        in_grammar = n  # the tokens llguidance saw: all but an EOS
        if self._ended and n:
            self._ended = False
            in_grammar -= 1
        if in_grammar and not self._m.rollback(in_grammar):
            self._check()
            raise RuntimeError(f"llguidance could not roll back {in_grammar} tokens")
        self._consumed -= n

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (possibly none): whatever the model's logits, these come next, so the
        decode loop may take them as drafts that cannot be rejected.  Only tokens whose tokenization no later text
        can change are given (a forced key ``"score"`` may end before its last token), and at its position each is
        the only token the mask allows."""
        if self._ended:
            return []
        ff = [int(t) for t in self._m.compute_ff_tokens()]
        self._check()
        return ff

    def accepting(self) -> bool:
        """Whether the output so far is complete: an EOS token may come now."""
        return not self._ended and bool(self._m.is_accepting())

    def done(self) -> bool:
        """Whether nothing but EOS may come (the grammar's output is complete and cannot go on), or EOS was
        consumed."""
        return self._ended or bool(self._m.is_stopped())
