"""A draft on the gguf kernel (specdec.native.gguf, kernels/draft.c): its weights requantised to Q4_1 blocks, and
its greedy chain of drafted tokens in one native call.

- Q4_1 blocks hold quantize_int4's numbers as llama.cpp reads them (d * q + m);
- a model requantised at load is, bit for bit, the GGUF file whose linears and head were written as those blocks;
- draft_greedy is forward() and an argmax of each last row, one token at a time: the same tokens, and the same
  cache after it (the next forward's logits bitwise), for catch-ups of 1..70 tokens and k of 1..8;
- the draft-model drafter proposes the same tokens natively as through its per-token Python loop, and
  speculative greedy output with it equals plain greedy output for every γ.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.drafters.model import NATIVE_FEED, ModelDrafter
from specdec.native import gguf, kernels
from specdec.native.int4 import q4_1_blocks, quantize_int4
from tests.tiny_gguf import save_tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-draft")
    return {(arch, requantized): save_tiny_gguf(folder / f"{arch}-{requantized}.gguf", arch, requantized=requantized)
            for arch in ("qwen2", "llama") for requantized in (False, True)}


@pytest.fixture(scope="module")
def drafts(files):
    """Per architecture: the model requantised at load, and the one read from the requantised file."""
    return {arch: (gguf.GGUFModel(gguf.GGUFFile(files[(arch, False)]), requantize=gguf.Q4_1),
                   gguf.GGUFModel(gguf.GGUFFile(files[(arch, True)]))) for arch in ("qwen2", "llama")}


def test_q4_1_blocks_hold_the_int4_numbers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g)
    w[3, 32:64] = 0.25  # a constant group: scale 0, every value its minimum
    values, scales, mins = quantize_int4(w)
    want = (scales.float().repeat_interleave(32, dim=1) * values.float()
            + mins.float().repeat_interleave(32, dim=1))  # d * q + m, as llama.cpp de-quantises Q4_1
    got = kernels.gguf.rows(gguf.Q4_1, q4_1_blocks(w), 96, list(range(40)))
    assert torch.equal(got, want)
    assert (got - w).abs().max() < 0.5  # an approximation of w, not something else


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_requantised_model_is_the_file_of_its_blocks(drafts, arch):
    loaded, written = drafts[arch]
    assert loaded.dtype == "q4_1" and written.dtype == "gguf"
    a, b = gguf.GGUFRunner(loaded), gguf.GGUFRunner(written)
    tokens = list(range(3, 40))
    assert torch.equal(a.forward(tokens), b.forward(tokens))
    assert a.identity()["dtype"] == "q4_1"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_draft_greedy_is_forward_and_argmax(drafts, arch):
    model = drafts[arch][0]
    rng = random.Random(arch)
    for trial in range(12):
        prefix = [rng.randrange(3, 250) for _ in range(rng.randrange(0, 20))]
        feed = [rng.randrange(3, 250) for _ in range(rng.choice([1, 2, 3, 5, 70]))]
        k = rng.randrange(1, 9)
        ref, fast = gguf.GGUFRunner(model), gguf.GGUFRunner(model)
        for r in (ref, fast):
            if prefix:
                r.forward(prefix)
        logits = ref.forward(feed)[-1]
        want = []
        for i in range(k):
            want.append(int(logits.argmax()))
            if i < k - 1:
                logits = ref.forward([want[-1]])[-1]
        assert fast.draft_greedy(feed, k) == want, trial
        assert fast.tokens == ref.tokens
        probe = [7, 11]  # the caches hold the same keys and values: the next forward is bitwise the same
        assert torch.equal(fast.forward(probe), ref.forward(probe)), trial


def test_draft_greedy_refuses_what_it_cannot(drafts):
    runner = gguf.GGUFRunner(drafts["qwen2"][0], max_context=16)
    with pytest.raises(ValueError):
        runner.draft_greedy([5], 0)
    with pytest.raises(ValueError):
        runner.draft_greedy([10**6], 2)
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError):
        runner.draft_greedy(list(range(3, 15)), 8)  # 12 fed + 7 drafted and fed > 16


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_drafter_proposes_natively_what_its_loop_does(drafts, arch, monkeypatch):
    model = drafts[arch][0]
    native, loop = ModelDrafter(gguf.GGUFRunner(model)), ModelDrafter(gguf.GGUFRunner(model))
    # a sampled request's draft proposes the same chain natively (draft_sampling "auto"), verified as a one-hot q
    sampled = ModelDrafter(gguf.GGUFRunner(model), SamplingParams(temperature=0.8, top_p=0.9, seed=0))
    assert native.native() and sampled.native()
    monkeypatch.setattr(loop, "native", lambda: False)
    rng = random.Random(1)
    context = [rng.randrange(3, 250) for _ in range(NATIVE_FEED + 9)]  # a first catch-up past NATIVE_FEED
    for step in range(10):
        k = rng.randrange(1, 7)
        a, b, c = native.propose(context, k), loop.propose(context, k), sampled.propose(context, k)
        assert a.tokens == b.tokens == c.tokens and a.synced == b.synced == c.synced and c.q is None, step
        context += a.tokens[: rng.randrange(0, k + 1)] + [rng.randrange(3, 250)]  # some accepted, then a bonus


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_speculative_with_a_native_draft_equals_plain(files, drafts, arch):
    target = gguf.GGUFModel(gguf.GGUFFile(files[(arch, False)]))
    rng = random.Random(arch + "!")
    prompt = [rng.randrange(3, 250) for _ in range(11)]
    plain = run(gguf.GGUFRunner(target), prompt, StopCondition(20))
    for draft in (drafts[arch][0], target):  # its own requantisation (mostly accepted), itself (all accepted)
        for gamma in (1, 2, 4, 8):
            drafter = ModelDrafter(gguf.GGUFRunner(draft))
            spec = run(gguf.GGUFRunner(target), prompt, StopCondition(20), drafter=drafter,
                       num_speculative_tokens=gamma)
            assert spec.token_ids == plain.token_ids, (gamma, draft.dtype)
            assert spec.stats.drafted > 0
            if draft is target:
                assert spec.stats.accepted == spec.stats.drafted
    assert np.unique(plain.token_ids).size > 1  # not a degenerate constant output


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_trimmed_head_is_the_full_heads_rows(drafts, arch):
    for model in drafts[arch]:  # requantised at load, and the file's own Q4_1 blocks
        full, trimmed = gguf.GGUFRunner(model), gguf.GGUFRunner(model)
        ids = torch.tensor([5, 200, 17, 3, 120, 64, 1, 99], dtype=torch.int64)
        trimmed.trim_head(ids)
        tokens = list(range(3, 30))
        assert torch.equal(trimmed.forward(tokens), full.forward(tokens)[:, ids])
        trimmed.extend_head([250, 7, 17])  # 17 is in the set already: 250 and 7 follow it
        assert trimmed.head_ids is not None and trimmed.head_ids.tolist() == ids.tolist() + [7, 250]
        assert torch.equal(trimmed.forward([8]), full.forward([8])[:, trimmed.head_ids])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_draft_greedy_over_a_trimmed_head_is_its_argmax(drafts, arch):
    model = drafts[arch][0]
    rng = random.Random(arch + "trim")
    ids = torch.tensor(sorted(rng.sample(range(256), 40)), dtype=torch.int64)
    for extra in ([], [rng.randrange(256) for _ in range(5)]):
        ref, fast = gguf.GGUFRunner(model), gguf.GGUFRunner(model)
        for r in (ref, fast):
            r.trim_head(ids)
            r.extend_head(extra)
            r.forward([9, 10, 11])
        head_ids = ref.head_ids
        assert head_ids is not None
        logits = ref.forward([12, 13])[-1]
        want = []
        for i in range(6):
            want.append(int(head_ids[int(logits.argmax())]))
            if i < 5:
                logits = ref.forward([want[-1]])[-1]
        assert fast.draft_greedy([12, 13], 6) == want
        assert set(want) <= set(head_ids.tolist())
