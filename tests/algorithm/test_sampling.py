"""SamplingParams validation and the logits -> probabilities warp (temperature, top-k, top-p)."""

from __future__ import annotations

import pytest
import torch

from specdec.algorithm.sampling import SamplingParams, make_generator, sample_from, warp_probs
from specdec.errors import SpecdecError
from tests.toy import reference_warp


def near_top_p_boundary(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> bool:
    """Whether float32 rounding could decide if one more token reaches top_p."""
    probs = reference_warp(logits, temperature, top_k, 1.0)
    cumulative = probs.sort(descending=True).values.cumsum(0)
    return bool(((cumulative - top_p).abs() < 1e-5).any())


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=-1e-9), dict(temperature=float("nan")),
    dict(top_k=-1), dict(top_k=-100),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.0000001), dict(top_p=2.0), dict(top_p=float("nan")),
])
def test_invalid_params_raise_user_errors(kwargs):
    with pytest.raises(SpecdecError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(temperature=0.0), dict(temperature=1e-6), dict(temperature=5.0), dict(top_k=0), dict(top_k=1),
    dict(top_p=1e-9), dict(top_p=1.0), dict(temperature=0.7, top_k=50, top_p=0.9, seed=3),
])
def test_valid_params(kwargs):
    params = SamplingParams(**kwargs)
    assert params.greedy == (params.temperature == 0.0)


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError):
        warp_probs(torch.zeros(4), SamplingParams())


# --------------------------------------------------------------------------- temperature


def test_temperature_divides_the_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 10, generator=gen) * 3
    for temperature in (0.05, 0.5, 1.0, 1.7, 10.0):
        probs = warp_probs(logits, SamplingParams(temperature=temperature))
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1), rtol=1e-5, atol=1e-7)


def test_higher_temperature_is_flatter():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    entropies = []
    for temperature in (0.2, 0.5, 1.0, 2.0, 5.0):
        probs = warp_probs(logits, SamplingParams(temperature=temperature)).double()
        entropies.append(float(-(probs * probs.clamp_min(1e-300).log()).sum()))
        assert int(probs.argmax()) == 0
    assert entropies == sorted(entropies) and entropies[0] < entropies[-1]


def test_tiny_temperature_is_one_hot_on_the_argmax():
    logits = torch.tensor([[0.3, 1.2, 1.1, -4.0], [5.0, -5.0, 4.99, 0.0]])
    probs = warp_probs(logits, SamplingParams(temperature=1e-4))
    assert torch.isfinite(probs).all()
    assert probs.argmax(-1).tolist() == [1, 0] and probs.max(-1).values.tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------- top-k


def test_top_k_keeps_exactly_k():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 12, generator=gen) * 2  # [rows, V]; no ties
    for k in range(1, 13):
        probs = warp_probs(logits, SamplingParams(temperature=0.9, top_k=k))
        assert ((probs > 0).sum(-1) == k).all()
        kept = probs > 0
        expected = torch.zeros_like(kept).scatter_(-1, logits.topk(k, -1).indices, True)
        assert torch.equal(kept, expected)  # the k most likely
        for row in range(20):
            torch.testing.assert_close(probs[row].double(), reference_warp(logits[row], 0.9, k, 1.0), rtol=1e-5, atol=1e-7)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0, 0.0])
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, False, True, False]
    assert probs[1] == probs[2] == probs[4]
    all_equal = warp_probs(torch.zeros(5), SamplingParams(temperature=1.0, top_k=1))
    torch.testing.assert_close(all_equal, torch.full((5,), 0.2))  # all tied: nothing is removed


def test_top_k_off_or_larger_than_vocabulary():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    plain = warp_probs(logits, SamplingParams(temperature=1.3))
    for k in (0, 7, 8, 1000):
        assert torch.equal(warp_probs(logits, SamplingParams(temperature=1.3, top_k=k)), plain)


def test_top_k_one_is_the_argmax():
    logits = torch.randn(50, 9, generator=torch.Generator().manual_seed(3))
    probs = warp_probs(logits, SamplingParams(temperature=2.0, top_k=1))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 9).float())


# --------------------------------------------------------------------------- top-p


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    gen = torch.Generator().manual_seed(4)
    checked = 0
    for trial in range(400):
        vocab = 2 + trial % 11
        logits = torch.randn(vocab, generator=gen) * 2
        top_p = float(torch.rand((), generator=gen)) * 0.98 + 0.01
        temperature = (0.5, 1.0, 1.5)[trial % 3]
        if near_top_p_boundary(logits, temperature, 0, top_p):
            continue
        checked += 1
        probs = warp_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
        expected = reference_warp(logits, temperature, 0, top_p)
        assert torch.equal(probs > 0, expected > 0), (logits, top_p)
        torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-7)
        # smallest: the kept mass reaches top_p, and without the least likely kept token it would not
        base = torch.softmax(logits.double() / temperature, -1)
        kept = base[probs > 0]
        assert kept.sum() >= top_p and kept.sum() - kept.min() < top_p
    assert checked > 350


def test_top_p_exact_cases():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda top_p: (warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0).sum().item()  # noqa: E731
    assert [kept(p) for p in (0.1, 0.49, 0.6, 0.79, 0.81, 0.94, 0.96, 1.0)] == [1, 1, 2, 2, 3, 3, 4, 4]


def test_top_p_keeps_ties_at_the_boundary():
    logits = torch.tensor([1.0, 1.0, 1.0, 0.0])  # three tied tokens of ~0.30 each
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.4))  # two would reach 0.4
    assert (probs > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(probs, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))


def test_top_p_always_keeps_the_argmax():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(30, 16, generator=gen)
    for top_p in (1e-9, 1e-3, 0.01):
        probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 16).float())
    flat = warp_probs(torch.zeros(6), SamplingParams(temperature=1.0, top_p=1e-6))
    assert (flat > 0).all()  # all tied with the argmax: all kept


def test_top_k_then_top_p():
    # top-p applies to the distribution renormalised after top-k (the transformers order).
    gen = torch.Generator().manual_seed(6)
    checked = 0
    for trial in range(300):
        logits = torch.randn(10, generator=gen) * 1.5
        top_k, top_p = 1 + trial % 6, 0.3 + 0.65 * float(torch.rand((), generator=gen))
        if near_top_p_boundary(logits, 0.8, top_k, top_p):
            continue
        checked += 1
        probs = warp_probs(logits, SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p))
        expected = reference_warp(logits, 0.8, top_k, top_p)
        assert torch.equal(probs > 0, expected > 0)
        torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-7)
        assert 1 <= int((probs > 0).sum()) <= top_k
    assert checked > 250


def tied_logits(gen: torch.Generator, vocab: int) -> torch.Tensor:
    """Logits on a coarse grid, so that many tokens tie exactly (also at the top-k / top-p cut)."""
    return (torch.randn(vocab, generator=gen) * 1.5).round()


def test_ties_at_the_cut_agree_with_the_reference():
    # Exactly tied tokens at the top-k or top-p cut are all kept, by the sampler and by the
    # independent float64 reference alike; only cases rounding could decide are skipped.
    gen = torch.Generator().manual_seed(9)
    checked = tied_cut = 0
    for trial in range(400):
        logits = tied_logits(gen, 4 + trial % 9)
        top_k, top_p = trial % 5, (0.35, 0.6, 0.8, 0.95, 1.0)[trial % 5 - 1]
        if near_top_p_boundary(logits, 1.0, top_k, top_p):
            continue
        checked += 1
        probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
        expected = reference_warp(logits, 1.0, top_k, top_p)
        assert torch.equal(probs > 0, expected > 0), (logits, top_k, top_p)
        torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-7)
        kept = logits[probs > 0]
        tied_cut += int((logits == kept.min()).sum() > 1)  # the least likely kept token has a tie
    assert checked > 300 and tied_cut > 50


# --------------------------------------------------------------------------- every warp


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.3, top_k=3), SamplingParams(temperature=2.0, top_p=0.5),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(temperature=1e-3, top_k=2, top_p=0.1),
])
def test_rows_are_distributions_that_keep_the_argmax(params):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 3, 50, generator=gen) * 4  # any leading shape
    logits[0, 0, 10:] = float("-inf")  # padding ids (see ModelDrafter) never get mass
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        probs = warp_probs(logits.to(dtype), params)
        assert probs.shape == logits.shape and probs.dtype == torch.float32
        assert (probs >= 0).all() and torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(4, 3))
        argmax = logits.to(dtype).argmax(-1, keepdim=True)
        assert (probs.gather(-1, argmax) > 0).all()
        assert (probs[0, 0, 10:] == 0).all()


def test_warp_is_per_row():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 9, generator=gen)
    params = SamplingParams(temperature=0.6, top_k=4, top_p=0.8)
    batched = warp_probs(logits, params)
    for row in range(6):
        torch.testing.assert_close(batched[row], warp_probs(logits[row], params), rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- random streams


def test_generators_are_seeded_per_stream():
    draw = lambda gen: torch.rand(8, generator=gen).tolist()  # noqa: E731
    assert draw(make_generator(5, 0)) == draw(make_generator(5, 0))
    assert draw(make_generator(5, 0)) != draw(make_generator(5, 1))
    assert draw(make_generator(5, 0)) != draw(make_generator(6, 0))
    assert draw(make_generator(None)) != draw(make_generator(None))


def test_sample_from_never_draws_a_zero():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])
    gen = make_generator(0)
    drawn = {sample_from(probs, gen) for _ in range(500)}
    assert drawn == {1, 3}
    assert sample_from(torch.tensor([0.0, 0.0, 1.0]), gen) == 2
    assert sample_from(torch.tensor([0.0, 2.0, 0.0]), gen) == 1  # unnormalised: the draw normalises


def test_sample_from_draws_each_token_with_its_probability():
    from tests.chisq import chi_square

    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05])
    gen = make_generator(3)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(20_000):
        token = (sample_from(probs, gen),)
        counts[token] = counts.get(token, 0) + 1
    _, _, p_value = chi_square(counts, {(i,): float(p) for i, p in enumerate(probs) if p > 0})
    assert p_value > 0.001 and set(counts) == {(0,), (2,), (3,), (5,), (6,), (7,)}


# --------------------------------------------------------------------------- the warp without a full sort


def sorted_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The warp as it was before the partial selection: top-p through a sort of the whole vocabulary."""
    from specdec.algorithm.sampling import scaled_logits

    scores = scaled_logits(logits, params.temperature)
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        num_kept = (mass_before < params.top_p).sum(dim=-1, keepdim=True).clamp(min=1)
        threshold = torch.gather(sorted_probs, -1, num_kept - 1)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@pytest.mark.parametrize("vocab", [7, 300, 151936])
def test_the_partial_selection_is_the_full_sort_bit_for_bit(vocab):
    # Random logits of several spreads (a peaked distribution: a small nucleus; a flat one: a nucleus of
    # thousands, past several rounds of candidates), tied logits, extreme temperatures, every top-p.
    gen = torch.Generator().manual_seed(vocab)
    rows = 4 if vocab > 10000 else 24
    checked = 0
    for spread in (0.5, 2.0, 6.0, 20.0):
        logits = torch.randn(rows, vocab, generator=gen) * spread  # [rows, V]
        logits[: rows // 4] = logits[: rows // 4].round()  # exact ties, at the cut too
        for temperature in (1e-30, 0.05, 0.7, 1.0, 3.0, 1e6):
            for top_k, top_p in ((0, 0.9), (0, 0.5), (40, 0.95), (0, 0.999), (0, 1e-9), (5, 0.3)):
                params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
                assert torch.equal(warp_probs(logits, params), sorted_warp(logits, params)), (spread, params)
                checked += 1
    assert checked == 4 * 6 * 6
