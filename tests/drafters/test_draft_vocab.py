"""A draft that proposes among some of its vocabulary only (FR-Spec; specdec.drafters.draft_vocab).

- Exactness: speculative greedy == plain greedy, token for token, with drafts whose heads are trimmed to
  a third of the vocabulary (the target's own int8 weights: long runs accepted, rejected wherever the
  target's token is outside the kept ones; an unrelated int4 draft), γ = 1..8 and hypothesis prompts.
- The vocabulary: deterministic, the most frequent ids (the tokenizer's merge order) and always the
  end-of-sequence and chat-template special tokens, however rare; the option's values.
- The engine trims a draft that can be trimmed and refuses a number for one that cannot.
(The sampled distribution through the loop with a trimmed draft: tests/algorithm/test_sampling_loop.py.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.algorithm.loop import StopCondition, run
from specdec.backends.hf import HFRunner
from specdec.drafters.draft_vocab import (
    VOCAB_AUTO,
    VOCAB_FULL,
    always_kept,
    draft_vocabulary,
    parse_draft_vocab,
    ranked_ids,
)
from specdec.drafters.model import ModelDrafter
from specdec.errors import SpecdecError
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from specdec.runtime.engine import Engine
from tests.tiny import VOCAB, tiny_model, tiny_tokenizer

TARGET_MODEL = quantize_model(tiny_model("qwen2", 0))  # int8: batch-invariant, so plain greedy is exact
OTHER_MODEL = quantize_model(tiny_model("qwen2", 1))
KEPT = torch.arange(1, VOCAB, 3)  # a third of the vocabulary


def trimmed_draft(kind: str) -> ModelDrafter:
    """The target's own weights ("self", int8) or an unrelated model's in int4 ("other"), head trimmed to KEPT."""
    runner = LeanRunner(TARGET_MODEL) if kind == "self" else LeanRunner(OTHER_MODEL, int4=True)
    runner.trim_head(KEPT)
    return ModelDrafter(runner)


def plain(prompt: list[int], max_new: int) -> list[int]:
    return run(LeanRunner(TARGET_MODEL), prompt, StopCondition(max_new)).token_ids


@pytest.mark.parametrize("kind", ["self", "other"])
@pytest.mark.parametrize("gamma", range(1, 9))
def test_speculative_greedy_with_a_trimmed_draft_equals_plain_greedy(kind, gamma):
    prompt = [5, 9, 13, 2 + gamma]
    reference = plain(prompt, 40)
    assert any(t not in KEPT.tolist() for t in reference)  # the draft cannot propose some of the target's tokens
    out = run(LeanRunner(TARGET_MODEL), prompt, StopCondition(40), drafter=trimmed_draft(kind),
              num_speculative_tokens=gamma)
    assert out.token_ids == reference
    assert 0 < out.stats.drafted and out.stats.accepted < out.stats.drafted  # rejections happened
    if kind == "self":
        assert out.stats.accepted > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=16), gamma=st.integers(1, 8),
       kind=st.sampled_from(["self", "other"]))
def test_speculative_greedy_with_a_trimmed_draft_equals_plain_hypothesis(prompt, gamma, kind):
    out = run(LeanRunner(TARGET_MODEL), prompt, StopCondition(16), drafter=trimmed_draft(kind),
              num_speculative_tokens=gamma)
    assert out.token_ids == plain(prompt, 16)


def chat_tokenizer():
    """The tiny tokenizer with a chat template naming two special tokens added at its end (the last ids)."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|turn|>", "<|end|>", "<|unused|>"]})
    tok.chat_template = "{% for m in messages %}<|turn|>{{ m['content'] }}<|end|>{% endfor %}"
    return tok


def test_the_vocabulary_is_the_most_frequent_ids_and_always_the_special_tokens():
    tok = chat_tokenizer()
    turn, end, unused = (tok.convert_tokens_to_ids(t) for t in ("<|turn|>", "<|end|>", "<|unused|>"))
    assert min(turn, end, unused) >= 300  # rarer than any token of the base vocabulary
    assert ranked_ids(tok).tolist() == list(range(300))  # a BPE's merge order
    kept = set(always_kept(tok, eos_token_ids=[7]))
    assert {turn, end, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, 7} <= kept and unused not in kept
    ids = draft_vocabulary(tok, 64, width=len(tok), eos_token_ids=[7])
    assert len(ids) == 64 and ids.tolist() == sorted(ids.tolist())
    assert {turn, end, 7} <= set(ids.tolist()) and unused not in ids.tolist()
    lowest = [i for i in range(300) if i not in kept][: 64 - len(kept)]  # then the most frequent: the lowest ids
    assert ids.tolist() == sorted(kept | set(lowest))
    assert torch.equal(ids, draft_vocabulary(chat_tokenizer(), 64, width=len(tok), eos_token_ids=[7]))  # deterministic
    assert max(draft_vocabulary(tok, 64, width=200).tolist()) < 200  # never past the draft head's rows


def test_the_option_takes_a_number_full_or_auto():
    assert parse_draft_vocab(None) == parse_draft_vocab("auto") == VOCAB_AUTO
    assert parse_draft_vocab("full") == VOCAB_FULL
    assert parse_draft_vocab("32768") == parse_draft_vocab("32,768") == parse_draft_vocab(32768) == 32768
    for bad in ("lots", "0", "-5"):
        with pytest.raises(SpecdecError):
            parse_draft_vocab(bad)


def test_the_engine_trims_a_draft_that_can_be_trimmed_and_refuses_one_that_cannot():
    tok = tiny_tokenizer()
    target = tiny_model("llama", 0, vocab_size=len(tok))
    draft = LeanRunner(quantize_model(tiny_model("llama", 1, vocab_size=len(tok))), int4=True)
    engine = Engine(target, tok, draft, tok)
    engine.trim_draft_vocabulary(VOCAB_AUTO)  # auto: a vocabulary this small is left whole
    assert draft.head_ids is None
    engine.trim_draft_vocabulary(100)
    assert draft.head_ids is not None and len(draft.head_ids) == 100
    assert engine.generate("def f", max_new_tokens=12, k=3).token_ids == \
        Engine(target, tok).generate("def f", max_new_tokens=12).token_ids
    engine.trim_draft_vocabulary(VOCAB_FULL)
    assert draft.head_ids is None
    engine.trim_draft_vocabulary(100)
    engine.trim_draft_vocabulary(VOCAB_AUTO)  # auto again: whole
    assert draft.head_ids is None
    with pytest.raises(SpecdecError, match="draft-vocab"):
        Engine(target, tok, HFRunner(tiny_model("llama", 1, vocab_size=len(tok))), tok).trim_draft_vocabulary(100)
