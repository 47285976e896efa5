"""A draft model's trimmed vocabulary: the N tokens it proposes among (FR-Spec, Zhao et al. 2025, "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", arXiv 2502.14856).

Why: the default draft, qwen2.5-coder-0.5b (hidden 896, 151,936 tokens), spends a large part of each drafted
token in its LM head: 151,936 x 896 weights in int4 are 85 MB of the 309 MB a drafted token reads.  A draft
that computes the logits of N frequent tokens only reads N / 151,936 of that.  Lossless: only the draft
changes; it proposes the argmax over the N (greedy) or samples from q = softmax over the N, zero elsewhere,
and the target verifies every token as before (the speculative-sampling rule is exact for any q).  What it
costs is the acceptance of the tokens the target would have taken outside the N.

Which N tokens (measured, BENCHMARKS.md "The draft's vocabulary trimmed"): the tokenizer's own order, then the
request's context.  A byte-level BPE vocabulary lists its tokens in merge order (Qwen2's and SmolLM2's: each
merge's token has the next id, checked), and a pair is merged because it is frequent in the tokenizer's
broad, multilingual training corpus; Gemma 3's SentencePiece vocabulary is ordered by score alike.  So the
lowest ids are the frequent tokens, with no data at all: nothing shipped, nothing built.  On top of that set
the draft proposes every token of the request's context, its prompt and its answer so far (ModelDrafter,
LeanRunner.extend_head: a second, small product): a prompt's tokens are likely in its answer (code, documents
to summarize or answer from) and an answer repeats its own.  The end-of-sequence ids and the special tokens
the chat template or the special-tokens map names are always in the set.

Measured on qwen2.5-coder-1.5b's greedy answers to the 79 prompts of the built-in set (chat, 64 tokens), the
int4 0.5B's γ = 3 acceptance (simulated from its teacher-forced argmax over each set: 0.619 with the whole
vocabulary, against 0.624 in the loop), for N = 16,384 / 32,768 / 49,152 / 65,536: merge order alone 0.515 /
0.559 / 0.582 / 0.598; with the context 0.569 / 0.587 / 0.599 / 0.605.  Counting the tokens of Python's
standard library (31 MB of installed text, the text specdec could build a table from once) did no better:
0.446 / 0.512 / 0.588 / 0.604 alone, 0.570 / 0.588 / 0.597 / 0.604 for a quarter of the set taken by count
with the context, and tokenizing it took five minutes on the 2-core Zen 4.  Adding the answers of earlier
requests gained 0.3-0.7 points more but would make one request's drafts, and so a seeded sample's text,
depend on the requests before it: left out.  DEFAULT_DRAFT_VOCAB is the smallest N whose cost stayed within
two points, 65,536 (1.4 points: 0.625 against 0.639 in the loop on the first two prompts of each category),
whose head reads 37 of the 85 MB.

The head itself: specdec.native.lean.TrimmedHead (the int4 draft's head rows gathered,
specdec.native.int4.Int4Linear.rows: its logits are bitwise the full head's at those ids), set on the draft's
runner by LeanRunner.trim_head; specdec.drafters.model.ModelDrafter maps its columns back to token ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecdecError

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads this module's names at every start
    import torch

VOCAB_AUTO = "auto"  # DEFAULT_DRAFT_VOCAB tokens where the draft's head can be trimmed and is larger, else the whole vocabulary
VOCAB_FULL = "full"  # the whole vocabulary: no trimming
DEFAULT_DRAFT_VOCAB = 65536  # see the module doc: the measured cost in acceptance against the head's bytes
AUTO_MIN_VOCAB = 100_000  # VOCAB_AUTO trims the drafts of larger vocabularies only (where it was measured: Qwen's)
MIN_DRAFT_VOCAB = 1


def parse_draft_vocab(value: str | int | None) -> str | int:
    """A --draft-vocab value, "auto" (or None), "full" or a number of tokens (>= MIN_DRAFT_VOCAB; "32,768" too),
    as VOCAB_AUTO, VOCAB_FULL or an int; a SpecdecError for anything else."""
    if value is None or value == VOCAB_AUTO:
        return VOCAB_AUTO
    if value == VOCAB_FULL:
        return VOCAB_FULL
    try:
        size = int(str(value).replace("_", "").replace(",", "")) if not isinstance(value, int) else value
    except ValueError:
        raise SpecdecError(f"--draft-vocab takes a number of tokens, '{VOCAB_FULL}' or '{VOCAB_AUTO}', not {value!r}") from None
    if size < MIN_DRAFT_VOCAB:
        raise SpecdecError(f"--draft-vocab must be at least {MIN_DRAFT_VOCAB} tokens, got {size}")
    return size


def always_kept(tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> list[int]:
    """The ids a draft vocabulary always holds, however rare: the end-of-sequence ids and the tokenizer's
    special tokens that its special-tokens map or its chat template names (end of turn, tool calls, ...), so
    that the draft can propose the end of an answer.  Not every added token: Gemma 3's 6,000 unused ones
    would cost head rows for nothing."""
    backend = tokenizer.backend_tokenizer
    named: set[str] = set()
    for value in (getattr(tokenizer, "special_tokens_map", None) or {}).values():
        named.update([value] if isinstance(value, str) else [str(v) for v in value])
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        named.update(token.content for token in backend.get_added_tokens_decoder().values()
                     if token.content in template)
    ids = {backend.token_to_id(token) for token in named}
    return sorted({int(i) for i in ids if i is not None} | {int(i) for i in eos_token_ids})


def ranked_ids(tokenizer: Any) -> torch.Tensor:
    """Every token id of the tokenizer's base vocabulary, most frequent first: its own order (a BPE's merge order,
    a SentencePiece vocabulary's score order; see the module doc), added tokens left out."""
    import torch

    return torch.arange(int(tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)))


def draft_vocabulary(tokenizer: Any, size: int, width: int, eos_token_ids: Iterable[int] = ()) -> torch.Tensor:
    """The `size` ids a trimmed draft head keeps, ascending [N] (int64, each < `width`, the draft head's rows):
    the always_kept ids, then the most frequent (ranked_ids) up to `size` in all."""
    import torch

    kept = [i for i in always_kept(tokenizer, eos_token_ids) if i < width]
    chosen = set(kept)
    for i in ranked_ids(tokenizer).tolist():
        if len(chosen) >= size:
            break
        if i < width:
            chosen.add(i)
    return torch.tensor(sorted(chosen), dtype=torch.int64)
