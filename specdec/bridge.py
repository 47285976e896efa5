"""Tokenizer bridges: let a draft model with another tokenizer draft for the target.

Universal assisted generation (Timor et al. 2025, "Accelerating LLM Inference
with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies";
the transformers implementation is `AssistedCandidateGeneratorDifferentTokenizers`)
moves sequences between vocabularies through text:

- target -> draft: the target's context is decoded to text and re-encoded
  with the draft's tokenizer (its BOS once, at the front).  The draft's KV
  cache is then cropped back to the first token where this re-encoding differs
  from what it holds (the longest common prefix), so only what changed is
  recomputed.  We re-encode the whole context rather than a lookbehind window:
  it is the limit of the windowed method with an unbounded window, can never
  misalign, and costs about a millisecond per thousand tokens — far below a
  forward pass.
- draft -> target: the draft's proposal is decoded with a lookbehind window
  of the tokens before it (so word-start markers and multi-byte characters
  decode as they do in context) and only the new text is kept; that text is
  appended to a lookbehind window of the target's tail and re-encoded with the
  target's tokenizer, and the tokens past the tail are the candidates.  If
  re-encoding would change the tail (the new text merges with the last
  token), the new text is encoded on its own instead.

A trailing incomplete UTF-8 character is never passed on: it decodes as
U+FFFD and would invent text.  Both directions are lossless for the output —
the target verifies whatever the bridge proposes — the bridge only decides
how often the draft is right.

`VocabularyMap` is the other bridge: the tokens whose byte strings exist in
both vocabularies, so that a draft restricted to them yields target ids and a
q over the target's vocabulary, verified with the standard speculative
sampling rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from specdec.vocab import decoded

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts in front of every encoded text (e.g. [<bos>]), often []."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    start = with_special.index(plain[0]) if plain and plain[0] in with_special else 0
    return list(with_special[:start])


class TokenizerSide:
    """Text <-> ids for one tokenizer, without its automatic special tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.prefix = special_prefix(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens included as their strings (nothing is dropped)."""
        return decoded(self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def body(self, ids: Sequence[int]) -> Sequence[int]:
        """ids without the automatic prefix (BOS), if they start with it."""
        n = len(self.prefix)
        return ids[n:] if n and list(ids[:n]) == self.prefix else ids


class TextBridge:
    """Moves a target context to the draft's tokens and draft proposals to target tokens, via text."""

    def __init__(
        self,
        target: PreTrainedTokenizerBase,
        draft: PreTrainedTokenizerBase,
        lookbehind: int = 8,
    ) -> None:
        self.target = TokenizerSide(target)
        self.draft = TokenizerSide(draft)
        self.lookbehind = lookbehind

    def to_draft(self, target_ids: Sequence[int]) -> list[int] | None:
        """The draft's ids for the target's context; None while it ends inside a character."""
        text = self.target.decode(self.target.body(target_ids))
        if text.endswith(REPLACEMENT):
            return None
        return self.draft.prefix + self.draft.encode(text)

    def window(self, side: TokenizerSide, ids: Sequence[int]) -> list[int]:
        """The last `lookbehind` tokens of ids, moved back (by at most 3 tokens) to start on a character.

        A window that starts inside a multi-byte character decodes its first bytes as U+FFFD, and a
        byte-fallback decoder (SentencePiece's) then replaces the whole run of byte tokens, the
        proposal's included.
        """
        body = list(side.body(ids))
        for extra in range(4):  # a UTF-8 character is at most 4 bytes
            window = body[-(self.lookbehind + extra) :]
            if len(window) == len(body) or not side.decode(window).startswith(REPLACEMENT):
                break
        return window

    def proposal_text(self, draft_ids: Sequence[int], proposal: Sequence[int]) -> str:
        """The text that `proposal` (draft ids) adds after `draft_ids`; a trailing partial character is cut."""
        window = self.window(self.draft, draft_ids)
        before = self.draft.decode(window)
        after = self.draft.decode(window + list(proposal))
        if not after.startswith(before):  # decoding is not prefix-stable here: propose nothing
            return ""
        return after[len(before) :].rstrip(REPLACEMENT)

    def to_target(self, target_ids: Sequence[int], text: str) -> list[int]:
        """Target ids that continue `target_ids` with `text` (tokenised as the target would, in context)."""
        if not text:
            return []
        tail = self.window(self.target, target_ids)
        ids = self.target.encode(self.target.decode(tail) + text)
        if ids[: len(tail)] == tail:
            return ids[len(tail) :]
        return self.target.encode(text)  # the text merges into the tail's last token: encode it alone


# --- vocabulary intersection -------------------------------------------------


@lru_cache(maxsize=1)
def _byte_level_decoding() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: each printable stand-in char -> its byte.

    Bytes that are printable (and not a space) stand for themselves; the rest
    are shifted to code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def token_keys(tokenizer: PreTrainedTokenizerBase) -> dict[int, tuple[str, bytes]]:
    """id -> a key naming what the token stands for: ("text", raw bytes) or ("special", its string).

    Byte-level BPE tokens are mapped through the byte alphabet; SentencePiece
    tokens have "▁" for a space and "<0xNN>" for a raw byte.
    """
    byte_level = "ByteLevel" in type(tokenizer.backend_tokenizer.decoder).__name__ if hasattr(
        tokenizer, "backend_tokenizer") else False
    alphabet = _byte_level_decoding()
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    keys: dict[int, tuple[str, bytes]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i in added:
            keys[i] = ("special", added[i].encode())
        elif byte_level:
            if all(c in alphabet for c in token):
                keys[i] = ("text", bytes(alphabet[c] for c in token))
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            keys[i] = ("text", bytes([int(token[3:5], 16)]))
        else:
            keys[i] = ("text", token.replace("\u2581", " ").encode())
    return keys


class VocabularyMap:
    """Tokens that mean the same bytes in both vocabularies (the intersection).

    draft_ids[j] and target_ids[j] are the same token; a draft restricted to
    draft_ids proposes target ids, and its q maps onto the target's vocabulary.
    """

    def __init__(self, pairs: dict[int, int], target_vocab_size: int) -> None:
        """pairs: draft id -> target id of the same token."""
        self.draft_ids = torch.tensor(sorted(pairs), dtype=torch.long)  # [S]
        self.target_ids = torch.tensor([pairs[i] for i in sorted(pairs)], dtype=torch.long)  # [S]
        self.target_vocab_size = target_vocab_size

    @classmethod
    def from_tokenizers(cls, target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase,
                        target_vocab_size: int, draft_vocab_size: int) -> VocabularyMap:
        """Pair the tokens that stand for the same bytes (or the same special token) in both."""
        by_key: dict[tuple[str, bytes], int] = {}
        for i, key in sorted(token_keys(target).items()):
            if i < target_vocab_size:
                by_key.setdefault(key, i)
        pairs: dict[int, int] = {}
        taken: set[int] = set()
        for i, key in sorted(token_keys(draft).items()):
            if i < draft_vocab_size and key in by_key and by_key[key] not in taken:
                pairs[i] = by_key[key]
                taken.add(by_key[key])
        return cls(pairs, target_vocab_size)

    def __len__(self) -> int:
        return len(self.draft_ids)

    def restrict(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [V_draft] -> [S], the shared tokens only."""
        return draft_logits[self.draft_ids]

    def to_target(self, shared_probs: torch.Tensor) -> torch.Tensor:
        """Probabilities [S] over the shared tokens -> [V_target] (zero elsewhere)."""
        out = shared_probs.new_zeros(self.target_vocab_size)
        out[self.target_ids] = shared_probs
        return out
