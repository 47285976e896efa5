"""OpenAI chat requests through a chat template (specdec.chat): with tools, tool calls and tool results, the zoo's
Qwen2.5 template gives exactly transformers' own rendering, token for token, through the lean tokenizer and the
transformers one alike; a template that cannot render tools and malformed messages are one-line
ChatTemplateErrors; plain turns render as text.chat_ids does."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from specdec.chat import openai_chat_ids, template_messages
from specdec.text import ChatTemplateError, chat_ids
from specdec.tokenizer import LeanTokenizer
from specdec.vocab import fast_tokenizer
from tests.test_tokenizer import wordpiece_folder

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Paris "},
                                                                               {"type": "text", "text": "weather?"}]}],
    [{"role": "user", "content": "Weather in Paris and the time?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
     {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
     {"role": "assistant", "content": "21 °C at noon."}, {"role": "user", "content": "Thanks. And Rome?"}],
    [{"role": "user", "content": "Rome?"},
     {"role": "assistant", "content": "Let me look.", "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
     {"role": "tool", "tool_call_id": "c", "content": "sunny"}],
]


@pytest.fixture(scope="module")
def qwen():
    """(transformers' tokenizer, the lean one) of the zoo's Qwen2.5, from the user's model cache."""
    from specdec import zoo
    from tests.conftest import user_home

    with user_home():
        folder = zoo.home() / zoo.CONVERTED / "qwen2.5-coder-1.5b"
    if not (folder / "tokenizer.json").exists():
        pytest.skip("the zoo's Qwen2.5 tokenizer is not in the model cache")
    lean = fast_tokenizer(str(folder))  # a snapshot taken in this session's temporary home
    assert isinstance(lean, LeanTokenizer)
    return AutoTokenizer.from_pretrained(str(folder)), lean


def hf_form(messages: list[dict]) -> list[dict]:
    """The messages as a caller of transformers writes them for Qwen's template: arguments as objects, text parts
    joined, no null content."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("tools", [[WEATHER, TIME], [WEATHER], None], ids=["two", "one", "none"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_qwen_renders_tools_as_transformers(qwen, tools, index):
    hf, lean = qwen
    messages = CONVERSATIONS[index]
    want = list(hf.apply_chat_template(hf_form(messages), tools=tools, add_generation_prompt=True,
                                       tokenize=True)["input_ids"])
    for tok in (lean, hf):
        assert openai_chat_ids(tok, messages, tools) == want
    text = hf.decode(want)
    assert ("<tools>" in text) == bool(tools)
    if tools:
        assert all(json.dumps(t, ensure_ascii=False) in text for t in tools)  # each schema, as tojson writes it
    if index == 2:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
            in text and "<tool_response>\n12:00\n</tool_response>" in text


def test_lean_renders_tools_without_transformers(qwen):
    hf, lean = qwen
    lean._full = None
    lean._loader = lambda: pytest.fail("the lean tokenizer loaded transformers to render tools")
    text = lean.apply_chat_template(hf_form(CONVERSATIONS[2]), tools=[WEATHER], add_generation_prompt=True,
                                    tokenize=False)
    assert text == hf.apply_chat_template(hf_form(CONVERSATIONS[2]), tools=[WEATHER], add_generation_prompt=True,
                                          tokenize=False)


def test_plain_turns_render_as_chat_ids(qwen):
    hf, lean = qwen
    turns = [("system", "S"), ("user", "Hi"), ("assistant", "Hello"), ("user", "Bye")]
    assert openai_chat_ids(lean, [{"role": r, "content": c} for r, c in turns]) == chat_ids(lean, turns)
    developer = [{"role": "developer", "content": "S"}] + [{"role": r, "content": c} for r, c in turns[1:]]
    assert openai_chat_ids(lean, developer) == chat_ids(lean, turns)  # OpenAI's developer role: the system turn
    assert openai_chat_ids(lean, [{"role": "user", "content": "x"}], tools=[]) == chat_ids(lean, [("user", "x")])


def test_a_template_without_tools_refuses_them(tmp_path):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tok = fast_tokenizer(wordpiece_folder(tmp_path, template))
    messages = [{"role": "user", "content": "hello world"}]
    assert openai_chat_ids(tok, messages) == chat_ids(tok, [("user", "hello world")])
    with pytest.raises(ChatTemplateError, match="cannot render tools") as e:
        openai_chat_ids(tok, messages, [WEATHER], name="tiny")
    assert "\n" not in str(e.value) and "tiny" in str(e.value)


@pytest.mark.parametrize("messages, tools, match", [
    ([], None, "non-empty list"),
    ([{"role": "robot", "content": "x"}], None, "role must be one of"),
    ([{"role": "user"}], None, "needs a content"),
    ([{"role": "assistant", "content": None}], None, "needs a content or tool_calls"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], None, "only text parts"),
    ([{"role": "user", "content": 3}], None, "must be a string"),
    ([{"role": "tool", "content": "x"}], None, "tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [{}]}], None, "assistant message only"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
     None, "arguments is not JSON"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
     None, "must be a JSON object"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}], None,
     "name must be"),
    ([{"role": "user", "content": "x"}], {"type": "function"}, "tools must be a list"),
    ([{"role": "user", "content": "x"}], [{"type": "code"}], r"tools\[0\] must be"),
    ([{"role": "user", "content": "x"}], [WEATHER, WEATHER], "given twice"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "parameters": []}}],
     "parameters must be"),
])
def test_malformed_requests_are_one_line_errors(messages, tools, match):
    with pytest.raises(ChatTemplateError, match=match) as e:
        template_messages(messages)
        openai_chat_ids(object(), messages, tools)
    assert "\n" not in str(e.value)
