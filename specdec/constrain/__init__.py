"""Constrained decoding: the tokens a grammar allows next, on llguidance (guidance-ai/llguidance, the library
llama.cpp and vLLM use; chosen by measurement in docs/structured-output.md).

A `Grammar` (a JSON schema, any JSON object, a regex, a Lark or GBNF grammar) is compiled once per tokenizer and
grammar and cached; each request walks it with its own `Matcher`: the mask of allowed tokens, consuming tokens
all-or-nothing, rolling back the last n (speculation: drafts checked, then some rejected), and the tokens the
grammar *forces* next.  A forced token is a draft that cannot be rejected (SGLang's jump-forward decoding): the
decode loop may append it without a proposal and verify it with the next forward (issue 75).
"""

from specdec.constrain.grammar import Grammar, Matcher, grammar_tokenizer

__all__ = ["Grammar", "Matcher", "grammar_tokenizer"]
