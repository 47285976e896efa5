"""The draft-model drafter: cache synchronisation, vocabulary padding, and a draft head trimmed to some tokens
(FR-Spec): its argmax, q and confidence over the kept tokens and the request's context."""

import torch

from specdec.backends.hf import HFRunner
from specdec.drafters.model import ModelDrafter
from tests.tiny import VOCAB, tiny_model
from tests.toy import RunnerDefaults

MODEL = tiny_model("llama", 5)


def greedy_continuation(context, k):
    runner = HFRunner(MODEL)
    out = []
    logits = runner.forward(context)[-1]
    for _ in range(k):
        out.append(int(logits.argmax()))
        logits = runner.forward([out[-1]])[-1]
    return out


def test_proposes_the_draft_models_greedy_continuation():
    drafter = ModelDrafter(HFRunner(MODEL))
    draft = drafter.propose([3, 4, 5], 4)
    assert draft.tokens == greedy_continuation([3, 4, 5], 4)
    assert draft.q is None


def test_a_sampled_request_drafts_the_argmax_chain_where_asked_or_where_the_runner_chains_natively():
    import dataclasses

    import pytest

    from specdec.algorithm.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    greedy = ModelDrafter(HFRunner(MODEL), params, draft_sampling="greedy").propose([3, 4, 5], 4)
    assert greedy.tokens == greedy_continuation([3, 4, 5], 4) and greedy.q is None  # verified as one-hot q
    sampled = ModelDrafter(HFRunner(MODEL), params, draft_sampling="sample").propose([3, 4, 5], 4)
    assert sampled.q is not None and sampled.q.shape == (4, VOCAB)
    # "auto": samples on a runner that cannot chain natively, the argmax chain on one that can
    assert not ModelDrafter(HFRunner(MODEL), params).argmax
    chaining = HFRunner(MODEL)
    chaining.capabilities = dataclasses.replace(chaining.capabilities, draft_chain=True)
    assert ModelDrafter(chaining, params).argmax and not ModelDrafter(chaining, params, draft_sampling="sample").argmax
    assert not ModelDrafter(chaining, params, confidence=0.5).argmax  # a confidence stop drafts in Python: it samples
    with pytest.raises(ValueError, match="draft_sampling"):
        ModelDrafter(HFRunner(MODEL), params, draft_sampling="beam")


def test_cache_resyncs_after_rejection():
    drafter = ModelDrafter(HFRunner(MODEL))
    first = drafter.propose([3, 4, 5], 4)
    # The target kept one draft token and then chose something else.
    context = [3, 4, 5, first.tokens[0], (first.tokens[1] + 1) % VOCAB]
    second = drafter.propose(context, 3)
    assert second.tokens == greedy_continuation(context, 3)
    # The cache holds the context and all but the last draft token, nothing stale.
    assert drafter.runner.tokens == context + second.tokens[:-1]


def test_context_shorter_than_cache_rolls_back():
    drafter = ModelDrafter(HFRunner(MODEL))
    drafter.propose([3, 4, 5, 6, 7, 8], 3)
    assert drafter.propose([3, 4], 2).tokens == greedy_continuation([3, 4], 2)


def test_padded_vocabularies_line_up():
    # A draft with fewer rows than the target: its logits are padded with -inf.
    drafter = ModelDrafter(HFRunner(MODEL), target_vocab_size=VOCAB + 32)
    padded = drafter._to_target_width(torch.zeros(VOCAB))
    assert padded.shape == (VOCAB + 32,) and torch.isinf(padded[VOCAB:]).all()
    # A draft with more rows than the target: cut to the target's width.
    drafter = ModelDrafter(HFRunner(MODEL), target_vocab_size=VOCAB - 16)
    assert drafter._to_target_width(torch.zeros(VOCAB)).shape == (VOCAB - 16,)
    assert all(t < VOCAB - 16 for t in drafter.propose([3, 4], 5).tokens)


def test_synced_counts_the_catch_up():
    # What the controller keeps out of the per-token drafting cost (Draft.synced).
    drafter = ModelDrafter(HFRunner(MODEL))
    prompt = [3, 4, 5, 6, 7]
    first = drafter.propose(prompt, 3)
    assert first.synced == len(prompt)  # the first draft reads the prompt
    context = prompt + first.tokens + [9]  # all accepted, then the bonus token
    second = drafter.propose(context, 3)
    assert second.synced == 2  # the last draft token (proposed, never fed) + the bonus
    context = context + [(second.tokens[0] + 1) % VOCAB, 2, 3, 4]  # rejected, then three plain steps
    assert drafter.propose(context, 2).synced == 4  # their four tokens


def test_lag_and_the_catch_up_window():
    drafter = ModelDrafter(HFRunner(MODEL), window=4)
    prompt = [3, 4, 5]
    assert drafter.lag(prompt) == 3  # the prompt, read at the first proposal
    first = drafter.propose(prompt, 2)
    context = prompt + first.tokens + [6]  # both accepted, then the bonus token
    assert drafter.lag(context) == 2  # steady state: the last draft token and the bonus
    assert drafter.propose(context, 2).synced == 2
    long = context + [7, 8, 9, 10, 11, 12]  # plain steps the draft did not see
    assert drafter.lag(long) == 4  # more than the window behind: it starts over from the last 4
    draft = drafter.propose(long, 3)
    assert draft.synced == 4 and drafter.cache.offset == len(long) - 4
    assert drafter.runner.tokens == long[-4:] + draft.tokens[:-1]
    assert draft.tokens == greedy_continuation(long[-4:], 3)  # what the draft model says after the window
    after = long + draft.tokens[:1] + [2]  # one accepted, then the target's token
    assert drafter.lag(after) == 1 and drafter.propose(after, 2).synced == 1  # follows from the window on
    drafter.reset()
    assert drafter.cache.offset == 0 and drafter.lag(prompt) == 3
    unlimited = ModelDrafter(HFRunner(MODEL), window=None)
    assert unlimited.lag(long) == len(long)


class FirstTokenRunner(RunnerDefaults):
    """A draft model that always proposes the first token it holds: what it says depends on the start of
    the prompt, so it is right only if it read the whole prompt."""

    capabilities = HFRunner(MODEL).capabilities

    def __init__(self, vocab: int = VOCAB, max_context: int = 4096) -> None:
        self.vocab_size, self.max_context = vocab, max_context
        self.tokens: list[int] = []

    def forward(self, new_tokens, last_n=None):
        self.tokens.extend(new_tokens)
        n = len(new_tokens) if last_n is None else min(last_n, len(new_tokens))
        logits = torch.zeros(n, self.vocab_size)
        logits[:, self.tokens[0]] = 1.0
        return logits  # [n, V]

    def rollback(self, n):
        del self.tokens[n:]

    def reset(self):
        self.tokens = []


def test_the_first_draft_reads_the_whole_prompt():
    prompt = [7] + [1] * 999  # the answer is in the first token, a thousand tokens back
    drafter = ModelDrafter(FirstTokenRunner())
    assert drafter.lag(prompt) == len(prompt)  # the controller prices the whole prompt's prefill
    draft = drafter.propose(prompt, 3)
    assert draft.tokens == [7, 7, 7] and draft.synced == len(prompt)
    later = prompt + draft.tokens + [7] + [2] * 300  # accepted, the bonus, then 300 plain steps
    assert drafter.lag(later) == 302  # the catch-up feeds what it missed, the prompt stays read
    assert drafter.propose(later, 2).tokens == [7, 7]


def test_a_context_longer_than_the_drafts_window_starts_over_from_its_tail():
    runner = FirstTokenRunner(max_context=116)  # room for 100 context tokens and 16 drafted ones
    drafter = ModelDrafter(runner)
    prompt = [5] * 60 + [9] * 60
    draft = drafter.propose(prompt, 3)  # the last 50 tokens (half the room): restarts stay rare
    assert drafter.cache.offset == 70 and draft.tokens == [9, 9, 9]
    assert len(runner.tokens) <= runner.max_context


def test_a_confidence_threshold_stops_the_draft_after_a_doubtful_token():
    import pytest

    context = [3, 4, 5]
    runner = HFRunner(MODEL)
    probs = []  # the draft model's probability of each of its greedy tokens
    logits = runner.forward(context)[-1]
    for token in greedy_continuation(context, 6):
        probs.append(float(torch.softmax(logits, -1)[token]))
        logits = runner.forward([token])[-1]
    ranked = sorted(probs)
    # some tokens fall below it, some not; halfway between two of them, so that no token sits on it (the
    # drafter's one-row forward rounds differently from these: on AVX-512 a token's probability at the
    # threshold itself measured just below it there)
    threshold = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2
    first_doubt = next(i for i, p in enumerate(probs) if p < threshold)
    drafter = ModelDrafter(HFRunner(MODEL), confidence=threshold)
    draft = drafter.propose(context, 6)
    assert draft.tokens == greedy_continuation(context, 6)[: first_doubt + 1]  # the doubtful token is still proposed
    assert ModelDrafter(HFRunner(MODEL), confidence=1e-9).propose(context, 6).tokens == greedy_continuation(context, 6)
    with pytest.raises(ValueError):
        ModelDrafter(HFRunner(MODEL), confidence=1.5)


def trimmed_runner(ids):
    """A tiny int8 draft on the lean runner, its head trimmed to vocabulary ids `ids` (FR-Spec)."""
    from specdec.native.lean import LeanRunner
    from specdec.native.quant import quantize_model

    runner = LeanRunner(quantize_model(tiny_model("llama", 5)))
    full = runner.clone()
    runner.trim_head(torch.tensor(ids))
    return runner, full


KEPT = list(range(0, VOCAB, 3))  # a third of the vocabulary
CONTEXT = [3, 4, 5]
WITH_CONTEXT = sorted(set(KEPT) | set(CONTEXT))  # the head's set and the request's context


def test_a_trimmed_draft_proposes_its_argmax_among_the_kept_tokens_and_its_context():
    runner, full = trimmed_runner(KEPT)
    drafter = ModelDrafter(runner)
    draft = drafter.propose(CONTEXT, 4)
    assert sorted(runner.head_ids.tolist()) == WITH_CONTEXT  # the context's tokens 4 and 5 added after the set
    expected, logits = [], full.forward(CONTEXT)[-1]
    for _ in range(4):  # the full head's logits, the best of the kept ids
        expected.append(WITH_CONTEXT[int(logits[WITH_CONTEXT].argmax())])
        logits = full.forward([expected[-1]])[-1]
    assert draft.tokens == expected and draft.q is None
    later = CONTEXT + draft.tokens[:1] + [7]  # a token the next step adds
    drafter.propose(later, 2)
    assert sorted(runner.head_ids.tolist()) == sorted(set(WITH_CONTEXT) | {7})
    # the tree's rows are the target's width, -inf outside the kept ids; a new request starts from the set
    tree = ModelDrafter(runner).propose_tree([9, 3], 3, width=2, nodes=5)
    assert set(tree.tokens) <= set(KEPT) and sorted(runner.head_ids.tolist()) == KEPT


def test_a_trimmed_draft_samples_from_q_over_the_kept_tokens_and_zero_elsewhere():
    from specdec.algorithm.sampling import SamplingParams, warp_probs

    runner, full = trimmed_runner(KEPT)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    drafter = ModelDrafter(runner, params, target_vocab_size=VOCAB + 4)
    draft = drafter.propose([3, 4, 5], 3)
    assert draft.q is not None and draft.q.shape == (3, VOCAB + 4)
    outside = torch.ones(VOCAB + 4, dtype=torch.bool)
    outside[WITH_CONTEXT] = False
    assert (draft.q[:, outside] == 0).all() and torch.allclose(draft.q.sum(-1), torch.ones(3))
    assert all(t in WITH_CONTEXT and float(draft.q[i, t]) > 0 for i, t in enumerate(draft.tokens))
    # q is the warp of the full head's logits restricted to the kept ids
    restricted = torch.full((VOCAB,), float("-inf"))
    restricted[WITH_CONTEXT] = full.forward(CONTEXT)[-1][WITH_CONTEXT]
    assert torch.equal(draft.q[0, :VOCAB], warp_probs(restricted, params))


def test_a_trimmed_drafts_confidence_is_its_softmax_over_the_kept_tokens():
    runner, full = trimmed_runner(KEPT)
    logits = full.forward(CONTEXT)[-1][WITH_CONTEXT]
    probs = torch.softmax(logits, -1)
    first = WITH_CONTEXT[int(logits.argmax())]
    just_above = float(probs.max()) * 1.0001  # a hair above the first token's own probability over the kept ids
    assert len(ModelDrafter(runner, confidence=just_above).propose([3, 4, 5], 4).tokens) == 1
    runner.reset()
    tokens = ModelDrafter(runner, confidence=float(probs.max()) * 0.999).propose([3, 4, 5], 4).tokens
    assert tokens[0] == first and len(tokens) >= 2  # the first passed: a second was drafted
