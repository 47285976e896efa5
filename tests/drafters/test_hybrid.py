"""Hybrid drafting (specdec.drafters.hybrid): lookup where it matches, the draft model elsewhere; exact through the loop."""

from __future__ import annotations

import pytest

from specdec.algorithm.control import Controller
from specdec.algorithm.draft import Draft, Drafter
from specdec.algorithm.loop import StopCondition, run
from specdec.backends.hf import HFRunner
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.model import ModelDrafter
from tests.tiny import VOCAB, tiny_model
from tests.toy import RandomK


class Scripted(Drafter):
    """A stand-in draft model: proposes k copies of `token` and records what it was told."""

    def __init__(self, token: int) -> None:
        self.token, self.observed, self.resets = token, [], 0

    def propose(self, context, k, source=None):
        return Draft([self.token] * k)

    def observe(self, context, num_accepted):
        self.observed.append(num_accepted)

    def reset(self):
        self.resets += 1


def test_lookup_first_then_the_model():
    model = Scripted(99)
    hybrid = HybridDrafter(model, LookupDrafter(max_ngram=3, min_ngram=2))
    assert hybrid.propose([1, 2, 3, 1, 2], 2).tokens == [3, 1]  # "1 2" occurred before, followed by "3 1"
    assert hybrid.last_source == "lookup"
    hybrid.observe([1, 2, 3, 1, 2], 1)
    assert model.observed == [1]  # the model hears the lookup's verifications too (a head reads their features)
    assert hybrid.propose([1, 2, 3, 4], 3).tokens == [99, 99, 99]  # only one-token matches: the model
    assert hybrid.last_source == "model"
    hybrid.observe([1, 2, 3, 4], 2)
    assert model.observed == [1, 2]
    assert hybrid.proposals == {"lookup": 1, "model": 1, "lookup-short": 0}
    hybrid.reset()
    assert model.resets == 1 and hybrid.proposals == {"lookup": 0, "model": 0, "lookup-short": 0}


def test_short_matches_come_after_the_model():
    model = Scripted(99)
    hybrid = HybridDrafter(model, LookupDrafter(max_ngram=3, min_ngram=2))
    assert hybrid.sources([1, 2, 3, 1, 2]) == [("lookup", 0)]  # a two-token match: the lookup alone
    assert hybrid.sources([1, 2, 3, 4, 2]) == [("model", 0), ("lookup-short", 0)]  # "2" occurred, "4 2" did not
    assert hybrid.sources([1, 2, 3, 4]) == [("model", 0)]  # nothing to copy from
    assert hybrid.propose([1, 2, 3, 4, 2], 2, "lookup-short").tokens == [3, 4]  # what followed "2"
    assert hybrid.last_source == "lookup-short"
    hybrid.observe([1, 2, 3, 4, 2], 0)
    assert model.observed == [0]
    assert hybrid.propose([1, 2, 3, 4, 2], 2, "model").tokens == [99, 99]
    assert hybrid.proposals == {"lookup": 0, "model": 1, "lookup-short": 1}
    assert HybridDrafter(model, LookupDrafter(max_ngram=3, min_ngram=2), short_matches=False).sources(
        [1, 2, 3, 4, 2]) == [("model", 0)]
    assert HybridDrafter(model, LookupDrafter(max_ngram=3, min_ngram=1)).short is None  # nothing shorter


class Refusing(Controller):
    """A controller that never drafts from the `refused` sources and drafts 2 tokens from any other."""

    def __init__(self, *refused):
        self.refused, self.asked, self.observed = refused, [], []

    def choose(self, limit, lag=0, source="model", grade=None):
        self.asked.append(source)
        return 0 if source in self.refused else min(2, limit)

    def observe(self, drafted, accepted, draft_s, target_s, synced=0, source="model"):
        self.observed.append((source, drafted))

    def reset(self):
        pass


def test_plan_walks_the_sources_in_order():
    from specdec.algorithm.control import plan

    hybrid = HybridDrafter(Scripted(99), LookupDrafter(max_ngram=3, min_ngram=2))
    context = [1, 2, 3, 4, 2]
    assert plan(hybrid, context, Refusing(), 8) == ("model", 2)
    refusing = Refusing("model")
    assert plan(hybrid, context, refusing, 8) == ("lookup-short", 2) and refusing.asked == ["model", "lookup-short"]
    assert plan(hybrid, context, Refusing("model", "lookup-short"), 8) == ("model", 0)  # a plain step
    assert plan(LookupDrafter(), context, Refusing(), 8) == ("lookup", 2)  # a drafter with one source
    # a controller that prices the sources asks the fastest first
    ranking = Refusing()
    ranking.prospect = lambda limit, lag, source, grade: {"model": 90.0, "lookup-short": 60.0}[source]
    assert plan(hybrid, context, ranking, 8) == ("lookup-short", 2) and ranking.asked == ["lookup-short"]


@pytest.mark.parametrize("refused", [(), ("model",), ("model", "lookup-short")])
def test_hybrid_with_every_source_order_equals_plain_greedy(refused):
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    prompt = [5, 9, 13, 21, 34, 55, 89 % VOCAB, 5, 9, 13, 21, 34, 7, 8, 5, 9]
    plain = run(HFRunner(target), prompt, StopCondition(40))
    hybrid = HybridDrafter(ModelDrafter(HFRunner(draft)))
    controller = Refusing(*refused)
    spec = run(HFRunner(target), prompt, StopCondition(40), drafter=hybrid, num_speculative_tokens=controller)
    assert spec.token_ids == plain.token_ids
    used = {source for source, drafted in controller.observed if drafted}
    assert used.isdisjoint(refused) and "lookup" in used
    assert ("lookup-short" in used) == (refused == ("model",))


@pytest.mark.parametrize("gamma", [1, 3, 5, 8])
def test_hybrid_speculative_equals_plain_greedy(gamma):
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    prompt = [5, 9, 13, 21, 34, 55, 89 % VOCAB, 5, 9, 13, 21, 34, 7, 8, 5, 9]  # repeats: lookups match
    plain = run(HFRunner(target), prompt, StopCondition(40))
    for k in (gamma, RandomK(gamma)):
        hybrid = HybridDrafter(ModelDrafter(HFRunner(draft)))
        spec = run(HFRunner(target), prompt, StopCondition(40), drafter=hybrid, num_speculative_tokens=k)
        assert spec.token_ids == plain.token_ids
        assert hybrid.proposals["lookup"] > 0 and hybrid.proposals["model"] > 0


def test_outlook_names_the_source_and_its_catch_up():
    from specdec.algorithm.draft import LOOKUP, MODEL
    from specdec.drafters.model import ModelDrafter

    hybrid = HybridDrafter(ModelDrafter(HFRunner(tiny_model("llama", 5))), LookupDrafter(max_ngram=3, min_ngram=2))
    repeating = [3, 4, 5, 6, 3, 4]  # "3 4" occurred before: the lookup proposes "5 6"
    assert hybrid.outlook(repeating) == (LOOKUP, 0)
    assert hybrid.propose(repeating, 2).tokens == [5, 6] and hybrid.last_source == "lookup"
    fresh = [3, 4, 5, 6, 7]
    assert hybrid.outlook(fresh) == (MODEL, len(fresh))  # the model has read nothing yet
    draft = hybrid.propose(fresh, 2).tokens
    assert hybrid.last_source == "model"
    for context, behind in ((fresh + draft + [1], 2), (fresh + [draft[0], 1], 1)):  # both kept / the second not
        matches = bool(hybrid.lookup.propose(context, 1).tokens)
        assert hybrid.outlook(context) == ((LOOKUP, 0) if matches else (MODEL, behind))
    assert LookupDrafter().outlook(fresh) == (LOOKUP, 0)
