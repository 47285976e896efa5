"""Structured output and tools through the server, with the official `openai` client (issue 75).

response_format (json_schema on every schema of tests/constrain/schemas.json, json_object, the regex and grammar
extensions), llama-server's and vLLM's fields, and tools with tool_choice "required" or a named function: the
output is in the language asked for, streamed and not, and greedy output with speculation is the plain output
(`speculative: {"enabled": false}`) token for token.  Bad schemas and grammars are 400s naming their field.

The target is a tiny random model (tests.tiny) with a longer context than conftest's and a chat template that
renders tools.  A random model writes strings of hundreds of tokens: each request sends a `logit_bias` (the
request's own field, applied before the grammar's mask as for any client) toward EOS and the tokens that close a
string, object or array, so that the outputs end (finish_reason "stop": a "length" output could not validate).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from specdec.runtime.engine import Engine
from tests.serve.conftest import MODEL, serve
from tests.tiny import save_tiny

SCHEMAS = json.loads((Path(__file__).parents[1] / "constrain" / "schemas.json").read_text())
MAX_TOKENS = 600  # the longest walk (order) ends at ~260 tokens
TOOLS_TEMPLATE = (
    "{% if tools %}<bos>system: tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<bos>assistant:{% endif %}")
PLAIN = {"speculative": {"enabled": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("structured-tiny")
    target = save_tiny(root / "target", "llama", seed=0, positions=1024)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(target)
    return Engine.load(target, save_tiny(root / "draft", "llama", seed=1, positions=1024), dtype="fp32")


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine, k=3) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def greedy(engine) -> dict:
    """The request fields every test sends: greedy, room enough, and the closing bias (see the module doc)."""
    tokenizer = engine.tokenizer
    bias = {}
    for token in range(len(tokenizer)):
        end = tokenizer.decode([token]).rstrip()[-1:]
        if end in CLOSING:
            bias[str(token)] = CLOSING[end]
    bias[str(tokenizer.eos_token_id)] = 10
    return {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "logit_bias": bias}


CLOSING = {'"': 8, "}": 4, "]": 2, ".": 3, ",": 2, "@": 3}  # ".", "," and "@": numbers and emails end too


def streamed(chunks) -> tuple[str, str | None, dict, list]:
    """A chat stream's (content, finish reason, speculative_decoding of its last chunk, tool calls put together)."""
    text, finish, stats, calls = [], None, {}, {}
    for chunk in chunks:
        stats = (chunk.model_extra or {}).get("speculative_decoding", stats)
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
    return "".join(text), finish, stats, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("entry", SCHEMAS, ids=[s["name"] for s in SCHEMAS])
def test_every_schema_validates_streamed_and_not_and_speculation_changes_nothing(client, greedy, entry):
    response_format = {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"],
                                                              "strict": True}}
    text, finish, stats, _ = streamed(client.chat.completions.create(
        messages=MESSAGES, response_format=response_format, stream=True, **greedy))
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), entry["schema"])
    assert stats["enabled"]  # speculation stayed on: the grammar's forced text came as drafts, all accepted
    forced = stats["by_source"].get("forced", {"drafted": 0, "accepted": 0})
    assert forced["accepted"] == forced["drafted"]
    if entry["name"] in ("enum_status", "const_fields", "tool_call", "order"):  # much fixed text
        assert forced["drafted"] >= 10 and stats["target_forwards"] < len(text) / 2
    plain = client.chat.completions.create(messages=MESSAGES, response_format=response_format, extra_body=PLAIN,
                                           **greedy)
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == text  # greedy: the plain constrained output, token for token
    assert plain.model_extra["speculative_decoding"]["drafted"] == 0


def test_sampled_outputs_validate_too(client, greedy):
    """temperature 1 (seeded), speculation on: every schema's output still parses and validates."""
    for entry in SCHEMAS:
        response_format = {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"]}}
        out = client.chat.completions.create(messages=MESSAGES, response_format=response_format, seed=7,
                                             **{**greedy, "temperature": 1.0})
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), entry["schema"])


def test_constrained_requests_in_a_batch_give_the_plain_outputs(engine, client, greedy):
    """Eight schemas at once through a server with --max-batch 4 (continuous batching: each request its own
    grammar): each output is what the plain server gives alone."""
    import concurrent.futures

    def ask(c: openai.OpenAI, entry: dict, extra: dict | None = None) -> tuple[str | None, str]:
        response_format = {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"]}}
        out = c.chat.completions.create(messages=MESSAGES, response_format=response_format, extra_body=extra, **greedy)
        return out.choices[0].message.content, out.choices[0].finish_reason

    entries = SCHEMAS[:8]
    plain = [ask(client, entry, PLAIN) for entry in entries]
    try:
        with serve(engine, k=3, max_batch=4) as batched, concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda entry: ask(batched.client(), entry), entries))
    finally:
        engine.enable_batching(1)  # as the module's server runs it
    assert together == plain and all(finish == "stop" for _, finish in plain)


def test_json_object_on_both_endpoints(client, greedy):
    chat = client.chat.completions.create(messages=MESSAGES, response_format={"type": "json_object"}, **greedy)
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(prompt="JSON:", extra_body={"response_format": {"type": "json_object"}},
                                           **greedy)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)


@pytest.mark.parametrize("body, check", [
    ({"response_format": {"type": "regex", "regex": "[a-c]{2,4}-[0-9]+"}}, r"[a-c]{2,4}-[0-9]+"),
    ({"guided_regex": "(yes|no), [0-9]{2}"}, r"(yes|no), [0-9]{2}"),
    ({"response_format": {"type": "grammar", "grammar": 'root ::= "n=" [0-9] [0-9]? ";"'}}, r"n=[0-9][0-9]?;"),
    ({"grammar": 'root ::= "id-" [a-f]+ "!"'}, r"id-[a-f]+!"),  # llama-server's
    ({"guided_grammar": 'root ::= "v" [0-9]'}, r"v[0-9]"),  # vLLM's, GBNF
    ({"guided_grammar": 'start: "x" ("ab" | "cd")+'}, r"x(ab|cd)+"),  # vLLM's, Lark
    ({"response_format": {"type": "grammar", "grammar": 'start: "k" /[0-9]{3}/', "syntax": "lark"}}, r"k[0-9]{3}"),
], ids=["regex", "guided-regex", "gbnf", "llama-grammar", "guided-gbnf", "guided-lark", "lark"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_regex_and_grammars(client, greedy, body, check, stream):
    if stream:
        text, finish, _, _ = streamed(client.chat.completions.create(messages=MESSAGES, extra_body=body,
                                                                     stream=True, **greedy))
    else:
        out = client.chat.completions.create(messages=MESSAGES, extra_body=body, **greedy)
        text, finish = out.choices[0].message.content, out.choices[0].finish_reason
    assert finish == "stop" and re.fullmatch(check, text), text


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


@pytest.mark.parametrize("body", [{"json_schema": SCHEMA}, {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                                  {"response_format": {"type": "json_object", "schema": SCHEMA}}],
                         ids=["llama-json-schema", "guided-json", "guided-json-text", "json-object-schema"])
def test_the_other_servers_schema_fields(client, greedy, body):
    out = client.completions.create(prompt="JSON:", extra_body=body, **greedy)
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strng"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format"),
    ({"response_format": {"type": "grammar", "grammar": "root ::= (", "syntax": "gbnf"}}, "response_format"),
    ({"grammar": "root ::= missing"}, "grammar"),
    ({"json_schema": "not an object"}, "json_schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": "start: start"}, "guided_grammar"),  # compiles, but its language is empty
    ({"response_format": {"type": "grammar", "grammar": "root ::= root"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),  # two at once
])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_bad_constraint_is_a_400_naming_its_field(client, greedy, body, param, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(messages=MESSAGES, extra_body=body, stream=stream, **greedy)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]


def test_response_format_text_is_free_text(client, greedy):
    out = client.chat.completions.create(messages=MESSAGES, response_format={"type": "text"},
                                         **{**greedy, "max_tokens": 8, "logit_bias": {}})
    assert out.choices[0].finish_reason == "length"


def call_arguments(calls: list[dict], tools: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each checked against its function's parameters schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for call in calls:
        arguments = json.loads(call["arguments"])
        jsonschema.validate(arguments, schemas[call["name"]])
        out.append((call["name"], arguments))
    return out


def whole_calls(message) -> list[dict]:
    calls = message.tool_calls or []
    assert all(c.type == "function" and re.fullmatch("call_[0-9a-f]{24}", c.id) for c in calls)
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls]


@pytest.mark.parametrize("tools, tool_choice, parallel", [
    ([WEATHER, TIME], "required", None),
    ([WEATHER], "required", False),
    ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None),
], ids=["required", "required-one-call", "named"])
def test_tool_choice_gives_calls_that_validate(client, greedy, tools, tool_choice, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    asked = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, tool_choice=tool_choice,
                 **extra, **greedy)
    out = client.chat.completions.create(**asked)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = call_arguments(whole_calls(choice.message), tools)
    assert calls and (parallel is not False or len(calls) == 1)
    if isinstance(tool_choice, dict):
        assert {name for name, _ in calls} == {"get_time"}
    content, finish, stats, streamed_calls = streamed(client.chat.completions.create(stream=True, **asked))
    assert finish == "tool_calls" and content == "" and stats["draft_steps"] > 0
    assert all(re.fullmatch("call_[0-9a-f]{24}", c["id"]) for c in streamed_calls)
    assert call_arguments(streamed_calls, tools) == calls
    plain = client.chat.completions.create(extra_body=PLAIN, **asked)  # speculation changes nothing
    assert call_arguments(whole_calls(plain.choices[0].message), tools) == calls


def test_tool_results_and_assistant_calls_are_accepted(client, greedy):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}]
    out = client.chat.completions.create(messages=messages, tools=[WEATHER], **{**greedy, "max_tokens": 8})
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content is not None
    # the same history without tools is rendered through specdec.chat too (a tool message in it)
    out = client.chat.completions.create(messages=messages, **{**greedy, "max_tokens": 8})
    assert out.usage.prompt_tokens > 10


def test_tool_choice_none_renders_the_tools_and_parses_nothing(client, greedy, engine):
    asked = dict(messages=MESSAGES, **{**greedy, "max_tokens": 8, "logit_bias": {}})
    none = client.chat.completions.create(tools=[WEATHER], tool_choice="none", **asked)
    auto = client.chat.completions.create(tools=[WEATHER], **asked)
    free = client.chat.completions.create(**asked)
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens > free.usage.prompt_tokens  # the tools are shown
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strng"}}}}}], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages"),  # no tool_call_id
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_requests_are_400s(server, greedy, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, **greedy, **body},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_tools_on_completions_are_refused(client, greedy):
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.completions.create(prompt="x", extra_body={"tools": [WEATHER]}, **greedy)


# Constraint fields of every shape, most of them wrong: a schema-like object of random keywords and values,
# regexes and grammars of random text (with their syntax's characters), the types and keys each field takes.
words = st.sampled_from(["type", "properties", "items", "enum", "const", "pattern", "minimum", "maxLength",
                         "required", "$ref", "anyOf", "additionalProperties", "format", "object", "string",
                         "integer", "array", "#/$defs/x", "$defs", "x"])
values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 5), words, st.text(max_size=6)),
                      lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(words, inner, max_size=3)),
                      max_leaves=10)
syntax = st.text(alphabet='ab01 ()[]{}|*+?^$\\.:=:"\'/%-_\nrootstart', max_size=30)
constraints = st.one_of(
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "json_object", "regex", "grammar", "text", "x"])},
        optional={"json_schema": st.one_of(values, st.fixed_dictionaries({"name": st.just("n")}, optional={
            "schema": st.dictionaries(words, values, max_size=4), "strict": values})),
            "schema": values, "regex": st.one_of(syntax, values), "grammar": st.one_of(syntax, values),
            "syntax": st.sampled_from(["gbnf", "lark", "ebnf"])})}),
    st.fixed_dictionaries({"json_schema": st.dictionaries(words, values, max_size=4)}),
    st.fixed_dictionaries({"guided_json": st.one_of(st.dictionaries(words, values, max_size=4), syntax)}),
    st.fixed_dictionaries({"grammar": syntax}), st.fixed_dictionaries({"guided_regex": syntax}),
    st.fixed_dictionaries({"guided_grammar": syntax}),
    st.fixed_dictionaries({"tools": st.just([WEATHER]), "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required", "x"]), values)}))


@seed(75)
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                                HealthCheck.too_slow])
@given(body=constraints, stream=st.booleans())
def test_no_constraint_gets_a_5xx(server, body, stream):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": stream, **body})
    event(f"status {response.status_code}")
    assert response.status_code in (200, 400), response.text
    assert "internal_error" not in response.text and "Traceback" not in response.text, response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["param"] in {*body, "response_format"} and "\n" not in error["message"], error
