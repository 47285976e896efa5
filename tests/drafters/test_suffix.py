"""Suffix drafting (specdec.drafters.suffix): the index against a naive search, frequency scoring, the
draft length, trees, the shared store's memory bound and eviction under threads, and exactness through
the loop and the engine (a second request drafted from the first's answer)."""

from __future__ import annotations

import random
import sys
import threading
import tracemalloc
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.algorithm.draft import Drafter
from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.backends.hf import HFRunner
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.suffix import STORE_LEAD, SuffixDrafter, SuffixIndex, SuffixStore, greedy_chain
from specdec.errors import SpecdecError
from specdec.runtime.engine import Engine
from tests.tiny import VOCAB, tiny_model, tiny_tokenizer
from tests.toy import RandomK

WORDS = "y = f( a ) b ... z".split()
ID = {w: i for i, w in enumerate(WORDS)}


def ids(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


def naive_match(sequences: list[list[int]], context: list[int], anchor: int, max_depth: int):
    """The definition: the longest n in anchor..max_depth whose last-n-tokens window of `context` occurs in a
    sequence followed by a token, and the tokens after each occurrence's match: [(sequence, start)]."""
    for n in range(min(max_depth, len(context)), anchor - 1, -1):
        window = context[-n:]
        found = [(s, i + n) for s, seq in enumerate(sequences) for i in range(len(seq) - n)
                 if seq[i:i + n] == window]
        if found:
            return n, found
    return 0, []


def naive_chain(sequences, follows, limit, min_prob):
    """The greedy chain by counts: the most frequent next token (ties: the latest occurrence), while its
    count / the match's count >= min_prob."""
    total, chain, alive = len(follows), [], follows
    while len(chain) < limit:
        nxt = [(s, i) for s, i in alive if i + len(chain) < len(sequences[s])]
        counts = Counter(sequences[s][i + len(chain)] for s, i in nxt)
        if not counts:
            break
        latest = {t: max((s, i) for s, i in nxt if sequences[s][i + len(chain)] == t) for t in counts}
        token = max(counts, key=lambda t: (counts[t], latest[t]))
        if counts[token] / total < min_prob:
            break
        chain.append(token)
        alive = [(s, i) for s, i in nxt if sequences[s][i + len(chain) - 1] == token]
    return chain


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=5),
       st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, 3), st.integers(1, 8),
       st.sampled_from([0, 1, 4]), st.sampled_from([0.0, 0.3]))
def test_index_equals_the_definition(sequences, context, anchor, max_depth, buckets, min_prob):
    # every window in one hash bucket (buckets 1) or a few, or exact windows (0): the same answers
    index = SuffixIndex(anchor, occurrences=10_000, buckets=buckets)
    for seq in sequences:
        index.open()
        index.extend(seq)
    max_depth = max(max_depth, anchor)
    n, follows = naive_match(sequences, context, anchor, max_depth)
    length, positions = index.match(context, max_depth)
    assert length == n
    counts = {token: len(group) for token, group in index.children(positions, 0).items()}
    assert counts == Counter(sequences[s][i] for s, i in follows)  # the suffix tree's children and counts
    chain, probs = greedy_chain(index, positions, 6, min_prob) if positions else ([], [])
    assert chain == naive_chain(sequences, follows, 6, min_prob)
    assert probs == sorted(probs, reverse=True) and all(p >= min_prob for p in probs)


def test_worked_example_from_the_docstring():
    store = SuffixStore(100)
    for output in ("y = f( a )", "y = f( a )", "y = f( b )"):
        store.add(ids(output))
    drafter = SuffixDrafter(store)
    context = ids("... z = f(")
    assert drafter.propose(context, 4).tokens == ids("a )")  # 2/3 each; the match "= f(" allows 2 tokens
    tree = drafter.propose_tree(context, 4, 2, 8)
    assert tree.tokens == ids("a ) b )") and tree.parents == [-1, 0, -1, 2]  # the chain first, then "b )"
    assert drafter.drafted_from == {"context": 0, "store": 2}


def test_draft_length_follows_the_match_length():
    context = ids("a b a b y = f( z b y = f(")  # "b y = f(" occurred (4 tokens), followed by "z b y = f("
    assert SuffixDrafter(spec_factor=1.0).propose(context, 8).tokens == ids("z b y =")  # 4 tokens
    assert SuffixDrafter().propose(context, 8).tokens == ids("z b y = f(")  # the default factor 2: up to 8
    one = ids("a b z a")  # a one-token match
    assert SuffixDrafter(spec_factor=1.0).propose(one, 8).tokens == ids("b")
    assert SuffixDrafter().propose(one, 8).tokens == ids("b z")
    context = ids("a b z ... y = f( a b z ... y")  # a 5-token match
    assert SuffixDrafter(spec_factor=1.0).propose(context, 8).tokens == ids("= f( a b z")
    assert SuffixDrafter(spec_factor=0.5).propose(context, 8).tokens == ids("= f(")  # 2.5 tokens
    assert SuffixDrafter().propose(context, 3).tokens == ids("= f( a")  # k caps it too


def test_grade_classes_the_match_and_the_first_tokens_count():
    store = SuffixStore(100)
    for output in ("y = f( a )", "y = f( a )", "y = f( b )"):
        store.add(ids(output))
    drafter = SuffixDrafter(store)
    assert drafter.grade(ids("... z = f(")) == "match 2-3 p>=.5"  # the docstring's example: 2 of 3 say "a"
    assert drafter.grade(ids("z ...")) is None  # nothing to propose
    run = list(range(10, 30))
    assert SuffixDrafter().grade(run + run[:19]) == "match 16+ p=1"  # its own context: a 19-token match
    assert SuffixDrafter().grade(run + run[:7]) == "match 4-7 p=1"
    assert SuffixDrafter().grade([1, 2, 9, 1]) == "match 1 p=1"
    assert SuffixDrafter().grade([1, 2, 1, 3, 1]) == "match 1 p>=.5"  # 2 and 3 after 1
    assert SuffixDrafter().grade([1, 2, 1, 3, 1, 4, 1]) == "match 1 p<.5"


def test_frequency_beats_recency_and_min_prob_cuts():
    store = SuffixStore(100)
    for output in ("y = a", "y = a", "y = b"):
        store.add(ids(output))
    assert SuffixDrafter(store).propose(ids("z y ="), 4).tokens == ids("a")  # 2 of 3, though "b" came last
    store.add(ids("y = b"))
    assert SuffixDrafter(store).propose(ids("z y ="), 4).tokens == ids("b")  # a tie: the latest
    assert SuffixDrafter(store, min_prob=0.6).propose(ids("z y ="), 4).tokens == []  # 1/2 < 0.6
    assert SuffixDrafter(store, min_score=1.5).propose(ids("z y ="), 4).tokens == []  # score 0.5


def test_the_better_scoring_source_drafts():
    store = SuffixStore(100)
    store.add(ids("a b y = f( a )"))
    drafter = SuffixDrafter(store)
    context = ids("z b y = f( b ) z b y")  # its own "z b y" (score 3) beats the store's "b y" (2 tokens, score 2)
    assert drafter.propose(context, 3).tokens == ids("= f( b")
    assert drafter.drafted_from == {"context": 1, "store": 0}
    context = ids("... a b y")  # only the store has "a b y"
    assert drafter.propose(context, 3).tokens == ids("= f( a")
    assert drafter.drafted_from == {"context": 0, "store": 1}  # a new context: the drafter started over


def test_the_store_knows_how_answers_begin_after_the_same_prompt_end():
    store = SuffixStore(100)
    store.add(ids("a ) ..."), lead=ids("z b y = f( z"))  # the prompt ends "... f( z", its answer "a ) ..."
    assert store.tokens == 3 + 6
    drafter = SuffixDrafter(store)
    assert drafter.propose(ids("b b = f( z"), 8).tokens == ids("a ) ...")  # another prompt, the same end
    store.add(ids("b"), lead=list(range(100)))  # only the prompt's last STORE_LEAD tokens
    assert store.tokens == 3 + 6 + 1 + STORE_LEAD
    store.add([], lead=ids("y = f("))  # no output: nothing, not even its lead
    assert store.tokens == 3 + 6 + 1 + STORE_LEAD and len(store) == 2
    bare = SuffixStore(100)
    bare.add(ids("a ) ..."))
    assert SuffixDrafter(bare).propose(ids("b b = f( z"), 8).tokens == []  # without its lead: no match


def test_a_store_of_no_memory_and_a_seeded_drafter_use_the_context_only():
    store = SuffixStore(0)
    store.add(ids("y = f( a )"))
    assert store.tokens == 0 and SuffixDrafter(store).propose(ids("... y ="), 3).tokens == []
    with pytest.raises(SpecdecError, match="memory"):
        SuffixStore(-1)


def test_eviction_keeps_memory_within_the_limit_and_forgets_the_oldest():
    rng = random.Random(0)
    store = SuffixStore(memory=1000)
    outputs = [[rng.randrange(50_000) for _ in range(rng.randint(4, 300))] for _ in range(200)]
    for output in outputs:
        store.add(output)
        assert store.tokens <= 1000
        assert len(store._index._tokens) == len(store._index._previous) == store.tokens + len(store)  # + SEPs
    kept = outputs[-len(store):]
    assert store.tokens == sum(map(len, kept))
    drafter = SuffixDrafter(store)
    for output in kept:  # every kept output is drafted from its first two tokens (random tokens: unique)
        assert drafter.propose(output[:2], 8).tokens == output[2:6]  # a 2-token match drafts 2 x 2
    gone = outputs[-len(store) - 1]
    assert drafter.propose(gone[:2], 8).tokens == []
    store.add(list(range(5000)))  # longer than the memory: its last 1000 tokens
    assert store.tokens == 1000 and len(store) == 1
    assert drafter.propose([4000, 4001], 2).tokens == [4002, 4003]
    assert drafter.propose([3000, 3001], 2).tokens == []


def test_memory_per_token():
    # the module's figure: ~20 bytes a token (the token, its link, a hash bucket), measured
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = SuffixStore(memory=1 << 16)
    rng = random.Random(1)
    while store.tokens < (1 << 16) - 300:
        store.add([rng.randrange(32_000) for _ in range(250)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 16 <= used / store.memory <= 28, used / store.memory


def test_concurrent_requests_do_not_corrupt_the_store():
    # Threads add outputs of distinct tokens and draft from the store at once, switched as often as the
    # interpreter allows: every draft is a real continuation of a kept output, and the store's size adds up.
    store = SuffixStore(memory=3000)
    errors: list[BaseException] = []
    interval = sys.getswitchinterval()

    def work(thread: int) -> None:
        try:
            rng = random.Random(thread)
            for j in range(150):
                first = (thread * 1000 + j) * 100
                output = list(range(first, first + rng.randint(20, 90)))
                store.add(output)
                drafter = SuffixDrafter(store, spec_factor=1.0)  # a 2-token match drafts 2
                for start in rng.sample(range(len(output) - 3), 3):
                    draft = drafter.propose(output[start:start + 2], 4).tokens
                    # evicted meanwhile (nothing) or the output's own continuation: consecutive numbers
                    assert draft in ([], output[start + 2:start + 4]), (output[start:start + 2], draft)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert store.tokens <= 3000
    assert len(store._index._tokens) == store.tokens + len(store)
    assert store.tokens == sum(end - start for start, end in store._outputs)


class Scripted(Drafter):
    """A stand-in draft model: proposes k copies of `token`."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, context, k, source=None):
        from specdec.algorithm.draft import Draft

        return Draft([self.token] * k)

    def observe(self, context, num_accepted):
        pass

    def reset(self):
        pass


def test_hybrid_puts_well_scored_suffix_drafts_first():
    store = SuffixStore(100)
    for output in ("y = a", "y = b", "y = f( a )"):
        store.add(ids(output))
    hybrid = HybridDrafter(Scripted(99), SuffixDrafter(store, min_ngram=2, spec_factor=1.0, min_score=1.0))
    assert hybrid.sources(ids("... = f(")) == [("suffix", 0)]  # "= f(" -> "a )": score 2
    assert hybrid.propose(ids("... = f("), 3).tokens == ids("a )")
    assert hybrid.sources(ids("z y =")) == [("model", 0), ("suffix-short", 0)]  # "a", "b", "f(": 1/3 each
    assert hybrid.propose(ids("z y ="), 2, "suffix-short").tokens == ids("f( a")  # a tie: the latest
    assert hybrid.sources(ids("... b")) == [("model", 0)]  # "b" and "... b" occurred nowhere before
    assert hybrid.proposals == {"suffix": 1, "model": 0, "suffix-short": 1}


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_suffix_speculative_equals_plain_greedy(gamma):
    model = tiny_model("llama", 0)
    prompt = [5, 9, 13, 21, 34, 55, 7, 5, 9, 13, 21, 34, 7, 8, 5, 9]
    plain = run(HFRunner(model), prompt, StopCondition(40))
    store = SuffixStore(1000)
    store.add(plain.token_ids[5:30])  # an earlier answer that overlaps this one
    store.add([int(t) for t in random.Random(gamma).choices(range(VOCAB), k=200)])  # and noise
    for drafter in (SuffixDrafter(), SuffixDrafter(store),
                    HybridDrafter(ModelDrafter(HFRunner(tiny_model("llama", 1))),
                                  SuffixDrafter(store, min_ngram=2, min_score=1.0))):
        spec = run(HFRunner(model), prompt, StopCondition(40), drafter=drafter, num_speculative_tokens=gamma)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted > 0
        by_source = spec.stats.by_source
        assert sum(c[1] for c in by_source.values()) == spec.stats.drafted  # each draft counted under its source
        assert sum(c[2] for c in by_source.values()) == spec.stats.accepted
        spec = run(HFRunner(model), prompt, StopCondition(40), drafter=drafter, num_speculative_tokens=RandomK(gamma))
        assert spec.token_ids == plain.token_ids  # k chosen per step, plain steps between drafts
    assert spec.stats.by_source["suffix"][2] > 0  # the hybrid drafted from the earlier answer, accepted


def test_graded_drafts_of_up_to_24_tokens_equal_plain_greedy():
    # -k auto with grades: the whole earlier answer in the store is a long sure match, so steps draft
    # past the old 8-token cap; every grade and k, the output is plain's token for token
    from specdec.algorithm.control import AutoK, Costs
    from specdec.drafters.lookup import LookupDrafter

    model = tiny_model("llama", 0)
    prompt = [5, 9, 13, 21, 34, 55, 7, 5, 9, 13, 21, 34, 7, 8, 5, 9]
    plain = run(HFRunner(model), prompt, StopCondition(60))
    store = SuffixStore(1000)
    store.add(plain.token_ids)  # an earlier identical answer
    store.add([int(t) for t in random.Random(0).choices(range(VOCAB), k=200)])  # and noise
    for drafter in (SuffixDrafter(store), LookupDrafter(),
                    HybridDrafter(ModelDrafter(HFRunner(tiny_model("llama", 1))), SuffixDrafter(store, min_score=1.0))):
        controller = AutoK(Costs({1: 70.0, 2: 74.0, 9: 115.0, 25: 200.0}, draft_ms=10.0), max_k=24, cost_ewma=0.0)
        spec = run(HFRunner(model), prompt, StopCondition(60), drafter=drafter, num_speculative_tokens=controller)
        assert spec.token_ids == plain.token_ids
        if not isinstance(drafter, LookupDrafter):
            assert max(k for k, _, _ in spec.stats.steps) > 8  # the sure grade drafted long


def test_the_engine_learns_across_requests():
    tok = tiny_tokenizer(0)
    engine = Engine(tiny_model("qwen2", 0, vocab_size=len(tok)), tok, suffix=True, suffix_memory=10_000)
    prompt = "def fibonacci(n):"
    plain = engine.generate(prompt, max_new_tokens=48, use_draft=False)
    # a plain request's answer is remembered too, after its prompt's end
    assert engine.suffix_store.tokens == len(plain.token_ids) + min(STORE_LEAD, len(engine.encode(prompt)))
    engine.forget()
    assert engine.suffix_store.tokens == 0
    first = engine.generate(prompt, max_new_tokens=48, k=8)
    second = engine.generate(prompt, max_new_tokens=48, k=8)  # the same answer again: drafted from the store
    assert first.token_ids == second.token_ids == plain.token_ids
    assert len(engine.suffix_store) == 2
    suffix = second.stats.by_source["suffix"]
    assert suffix[2] / suffix[1] >= 0.9 and suffix[1] >= 36  # nearly every token drafted and accepted (39 of 48)
    assert second.stats.target_forwards < first.stats.target_forwards / 2
    assert set(second.to_dict()["stats"]["by_source"]["suffix"]) == {"draft_steps", "drafted", "accepted",
                                                                      "acceptance_rate"}
    assert engine.make_drafter(SamplingParams()).store is engine.suffix_store
    assert engine.make_drafter(SamplingParams(temperature=0.7, seed=3)).store is None  # its own context only
    assert engine.make_drafter(SamplingParams(temperature=0.7)).store is engine.suffix_store


def test_a_fork_forgets_and_keeps_its_own_store():
    tok = tiny_tokenizer(0)
    engine = Engine(tiny_model("qwen2", 0, vocab_size=len(tok)), tok, suffix=True, suffix_memory=777)
    engine.generate("def fibonacci(n):", max_new_tokens=12)
    parent = engine.suffix_store
    twin = engine.fork()
    assert twin.suffix_store is not parent and len(twin.suffix_store) == 0 and twin.suffix_store.memory == 777
    twin.generate("def fibonacci(n):", max_new_tokens=12)
    assert len(twin.suffix_store) == 1 and engine.suffix_store is parent and len(parent) == 1  # apart


def test_engine_refuses_lookup_with_suffix():
    tok = tiny_tokenizer(0)
    with pytest.raises(SpecdecError, match="not both"):
        Engine(tiny_model("qwen2", 0, vocab_size=len(tok)), tok, lookup=True, suffix=True)
