"""Who may come in: API keys (401 in OpenAI's shape), JSON-only bodies (415), CORS only for named
origins, and the warning for a server others can reach without a key."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from specdec.serve.access import check_key, exposure_warning, is_loopback, split_values
from specdec.serve.protocol import APIError
from tests.serve.conftest import MODEL, metric, metric_samples, serve
from tests.serve.test_errors import OK, assert_openai_error

KEYS = ("key-one", "key-two")
ORIGIN = "https://app.example"
BODY = json.dumps(OK).encode()


@pytest.fixture(scope="module")
def locked(engine):
    with serve(engine, k=3, api_keys=KEYS) as s:
        yield s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --------------------------------------------------------------------------- API keys


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"),
    ({"Authorization": "Bearer"}, "missing_api_key"),
    ({"Authorization": "Basic a2V5LW9uZTo="}, "missing_api_key"),
    (bearer("key-three"), "invalid_api_key"),
    (bearer("key-one-and-more"), "invalid_api_key"),
    (bearer("key-on"), "invalid_api_key"),
])
def test_the_api_wants_a_valid_key(locked, headers, code):
    for response in (httpx.get(locked.url + "/v1/models", headers=headers),
                     httpx.post(locked.url + "/v1/completions", json=OK, headers=headers),
                     httpx.post(locked.url + "/v1/chat/completions", json=OK, headers=headers),
                     httpx.get(locked.url + "/metrics", headers=headers)):
        error = assert_openai_error(response, 401)
        assert error["code"] == code and response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("key", KEYS)
def test_every_key_works_with_the_official_client(locked, key):
    client = openai.OpenAI(base_url=locked.url + "/v1", api_key=key, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="for i in range", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_official_client_without_the_key(locked):
    client = openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)


def test_health_and_the_playground_stay_open(locked):
    assert httpx.get(locked.url + "/health").json() == {"status": "ok"}
    page = httpx.get(locked.url + "/")
    assert page.status_code == 200 and 'id="api-key"' in page.text  # the page asks for the key itself
    assert httpx.get(locked.url + "/metrics", headers=bearer(KEYS[1])).status_code == 200


def test_metrics_can_be_open(engine):
    with serve(engine, api_keys=KEYS, metrics_need_key=False) as server:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert_openai_error(httpx.get(server.url + "/v1/models"), 401)


def test_refusals_are_counted(locked):
    before = metric_samples(httpx.get(locked.url + "/metrics", headers=bearer(KEYS[0])).text)
    httpx.post(locked.url + "/v1/completions", json=OK)
    httpx.post(locked.url + "/v1/completions", content=b"{}", headers={**bearer(KEYS[0]), "Content-Type": "text/plain"})
    after = metric_samples(httpx.get(locked.url + "/metrics", headers=bearer(KEYS[0])).text)
    for code in ("401", "415"):
        labels = dict(endpoint="/v1/completions", code=code)
        assert metric(after, "requests_total", **labels) - metric(before, "requests_total", **labels) == 1


def test_the_key_is_checked_before_anything_else(locked):
    """No key: a 401, whatever the body (its type, its size) -- nothing of it is read."""
    response = httpx.post(locked.url + "/v1/completions", content=b"x" * 100_000, headers={"Content-Type": "text/plain"})
    assert_openai_error(response, 401)


def test_check_key_unit():
    check_key({}, ())  # no keys: everyone
    check_key({"authorization": "bearer  key-two "}, KEYS)  # the scheme's case and spaces do not matter
    with pytest.raises(APIError) as e:
        check_key({"authorization": "Bearer key-one key-two"}, KEYS)
    assert e.value.status == 401


def test_split_values():
    assert split_values(None) == ()
    assert split_values(["a, b", "c\nd  e", ",,"]) == ("a", "b", "c", "d", "e")


# --------------------------------------------------------------------------- JSON only


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonp", "application/json-seq", "json"])
def test_a_body_that_is_not_declared_json_is_415(server, content_type):
    """What a web page can make a browser send cross-site without a preflight is refused."""
    headers = {} if content_type is None else {"Content-Type": content_type}  # raw content: httpx adds no type
    error = assert_openai_error(httpx.post(server.url + "/v1/completions", content=BODY, headers=headers), 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


@pytest.mark.parametrize("content_type",
                         ["application/json; charset=utf-8", "Application/JSON", "application/json ;charset=utf-8"])
def test_json_with_parameters_is_served(server, content_type):
    response = httpx.post(server.url + "/v1/completions", content=BODY, headers={"Content-Type": content_type})
    assert response.status_code == 200, response.text


# --------------------------------------------------------------------------- CORS


def preflight(server, origin: str) -> httpx.Response:
    return httpx.options(server.url + "/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_is_off_by_default(server):
    assert "access-control-allow-origin" not in preflight(server, ORIGIN).headers
    response = httpx.post(server.url + "/v1/completions", json=OK, headers={"Origin": ORIGIN})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_cors_for_the_named_origins_only(engine):
    with serve(engine, allowed_origins=(ORIGIN,), api_keys=KEYS) as server:
        allowed = preflight(server, ORIGIN)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-origin" not in preflight(server, "https://evil.example").headers
        response = httpx.post(server.url + "/v1/completions", json=OK, headers={"Origin": ORIGIN, **bearer(KEYS[0])})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN
        refused = httpx.post(server.url + "/v1/completions", json=OK, headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # CORS lets the page read the answer; the key is still needed


# --------------------------------------------------------------------------- exposure


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("192.168.1.20", False), ("10.0.0.1", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) == loopback


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", ()) is None
    assert exposure_warning("0.0.0.0", KEYS) is None
    warning = exposure_warning("0.0.0.0", ())
    assert "without an API key" in warning and "SPECDEC_API_KEY" in warning
