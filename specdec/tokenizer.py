"""A tokenizer without transformers: what decoding needs of a transformers fast tokenizer, on the tokenizers
library and jinja2 alone, so that a start that loads no transformers model imports no transformers either
(``import transformers`` alone scans every model folder it ships: ~0.6 s on a Zen 4 core).

A `LeanTokenizer` stands for one transformers tokenizer and answers as it does: ``tok(text)["input_ids"]``,
``encode``, ``decode``, ``apply_chat_template`` with the transformers 5 chat-template environment, the special
token ids, ``get_vocab``.  It is built from a *snapshot* taken of the transformers tokenizer once (the Rust
tokenizer as transformers configured it, its special tokens, template and clean-up rule), and the snapshot is
kept only when the two agree on a set of probes (texts, special tokens, chat turns); anything else a caller
asks of it is answered by the transformers tokenizer itself, loaded on first use (`LeanTokenizer.full`).

Snapshots live in ``$SPECDEC_HOME/tokenizers/lean``: ``<key>.json`` per saved tokenizer (vocab.tokenizer_key)
and the Rust tokenizer's JSON once per content (``backend-<digest>.json``), so that a draft and a target of one
family, whose templates may differ, share one parsed vocabulary in a process (`_BACKENDS`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.zoo import write_atomically

if TYPE_CHECKING:
    import tokenizers

SNAPSHOT_FORMAT = 1
# Texts a snapshot must encode and decode as transformers does before it is used (special tokens are added
# by `probe_texts`): code, prose, whitespace runs, several scripts, emoji, digits, clean-up patterns.
PROBES = ("def add(a, b):\n    return a + b\n", "Hello, world! It's a test . Isn't it ? ok , yes 've 're 'm 's",
          "  \t\n\n   leading and trailing   ", "naïve café 日本語のテキスト Ελληνικά русский 한국어 عربى",
          "emoji 🙂👍🏽 and 12345678901234567890 3.14159", "", " ", "<html><body>x &amp; y</body></html>",
          "A" * 300 + " b" * 50)
CHAT_PROBES: tuple[tuple[tuple[str, str], ...], ...] = (
    (("user", "Write a haiku about the sea."),),
    (("system", "You are terse."), ("user", "What is 2 + 2?")),
    (("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Explain recursion  briefly.\n")),
)
_BACKENDS: dict[str, tokenizers.Tokenizer] = {}  # backend digest -> the parsed Rust tokenizer, one per process
_LOCK = threading.Lock()


def _compiled_template(source: str) -> Any:
    """`source` compiled in the environment transformers 5 renders chat templates in: a sandbox that cannot
    change what it is given, blocks trimmed, loop controls, a ``{% generation %}`` block that renders its body,
    ``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``
    (underscore names refused)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the body as it is (transformers tracks where it lies)."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def fail(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace, refusing the names that reach an object's internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `self` may be a key
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class Dicts:
        """``dict(...)`` and ``dict.fromkeys(...)``, and nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=fail, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dicts(), namespace=Namespace)
    return env.from_string(source)


def clean_up(text: str) -> str:
    """transformers' clean-up of tokenization spaces (for WordPiece vocabularies: " ." -> "." and the like)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


class LeanTokenizer:
    """A transformers fast tokenizer's answers from its snapshot (see the module doc); `full` is the
    transformers tokenizer, loaded (through `loader`) the first time something else is asked of it."""

    def __init__(self, meta: dict[str, Any], backend: tokenizers.Tokenizer,
                 loader: Callable[[], Any]) -> None:
        self.backend_tokenizer = backend  # shared with every LeanTokenizer of the same vocabulary: read-only here
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.bos_token_id: int | None = meta["bos_token_id"]
        self.pad_token_id: int | None = meta["pad_token_id"]
        self.special_tokens_map: dict[str, str] = meta["special_tokens_map"]
        self.chat_template: str | None = meta["chat_template"]
        self.split_special_tokens: bool = meta["split_special_tokens"]
        self.cleans_up: bool = meta["cleans_up"]
        self._chat_ok: bool = meta["chat_ok"]
        self._loader = loader
        self._full: Any = None
        self._template: Any = None

    def full(self) -> Any:
        """The transformers tokenizer this one stands for (loaded once, on first use)."""
        if self._full is None:
            self._full = self._loader()
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # internals (and copy/pickle's probes before __init__ ran): never forwarded
            raise AttributeError(name)
        return getattr(self.full(), name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (transformers' ``encode``)."""
        backend = self.backend_tokenizer
        if backend.encode_special_tokens != self.split_special_tokens:
            backend.encode_special_tokens = self.split_special_tokens
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """transformers' encoding of one text: its ids and attention mask."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The text of `token_ids` (transformers' ``decode`` of one sequence: ids, one id, or a 1-d tensor)."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text: str = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.cleans_up if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return clean_up(text) if clean and self._cleans_when_asked else text

    @property
    def _cleans_when_asked(self) -> bool:
        # transformers 5 skips the clean-up for a BPE model even when it is asked for
        return type(self.backend_tokenizer.model).__name__ != "BPE"

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included (transformers' ``len(tokenizer)``)."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, added tokens left out (transformers' ``vocab_size``)."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> Any:
        """transformers' ``apply_chat_template`` for one conversation of role/content messages: the text, or (as
        transformers 5 returns it) its ids and attention mask, with `tools` (a list of JSON schema dicts, as
        transformers passes them to the template) where given.  Anything more -- tools given as Python functions,
        documents, batches, other options -- goes to the transformers tokenizer."""
        batch = bool(conversation) and isinstance(conversation[0], (list, tuple))
        tools = kwargs.get("tools")
        own_tools = set(kwargs) <= {"tools"} and (tools is None or all(isinstance(t, dict) for t in tools))
        if not own_tools or batch or not self._chat_ok or self.chat_template is None:
            return self.full().apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                   tokenize=tokenize, **kwargs)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self._template is None:
            self._template = _compiled_template(self.chat_template)
        messages = [{k: v for k, v in dict(m).items() if v is not None} for m in conversation]
        text: str = self._template.render(messages=messages, tools=tools, documents=None,
                                          add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return self(text, add_special_tokens=False) if tokenize else text


def _ids(value: Any) -> list[int]:
    """Token ids from what transformers returns (a list, or a BatchEncoding)."""
    if isinstance(value, dict) or hasattr(value, "input_ids"):
        value = value["input_ids"]
    return [int(i) for i in value]


def probe_texts(hf: Any) -> list[str]:
    """PROBES, and each special token alone and inside text."""
    specials = [t for t in hf.special_tokens_map.values() if isinstance(t, str)]
    return list(PROBES) + specials + [f"a{t}b {t} c" for t in specials]


def agrees(lean: LeanTokenizer, hf: Any) -> tuple[bool, bool]:
    """(texts, chat): whether `lean` encodes and decodes every probe as `hf` does, and renders and encodes
    every chat probe alike (False where either raises)."""
    # transformers refuses (with a warning) to clean up a BPE vocabulary's text even when asked: not asked here
    cleanups = (None, False) if type(lean.backend_tokenizer.model).__name__ == "BPE" else (None, False, True)
    try:
        for text in probe_texts(hf):
            for special in (True, False):
                ids = _ids(hf(text, add_special_tokens=special))
                if lean.encode(text, add_special_tokens=special) != ids:
                    return False, False
                for skip in (True, False):
                    for clean in cleanups:
                        if lean.decode(ids, skip, clean) != hf.decode(ids, skip_special_tokens=skip,
                                                                      clean_up_tokenization_spaces=clean):
                            return False, False
    except Exception:  # noqa: BLE001 -- a tokenizer the snapshot cannot stand for: transformers keeps it
        return False, False
    if not isinstance(hf.chat_template, str):
        return True, hf.chat_template is None
    try:
        for turns in CHAT_PROBES:
            messages = [{"role": role, "content": content} for role, content in turns]
            for opened in (True, False):
                want = _ids(hf.apply_chat_template(messages, add_generation_prompt=opened, tokenize=True))
                if _ids(lean.apply_chat_template(messages, add_generation_prompt=opened)) != want:
                    return True, False
    except Exception:  # noqa: BLE001 -- a template only transformers renders (or none renders): it keeps chat
        return True, False
    return True, True


def snapshot(hf: Any) -> tuple[dict[str, Any], str] | None:
    """(metadata, the Rust tokenizer's JSON) of the transformers tokenizer `hf`, or None when it has no Rust
    tokenizer or the snapshot would answer a probe differently."""
    backend = getattr(hf, "backend_tokenizer", None)  # a slow (Python) tokenizer has none
    if backend is None:
        return None
    source = backend.to_str()
    template = hf.chat_template
    meta = {"format": SNAPSHOT_FORMAT, "eos_token_id": hf.eos_token_id, "bos_token_id": hf.bos_token_id,
            "pad_token_id": hf.pad_token_id, "special_tokens_map": dict(hf.special_tokens_map),
            "chat_template": template if isinstance(template, str) else None,
            "split_special_tokens": bool(hf.split_special_tokens),
            "cleans_up": bool(hf.clean_up_tokenization_spaces), "chat_ok": True,
            "backend": hashlib.sha256(source.encode()).hexdigest()[:24]}
    texts, chat = agrees(LeanTokenizer(meta, _backend(meta["backend"], lambda: source), lambda: hf), hf)
    if not texts:
        return None
    meta["chat_ok"] = chat
    return meta, source


def _backend(digest: str, source: Callable[[], str]) -> tokenizers.Tokenizer:
    """The Rust tokenizer whose JSON (`source()`, read only when needed) has this digest, parsed once per process
    (0.37 s for a 151,936-token vocabulary), neither truncating nor padding."""
    import tokenizers

    with _LOCK:
        if digest not in _BACKENDS:
            rust = tokenizers.Tokenizer.from_str(source())
            rust.no_truncation()
            rust.no_padding()
            _BACKENDS[digest] = rust
        return _BACKENDS[digest]


def lean_tokenizer(key: str, cache_dir: Path, load_full: Callable[[], Any]) -> Any:
    """The tokenizer whose vocab.tokenizer_key is `key`: a LeanTokenizer from its snapshot in `cache_dir`
    (taken from ``load_full()``, the transformers tokenizer, when there is none), or that transformers
    tokenizer itself when no snapshot can stand for it.  A damaged snapshot is taken again, with one line."""
    meta_path = cache_dir / f"{key}.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if meta.get("format") == SNAPSHOT_FORMAT:
                if meta.get("lean") is False:
                    return load_full()
                saved = cache_dir / f"backend-{meta['backend']}.json"
                return LeanTokenizer(meta, _backend(meta["backend"], lambda: saved.read_text(encoding="utf-8")),
                                     load_full)
        except Exception as e:  # noqa: BLE001 -- truncated or damaged: taken again below
            print(f"specdec: the tokenizer snapshot {meta_path} could not be read ({type(e).__name__}); "
                  "taking it again", file=sys.stderr)
    hf = load_full()
    taken = snapshot(hf)
    if taken is None:
        write_atomically(meta_path, json.dumps({"format": SNAPSHOT_FORMAT, "lean": False}))
        return hf
    meta, source = taken
    write_atomically(cache_dir / f"backend-{meta['backend']}.json", source)
    write_atomically(meta_path, json.dumps(meta))
    lean = LeanTokenizer(meta, _backend(meta["backend"], lambda: source), load_full)  # parsed by snapshot()
    lean._full = hf  # already loaded: nothing to load again
    return lean
