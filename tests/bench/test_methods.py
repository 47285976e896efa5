"""Methods: option parsing, draft counting, and every method on tiny fp32 models (same greedy output)."""

import pytest

from specdec.algorithm.sampling import SamplingParams
from specdec.bench.methods import (
    DraftCounter,
    HFAssisted,
    Measurement,
    build_methods,
    check_drafters,
    generation_settings,
    parse_gammas,
    parse_methods,
    split_method,
)
from specdec.drafters.spec import DrafterSpec
from specdec.errors import SpecdecError
from specdec.runtime.engine import Engine
from tests.tiny import tiny_model, tiny_tokenizer


def test_parse_methods_adds_plain_and_drops_duplicates():
    assert parse_methods("specdec, HF,specdec") == ["plain", "specdec", "hf"]
    assert parse_methods("hf-plain,plain") == ["hf-plain", "plain"]


@pytest.mark.parametrize("text, fragment", [("", "empty"), (" , ", "empty"), ("plain,fast", "unknown method 'fast'")])
def test_parse_methods_errors(text, fragment):
    with pytest.raises(SpecdecError, match=fragment):
        parse_methods(text)


def test_parse_gammas():
    assert parse_gammas("5,1, 3,3") == [1, 3, 5]


@pytest.mark.parametrize("text, fragment", [("", "empty"), ("1,x", "'x' is not an integer"), ("0", ">= 1"), ("2,-1", ">= 1")])
def test_parse_gammas_errors(text, fragment):
    with pytest.raises(SpecdecError, match=fragment):
        parse_gammas(text)


def test_draft_counter_matches_stats_semantics():
    c = DraftCounter()
    c.record(3, 1)
    c.record(0, 0)  # a step without candidates: a target forward, not a draft
    c.record(2, 2)
    assert (c.forwards, c.draft_steps, c.drafted, c.accepted) == (3, 2, 5, 3)
    assert c.proposed_at == [2, 2, 1] and c.accepted_at == [2, 1, 0]


def test_measurement_rates():
    m = Measurement([1, 2, 3, 4], wall_s=2.0, target_forwards=2, drafted=6, accepted=3, draft_steps=2,
                    proposed_at=[2, 2, 2], accepted_at=[2, 1, 0], tree_steps=1, tree_nodes=5)
    assert m.tokens_per_s == 2.0 and m.acceptance_rate == 0.5 and m.mean_accepted_per_step == 1.5
    assert m.tokens_per_target_forward == 2.0 and m.per_position_acceptance == [1.0, 0.5, 0.0]
    assert Measurement.from_dict(m.to_dict()) == m
    plain = Measurement([1], wall_s=1.0)
    assert plain.acceptance_rate is None and plain.per_position_acceptance is None


def test_generation_settings_are_restored():
    model = tiny_model("llama", seed=3)
    model.generation_config.num_assistant_tokens = 7
    with generation_settings(model, num_assistant_tokens=2, assistant_confidence_threshold=0.0):
        assert model.generation_config.num_assistant_tokens == 2
    assert model.generation_config.num_assistant_tokens == 7
    assert model.generation_config.assistant_confidence_threshold is None


@pytest.fixture(scope="module")
def engine():
    tok = tiny_tokenizer()
    target = tiny_model("llama", seed=0, vocab_size=len(tok))
    target.generation_config.eos_token_id = tok.eos_token_id
    draft = tiny_model("llama", seed=0, vocab_size=len(tok))  # a perfect draft: every token accepted
    return Engine(target, tok, draft, tok)


def test_every_method_gives_plain_greedy_output(engine):
    ids = engine.encode("def fibonacci(n):")
    families = ["plain", "specdec", "specdec-stairs", "hf", "hf-auto", "hf-plain", "hf-pld"]
    methods = build_methods(engine, families, [3], max_new_tokens=12)
    assert [m.name for m in methods] == families
    runs = {m.name: m.run(ids) for m in methods}
    for name, m in runs.items():
        assert m.token_ids == runs["plain"].token_ids, name
        assert m.wall_s > 0 and m.target_forwards
    # A perfect draft: everything accepted, by our loop and by transformers'.
    assert runs["specdec"].acceptance_rate == 1.0 and runs["hf"].acceptance_rate == 1.0
    assert runs["specdec-stairs"].acceptance_rate == 1.0
    assert runs["plain"].drafted is None and runs["hf-plain"].drafted is None
    for name, m in runs.items():  # the time to the first output: our loop's prefill, transformers' streamer
        assert m.first_token_s is not None and 0 < m.first_token_s < m.wall_s, name
        assert m.decode_tokens_per_s is not None and m.decode_tokens_per_s > 0, name
    assert runs["hf-plain"].first_tokens == 1 and runs["hf"].first_tokens > 1  # a perfect draft's first step


def test_hf_drafts_gamma_tokens_per_step(engine):
    # transformers reads γ from the draft's generation_config, not from generate()'s kwargs:
    # the method must set it there (and switch the confidence early stop off).
    ids = engine.encode("Once upon a time")
    for gamma in (1, 4):
        [method] = build_methods(engine, ["hf"], [gamma], max_new_tokens=21)
        m = method.run(ids)
        assert isinstance(method, HFAssisted)
        assert m.proposed_at[0] == m.draft_steps and len(m.proposed_at) == gamma
        assert m.drafted >= gamma * (m.draft_steps - 1)  # only the last step may be cut by max_new_tokens
    assert engine.draft_runner.model.generation_config.num_assistant_tokens is None  # restored


def test_stairs_method_is_greedy_only(engine):
    with pytest.raises(SpecdecError, match="greedy only"):
        build_methods(engine, ["specdec-stairs"], [3], 8, SamplingParams(temperature=0.7))


def test_sweep_names_and_draft_requirement(engine):
    names = [m.name for m in build_methods(engine, ["plain", "specdec", "hf-plain"], [1, 3], 8)]
    assert names == ["plain", "specdec-g1", "specdec-g3", "hf-plain"]
    no_draft = Engine(engine.target_runner.model, engine.tokenizer)
    with pytest.raises(SpecdecError, match="needs a draft"):
        build_methods(no_draft, ["specdec"], [3], 8)


def test_hf_peer_gets_the_drafts_own_tokenizer_for_another_vocabulary():
    # transformers' universal assisted generation needs the assistant's tokenizer, not the target's.
    tok, other = tiny_tokenizer(0), tiny_tokenizer(1)
    target = tiny_model("llama", seed=0, vocab_size=len(tok))
    target.generation_config.eos_token_id = tok.eos_token_id
    draft = tiny_model("llama", seed=1, vocab_size=len(other))
    engine = Engine(target, tok, draft, other)
    [method] = build_methods(engine, ["hf"], [3], max_new_tokens=10)
    kwargs = method.generate_kwargs()
    assert kwargs["tokenizer"] is tok and kwargs["assistant_tokenizer"] is other
    ids = engine.encode("def fibonacci(n):")
    [plain] = build_methods(engine, ["plain"], [3], max_new_tokens=10)
    assert method.run(ids).token_ids == plain.run(ids).token_ids


def test_llamacpp_peer_decodes_the_gguf_plainly():
    # A fake llama.cpp session stands in for the target's GGUF (tests/backends/test_llamacpp.py).
    from specdec.backends.llamacpp import LlamaCppRunner
    from tests.backends.test_llamacpp import VOCAB, FakeSession

    tok = tiny_tokenizer(0, vocab_size=VOCAB + 100)
    engine = Engine(tiny_model("llama", 0, vocab_size=VOCAB), tok)
    peer_runner = LlamaCppRunner(FakeSession(n_ctx=128))
    (plain, peer) = build_methods(engine, ["plain", "llamacpp"], [5], 16, llamacpp_target=(peer_runner, tok))
    prompt = [3, 4, 5]
    measured = peer.run(prompt)
    assert peer.name == "llamacpp" and measured.wall_s > 0
    assert measured.token_ids == Engine(LlamaCppRunner(FakeSession(n_ctx=128)), tok).generate(
        prompt, max_new_tokens=16).token_ids
    assert plain.run(prompt).token_ids == engine.generate(prompt, max_new_tokens=16).token_ids
    with pytest.raises(SpecdecError, match="GGUF"):
        build_methods(engine, ["llamacpp"], [5], 16)


def test_each_method_runs_on_a_fork_of_its_own(engine, monkeypatch):
    forgotten = []
    monkeypatch.setattr(Engine, "forget", lambda self: forgotten.append(self))
    methods = build_methods(engine, ["plain", "specdec", "hf"], [3], max_new_tokens=8)
    engines = [m.engine for m in methods]
    assert len({id(e) for e in engines}) == 3 and all(e is not engine for e in engines)
    # runners of its own (so are their cached prompts) over the same weights
    assert len({id(e.target_runner) for e in [engine, *engines]}) == 4
    assert len({id(e.draft_runner) for e in [engine, *engines]}) == 4
    assert all(e.target_runner.model is engine.target_runner.model and e.draft_runner.model is engine.draft_runner.model
               for e in engines)
    assert all(e.pool is not engine.pool and e.pool._lease.controller.__self__ is e for e in engines)
    assert forgotten == engines  # a fork forgets what its parent's drafters learned
    methods[1].before_session()
    assert forgotten[-1] is engines[1]  # a session starts with the method's own engine forgetting


def test_suffix_methods_never_draft_from_another_run():
    tok = tiny_tokenizer(0)
    suffix = Engine(tiny_model("llama", 0, vocab_size=len(tok)), tok, suffix=True, suffix_memory=1000)
    plain, spec = build_methods(suffix, ["plain", "specdec"], [3], max_new_tokens=16)
    ids = suffix.encode("def fibonacci(n):")
    reference = suffix.generate(ids, max_new_tokens=16, use_draft=False).token_ids
    for m in (plain, spec, spec):
        m.before_session()
        assert len(m.engine.suffix_store) == 0  # not plain's answer, nor its own earlier repeat
        assert m.run(ids).token_ids == reference
        assert len(m.engine.suffix_store) == 1
    assert len(suffix.suffix_store) == 1 and suffix.suffix_store is not spec.engine.suffix_store


def test_auto_methods_share_one_controller_across_forks(engine, monkeypatch):
    def controller(self):
        if self._auto is None:
            self._auto = object()
        return self._auto

    monkeypatch.setattr(Engine, "auto_controller", controller)
    base = engine.fork()  # its own, so the module's engine keeps no controller
    methods = build_methods(base, ["specdec-auto", "specdec-tree"], [3], max_new_tokens=8)
    assert base._auto is not None and all(m.engine._auto is base._auto for m in methods)


def test_parse_methods_keeps_a_drafter_after_the_family():
    assert parse_methods("SPECDEC-AUTO@Lookup, specdec-auto,specdec@suffix+Dir/M") == [
        "plain", "specdec-auto@Lookup", "specdec-auto", "specdec@suffix+Dir/M"]
    assert split_method("specdec-tree@lookup+head") == ("specdec-tree", "lookup+head")
    assert split_method("hf") == ("hf", None)


@pytest.mark.parametrize("text, fragment", [
    ("hf-pld@lookup", "only our loop's methods"), ("specdec@", "name a drafter"), ("fast@lookup", "unknown method 'fast'"),
])
def test_parse_methods_refuses_a_drafter_where_none_can_go(text, fragment):
    with pytest.raises(SpecdecError, match=fragment):
        parse_methods(text)


def test_check_drafters_allows_the_runs_own_models_and_any_head():
    entries = ["plain", "specdec-auto", "specdec-auto@lookup", "specdec@suffix+m0", "specdec-tree@m0"]
    assert check_drafters(entries, "m0", None) == {"specdec-auto@lookup": ("lookup", False, None),
                                                   "specdec@suffix+m0": ("suffix", True, None),
                                                   "specdec-tree@m0": (None, True, None)}
    with pytest.raises(SpecdecError, match="drafts with m1, but this run loads the draft m0"):
        check_drafters(["specdec@lookup+m1"], "m0", None)
    with pytest.raises(SpecdecError, match="loads no draft model"):
        check_drafters(["specdec@m1"], None, None)
    with pytest.raises(SpecdecError, match="not auto"):
        check_drafters(["specdec@auto"], "m0", None)
    # a head beside the run's draft model, or another than the run's head, is loaded for its methods
    assert check_drafters(["specdec@lookup+head", "specdec-tree@head:/h"], "m0", None) == {
        "specdec@lookup+head": ("lookup", False, DrafterSpec(head="")),
        "specdec-tree@head:/h": (None, False, DrafterSpec(head="/h"))}
    assert check_drafters(["specdec@head:/h", "specdec@suffix+head:/g"], None, DrafterSpec(head="/h")) == {
        "specdec@head:/h": (None, True, None), "specdec@suffix+head:/g": ("suffix", False, DrafterSpec(head="/g"))}


def test_methods_with_their_own_drafters_share_the_runs_models():
    tok = tiny_tokenizer()
    target = tiny_model("llama", seed=0, vocab_size=len(tok))
    draft = tiny_model("llama", seed=1, vocab_size=len(tok))
    engine = Engine(target, tok, draft, tok, draft_name="m0", suffix=True)
    entries = ["plain", "specdec", "specdec@lookup", "specdec@lookup+m0", "specdec@m0", "specdec@suffix"]
    methods = build_methods(engine, entries, [3], max_new_tokens=16)
    assert [m.name for m in methods] == entries
    by_name = {m.name: m.engine for m in methods}
    assert [(e.copier, e.draft_runner is not None) for e in by_name.values()] == [
        ("suffix", True), ("suffix", True), ("lookup", False), ("lookup", True), (None, True), ("suffix", False)]
    assert by_name["specdec@lookup"].draft_name == "lookup" and by_name["specdec@lookup+m0"].draft_name == "lookup+m0"
    assert by_name["specdec@m0"].draft_runner.model is draft and by_name["specdec@lookup"].pool._lease.draft is None
    ids = engine.encode("def fibonacci(n): return fibonacci(n - 1) + fibonacci(n")
    runs = {m.name: m.run(ids) for m in methods}
    assert all(r.token_ids == runs["plain"].token_ids for r in runs.values())
    assert set(runs["specdec@lookup"].by_source) <= {"lookup"} and "suffix" not in runs["specdec@m0"].by_source
    sweep = build_methods(engine, ["specdec@lookup"], [1, 3], max_new_tokens=8)
    assert [m.name for m in sweep] == ["specdec-g1@lookup", "specdec-g3@lookup"]
    with pytest.raises(SpecdecError, match="drafts with m1"):
        build_methods(engine, ["specdec@m1"], [3], max_new_tokens=8)


def test_a_method_drafting_otherwise_prices_its_own_drafters(engine, monkeypatch):
    made = []

    def controller(self):
        if self._auto is None:
            self._auto = object()
            made.append(self)
        return self._auto

    monkeypatch.setattr(Engine, "auto_controller", controller)
    base = engine.fork()
    same, other = build_methods(base, ["specdec-auto", "specdec-auto@lookup"], [3], max_new_tokens=8)
    assert same.engine._auto is base._auto and other.engine._auto is not base._auto
    assert made == [base, other.engine]
    assert engine.fork_drafting(None, True)._auto is engine._auto  # drafting as its parent: the parent's
    with pytest.raises(SpecdecError, match="needs lookup, suffix"):
        engine.fork_drafting(None, False)
    with pytest.raises(SpecdecError, match="no draft model or head"):
        Engine(engine.target_runner.model, engine.tokenizer, lookup=True).fork_drafting("suffix", True)
