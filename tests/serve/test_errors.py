"""Every malformed request gets an OpenAI-style error with a 4xx status, never a 500 or a traceback,
and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec.text import EMPTY_PROMPT
from tests.serve.conftest import MODEL, metric, metric_samples, serve

MAX_TOKENS_LIMIT = 64
MAX_BODY = 4096

OK = {"model": MODEL, "prompt": "for i in range", "max_tokens": 4, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def completion(**changes):
    return ("/v1/completions", {**OK, **changes})


def chat(**changes):
    return ("/v1/chat/completions", {**CHAT_OK, **changes})


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, (path, body: dict or raw bytes), status, param)
CASES = [
    ("bad-json", ("/v1/completions", b'{"model": "tiny", "prompt": '), 400, None),
    ("not-utf8", ("/v1/completions", b'{"model": "\xff"}'), 400, None),
    ("body-not-an-object", ("/v1/completions", b"[1, 2]"), 400, None),
    ("no-model", ("/v1/completions", without(OK, "model")), 400, "model"),
    ("model-not-a-string", completion(model=7), 400, "model"),
    ("unknown-model", completion(model="gpt-4"), 404, "model"),
    ("a-path-as-model", completion(model="/etc/passwd"), 404, "model"),
    ("no-prompt", ("/v1/completions", without(OK, "prompt")), 400, "prompt"),
    ("empty-prompt", completion(prompt=""), 400, "prompt"),
    ("empty-token-list", completion(prompt=[]), 400, "prompt"),
    ("prompt-a-number", completion(prompt=5), 400, "prompt"),
    ("two-prompts", completion(prompt=["a", "b"]), 400, "prompt"),
    ("token-id-out-of-range", completion(prompt=[1, 10**6]), 400, "prompt"),
    ("prompt-over-the-context", completion(prompt="for i in range(10): " * 200), 400, "prompt"),
    ("max-tokens-zero", completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", completion(max_tokens=-3), 400, "max_tokens"),
    ("max-tokens-a-string", completion(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-over-the-limit", completion(max_tokens=MAX_TOKENS_LIMIT + 1), 400, "max_tokens"),
    ("n-2", completion(n=2), 400, "n"),
    ("n-0", completion(n=0), 400, "n"),
    ("temperature-negative", completion(temperature=-0.5), 400, "temperature"),
    ("temperature-over-2", completion(temperature=2.5), 400, "temperature"),
    ("temperature-a-string", completion(temperature="hot"), 400, "temperature"),
    ("top-p-zero", completion(top_p=0), 400, "top_p"),
    ("top-p-over-1", completion(top_p=1.5), 400, "top_p"),
    ("top-k-negative", completion(top_k=-2), 400, "top_k"),
    ("seed-a-float", completion(seed=1.5), 400, "seed"),
    ("stop-empty", completion(stop=""), 400, "stop"),
    ("stop-not-strings", completion(stop=[1]), 400, "stop"),
    ("too-many-stops", completion(stop=[str(i) for i in range(9)]), 400, "stop"),
    ("stream-yes", completion(stream="yes"), 400, "stream"),
    ("speculative-k-0", completion(speculative={"k": 0}), 400, "speculative.k"),
    ("speculative-k-huge", completion(speculative={"k": 1000}), 400, "speculative.k"),
    ("speculative-k-word", completion(speculative={"k": "fast"}), 400, "speculative.k"),
    ("speculative-enabled-yes", completion(speculative={"enabled": "yes"}), 400, "speculative.enabled"),
    ("speculative-unknown-key", completion(speculative={"gamma": 3}), 400, "speculative.gamma"),
    ("speculative-not-an-object", completion(speculative=3), 400, "speculative"),
    ("logprobs-over-20", completion(logprobs=21), 400, "logprobs"),
    ("logprobs-a-bool-in-completions", completion(logprobs=True), 400, "logprobs"),
    ("chat-logprobs-a-number", chat(logprobs=2), 400, "logprobs"),
    ("chat-top-logprobs-without-logprobs", chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-top-logprobs-over-20", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("echo", completion(echo=True), 400, "echo"),
    ("best-of", completion(best_of=3), 400, "best_of"),
    ("suffix", completion(suffix="x"), 400, "suffix"),
    ("presence-penalty-over-2", completion(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty-a-string", completion(frequency_penalty="high"), 400, "frequency_penalty"),
    ("repetition-penalty-zero", completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("logit-bias-not-an-id", completion(logit_bias={"x": 1}), 400, "logit_bias"),
    ("logit-bias-over-100", completion(logit_bias={"3": 150}), 400, "logit_bias"),
    ("logit-bias-outside-the-vocabulary", completion(logit_bias={"1000000": 1}), 400, "logit_bias"),
    ("tools", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("tool-choice", chat(tool_choice="required"), 400, "tool_choice"),
    ("audio", chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    ("modalities-audio", chat(modalities=["text", "audio"]), 400, "modalities"),
    ("prediction", chat(prediction={"type": "content", "content": "x"}), 400, "prediction"),
    ("web-search-options", chat(web_search_options={"search_context_size": "low"}), 400, "web_search_options"),
    ("chat-no-messages", chat(messages=[]), 400, "messages"),
    ("chat-messages-missing", ("/v1/chat/completions", without(CHAT_OK, "messages")), 400, "messages"),
    ("chat-unknown-role", chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
    ("chat-content-a-number", chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("chat-max-completion-tokens-zero", ("/v1/chat/completions", {**without(CHAT_OK, "max_tokens"),
                                                                  "max_completion_tokens": 0}),
     400, "max_completion_tokens"),
    ("chat-n-3", chat(n=3), 400, "n"),
    ("chat-unknown-model", chat(model="other"), 404, "model"),
    ("body-too-large", completion(prompt="x" * (MAX_BODY + 1)), 413, None),
]


@pytest.fixture(scope="module")
def limited(engine):
    """A server with small limits: MAX_TOKENS_LIMIT tokens a request, MAX_BODY bytes a body."""
    with serve(engine, k=3, max_tokens_limit=MAX_TOKENS_LIMIT, max_body_bytes=MAX_BODY) as s:
        yield s


def post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
    return httpx.post(server.url + path, json=body)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("request_, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(limited, request_, status, param):
    path, body = request_
    assert_openai_error(post(limited, path, body), status, param)
    assert post(limited, *completion()).status_code == 200  # and it keeps serving


def test_a_chunked_body_over_the_limit_is_413(limited):
    def chunks():
        for _ in range(MAX_BODY // 512 + 2):
            yield b" " * 512  # no Content-Length: the server counts what arrives

    response = httpx.post(limited.url + "/v1/completions", content=chunks(),
                          headers={"Content-Type": "application/json"})
    assert_openai_error(response, 413)


def test_routing_errors_are_openai_shaped(limited):
    assert_openai_error(httpx.get(limited.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(limited.url + "/v1/completions"), 405)


def test_the_official_client_sees_the_errors(limited):
    client = limited.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):  # refused before the stream starts
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0, stream=True)


def test_errors_are_counted_by_status(limited):
    before = metric_samples(httpx.get(limited.url + "/metrics").text)
    post(limited, *completion(model="nope"))
    post(limited, *completion(n=2))
    after = metric_samples(httpx.get(limited.url + "/metrics").text)
    for code in ("404", "400"):
        labels = dict(endpoint="/v1/completions", code=code)
        assert metric(after, "requests_total", **labels) - metric(before, "requests_total", **labels) == 1


@pytest.mark.parametrize("prompt", ["", [], [""]])
def test_an_empty_prompt_is_refused_in_the_words_of_every_entry_point(limited, prompt):
    """One check, one text (specdec.text.check_prompt): what the CLI and the Python API say too."""
    error = assert_openai_error(post(limited, *completion(prompt=prompt)), 400, "prompt")
    assert error["message"] == EMPTY_PROMPT and error["code"] == "invalid_value"


def test_a_model_without_a_chat_template(tiny_dirs):
    """Chat needs a chat template: without one it is a 400 that says to use completions."""
    from specdec.runtime.engine import Engine

    engine = Engine.load(tiny_dirs["draft"])  # saved without a chat template
    with serve(engine) as server:
        error = assert_openai_error(post(server, *chat()), 400, "messages")
        assert "/v1/completions" in error["message"]
        assert post(server, *completion()).status_code == 200


def test_stairs_verification_refuses_sampling(engine):
    with serve(engine, k=3, verify="stairs") as server:
        error = assert_openai_error(post(server, *completion(temperature=0.7)), 400, "temperature")
        assert "greedy" in error["message"]
        greedy = post(server, *completion())
        assert greedy.status_code == 200, greedy.text


def test_a_prompt_over_the_servers_limit_is_refused_at_once(engine):
    with serve(engine, k=3, max_prompt_tokens=8) as server:
        prompt = list(range(3, 12))  # 9 token ids
        error = assert_openai_error(post(server, *completion(prompt=prompt)), 400, "prompt")
        assert error["code"] == "context_length_exceeded" and "--max-prompt-tokens 8" in error["message"]
        assert post(server, *completion(prompt=prompt[:8])).status_code == 200  # at the limit: served
        error = assert_openai_error(post(server, *chat(messages=[{"role": "user", "content": "hi " * 50}])), 400,
                                    "messages")
        assert error["code"] == "context_length_exceeded"
