"""Constrained decoding: the tokens a grammar allows next, on llguidance (guidance-ai/llguidance, the library
llama.cpp and vLLM use; chosen by measurement in docs/structured-output.md).

A `Constraint` (specdec.constrain.spec: a JSON schema, any JSON object, a regex, a Lark or GBNF grammar, as a
request holds it) compiles to a `Grammar`, once per tokenizer and grammar (cached); each request walks it with its
own `Matcher`: the mask of allowed tokens, consuming tokens all-or-nothing, rolling back the last n (speculation:
drafts checked, then some rejected), and the tokens the grammar *forces* next.  `GrammarProcessor`
(specdec.constrain.processor) is the decode loop's view of a matcher: the mask on every row of target logits, drafts
cut at the first forbidden token, and the forced tokens as drafts that need no proposal (SGLang's jump-forward
decoding; issue 75).

Importing this package loads neither torch nor llguidance: `Constraint` is read from it at once, the rest when
first named.
"""

from __future__ import annotations

from typing import Any

from specdec.constrain.spec import Constraint

__all__ = ["Constraint", "Grammar", "GrammarProcessor", "Matcher", "grammar_tokenizer"]


def __getattr__(name: str) -> Any:
    if name in ("Grammar", "Matcher", "grammar_tokenizer"):
        from specdec.constrain import grammar

        return getattr(grammar, name)
    if name == "GrammarProcessor":
        from specdec.constrain.processor import GrammarProcessor

        return GrammarProcessor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
