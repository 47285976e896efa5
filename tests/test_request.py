"""The request config (specdec.request): validated once, and one field is one option everywhere.

- Its checks and their one-line messages, in the Python API's words and, through RequestError,
  in the CLI's (a flag) and the server's (a key of the "speculative" object).
- Keyword options as the Python API has always taken them (num_speculative_tokens, use_draft,
  sampling=...).
- Every field the config marks for the CLI is an option of `specdec generate`, every per-request one
  an option of `specdec serve` and a key of the server's "speculative" object, and what a request
  sends there reaches Engine.stream's config and, in a batch, the slot's drafter.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import typer

from specdec import cli
from specdec.algorithm.control import FixedK
from specdec.algorithm.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.request import RequestConfig, RequestError, cli_fields, options, served_fields
from specdec.runtime.engine import Engine
from tests.tiny import assert_near_tie_parting, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("options, field, message", [
    (dict(max_new_tokens=0), "max_new_tokens", "max_new_tokens must be > 0, got 0"),
    (dict(k=0), "k", "the number of speculative tokens must be >= 1 (or 'auto'), got 0"),
    (dict(k="many"), "k", "the number of speculative tokens must be 'auto' or a number >= 1, got 'many'"),
    (dict(draft_confidence=1.5), "draft_confidence", "the draft confidence must be between 0 and 1, got 1.5"),
    (dict(draft_confidence=float("nan")), "draft_confidence", "the draft confidence must be between 0 and 1"),
    (dict(draft_mode="fast"), "draft_mode", "unknown draft mode 'fast'"),
    (dict(verify="tree"), "verify", "unknown verification 'tree'"),
    (dict(verify="stairs", temperature=0.7), "verify", "stairs verification is greedy only"),
    (dict(tree="wide"), "tree", "--tree must be off, auto or <width>x<depth> (e.g. 2x4), got 'wide'"),
    (dict(tree="2x3", verify="stairs"), "tree", "token trees need causal verification, not stairs"),
])
def test_refusals_name_the_field(options, field, message):
    with pytest.raises(RequestError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as caught:
        RequestConfig(**options)
    assert caught.value.field == field
    assert "\n" not in str(caught.value)


def test_each_caller_names_the_option_its_own_way():
    with pytest.raises(RequestError) as caught:
        RequestConfig(k=0)
    assert caught.value.named("--num-speculative-tokens") == "--num-speculative-tokens must be >= 1 (or 'auto'), got 0"
    with pytest.raises(RequestError) as caught:
        RequestConfig(draft_mode="fast")
    assert caught.value.named("--draft-mode") == str(caught.value)  # a whole sentence stays as it is


def test_sampling_is_checked_by_sampling_params():
    with pytest.raises(SpecdecError, match="top_p must be in"):
        RequestConfig(top_p=1.5)
    config = RequestConfig(temperature=0.7, top_k=5, top_p=0.9, seed=3)
    assert config.sampling == SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)


def test_values_are_normalised():
    assert RequestConfig(k="4").k == 4 and RequestConfig(k=" Auto ").k == "auto"
    assert RequestConfig(stop=["a", "b"]).stop == ("a", "b") and RequestConfig(stop=None).stop == ()
    controller = FixedK(3)
    assert RequestConfig(k=controller).k is controller  # a Controller object is the Python API's own k
    config = RequestConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.k = 3


def test_keyword_options_as_the_api_takes_them():
    sampling = SamplingParams(temperature=0.5, seed=9)
    config = RequestConfig.from_options(max_new_tokens=7, num_speculative_tokens=2, use_draft=False, sampling=sampling)
    assert (config.max_new_tokens, config.k, config.speculative, config.sampling) == (7, 2, False, sampling)
    changed = RequestConfig.from_options(config, verify="stairs", temperature=0.0)
    assert (changed.max_new_tokens, changed.verify, changed.sampling.greedy) == (7, "stairs", True)
    assert RequestConfig.from_options(config) is config
    with pytest.raises(TypeError, match="gamma"):
        RequestConfig.from_options(gamma=3)
    with pytest.raises(TypeError, match="not both"):
        RequestConfig.from_options(sampling=sampling, temperature=1.0)


def _command(name: str):
    return typer.main.get_command(cli.app).commands[name]


def test_generate_takes_every_cli_field_and_serve_every_per_request_one():
    fields = {f.name for f in dataclasses.fields(RequestConfig)}
    generate = {p.name: p.opts for p in _command("generate").params}
    serve = {p.name: p.opts for p in _command("serve").params}
    assert {name for name in generate if name in fields} == {f.name for f, _ in cli_fields()}
    assert {name for name in serve if name in fields} == {f.name for f, _ in cli_fields(per_request=True)}
    for f, option in cli_fields():
        assert sorted(generate[f.name]) == sorted(option.flags)


def test_a_bad_cli_value_is_a_one_line_error_naming_its_flag():
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli.app, ["generate", "hi", "--draft-confidence", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--draft-confidence must be between 0 and 1, got 2.0" in " ".join(result.output.split())


# Values other than the defaults for the keys a server request may set; another field gets a value of its
# JSON type (sent()).
SENT = {"enabled": True, "k": 2, "draft_mode": "same", "draft_confidence": 0.25, "verify": "causal"}
SAMPLES = {float: 0.5, int: 2, bool: True, str: "auto"}


def sent() -> dict:
    """A value for every key of the "speculative" object."""
    samples = {}
    for key, (_f, option) in served_fields().items():
        kinds = typing.get_args(option.json_type) or (option.json_type,)
        samples[key] = SENT[key] if key in SENT else SAMPLES[kinds[0]]
    return samples


def test_the_servers_extension_takes_exactly_the_per_request_fields():
    assert {f.name for f, _ in served_fields().values()} == {f.name for f, o in options() if o.per_request}
    assert {key for key, (f, o) in served_fields().items()} == {o.wire or f.name for f, o in options() if o.per_request}


@pytest.fixture(scope="module")
def engine() -> Engine:
    tok = tiny_tokenizer(0)
    return Engine(tiny_model("qwen2", 0, vocab_size=len(tok)), tok, tiny_model("qwen2", 3, vocab_size=len(tok)), tok)


def test_a_servers_request_reaches_engine_stream(engine, monkeypatch):
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from specdec.serve.app import ServeOptions, create_app

    seen: list[RequestConfig] = []
    stream = engine.stream
    monkeypatch.setattr(engine, "stream", lambda prompt, config: seen.append(config) or stream(prompt, config))
    app = create_app(engine, ServeOptions(served_names=("tiny",), defaults=RequestConfig(k=3, draft_confidence=0.5)))
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "stop": ["\n\n"]}
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        response = client.post("/v1/completions", json={**body, "speculative": sent()})
        assert response.status_code == 200, response.text
        bad = client.post("/v1/completions", json={**body, "speculative": {"draft_confidence": 3}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.draft_confidence"
    defaults, given = seen
    assert (defaults.k, defaults.draft_confidence, defaults.max_new_tokens, defaults.stop) == (3, 0.5, 4, ("\n\n",))
    fields = {key: f.name for key, (f, _) in served_fields().items()}
    assert {key: getattr(given, fields[key]) for key in sent()} == sent()


def test_a_batch_slot_drafts_with_the_requests_options(engine, monkeypatch):
    engine.enable_batching(2)
    seen = []
    make_drafter = engine.make_drafter
    monkeypatch.setattr(engine, "make_drafter", lambda *args, **kw: seen.append((args, kw)) or make_drafter(*args, **kw))
    try:
        out = engine.generate("def f(x):", max_new_tokens=6, k=2, draft_confidence=0.25, temperature=0.5, seed=4)
    finally:
        engine.enable_batching(1)
    (sampling, mode, confidence), kw = seen[0]
    assert (sampling, mode, confidence) == (SamplingParams(temperature=0.5, seed=4), "auto", 0.25)
    assert kw["draft_runner"] is not engine.draft_runner  # the slot's own draft cache
    assert len(out.token_ids) <= 6
    with pytest.raises(SpecdecError, match="verifies causally"):
        engine.enable_batching(2)
        try:
            engine.generate("x", max_new_tokens=2, verify="stairs")
        finally:
            engine.enable_batching(1)


def test_trees_and_block_verification_reach_the_loop(engine):
    """--tree and --verify block through Engine.stream: greedy output as causal chains' (the tiny fp32
    transformers target verifies trees), sampled output seeded and complete."""
    chain = engine.generate("def f(x):", max_new_tokens=12, k=3)
    tree = engine.generate("def f(x):", max_new_tokens=12, k=3, tree="2x3")
    assert tree.stats.tree_steps > 0 and tree.stats.tree_nodes > tree.stats.drafted
    prompt = engine.encode("def f(x):", chat=False)
    assert_near_tie_parting(engine.target_runner.model, prompt, tree.token_ids, chain.token_ids)  # fp32
    block = engine.generate("def f(x):", max_new_tokens=12, k=3, verify="block")
    assert block.token_ids == chain.token_ids  # greedy block verification is causal verification
    sampled = [engine.generate("def f(x):", max_new_tokens=12, k=3, verify="block", temperature=0.8, seed=5)
               for _ in range(2)]
    assert sampled[0].token_ids == sampled[1].token_ids and len(sampled[0].token_ids) == 12
