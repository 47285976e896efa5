"""The requests that once got a 500: a valid but tiny temperature, a body nested 50,000 deep; and an
unexpected error inside a request, which answers in OpenAI's shape and is counted as the 500 it is."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import MODEL, metric, metric_samples
from tests.serve.test_errors import OK, assert_openai_error, completion, post


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 5e-324])
def test_a_tiny_temperature_is_greedy(server, temperature):
    greedy = post(server, *completion(max_tokens=8))
    tiny = post(server, *completion(max_tokens=8, temperature=temperature, seed=1))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.mark.parametrize("depth", [500, 50_000])
def test_a_deeply_nested_body_is_400(server, depth):
    body = b'{"model": "%s", "prompt": "x", "extra": %s%s}' % (MODEL.encode(), b"[" * depth, b"]" * depth)
    error = assert_openai_error(post(server, "/v1/completions", body), 400)
    assert error["code"] == "invalid_json" and "recursion limit" in error["message"]
    assert post(server, *completion()).status_code == 200


@pytest.mark.parametrize("body, fragment", [
    (b'{"model": "tiny", "prompt": ', "not valid JSON"),
    (b'{"model": "\xff"}', "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
    (b"", "not valid JSON"),
])
def test_a_body_that_is_not_a_json_object(server, body, fragment):
    error = assert_openai_error(post(server, "/v1/completions", body), 400)
    assert fragment in error["message"] and error["code"] == "invalid_json"


def test_an_unexpected_error_is_a_counted_500(server, engine, monkeypatch):
    def broken(text: str, chat: bool = False):
        raise RuntimeError("a bug")

    before = metric_samples(httpx.get(server.url + "/metrics").text)
    monkeypatch.setattr(engine, "encode", broken)  # tokenizing the prompt fails as a bug would
    error = assert_openai_error(post(server, "/v1/completions", OK), 500)
    assert error["code"] == "internal_error" and error["message"] == "internal error: RuntimeError"
    monkeypatch.undo()
    after = metric_samples(httpx.get(server.url + "/metrics").text)
    labels = dict(endpoint="/v1/completions")
    assert metric(after, "requests_total", code="500", **labels) - metric(before, "requests_total", code="500",
                                                                       **labels) == 1
    assert metric(after, "requests_total", code="200", **labels) == metric(before, "requests_total", code="200",
                                                                        **labels)
    assert post(server, *completion()).status_code == 200


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(server):
    greedy = post(server, *completion(max_tokens=8))
    tiny = post(server, *completion(max_tokens=8, temperature=1.0, top_p=5e-324, seed=1))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
