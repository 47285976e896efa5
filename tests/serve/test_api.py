"""The OpenAI-compatible API through the official `openai` client: completions and chat, streamed
and not, the `speculative` field, usage and acceptance stats, /metrics adding up."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from specdec.cli import app as cli
from specdec.drafters.suffix import STORE_LEAD
from tests.serve.conftest import MODEL, metric, metric_samples, serve, streamed_text

PROMPT = "def fibonacci(n):"
GREEDY = dict(model=MODEL, temperature=0, max_tokens=24)


def cli_text(tiny_dirs, prompt: str, *args: str) -> str:
    """`specdec generate --json` text for the same models, dtype (the server's tiny engine is fp32), draft
    length and token budget."""
    result = CliRunner().invoke(cli, ["generate", prompt, "--target", tiny_dirs["target"], "--draft",
                                      tiny_dirs["draft"], "--dtype", "fp32", "-k", "3", "--max-new-tokens", "24",
                                      "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["text"]


def test_completion_streamed_equals_whole_equals_generate(server, tiny_dirs):
    client = server.client()
    whole = client.completions.create(prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **GREEDY))
    assert whole.choices[0].text == streamed_text(chunks) == cli_text(tiny_dirs, PROMPT)
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    # every chunk but the last carries one decode step's text; the last also the request's stats
    assert all(c.specdec["emitted"] >= 1 for c in chunks)
    assert sum(c.specdec["emitted"] for c in chunks) == 24
    assert chunks[-1].speculative_decoding == whole.speculative_decoding | {
        "tokens_per_second": chunks[-1].speculative_decoding["tokens_per_second"]}


def test_chat_streamed_equals_whole_equals_generate_chat(server, tiny_dirs):
    client = server.client()
    messages = [{"role": "user", "content": "Once upon a time"}]
    whole = client.chat.completions.create(messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    generated = cli_text(tiny_dirs, "Once upon a time", "--chat")
    assert whole.choices[0].message.content == streamed_text(chunks) == generated
    assert whole.object == "chat.completion" and chunks[0].object == "chat.completion.chunk"


def test_stop_strings_across_chunks(server, engine):
    """A stop string taken from the middle of the unstopped text ends generation there, streamed or not."""
    client = server.client()
    full = engine.generate(PROMPT, max_new_tokens=24, num_speculative_tokens=3).text
    stop = full[9:12]
    expected = full[: full.index(stop)]
    whole = client.completions.create(prompt=PROMPT, stop=[stop, "never occurs"], **GREEDY)
    chunks = list(client.completions.create(prompt=PROMPT, stop=stop, stream=True, **GREEDY))
    assert whole.choices[0].text == streamed_text(chunks) == expected
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"


def test_speculative_field(server):
    client = server.client()
    plain = client.completions.create(prompt=PROMPT, extra_body={"speculative": {"enabled": False}}, **GREEDY)
    assert plain.speculative_decoding["enabled"] is False
    assert plain.speculative_decoding["drafted"] == 0 and plain.speculative_decoding["draft_steps"] == 0
    k2 = client.completions.create(prompt=PROMPT, extra_body={"speculative": {"k": 2}}, **GREEDY)
    s = k2.speculative_decoding
    assert s["k"] == 2 and s["draft_steps"] > 0
    assert s["drafted"] <= 2 * s["draft_steps"] and len(s["accepted_per_position"]) <= 2
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], abs=1e-6)
    assert plain.choices[0].text == k2.choices[0].text  # lossless: the same greedy text either way


def test_a_draft_that_agrees_is_accepted(tiny_dirs):
    """The target's bf16 copy as the draft: most drafts accepted, the same text as plain decoding."""
    from specdec.runtime.engine import Engine
    from tests.serve.conftest import serve

    engine = Engine.load(tiny_dirs["target"], tiny_dirs["target"], draft_dtype="bf16")
    with serve(engine, k=4) as server:
        client = server.client()
        spec = client.completions.create(prompt=PROMPT, **GREEDY)
        plain = client.completions.create(prompt=PROMPT, extra_body={"speculative": {"enabled": False}}, **GREEDY)
        chunks = list(client.completions.create(prompt=PROMPT, stream=True, **GREEDY))
    assert spec.choices[0].text == plain.choices[0].text == streamed_text(chunks)
    assert spec.speculative_decoding["acceptance_rate"] > 0.5
    assert spec.speculative_decoding["mean_accepted_per_step"] > 1
    # each chunk's accepted_text is the leading part of its text that came from accepted draft tokens
    assert any(c.specdec["accepted"] > 0 and c.specdec["accepted_text"] for c in chunks)
    assert all(c.choices[0].text.startswith(c.specdec["accepted_text"]) for c in chunks)


def test_usage_chunk(server):
    client = server.client()
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert last.usage.total_tokens == last.usage.prompt_tokens + 24
    assert set(last.speculative_decoding) >= {"drafted", "accepted", "acceptance_rate", "mean_accepted_per_step"}


def test_seeded_sampling_repeats(server):
    client = server.client()
    sampled = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    first = client.completions.create(**sampled).choices[0].text
    assert client.completions.create(**sampled).choices[0].text == first
    assert streamed_text(client.completions.create(stream=True, **sampled)) == first


def test_metrics_add_up_to_the_responses(server):
    before = metric_samples(httpx.get(server.url + "/metrics").text)
    client = server.client()
    responses = [client.completions.create(prompt=PROMPT, **GREEDY),
                 client.completions.create(prompt="for i in range", extra_body={"speculative": {"tree": "2x3"}}, **GREEDY)]
    responses.append(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **GREEDY))
    after = metric_samples(httpx.get(server.url + "/metrics").text)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    stats = [r.speculative_decoding for r in responses]
    assert delta("spec_decode_num_drafts_total") == sum(s["draft_steps"] for s in stats)
    assert delta("spec_decode_num_draft_tokens_total") == sum(s["drafted"] for s in stats)
    assert delta("spec_decode_num_accepted_tokens_total") == sum(s["accepted"] for s in stats)
    assert stats[1]["tree_drafts"] > 0 and stats[0]["tree_drafts"] == 0  # the second asked for token trees
    assert delta("spec_decode_num_tree_drafts_total") == sum(s["tree_drafts"] for s in stats)
    assert delta("spec_decode_num_tree_nodes_total") == sum(s["tree_nodes"] for s in stats)
    assert all(set(s["by_source"]) == {"model"} for s in stats)  # a draft model alone
    assert delta("spec_decode_num_draft_tokens_by_source_total", source="model") == sum(s["drafted"] for s in stats)
    assert delta("spec_decode_num_accepted_tokens_by_source_total", source="model") == sum(s["accepted"] for s in stats)
    for pos in range(3):
        assert delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == sum(
            s["accepted_per_position"][pos] for s in stats if len(s["accepted_per_position"]) > pos)
    assert delta("generation_tokens_total") == sum(r.usage.completion_tokens for r in responses)
    assert delta("prompt_tokens_total") == sum(r.usage.prompt_tokens for r in responses)
    assert delta("n_decode_total") == sum(s["target_forwards"] for s in stats)
    assert delta("request_success_total", finished_reason="length") == 3
    assert delta("requests_total", endpoint="/v1/completions", code="200") == 2
    assert delta("requests_total", endpoint="/v1/chat/completions", code="200") == 1
    assert delta("e2e_request_latency_seconds_count") == 3
    assert delta("time_to_first_token_seconds_count") == 3
    assert metric(after, "num_requests_running") == 0 and metric(after, "num_requests_waiting") == 0
    assert metric(after, "predicted_tokens_seconds") > 0


def test_suffix_drafts_learn_across_requests_and_are_counted_by_source(tiny_dirs):
    from specdec.runtime.engine import Engine

    engine = Engine.load(tiny_dirs["target"], "suffix+" + tiny_dirs["draft"], dtype="fp32", suffix_memory=5000)
    with serve(engine, k=4) as server:
        client = server.client()
        before = metric_samples(httpx.get(server.url + "/metrics").text)
        responses = [client.completions.create(prompt=PROMPT, **GREEDY) for _ in range(2)]
        after = metric_samples(httpx.get(server.url + "/metrics").text)
    first, second = (r.speculative_decoding["by_source"] for r in responses)
    assert responses[0].choices[0].text == responses[1].choices[0].text == cli_text(tiny_dirs, PROMPT)
    assert second["suffix"]["drafted"] > first.get("suffix", {}).get("drafted", 0)  # the first answer, drafted again
    assert second["suffix"]["acceptance_rate"] >= 0.85 and second["suffix"]["drafted"] >= 16  # 16 of 18
    forwards = [r.speculative_decoding["target_forwards"] for r in responses]
    assert forwards[1] < forwards[0] / 2
    assert len(engine.suffix_store) == 2
    assert metric(before, "suffix_store_tokens") == 0  # the gauge: what the store holds
    assert metric(after, "suffix_store_tokens") == engine.suffix_store.tokens == sum(  # each after its prompt's end
        r.usage.completion_tokens + min(STORE_LEAD, r.usage.prompt_tokens) for r in responses)
    for source in ("suffix", "model", "suffix-short"):
        for counter, key in (("drafts", "draft_steps"), ("draft_tokens", "drafted"), ("accepted_tokens", "accepted")):
            name = f"spec_decode_num_{counter}_by_source_total"
            assert metric(after, name, source=source) - metric(before, name, source=source) == sum(
                r.speculative_decoding["by_source"].get(source, {}).get(key, 0) for r in responses)


def test_models_health_and_playground(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "specdec playground" in page.text
