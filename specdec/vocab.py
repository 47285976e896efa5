"""Tokenizer compatibility: when may a draft's token ids be used as the target's?

Two tokenizers are the same when they map the same strings to the same ids.
The models' embedding matrices may still differ in width (padding rows, e.g.
151936 vs 152064): that is handled by cutting/padding logits, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when both tokenizers have identical token -> id maps (added tokens included)."""
    if a is b:
        return True
    return a.get_vocab() == b.get_vocab()
