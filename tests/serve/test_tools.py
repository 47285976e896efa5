"""Tool calls (specdec.serve.tools): the Hermes/Qwen format parsed into OpenAI's tool_calls -- one call, two,
text before and after, malformed and unclosed blocks left as content; the streamed form, cut at every character
boundary (and in random pieces), gives what the whole answer gives; the grammar of tool_choice "required" or a
named function, walked with random logits on the zoo's Qwen2.5 tokenizer, always gives calls that parse and whose
arguments validate against their schema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.serve.tools import (
    ToolCallStream,
    call_id,
    chosen_tools,
    merged_delta,
    parse_tool_calls,
    tool_call_lark,
    tool_choice_grammar,
)
from tests.constrain.test_grammar import QWEN


def ids(i: int) -> str:
    return f"call_{i}"


def block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


ONE = block("get_weather", '{"city": "Paris"}')
TWO = block("get_time", '{"zone": "CET", "nested": {"a": [1, 2]}}')
BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
CASES = {
    "one": (ONE, None, [("get_weather", {"city": "Paris"})]),
    "two": (ONE + "\n" + TWO, None, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "nested": {"a": [1, 2]}})]),
    "text before": ("Let me check.\n\n" + ONE, "Let me check.", [("get_weather", {"city": "Paris"})]),
    "text around": ("A <b>x</b> <tool\n" + ONE + "\n  after it\n", "A <b>x</b> <toolafter it\n",
                    [("get_weather", {"city": "Paris"})]),
    "malformed": ("Here: " + BAD, "Here: " + BAD, []),
    "malformed then good": (BAD + "\n" + ONE, BAD, [("get_weather", {"city": "Paris"})]),
    "good then malformed": (ONE + "\n" + BAD + " ", BAD + " ", [("get_weather", {"city": "Paris"})]),
    "not an object": ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "string arguments": ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
                         '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    "no arguments": ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
    "unclosed": ("ok " + ONE[:30], "ok " + ONE[:30], []),
    "nested open": ("<tool_call> " + ONE, "<tool_call> " + ONE, []),  # the first open tag's block: not JSON
    "plain": ("  just text, <tool_ and </tool_call>  ", "  just text, <tool_ and </tool_call>  ", []),
    "empty": ("", "", []),
    "unicode": (block("wetter", '{"stadt": "Zürich 🌧"}'), None, [("wetter", {"stadt": "Zürich 🌧"})]),
}


@pytest.mark.parametrize("name", CASES)
def test_parse_whole_answers(name):
    text, content, calls = CASES[name]
    parsed = parse_tool_calls(text, ids)
    assert parsed.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls
    assert all(c["id"] == f"call_{i}" and c["type"] == "function" and isinstance(c["function"]["arguments"], str)
               for i, c in enumerate(parsed.tool_calls))


def streamed(pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """(the content, the calls rebuilt from the deltas, the deltas) of an answer fed in `pieces`."""
    stream = ToolCallStream(ids)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content, calls = "", []
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert d["content"]  # never an empty delta
            content += d["content"]
            continue
        (part,) = d["tool_calls"]
        if "id" in part:  # a call's first delta: OpenAI's shape, empty arguments
            assert part["index"] == len(calls) and part["type"] == "function" and part["function"]["arguments"] == ""
            calls.append({"id": part["id"], "type": "function", "function": dict(part["function"])})
        else:
            assert part["index"] == len(calls) - 1 and set(part) == {"index", "function"}
            calls[-1]["function"]["arguments"] += part["function"]["arguments"]
    assert calls == stream.tool_calls
    return content, calls, deltas


@pytest.mark.parametrize("name", CASES)
def test_streaming_cut_anywhere_gives_the_whole_answer(name):
    text = CASES[name][0]
    parsed = parse_tool_calls(text, ids)
    want = (parsed.content or "", parsed.tool_calls)
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]])[:2] == want, cut
    assert streamed(list(text))[:2] == want  # a character at a time
    rng = random.Random(name)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(pieces)[:2] == want, pieces


@pytest.mark.parametrize("name", ["two", "text around", "malformed then good", "unicode"])
def test_merged_deltas_one_a_step_rebuild_the_whole_answer(name):
    """The server's chunks: each step's deltas merged into one (merged_delta), put together as a client does."""
    text = CASES[name][0]
    parsed = parse_tool_calls(text, ids)
    rng = random.Random(name)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        stream = ToolCallStream(ids)
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        chunks = [merged_delta(stream.feed(p) + (stream.finish() if i == len(pieces) - 1 else []))
                  for i, p in enumerate(pieces)]
        content, calls = "", {}
        for chunk in chunks:
            assert set(chunk) <= {"content", "tool_calls"} and chunk.get("content", "x")
            content += chunk.get("content", "")
            for part in chunk.get("tool_calls", []):
                call = calls.setdefault(part["index"], {"id": part.get("id"), "type": part.get("type"),
                                                        "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += part.get("function", {}).get("name", "")
                call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
        assert content == (parsed.content or "") and [calls[i] for i in sorted(calls)] == parsed.tool_calls
    assert merged_delta([]) == {}


def test_streaming_holds_back_only_what_may_start_a_call():
    stream = ToolCallStream(ids)
    assert stream.feed("Let me check. <tool_") == [{"content": "Let me check."}]  # the space and "<tool_" held
    assert stream.feed("x") == [{"content": " <tool_x"}]  # not a tag after all
    assert stream.feed(ONE[:-3]) == []  # an open block: nothing known yet
    deltas = stream.feed(ONE[-3:])
    assert deltas == [{"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                       "function": {"name": "get_weather", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]
    assert stream.finish() == []


def test_default_ids_are_random_and_openai_shaped():
    a, b = call_id(0), call_id(0)
    assert a != b and a.startswith("call_") and len(a) == 29
    assert parse_tool_calls(ONE).tool_calls[0]["id"].startswith("call_")


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"],
    "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"],
        "additionalProperties": False}, "minItems": 1, "maxItems": 3},
    "express": {"type": "boolean"}}, "required": ["items", "express"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "place_order", "description": "Order things.", "parameters": ORDER}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: any object
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


def test_tool_choice_is_checked():
    assert chosen_tools(TOOLS, "auto") is None and chosen_tools(TOOLS, "none") is None and chosen_tools(None, None) is None
    assert list(chosen_tools(TOOLS, "required")) == ["get_weather", "place_order", "ping"]
    assert chosen_tools(TOOLS, {"type": "function", "function": {"name": "ping"}}) == {"ping": {"type": "object"}}
    for bad, match in ((("required"), "needs some tools"), ({"type": "function"}, "must be"), ("sometimes", "must be"),
                       ({"type": "function", "function": {"name": "nope"}}, "not among the tools")):
        with pytest.raises(SpecdecError, match=match) as e:
            chosen_tools(TOOLS if match != "needs some tools" else [], bad)
        assert "\n" not in str(e.value)


def test_the_lark_text_names_each_function_once():
    lark = tool_call_lark({"a": {"type": "object"}, "b": {"type": "object"}}, object(), parallel=False)
    assert lark.startswith("start: call\ncall: call0 | call1\n") and lark.count("%json") == 2
    assert '"<tool_call>"' in lark  # a tokenizer without the tag as a token: the text itself


@pytest.fixture(scope="module")
def qwen():
    if not QWEN.exists():
        pytest.skip("the zoo's Qwen2.5 tokenizer is not in the model cache")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(QWEN))
    text = [tok.decode([i]) for i in range(tok.get_vocab_size(with_added_tokens=True))]
    bias = torch.zeros(151936)  # the model's logits: a bonus for tokens that end strings, objects and arrays
    for i, t in enumerate(text):
        end = t.rstrip()[-1:]
        bias[i] = {'"': 4.0, "}": 4.0, "]": 2.0}.get(end, 0.0)
    return tok, bias


def walk(matcher, bias: torch.Tensor, eos: int, seed: int) -> list[int]:
    """Greedy decoding of seeded random logits (plus `bias`) under `matcher`, until `eos`."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < 600:
        forced = matcher.forced()
        pick = forced[0] if forced else int(matcher.mask_logits(torch.randn(151936, generator=gen) + bias).argmax())
        assert matcher.consume([pick])
        if pick == eos:
            return out
        out.append(pick)
    raise AssertionError("no end after 600 tokens")


@pytest.mark.parametrize("choice, parallel, names", [
    ("required", True, set(SCHEMAS)),
    ("required", False, set(SCHEMAS)),
    ({"type": "function", "function": {"name": "place_order"}}, True, {"place_order"}),
    ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}),
], ids=["required-parallel", "required-one", "named-parallel", "named-one"])
def test_walks_of_the_tool_choice_grammar_are_valid_calls(qwen, choice, parallel, names):
    tok, bias = qwen
    eos = tok.token_to_id("<|im_end|>")
    grammar = tool_choice_grammar(TOOLS, choice, tok, parallel=parallel, vocab_size=151936, eos_token_ids=[eos])
    seen, counts = set(), set()
    for seed in range(6):
        # as the engine decodes an answer (special tokens skipped): Qwen's tags are added tokens, not special ones
        text = tok.decode(walk(grammar.matcher(), bias, eos, seed), skip_special_tokens=True)
        parsed = parse_tool_calls(text, ids)
        assert parsed.content is None and parsed.tool_calls, text
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            name = call["function"]["name"]
            assert name in names
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
            seen.add(name)
        counts.add(len(parsed.tool_calls))
    assert seen == names or len(names) > 1 and len(seen) > 1, seen  # the walks reach different functions
    assert (max(counts) > 1) == parallel, counts  # parallel: some walks make several calls
    m = grammar.matcher()
    forced = tok.decode(m.forced(), skip_special_tokens=False)
    assert forced.startswith('<tool_call>\n{"name":')
    if len(names) == 1:  # one function: its name and the arguments' opening are forced
        assert forced.startswith(f'<tool_call>\n{{"name": "{next(iter(names))}", "arguments": {{"')


def test_the_grammar_refuses_what_is_not_a_call(qwen):
    tok, _ = qwen
    eos = tok.token_to_id("<|im_end|>")
    grammar = tool_choice_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, tok,
                                  vocab_size=151936, eos_token_ids=[eos])
    assert tool_choice_grammar(TOOLS, "auto", tok) is None
    good = block("get_weather", '{"city": "Paris", "unit": "celsius"}')
    for text, ok in ((good, True), (good + "\n" + good, True), ("Sure! " + good, False),
                     (block("get_weather", '{"city": "paris", "unit": "celsius"}'), False),  # the pattern
                     (block("get_weather", '{"city": "Paris"}'), False),  # a required key missing
                     (block("ping", "{}"), False)):
        m = grammar.matcher()
        tokens = tok.encode(text, add_special_tokens=False).ids + [eos]
        assert (m.valid_prefix(tokens) == len(tokens)) == ok, text


def test_a_name_with_a_quote_and_non_ascii_is_written_as_json_writes_it(qwen):
    tok, _ = qwen
    eos = tok.token_to_id("<|im_end|>")
    name = 'wetter_ü"x'
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    grammar = tool_choice_grammar(tools, "required", tok, vocab_size=151936, eos_token_ids=[eos])
    text = '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": {"a": 3}}\n</tool_call>'
    tokens = tok.encode(text, add_special_tokens=False).ids + [eos]
    assert grammar.matcher().valid_prefix(tokens) == len(tokens)
    assert [c["function"]["name"] for c in parse_tool_calls(text).tool_calls] == [name]
