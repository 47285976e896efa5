"""A property, with hypothesis: no request body a client can send gets a 5xx, and the server stays
healthy after each.

Bodies: valid requests (completions and chat, every field in its valid range: temperatures down to
subnormals, any seed...); valid requests with one field replaced by a hostile value (a wrong type,
out of range, huge, nested deep, NaN, inf); and raw byte garbage, alone or after a JSON prefix.
A fixed seed and a bounded number of examples: the same requests in every run (CI included).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from tests.serve.conftest import MODEL, serve

MAX_TOKENS = 4  # the server's limit: valid requests stay short
EXAMPLES = 80

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "speculative", "presence_penalty", "logit_bias",
          "logprobs", "echo", "suffix", "tools", "best_of", "frequency_penalty", "repetition_penalty", "top_logprobs",
          "tool_choice", "parallel_tool_calls", "audio", "modalities", "prediction", "user", "metadata",
          "response_format", "json_schema", "grammar", "guided_json", "guided_regex", "guided_grammar"]


@pytest.fixture(scope="module")
def fuzzed(engine):
    with serve(engine, k=3, max_tokens_limit=MAX_TOKENS, max_body_bytes=64 * 1024) as s:
        yield s


text = st.text(max_size=40)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": text}), min_size=1, max_size=3)
optional = {  # the valid fields a request may add
    "max_tokens": st.integers(1, MAX_TOKENS),
    "temperature": st.floats(0.0, 2.0),  # subnormals and 0 included
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.integers(-1, 200),
    "seed": st.integers(-(2**70), 2**70),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "logit_bias": st.dictionaries(st.integers(0, 95).map(str), st.floats(-100.0, 100.0), max_size=4),
    "speculative": st.fixed_dictionaries({}, optional={"enabled": st.booleans(),
                                                       "k": st.one_of(st.integers(1, 32), st.just("auto"))}),
}
completion = st.fixed_dictionaries({"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=40)},
                                   optional=optional)
chat = st.fixed_dictionaries({"model": st.just(MODEL), "messages": messages}, optional=optional)
valid = st.one_of(st.tuples(st.just("/v1/completions"), completion),
                  st.tuples(st.just("/v1/chat/completions"), chat))

# Hostile values for any field: wrong types, out of range, huge, nested.
leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2**200), 2**200),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
                 st.just("x" * 20_000), st.just(10**300), st.just(-1), st.just(0), st.just(""))
nested = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
deep = st.integers(1, 400).map(lambda depth: json.loads("[" * depth + "]" * depth) if depth < 200 else depth)
hostile_value = st.one_of(nested, deep)


@st.composite
def mutated(draw) -> tuple[str, dict]:
    """A valid request with one field set to a hostile value."""
    path, body = draw(valid)
    body[draw(st.sampled_from(FIELDS))] = draw(hostile_value)
    return path, body


def encode(body: dict) -> bytes:
    return json.dumps(body).encode()  # NaN and inf become the non-JSON tokens NaN / Infinity: hostile too


garbage = st.one_of(st.binary(max_size=2000),
                    st.tuples(st.sampled_from([b'{"model": "tiny", "prompt": ', b'{"messages": [', b"[", b"{"]),
                              st.binary(max_size=200)).map(b"".join),
                    st.integers(200, 20_000).map(lambda depth: b'{"model": "tiny", "x": ' + b"[" * depth))
requests = st.one_of(valid.map(lambda r: (r[0], encode(r[1]))),
                     mutated().map(lambda r: (r[0], encode(r[1]))),
                     st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), garbage))


@seed(36)
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                      HealthCheck.data_too_large])
@given(request=requests)
def test_no_body_gets_a_5xx(fuzzed, request):
    path, body = request
    response = httpx.post(fuzzed.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    event(f"status {response.status_code}")  # --hypothesis-show-statistics: what the bodies got
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert "internal_error" not in response.text, response.text[:500]  # nor a failure inside a stream
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    assert httpx.get(fuzzed.url + "/health").json() == {"status": "ok"}
