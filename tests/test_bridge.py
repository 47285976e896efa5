"""Tokenizer bridges: no text lost or invented in either direction (hypothesis, arbitrary unicode).

Tiny tokenizers trained here run always; the real Qwen, SmolLM2 and Gemma
tokenizers (marked `real`: they come with the zoo models) run in CI.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from specdec.bridge import REPLACEMENT, TextBridge, TokenizerSide, VocabularyMap, special_prefix
from tests.tiny import tiny_tokenizer

TEXT = st.text(max_size=60)  # arbitrary unicode: CJK, emoji, combining marks, control characters
CODE = st.sampled_from([
    "def f(x):\n    return x\n", "\tif a:\n\t\tb()\n", "    for i in range(10):\n        print(i)",
    "x = [1, 2, 3]  # list", "12345.678 + 9e-3", "日本語のテキスト", "emoji 🙂👍🏽 end", "naïve café",
    "  leading spaces", "trailing spaces   ", "\n\n\nnewlines\n",
])
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def roundtrip(side: TokenizerSide, text: str) -> str:
    """What the tokenizer makes of text (its normalisation, e.g. NFC), the most any bridge can keep."""
    return side.decode(side.encode(text))


def check_to_draft(bridge: TextBridge, text: str) -> None:
    target_ids = bridge.target.prefix + bridge.target.encode(text)
    target_text = bridge.target.decode(bridge.target.body(target_ids))
    draft_ids = bridge.to_draft(target_ids)
    if target_text.endswith(REPLACEMENT):
        assert draft_ids is None
        return
    assert draft_ids[: len(bridge.draft.prefix)] == bridge.draft.prefix  # BOS once, at the front
    assert bridge.draft.decode(bridge.draft.body(draft_ids)) == roundtrip(bridge.draft, target_text)


def check_to_target(bridge: TextBridge, before: str, text: str) -> None:
    target_ids = bridge.target.prefix + bridge.target.encode(before)
    candidates = bridge.to_target(target_ids, text)
    old = bridge.target.decode(bridge.target.body(target_ids))
    new = bridge.target.decode(bridge.target.body(target_ids) + candidates)
    assert roundtrip(bridge.target, new) == roundtrip(bridge.target, old + text)


def check_proposal_text(bridge: TextBridge, before: str, proposal_text: str) -> None:
    draft_ids = bridge.draft.prefix + bridge.draft.encode(before)
    proposal = bridge.draft.encode(proposal_text)
    text = bridge.proposal_text(draft_ids, proposal)
    whole = bridge.draft.decode(bridge.draft.body(draft_ids) + proposal)
    start = bridge.draft.decode(bridge.draft.body(draft_ids))
    assume(whole.startswith(start))  # the bridge gives "" when decoding is not prefix-stable
    assert text == whole[len(start):].rstrip(REPLACEMENT)


# --- tiny tokenizers (always run) --------------------------------------------

TINY = TextBridge(tiny_tokenizer(0), tiny_tokenizer(1))


@SETTINGS
@given(text=st.one_of(TEXT, CODE))
def test_tiny_to_draft(text):
    check_to_draft(TINY, text)


@SETTINGS
@given(before=st.one_of(TEXT, CODE), text=st.one_of(TEXT, CODE))
def test_tiny_to_target(before, text):
    check_to_target(TINY, before, text)


@SETTINGS
@given(before=st.one_of(TEXT, CODE), proposal=st.one_of(TEXT, CODE))
def test_tiny_proposal_text(before, proposal):
    check_proposal_text(TINY, before, proposal)


def test_partial_character_is_held_back():
    side = TINY.target
    ids = side.encode("🙂")
    assert len(ids) > 1  # byte-level: the emoji is several byte tokens
    assert TINY.to_draft(ids[:-1]) is None
    assert TINY.proposal_text(TINY.draft.encode("a"), TINY.draft.encode("🙂")[:-1]) == ""


def test_lookbehind_window_starts_on_a_character():
    bridge = TextBridge(tiny_tokenizer(0), tiny_tokenizer(1), lookbehind=2)
    ids = bridge.draft.encode("x🙂🙂")
    assert len(bridge.draft.encode("🙂")) > 2  # so a 2-token window would start inside the second emoji
    window = bridge.window(bridge.draft, ids)
    assert bridge.draft.decode(window) == "🙂"
    assert bridge.proposal_text(ids, bridge.draft.encode(" y")) == " y"


def test_tiny_vocabulary_map_pairs_identical_tokens():
    a, b = tiny_tokenizer(0), tiny_tokenizer(1)
    vocab_map = VocabularyMap.from_tokenizers(a, b, len(a), len(b))
    assert len(vocab_map) > 0
    for d, t in zip(vocab_map.draft_ids.tolist(), vocab_map.target_ids.tolist()):
        assert b.convert_ids_to_tokens(d) == a.convert_ids_to_tokens(t)


# --- real tokenizers (CI) ----------------------------------------------------


@pytest.fixture(scope="module")
def real_tokenizers():
    from transformers import AutoTokenizer

    from specdec import zoo
    from tests.conftest import user_home

    with user_home():
        return {name: AutoTokenizer.from_pretrained(zoo.hf_dir(name))
                for name in ("qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m")}


PAIRS = [("qwen2.5-coder-1.5b", "smollm2-135m"), ("qwen2.5-coder-1.5b", "gemma3-270m"),
         ("smollm2-135m", "qwen2.5-coder-1.5b"), ("gemma3-270m", "qwen2.5-coder-1.5b")]


@pytest.mark.real
@pytest.mark.parametrize("pair", PAIRS, ids="<-".join)
def test_real_bridges_lose_and_invent_nothing(real_tokenizers, pair):
    bridge = TextBridge(real_tokenizers[pair[0]], real_tokenizers[pair[1]])

    @SETTINGS
    @given(before=st.one_of(TEXT, CODE), text=st.one_of(TEXT, CODE))
    # Found by hypothesis: a lookbehind window that began inside a 4-byte character made Gemma's
    # byte-fallback decoder replace the whole run of byte tokens, the proposal's too.
    @example(before="\U00010000\U00010000\x00", text="\u02f7")
    def check(before, text):
        check_to_draft(bridge, before + text)
        check_to_target(bridge, before, text)
        check_proposal_text(bridge, before, text)

    check()


@pytest.mark.real
def test_real_special_prefixes(real_tokenizers):
    assert special_prefix(real_tokenizers["gemma3-270m"]) == [real_tokenizers["gemma3-270m"].bos_token_id]
    assert special_prefix(real_tokenizers["qwen2.5-coder-1.5b"]) == []
    assert special_prefix(real_tokenizers["smollm2-135m"]) == []


@pytest.mark.real
@pytest.mark.parametrize("draft", ["smollm2-135m", "gemma3-270m"])
def test_real_vocabulary_maps(real_tokenizers, draft):
    target = real_tokenizers["qwen2.5-coder-1.5b"]
    d = real_tokenizers[draft]
    vocab_map = VocabularyMap.from_tokenizers(target, d, len(target), len(d))
    assert len(vocab_map) > 20_000
    # A shared token decodes to the same text on both sides.
    for j in range(0, len(vocab_map), 997):
        dt, tt = int(vocab_map.draft_ids[j]), int(vocab_map.target_ids[j])
        assert d.decode([dt]) == target.decode([tt])
    # The chat tokens both ChatML vocabularies have are shared (EOS included).
    if draft == "smollm2-135m":
        im_end = target.convert_tokens_to_ids("<|im_end|>")
        assert im_end in vocab_map.target_ids.tolist()
