"""Universal drafting (a draft with another tokenizer) through the whole loop.

Greedy: identical to plain greedy on tiny models with different tokenizers.
Sampling: 20,000 seeded runs per case, chi-square of the new tokens against
the exact target distribution, in both modes ("text": proposals re-tokenised,
verified without q; "intersection": the draft restricted to shared tokens,
verified with its real q).  The toy target and draft are Markov tables over
letter tokenizers whose vocabularies only partly overlap, so text really has
to be re-tokenised on the way (target "ba" is draft "b"+"a", draft "bc" is
target "b"+"c").
"""

from __future__ import annotations

from collections import Counter

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.verify import make_verifier
from specdec.backends.hf import HFRunner
from specdec.bridge import TextBridge, VocabularyMap
from specdec.drafters.universal import UniversalDrafter
from tests.chisq import chi_square, seeded_runs
from tests.tiny import tiny_model, tiny_tokenizer
from tests.toy import RandomK, ToyRunner, chain_distribution, random_table


def letter_tokenizer(tokens: list[str], merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    """A BPE tokenizer over the letters a, b, c with a few merged pairs; text is the plain concatenation."""
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


TARGET_TOK = letter_tokenizer(["a", "b", "c", "ab", "ba", "cc"], [("a", "b"), ("b", "a"), ("c", "c")])
DRAFT_TOK = letter_tokenizer(["c", "b", "a", "bc", "ab", "ca", "aa"], [("b", "c"), ("a", "b"), ("c", "a"), ("a", "a")])
VOCAB = 6
PROMPT = [3, 2]  # "ab", "c"
MAX_NEW, GAMMA, RUNS = 4, 3, 20_000
TARGET = random_table(VOCAB, seed=10)
DRAFT = random_table(7, seed=11)


def test_letter_tokenizers_overlap_partly():
    vocab_map = VocabularyMap.from_tokenizers(TARGET_TOK, DRAFT_TOK, 6, 7)
    # a, b, c, ab are shared; target ba, cc and draft bc, ca, aa are not.
    pairs = {DRAFT_TOK.convert_ids_to_tokens(d): TARGET_TOK.convert_ids_to_tokens(t)
             for d, t in zip(vocab_map.draft_ids.tolist(), vocab_map.target_ids.tolist())}
    assert pairs == {"a": "a", "b": "b", "c": "c", "ab": "ab"}


CASES = {
    "text": ("text", dict(temperature=0.8)),
    "intersection": ("intersection", dict(temperature=0.8)),
    "intersection-top-k-top-p": ("intersection", dict(temperature=0.8, top_k=3, top_p=0.9)),
}


def sample(case: str, seeds: range) -> dict:
    """One seeded run per seed: the histogram of new tokens, and drafted / accepted totals."""
    mode, params_kwargs = CASES[case]
    bridge = TextBridge(TARGET_TOK, DRAFT_TOK)
    vocab_map = VocabularyMap.from_tokenizers(TARGET_TOK, DRAFT_TOK, 6, 7) if mode == "intersection" else None
    target, draft_runner = ToyRunner(TARGET), ToyRunner(DRAFT)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in seeds:
        params = SamplingParams(seed=seed, **params_kwargs)
        drafter = UniversalDrafter(draft_runner, bridge, params, vocab_map)
        out = run(target, PROMPT, StopCondition(MAX_NEW), drafter=drafter, num_speculative_tokens=GAMMA,
                  verifier=make_verifier(params))
        counts[tuple(out.token_ids)] += 1
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    return {"counts": counts, "drafted": drafted, "accepted": accepted}


# With seeds 0..19,999 (torch 2.13 CPU) the p-values are 0.676 (text), 0.398 (intersection)
# and 0.272 (intersection, top-k/top-p); the test passes when p > 0.001.  The runs are split
# over two processes (tests/chisq.py); the histogram does not depend on the split.
@pytest.mark.parametrize("case", list(CASES))
def test_universal_sampling_matches_the_target_distribution(case):
    mode, params_kwargs = CASES[case]
    totals = seeded_runs(sample, case, RUNS)
    drafted, accepted = totals["drafted"], totals["accepted"]
    exact = chain_distribution(TARGET, SamplingParams(**params_kwargs), PROMPT, MAX_NEW)
    stat, dof, p_value = chi_square(totals["counts"], exact)
    print(f"{case}: chi2={stat:.1f} dof={dof} p={p_value:.4f} acceptance={accepted / drafted:.3f}")
    assert drafted > RUNS and 0 < accepted < drafted
    assert p_value > 0.001, f"chi2={stat:.1f} with {dof} dof, p={p_value:.2e}"


@pytest.mark.parametrize("mode", ["text", "intersection"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_universal_greedy_equals_plain_on_tiny_models(mode, gamma):
    target_tok, draft_tok = tiny_tokenizer(0), tiny_tokenizer(1)
    target = tiny_model("llama", 0, vocab_size=len(target_tok))
    draft = tiny_model("qwen2", 1, vocab_size=len(draft_tok))
    bridge = TextBridge(target_tok, draft_tok)
    vocab_map = VocabularyMap.from_tokenizers(target_tok, draft_tok, len(target_tok), len(draft_tok)) \
        if mode == "intersection" else None
    for text in ["def fibonacci(n):", "The quick brown", "for i in range(10):\n    "]:
        prompt = target_tok(text)["input_ids"]
        reference = run(HFRunner(target), prompt, StopCondition(30))
        drafter = UniversalDrafter(HFRunner(draft), bridge, SamplingParams(), vocab_map)
        out = run(HFRunner(target), prompt, StopCondition(30), drafter=drafter, num_speculative_tokens=gamma)
        assert out.token_ids == reference.token_ids
        assert out.stats.drafted > 0
        # k chosen per step, plain steps between drafts: the bridge follows text it did not draft
        out = run(HFRunner(target), prompt, StopCondition(30), drafter=drafter, num_speculative_tokens=RandomK(gamma))
        assert out.token_ids == reference.token_ids


def test_same_model_through_the_text_bridge():
    # Draft = target model and tokenizer, but through text (what the target emitted is
    # re-tokenised canonically, which a random toy model need not match): output unchanged.
    tok = TARGET_TOK
    bridge = TextBridge(tok, tok)
    target = ToyRunner(TARGET)
    drafter = UniversalDrafter(ToyRunner(TARGET), bridge)
    out = run(target, PROMPT, StopCondition(40), drafter=drafter, num_speculative_tokens=4)
    assert out.token_ids == run(ToyRunner(TARGET), PROMPT, StopCondition(40)).token_ids


def test_lag_counts_only_its_own_accepted_tokens_as_seen():
    """observe after its own proposal: the accepted tokens are in the draft's cache; after another source's
    verification (a hybrid reports its lookups' too), they are not, so lag still counts them."""
    tok = TARGET_TOK
    drafter = UniversalDrafter(ToyRunner(TARGET), TextBridge(tok, tok))
    context = [3, 2, 1, 0]
    drafter.propose(context, 2)
    drafter.observe(context, 2)  # its own two tokens accepted
    grown = context + [1, 1, 0]  # the two accepted and the target's bonus token
    assert drafter.lag(grown) == 1
    drafter.observe(grown, 2)  # a lookup's verification at `grown`: not its tokens
    assert drafter.lag(grown + [1, 1, 0]) == 4  # the bonus token before, and the three of that step
