"""Penalties, logit_bias and logprobs through the official `openai` client against a running server.

On an int8 target (batch-invariant: a token's logits are the same bits in a plain step and in a k-row
verification): greedy output with penalties and logit_bias identical with and without speculation, and the
logprobs identical to the last bit (JSON floats round-trip exactly); chat's and completions' logprobs shapes,
streamed chunks' logprobs equal to the whole response's; logit_bias bans tokens; the fields OpenAI defines
that this server cannot honour are refused naming them, harmless ones are ignored.  Also: `specdec generate`'s
flags give the server's answer and refuse bad values in one line; a caller's LogitsProcessor through the Python
API; stairs, tree and block verification on the penalised rows; requests with their own penalties in one batch.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec.runtime.engine import Engine
from tests.serve.conftest import MODEL, serve

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "count with me: one two three"}]
GREEDY = {"model": MODEL, "max_tokens": 24, "temperature": 0}
PENALTIES = {"presence_penalty": 2.0, "frequency_penalty": 1.5}
REPETITION = {"repetition_penalty": 3.0}  # vLLM's extension field: the prompt's tokens too
PLAIN = {"speculative": {"enabled": False}}
SPECULATIVE = {"speculative": {"k": 3}}


@pytest.fixture(scope="module")
def int8_server(tiny_dirs):
    # a draft of the target's own weights (bf16): long drafts accepted, so speculation really emits many tokens
    engine = Engine.load(tiny_dirs["target"], tiny_dirs["target"], dtype="int8", draft_dtype="bf16")
    with serve(engine, k=3) as s:
        yield s


def chat_logprobs(choice) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in choice.logprobs.content]


def test_chat_greedy_with_penalties_and_logprobs_is_the_same_plain_and_speculative(int8_server):
    client = int8_server.client()
    asked = dict(messages=MESSAGES, logprobs=True, top_logprobs=3, **PENALTIES, **GREEDY)
    plain = client.chat.completions.create(extra_body={**PLAIN, **REPETITION}, **asked)
    spec = client.chat.completions.create(extra_body={**SPECULATIVE, **REPETITION}, **asked)
    unpenalised = client.chat.completions.create(messages=MESSAGES, extra_body=PLAIN, **GREEDY)
    assert plain.choices[0].message.content != unpenalised.choices[0].message.content  # the penalties bite
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.model_extra["speculative_decoding"]["accepted"] > 0
    assert chat_logprobs(spec.choices[0]) == chat_logprobs(plain.choices[0])  # float ==: to the last bit
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob <= values[0]
    # raw logprobs (the model's own distribution): where the penalties chose another token than the model's best
    assert any(entry.logprob < entry.top_logprobs[0].logprob for entry in content)


def test_streamed_logprobs_are_the_whole_responses(int8_server):
    client = int8_server.client()
    asked = dict(messages=MESSAGES, logprobs=True, top_logprobs=2, **PENALTIES, **GREEDY)
    whole = client.chat.completions.create(extra_body=SPECULATIVE, **asked)
    chunks = list(client.chat.completions.create(extra_body=SPECULATIVE, stream=True, **asked))
    streamed = [entry for chunk in chunks for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert any(len(chunk.choices[0].logprobs.content) > 1 for chunk in chunks if chunk.choices and chunk.choices[0].logprobs)


def test_completions_logprobs_shape_plain_and_speculative(int8_server):
    client = int8_server.client()
    plain = client.completions.create(prompt=PROMPT, logprobs=4, extra_body=PLAIN, **PENALTIES, **GREEDY)
    spec = client.completions.create(prompt=PROMPT, logprobs=4, extra_body=SPECULATIVE, **PENALTIES, **GREEDY)
    assert spec.choices[0].text == plain.choices[0].text
    lp, sp = plain.choices[0].logprobs, spec.choices[0].logprobs
    assert (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset) == \
        (sp.tokens, sp.token_logprobs, sp.top_logprobs, sp.text_offset)
    assert len(lp.tokens) == plain.usage.completion_tokens
    assert all(len(top) <= 4 for top in lp.top_logprobs)  # (two tokens may decode to the same text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = list(client.completions.create(prompt=PROMPT, logprobs=4, stream=True, extra_body=SPECULATIVE,
                                              **PENALTIES, **GREEDY))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_no_logprobs_unless_asked(int8_server):
    client = int8_server.client()
    assert client.chat.completions.create(messages=MESSAGES, **GREEDY).choices[0].logprobs is None
    assert client.completions.create(prompt=PROMPT, **GREEDY).choices[0].logprobs is None


def test_logit_bias_bans_tokens_plain_and_speculative(int8_server):
    client = int8_server.client()
    free = client.completions.create(prompt=PROMPT, **GREEDY)
    tokenizer = int8_server.app.state.worker.engine.tokenizer
    banned = {str(t): -100 for t in tokenizer.encode(free.choices[0].text, add_special_tokens=False)}
    plain = client.completions.create(prompt=PROMPT, logit_bias=banned, extra_body=PLAIN, **GREEDY)
    spec = client.completions.create(prompt=PROMPT, logit_bias=banned, extra_body=SPECULATIVE, **GREEDY)
    assert plain.choices[0].text != free.choices[0].text
    assert spec.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize(("body", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"n": 2}, "n"),
])
def test_bad_values_are_refused_naming_the_field(int8_server, body, param):
    response = httpx.post(int8_server.url + "/v1/completions", json={"prompt": PROMPT, **GREEDY, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"web_search_options": {}, "tool_choice": "auto"}, "tool_choice"),
])
def test_bad_chat_values_are_refused_naming_the_field(int8_server, body, param):
    response = httpx.post(int8_server.url + "/v1/chat/completions", json={"messages": MESSAGES, **GREEDY, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_harmless_fields_are_ignored(int8_server):
    client = int8_server.client()
    out = client.chat.completions.create(messages=MESSAGES, user="u1", metadata={"a": "b"}, store=False,
                                         service_tier="auto", modalities=["text"], **GREEDY)
    assert out.choices[0].message.content


def test_the_official_client_sees_a_refusal(int8_server):
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        int8_server.client().completions.create(prompt=PROMPT, presence_penalty=5, **GREEDY)


def generate_cli(tiny_dirs, *args: str):
    from typer.testing import CliRunner

    from specdec.cli import app as cli

    return CliRunner().invoke(cli, ["generate", PROMPT, "--target", tiny_dirs["target"], "--draft", tiny_dirs["target"],
                                    "--dtype", "int8", "--draft-dtype", "bf16", "-k", "3", "--max-new-tokens", "24",
                                    "--json", *args])


def test_generate_takes_the_same_options_and_gives_the_servers_answer(int8_server, tiny_dirs):
    import json

    result = generate_cli(tiny_dirs, "--presence-penalty", "2", "--frequency-penalty", "1.5", "--logit-bias", "7:-100",
                          "--logit-bias", "9:3.5", "--logprobs", "2")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    served = int8_server.client().completions.create(prompt=PROMPT, logprobs=2, logit_bias={"7": -100, "9": 3.5},
                                                     **PENALTIES, **GREEDY)
    assert out["text"] == served.choices[0].text
    assert [lp["logprob"] for lp in out["logprobs"]] == served.choices[0].logprobs.token_logprobs
    assert 7 not in out["token_ids"] and all(len(lp["top"]) == 2 for lp in out["logprobs"])


@pytest.mark.parametrize(("args", "words"), [
    (("--logit-bias", "x:1"), "--logit-bias must map token ids"),
    (("--logit-bias", "5:300"), "--logit-bias biases must be in -100..100"),
    (("--presence-penalty", "3"), "--presence-penalty must be a number in -2..2"),
    (("--logprobs", "50"), "--logprobs must be an integer in 0..20"),
])
def test_generate_refuses_bad_values_in_one_line(tiny_dirs, args, words):
    result = generate_cli(tiny_dirs, *args)
    assert result.exit_code == 2
    assert words in result.output and "Traceback" not in result.output


class BanAfter:
    """A caller's processor through the Python API: bans `token` once the output holds `after`."""

    def __init__(self, after: int, token: int) -> None:
        self.after, self.token = after, token

    def start(self, prompt) -> None:
        return None

    def accept(self, tokens) -> None:
        return None

    def process(self, generated, paths, logits):
        out = logits[: len(paths)].clone()
        for r, path in enumerate(paths):
            if self.after in [*generated, *path]:
                out[r, self.token] = float("-inf")
        return out


def test_a_callers_processor_through_the_python_api(int8_server):
    engine = int8_server.app.state.worker.engine
    free = engine.generate_from(engine.stream(PROMPT, max_new_tokens=24, use_draft=False))
    after, token = free.token_ids[2], free.token_ids[5]  # ban the sixth token once the third is out
    runs = [engine.generate_from(engine.stream(PROMPT, max_new_tokens=24, use_draft=speculative, k=3,
                                               logits_processor=BanAfter(after, token)))
            for speculative in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids != free.token_ids
    assert token not in runs[0].token_ids[3:]
    assert runs[1].stats.accepted > 0


@pytest.mark.parametrize("how", [{"verify": "stairs", "k": 3}, {"tree": "2x3", "k": 3}, {"verify": "block", "k": 4}])
def test_every_verification_decides_on_the_penalised_rows(int8_server, how):
    # stairs (next-token queries), token trees and block verification: the same tokens and logprobs as plain
    engine = int8_server.app.state.worker.engine
    asked = dict(presence_penalty=2.0, frequency_penalty=1.5, repetition_penalty=2.0, logprobs=2, max_new_tokens=40)
    plain = engine.generate_from(engine.stream(PROMPT, use_draft=False, **asked))
    out = engine.generate_from(engine.stream(PROMPT, **how, **asked))
    assert out.token_ids == plain.token_ids and out.logprobs == plain.logprobs
    assert out.stats.accepted > 0 and (out.stats.tree_steps > 0) == ("tree" in how)


def test_batched_serving_gives_the_same_penalised_answers_and_logprobs(tiny_dirs, int8_server):
    # requests with their own penalties and logit_bias decoded in one batch (packed forwards): each equals
    # its answer served alone, logprobs bitwise (int8: a row's logits do not depend on its neighbours)
    import threading

    bodies = [dict(prompt=f"{PROMPT} {i}", logprobs=1, presence_penalty=0.5 * i - 1, logit_bias={str(10 + i): -100},
                   **GREEDY) for i in range(4)]
    alone = [int8_server.client().completions.create(**b).choices[0] for b in bodies]
    engine = Engine.load(tiny_dirs["target"], tiny_dirs["target"], dtype="int8", draft_dtype="bf16")
    with serve(engine, k=3, max_batch=4) as server:
        got: list = [None] * len(bodies)

        def ask(i: int) -> None:
            got[i] = server.client().completions.create(**bodies[i]).choices[0]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert [(c.text, c.logprobs.token_logprobs) for c in got] == [(c.text, c.logprobs.token_logprobs) for c in alone]
