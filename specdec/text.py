"""A request's text, in and out: the prompt's one check, chat templating, and the output as it streams.

Every entry point reads these from here, and nothing else words them: :func:`check_prompt` is the one
check of a prompt (one text per fault, whoever sends it: the CLI, the server, the Python API, the decode
loop's own callers); :func:`chat_ids` is the one place a conversation goes through a chat template (the
engine's ``chat`` option, the server's chat endpoint, ``train-drafter``'s prompts); :class:`TextStream`
turns the tokens a generation emits step by step into text that is safe to print (the CLI's stream, the
server's events), and :func:`cut_at_stop` cuts a whole answer at its stop strings.

On the ground floor (tests/test_structure.py): it imports no torch and no transformers, so the CLI reads
it before anything loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specdec.errors import SpecdecError

EMPTY_PROMPT = "the prompt is empty: give some text to continue"


class PromptError(SpecdecError):
    """A prompt no request can run (check_prompt).  `too_long`: it does not fit the context window (the
    server answers it as OpenAI does, context_length_exceeded); else it is empty or names unknown tokens."""

    def __init__(self, message: str, too_long: bool = False) -> None:
        super().__init__(message)
        self.too_long = too_long


def check_prompt(prompt: str | Sequence[int], max_context: int | None = None, vocab_size: int | None = None) -> None:
    """Refuse a prompt that cannot be decoded, with a PromptError: an empty one (text, or token ids); with
    `vocab_size`, token ids outside 0..vocab_size - 1; with `max_context`, ids that fill the context window
    (it must hold the prompt and the first token after it).  Text is checked for emptiness alone: its ids,
    once encoded, are what the window holds."""
    if not prompt:
        raise PromptError(EMPTY_PROMPT)
    if isinstance(prompt, str):
        return
    if vocab_size is not None and not all(0 <= t < vocab_size for t in prompt):
        raise PromptError(f"prompt: token ids must be in 0..{vocab_size - 1}")
    if max_context is not None and len(prompt) >= max_context:
        raise PromptError(f"the prompt has {len(prompt)} tokens, which does not fit the model's context window "
                          f"of {max_context} tokens", too_long=True)


class ChatTemplateError(SpecdecError):
    """A conversation the chat template cannot take.  `missing`: the tokenizer has none (the server answers
    no_chat_template); else the template refused these messages (roles, order...)."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def chat_ids(tokenizer: Any, messages: Sequence[tuple[str, str]] | Sequence[dict[str, Any]], name: str = "",
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    """(role, content) turns, a user turn last, through `tokenizer`'s chat template with the assistant's turn
    opened: token ids.  A ChatTemplateError where the tokenizer has no template (`name`: the target, in the
    message) or where the template refuses the turns.  (Newer transformers return a BatchEncoding there, older ones
    the list: the template's result is read either way.)  Messages already in the template's shape (dicts, and
    `tools`) are what specdec.chat passes for an OpenAI request."""
    if not getattr(tokenizer, "chat_template", None):
        target = f"target '{name}'" if name else "the target"
        raise ChatTemplateError(f"{target} has no chat template; drop --chat", missing=True)
    turns = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
    extra = {} if tools is None else {"tools": tools}  # no `tools` argument at all without: as before
    try:
        ids: Any = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, **extra)
    except Exception as e:  # a template that refuses these messages: its own raise_exception, or jinja's errors
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """Text up to (not including) the first stop string, as OpenAI-style APIs return it."""
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
    return text[:cut]


class TextStream:
    """Turns a growing list of token ids into text deltas that are safe to print.

    Holds back a trailing partial UTF-8 character, and the last few characters
    that might be the start of a stop string, until they are known.
    """

    def __init__(self, decode_fn: Callable[[Sequence[int]], str], stop_strings: Sequence[str] = ()) -> None:
        self.decode_fn = decode_fn
        self.stop_strings = tuple(stop_strings)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.printed = 0

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """The text the tokens add (all that is known so far with `final`, the generation's last tokens)."""
        self.token_ids.extend(tokens)
        text = cut_at_stop(self.decode_fn(self.token_ids), self.stop_strings)
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character
            text = text[: max(self.printed, len(text) - self.hold)]
        delta = text[self.printed :]
        self.printed = len(text)
        return delta
