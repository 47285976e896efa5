"""A request's text (specdec.text): the prompt's one check and its one text per fault, chat templating's
errors, and the streamed text (never a broken character, never a piece of a stop string)."""

from __future__ import annotations

import pytest

from specdec.errors import SpecdecError
from specdec.text import EMPTY_PROMPT, ChatTemplateError, PromptError, TextStream, chat_ids, check_prompt, cut_at_stop


@pytest.mark.parametrize("prompt", ["", [], ()])
def test_an_empty_prompt_is_refused_in_one_text(prompt):
    with pytest.raises(PromptError, match=f"^{EMPTY_PROMPT}$") as caught:
        check_prompt(prompt, max_context=8, vocab_size=10)
    assert not caught.value.too_long and isinstance(caught.value, SpecdecError)


def test_token_ids_and_the_window():
    check_prompt("any text, however long " * 100, max_context=8, vocab_size=10)  # text: its ids are checked later
    check_prompt([0, 9] * 3 + [5], max_context=8, vocab_size=10)  # 7 ids: the window holds them and one token more
    with pytest.raises(PromptError, match=r"^prompt: token ids must be in 0\.\.9$"):
        check_prompt([1, 10], max_context=8, vocab_size=10)
    with pytest.raises(PromptError, match=r"^prompt: token ids must be in 0\.\.9$"):
        check_prompt([-1], vocab_size=10)
    with pytest.raises(PromptError, match="^the prompt has 8 tokens, which does not fit the model's context window "
                                          "of 8 tokens$") as caught:
        check_prompt([1] * 8, max_context=8)
    assert caught.value.too_long
    check_prompt([10**9] * 50)  # nothing to check ids against: only emptiness


class Template:
    """A tokenizer stand-in: a chat template that writes each turn's length and role, or that refuses."""

    def __init__(self, template: str | None = "t", refuse: bool = False, batch: bool = False) -> None:
        self.chat_template, self.refuse, self.batch = template, refuse, batch
        self.seen: list = []

    def apply_chat_template(self, turns, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        if self.refuse:
            raise ValueError("Conversation roles must alternate user/assistant")
        self.seen = turns
        ids = [len(turn["content"]) for turn in turns] + [99]
        return {"input_ids": ids} if self.batch else ids


@pytest.mark.parametrize("batch", [False, True])
def test_chat_ids_reads_the_templates_ids(batch):
    template = Template(batch=batch)
    assert chat_ids(template, [("system", "ab"), ("user", "xyz")], "tiny") == [2, 3, 99]
    assert template.seen == [{"role": "system", "content": "ab"}, {"role": "user", "content": "xyz"}]


def test_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="^target 'tiny' has no chat template; drop --chat$") as missing:
        chat_ids(Template(None), [("user", "hi")], "tiny")
    assert missing.value.missing
    with pytest.raises(ChatTemplateError, match="^the chat template refused these messages: Conversation roles") as refused:
        chat_ids(Template(refuse=True), [("user", "hi"), ("user", "again")], "tiny")
    assert not refused.value.missing


def decode_bytes(ids):
    """Token ids as bytes, decoded as a tokenizer does: an incomplete character is U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_a_partial_character():
    stream = TextStream(decode_bytes)
    euro = list("€".encode())  # three bytes
    assert [stream.push(list(b"ab")), stream.push(euro[:2]), stream.push(euro[2:])] == ["ab", "", "€"]


def test_text_stream_holds_back_what_may_start_a_stop_string():
    stream = TextStream(decode_bytes, stop_strings=["END"])
    pushed = [stream.push(list(b"abc")), stream.push(list(b"xE")), stream.push(list(b"N")),
              stream.push(list(b"D tail"), final=True)]
    assert pushed == ["a", "bc", "x", ""]  # the last two characters held: they may begin "END"
    assert "".join(pushed) == cut_at_stop(decode_bytes(list(b"abcxEND tail")), ["END"]) == "abcx"


def test_text_stream_gives_everything_at_the_end():
    stream = TextStream(decode_bytes, stop_strings=["STOP"])
    assert stream.push(list(b"hello ST")) == "hello"
    assert stream.push(list(b"O"), final=True) == " STO"  # no stop string came: the held text is text
