"""specdec's attention kernel (specdec.native.kernels.attention): exact, the same on every path, batch-invariant.

- Close to float64 attention (softmax over the visible keys, grouped-query heads, sliding windows).
- Every path this CPU runs (AVX-512, AVX2, portable C) gives the same bits, for head sizes the vector paths
  take and one they leave to C, context lengths on and off the 16-lane blocks.
- A query row's result is the same alone, among any other rows, at any thread count.
- Scores far below the maximum give exactly zero weight; a NaN query poisons only its own row and head.
- Tree mode (issue 39): a token tree's node is bitwise the chain over its path (the cache, its ancestors,
  itself; sliding windows that end among the ancestors too), close to float64, the same on every path.
"""

from __future__ import annotations

import pytest
import torch

from specdec.backends.tree import Tree
from specdec.native import kernels


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
              window: int | None, tree: Tree | None = None) -> torch.Tensor:
    """The same attention in float64: q [H, n, D], keys/values [H_kv, L, D] -> [n, H * D]."""
    heads, n, d = q.shape
    group = heads // keys.shape[0]
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        end = start + i + 1
        lo = max(0, end - window) if window else 0
        seen = torch.arange(lo, end) if tree is None else torch.tensor(tree.visible(i, start, window))
        for h in range(heads):
            k, v = keys[h // group, seen].double(), values[h // group, seen].double()
            weights = torch.softmax(k @ q[h, i].double() * scale, dim=0)  # [L]
            out[i, h] = weights @ v
    return out.reshape(n, heads * d)


def inputs(heads: int, kv_heads: int, d: int, length: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, d, generator=gen)
    keys = torch.randn(kv_heads, length, d, generator=gen)
    values = torch.randn(kv_heads, length, d, generator=gen)
    return q, keys, values


SHAPES = [  # heads, kv_heads, head size, sliding window
    (12, 2, 128, None),  # qwen2.5-1.5b
    (9, 3, 64, None),  # smollm2-135m
    (4, 1, 256, 7),  # gemma3-270m, a sliding-window layer
    (2, 2, 16, None),
    (3, 1, 24, 5),  # a head size the vector paths leave to C
]


@pytest.mark.parametrize("heads,kv_heads,d,window", SHAPES)
def test_every_path_gives_the_same_bits_close_to_float64(heads, kv_heads, d, window):
    for start, n in [(0, 1), (0, 19), (15, 1), (16, 3), (40, 9)]:  # contexts on and off 16-key blocks
        q, keys, values = inputs(heads, kv_heads, d, start + n + 3, n, seed=start * 100 + n + d)
        scale = d ** -0.5
        out = kernels.attention.causal(q, keys, values, start, scale, window)
        assert out.shape == (n, heads * d)
        assert torch.allclose(out.double(), reference(q, keys, values, start, scale, window), atol=2e-6, rtol=1e-5)
        for path in kernels.attention.paths():
            assert torch.equal(out, kernels.attention.causal(q, keys, values, start, scale, window, path=path)), path


@pytest.mark.parametrize("heads,kv_heads,d,window", [(12, 2, 128, None), (14, 2, 64, 150), (7, 1, 128, 40)])
def test_long_contexts_and_large_groups_give_every_path_the_same_bits(heads, kv_heads, d, window):
    # the AVX-512 path scores 16 keys at a time for up to 6 heads of a kv head together: contexts of many
    # blocks, groups of more heads than one block (the 0.5B's 7), windows that end inside a block
    for start, n in [(203, 1), (300, 37)]:
        q, keys, values = inputs(heads, kv_heads, d, start + n, n, seed=start + n + d)
        scale = d ** -0.5
        out = kernels.attention.causal(q, keys, values, start, scale, window)
        assert torch.allclose(out.double(), reference(q, keys, values, start, scale, window), atol=2e-6, rtol=1e-5)
        for path in kernels.attention.paths():
            assert torch.equal(out, kernels.attention.causal(q, keys, values, start, scale, window, path=path)), path
        # a row alone (a one-token step) is the same bits as among the others (a prefill)
        assert torch.equal(out[-1], kernels.attention.causal(q[:, -1:], keys, values, start + n - 1, scale, window)[0])


def test_a_row_is_the_same_alone_among_others_and_at_any_thread_count():
    q, keys, values = inputs(12, 2, 128, 60, 19, seed=1)
    start, scale = 40, 0.09
    together = kernels.attention.causal(q, keys, values, start, scale)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for i in range(19):
                alone = kernels.attention.causal(q[:, i : i + 1], keys, values, start + i, scale)
                assert torch.equal(alone[0], together[i]), (count, i)
            few = kernels.attention.causal(q[:, 3:7], keys, values, start + 3, scale)
            assert torch.equal(few, together[3:7])
    finally:
        torch.set_num_threads(threads)


def test_strided_views_give_the_same_bits():
    q, keys, values = inputs(4, 2, 64, 30, 5, seed=2)
    cache_k = torch.zeros(1, 2, 50, 64)
    cache_v = torch.zeros(1, 2, 50, 64)
    cache_k[0, :, :30], cache_v[0, :, :30] = keys, values
    wide_q = torch.randn(4, 5, 128)
    wide_q[..., :64] = q
    assert torch.equal(kernels.attention.causal(wide_q[..., :64], cache_k[0], cache_v[0], 25, 0.1),
                       kernels.attention.causal(q, keys, values, 25, 0.1))


def test_far_scores_weigh_nothing_and_a_nan_stays_in_its_row_and_head():
    q, keys, values = inputs(2, 1, 16, 4, 2, seed=3)
    keys[0, 1] = q[0, 1] * 1000  # key 1: a score ~1e5 above the others for (row 1, head 0)
    out = kernels.attention.causal(q, keys, values, 2, 1.0)
    assert torch.equal(out[1, :16], values[0, 1])  # every other key's exp underflows to exactly 0
    q[1, 0, 0] = float("nan")
    poisoned = kernels.attention.causal(q, keys, values, 2, 1.0)
    assert poisoned[0, 16:].isnan().all()  # row 0, head 1
    assert not poisoned[0, :16].isnan().any() and not poisoned[1].isnan().any()


def test_shapes_that_do_not_fit_are_refused():
    q, keys, values = inputs(4, 2, 16, 8, 3, seed=4)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.attention.causal(q, keys, values, 6, 0.1)  # positions 6..8 need 9 keys
    with pytest.raises(ValueError, match="fp32"):
        kernels.attention.causal(q.double(), keys, values, 0, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.attention.causal(torch.randn(3, 1, 16), keys, values, 0, 0.1)  # 3 heads over 2 key heads


TREES = [  # parents: one node, a chain, a bushy tree, one deeper than the windows of SHAPES, two roots
    [-1],
    [-1, 0, 1, 2],
    [-1, 0, 0, 1, 1, 2, 3, 4, 0],
    [-1, 0, 1, 2, 3, 4, 5, 6, 2, 8, 9],
    [-1, -1, 0, 1],
]


@pytest.mark.parametrize("heads,kv_heads,d,window", SHAPES)
def test_a_tree_node_is_its_paths_chain_on_every_path(heads, kv_heads, d, window):
    for start in (0, 15, 16, 70):  # past 64 keys: several 16-key blocks before the nodes
        for t, parents in enumerate(TREES):
            tree, n = Tree(parents), len(parents)
            q, keys, values = inputs(heads, kv_heads, d, start + n, n, seed=start * 10 + t + d)
            scale = d ** -0.5
            out = kernels.attention.causal(q, keys, values, start, scale, window, tree=tree)  # [n, H D]
            assert torch.allclose(out.double(), reference(q, keys, values, start, scale, window, tree),
                                  atol=2e-6, rtol=1e-5)
            for path in kernels.attention.paths():
                assert torch.equal(out, kernels.attention.causal(q, keys, values, start, scale, window, path=path,
                                                                 tree=tree)), path
            for i, nodes in enumerate(tree.paths):
                seen = [*range(start), *(start + j for j in nodes)]  # the chain: cache, then the path
                chain = kernels.attention.causal(q[:, nodes], keys[:, seen], values[:, seen], start, scale, window)
                assert torch.equal(out[i], chain[-1]), (start, parents, i)


def test_a_chain_given_as_a_tree_is_the_chain_and_a_tree_must_fit():
    q, keys, values = inputs(12, 2, 128, 60, 9, seed=5)
    chain = Tree([i - 1 for i in range(9)])
    for window in (None, 4):
        assert torch.equal(kernels.attention.causal(q, keys, values, 51, 0.1, window, tree=chain),
                           kernels.attention.causal(q, keys, values, 51, 0.1, window))
    with pytest.raises(ValueError, match="tree of 3 nodes"):
        kernels.attention.causal(q, keys, values, 51, 0.1, tree=Tree([-1, 0, 0]))
