"""Prompt lookup drafting (specdec.drafters.lookup): the match rules, the index, and exactness through the loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.algorithm.loop import StopCondition, run
from specdec.backends.hf import HFRunner
from specdec.drafters.lookup import LookupDrafter
from tests.tiny import VOCAB, tiny_model
from tests.toy import RandomK


def naive(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The definition: longest n first, the latest earlier occurrence, what followed it."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # occurrences followed by a token
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def test_worked_example_from_the_docstring():
    words = "The cat sat on the mat . The cat sat on".split()
    ids = {w: i for i, w in enumerate(dict.fromkeys(words))}
    context = [ids[w] for w in words]
    assert LookupDrafter(max_ngram=3).propose(context, 3).tokens == [ids["the"], ids["mat"], ids["."]]


def test_longest_match_wins_over_a_later_shorter_one():
    # "1 2 3" occurred followed by 7; "3" alone occurred later followed by 9.
    context = [1, 2, 3, 7, 8, 3, 9, 5, 1, 2, 3]
    assert LookupDrafter(max_ngram=3).propose(context, 2).tokens == [7, 8]
    assert LookupDrafter(max_ngram=1).propose(context, 2).tokens == [9, 5]


def test_no_match_proposes_nothing():
    assert LookupDrafter().propose([1, 2, 3, 4, 5], 4).tokens == []
    assert LookupDrafter().propose([7], 4).tokens == []
    assert LookupDrafter().propose([], 4).tokens == []
    assert LookupDrafter(min_ngram=2).propose([1, 2, 5, 2], 3).tokens == []  # only a 1-gram repeats


def test_match_at_the_very_end_gives_a_short_proposal():
    # The latest earlier "4 4" is followed only by the last token.
    assert LookupDrafter(max_ngram=2).propose([3, 4, 4, 4], 5).tokens == [4]
    assert LookupDrafter(max_ngram=2).propose([1, 2, 9, 1, 2], 5).tokens == [9, 1, 2]


def test_repeated_ngrams_use_the_latest_occurrence():
    context = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert LookupDrafter(max_ngram=2).propose(context, 1).tokens == [3]


def test_grade_follows_the_match_back_and_counts_the_occurrences():
    run = list(range(10, 40))
    # a 4-gram whose latest occurrence matches 20 tokens back: a copy of the prompt
    assert LookupDrafter().grade(run + [1] + run[:20]) == "match 16+ p=1"
    assert LookupDrafter().grade(run + [1] + run[:6]) == "match 4-7 p=1"
    assert LookupDrafter().grade([1, 2, 9, 1]) == "match 1 p=1"
    assert LookupDrafter().grade([5, 6, 1, 5, 6, 2, 5, 6]) == "match 2-3 p>=.5"  # 1 and 2 after "5 6"
    assert LookupDrafter().grade([5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]) == "match 2-3 p<.5"
    assert LookupDrafter().grade([1, 2, 3, 4, 5]) is None


def test_k_limits_the_proposal():
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    assert LookupDrafter().propose(context, 0).tokens == []
    assert LookupDrafter().propose(context, 3).tokens == [3, 4, 5]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=60), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_incremental_index_equals_the_definition(tokens, k, max_ngram, min_offset):
    # Proposals along a growing context (and after a switch to an unrelated one) equal a naive search.
    min_ngram = max(1, max_ngram - min_offset)
    drafter = LookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    for end in range(len(tokens) + 1):
        assert drafter.propose(tokens[:end], k).tokens == naive(tokens[:end], k, max_ngram, min_ngram)
    other = tokens[::-1]
    assert drafter.propose(other, k).tokens == naive(other, k, max_ngram, min_ngram)


def test_bad_ngram_range():
    with pytest.raises(ValueError):
        LookupDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        LookupDrafter(min_ngram=0)


@pytest.mark.parametrize("gamma", range(1, 9))
def test_lookup_speculative_equals_plain_greedy(gamma):
    model = tiny_model("llama", 0)
    # A prompt with repeats, so lookups match and some drafts are accepted, some not.
    prompt = [5, 9, 13, 21, 34, 55, 89 % VOCAB, 5, 9, 13, 21, 34, 7, 8, 5, 9]
    plain = run(HFRunner(model), prompt, StopCondition(40))
    spec = run(HFRunner(model), prompt, StopCondition(40), drafter=LookupDrafter(), num_speculative_tokens=gamma)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted > 0
    spec = run(HFRunner(model), prompt, StopCondition(40), drafter=LookupDrafter(), num_speculative_tokens=RandomK(gamma))
    assert spec.token_ids == plain.token_ids  # k chosen per step, plain steps between lookups
