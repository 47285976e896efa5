"""Token trees in one forward (TreeRunner.forward_tree / keep_rows; specdec.native.lean and .hf).

On tiny random models, for random trees (depth up to 4, width up to 3, a chain among them) after a short
and a long (> 64 tokens: the kernel's 16-lane blocks) prefix:

- every node's logits and final hidden state are a fresh runner's chain forward over the cache and the
  node's path: bitwise for int8 (the lean runner, and the transformers runner over the int8 model, sliding
  windows included), up to fp32 rounding for fp32 transformers models;
- keep_rows leaves the runner as that chain forward did: its tokens, hidden rows, and the next forward's
  logits (bitwise for int8), also after a rollback past the kept path;
- a tree packed with other runners' chunks gives the same bits as alone, and so do they;
- misuse is refused (a forward or rollback into an unsettled tree, a kept path that is not one), and runners
  that cannot compute trees say so (native int4 layers, batch slots).
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.backends.hf import HFRunner
from specdec.backends.tree import Tree
from specdec.errors import SpecdecError
from specdec.native.lean import LeanRunner, forward_packed
from specdec.native.quant import quantize_model
from tests.native.test_lean import tiny_mistral
from tests.tiny import VOCAB, tiny_model

FIXED = [  # parents of some shapes: one node, a chain, a fan, nodes out of breadth-first order, two roots, deep
    [-1],
    [-1, 0, 1, 2, 3],
    [-1, 0, 0, 0],
    [-1, 0, 1, 0, 3, 1, 2],
    [-1, -1, 0, 1],
    [-1, 0, 1, 2, 3, 4, 5, 2, 7, 8, 9],  # deeper than the sliding windows (5, 6): they end among the ancestors
]
SHORT, LONG = 9, 70  # prefix lengths: within one 16-key block of the kernel's lanes, and past four


def random_tree(rng: random.Random, depth: int = 4, width: int = 3) -> list[int]:
    """Parents of a random tree rooted at node 0 (the pending token), breadth first: every node above
    `depth` gets 0..width children (the root at least one)."""
    parents, depths, i = [-1], [0], 0
    while i < len(parents):
        if depths[i] < depth:
            for _ in range(rng.randint(1 if i == 0 else 0, width)):
                parents.append(i)
                depths.append(depths[i] + 1)
        i += 1
    return parents


def trees(seed: int, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return FIXED + [random_tree(rng) for _ in range(count)]


def tokens_for(parents: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in parents]


def prefix_of(length: int, seed: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


MODELS: dict[str, torch.nn.Module] = {}


def model(kind: str) -> torch.nn.Module:
    """The tiny models, built once: "int8 llama", "int8 qwen2", "int8 mistral" (sliding window 5), "int8
    gemma3" (window 6, transformers runner only), and fp32 "llama", "qwen2", "gemma3"."""
    if kind not in MODELS:
        arch = kind.split()[-1]
        fp32 = tiny_mistral(seed=2) if arch == "mistral" else tiny_model(arch, 2)
        MODELS[kind] = quantize_model(fp32) if kind.startswith("int8") else fp32
    return MODELS[kind]


RUNNERS = {"lean": LeanRunner, "hf": HFRunner}
EXACT = [("lean", "int8 llama"), ("lean", "int8 qwen2"), ("lean", "int8 mistral"), ("hf", "int8 llama"),
         ("hf", "int8 gemma3")]
FLOAT = [("hf", "llama"), ("hf", "qwen2"), ("hf", "gemma3")]


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def chain(runner_kind: str, kind: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, object]:
    """A fresh runner's forward over `tokens` in two steps (a prefill, then the last up to 5 as a
    verification would): (logits of the last token [V], its hidden state [H], the runner)."""
    runner = RUNNERS[runner_kind](model(kind))
    split = len(tokens) - min(5, len(tokens) - 1)
    runner.forward(tokens[:split])
    return runner.forward(tokens[split:])[-1], runner.hidden()[-1], runner


def check_tree(runner_kind: str, kind: str, prefix: list[int], parents: list[int], seed: int) -> None:
    exact = kind.startswith("int8")
    tree = Tree(parents)
    new = tokens_for(parents, seed)
    runner = RUNNERS[runner_kind](model(kind))
    runner.forward(prefix)
    cached = len(runner.tokens)
    logits = runner.forward_tree(new, parents)  # [n, V]
    assert logits.shape == (len(new), runner.vocab_size) and runner.tokens == prefix + new
    hidden = runner.hidden()  # [n, H]
    assert hidden.shape[0] == len(new) and torch.equal(runner.hidden_tail(), hidden)
    for i, path in enumerate(tree.paths):
        want, want_hidden, _ = chain(runner_kind, kind, prefix + [new[j] for j in path])
        same(logits[i], want, exact)
        same(hidden[i], want_hidden, exact)

    # keep a random node's path: the runner is then the chain runner over it, for the next forwards too
    rng = random.Random(seed)
    path = tree.paths[rng.randrange(len(new))]
    runner.keep_rows(cached, path)
    kept = prefix + [new[j] for j in path]
    assert runner.tokens == kept
    _, _, reference = chain(runner_kind, kind, kept)
    same(runner.hidden(), hidden[path], True)
    nxt = [rng.randrange(VOCAB) for _ in range(3)]
    same(runner.forward(nxt), reference.forward(nxt), exact)
    back = rng.randrange(cached - 2, len(runner.tokens))  # into the prefix, the path or the next tokens
    runner.rollback(back)
    reference.rollback(back)
    again = [rng.randrange(VOCAB) for _ in range(4)]
    same(runner.forward(again), reference.forward(again), exact)
    assert runner.tokens == reference.tokens


@pytest.mark.parametrize("runner_kind,kind", EXACT)
def test_int8_nodes_are_their_paths_chains_bitwise(runner_kind, kind):
    for n, parents in enumerate(trees(seed=len(kind))):
        prefix = prefix_of(LONG if n % 2 else SHORT, n)
        check_tree(runner_kind, kind, prefix, parents, seed=n)


@pytest.mark.parametrize("runner_kind,kind", FLOAT)
def test_fp32_transformers_nodes_are_their_paths_chains(runner_kind, kind):
    for n, parents in enumerate(trees(seed=7, count=2)):
        check_tree(runner_kind, kind, prefix_of(LONG if n % 2 else SHORT, n), parents, seed=n)


def test_lean_and_transformers_int8_trees_agree_bitwise():
    parents = random_tree(random.Random(3))
    new, prefix = tokens_for(parents, 3), prefix_of(LONG, 3)
    got = []
    for runner_kind in RUNNERS:
        runner = RUNNERS[runner_kind](model("int8 qwen2"))
        runner.forward(prefix)
        got.append(runner.forward_tree(new, parents))
    assert torch.equal(*got)


def test_lean_fp32_layers_take_trees_up_to_rounding():
    fp32 = model("llama")
    parents = [-1, 0, 0, 1, 2]
    new, prefix = tokens_for(parents, 4), prefix_of(SHORT, 4)
    runner = LeanRunner(fp32, fp32=True)
    assert runner.capabilities.tree and not runner.capabilities.batch_invariant
    runner.forward(prefix)
    logits = runner.forward_tree(new, parents)
    for i, path in enumerate(Tree(parents).paths):
        want = LeanRunner(fp32, fp32=True).forward(prefix + [new[j] for j in path])[-1]
        torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)


def test_a_packed_tree_is_the_same_bits_as_alone_and_so_are_its_neighbours():
    int8 = model("int8 llama")
    parents = [-1, 0, 0, 1, 1, 2]
    new, prefix = tokens_for(parents, 5), prefix_of(LONG, 5)
    alone = LeanRunner(int8)
    alone.forward(prefix)
    tree_alone = alone.forward_tree(new, parents)
    other_alone = LeanRunner(int8)
    other_alone.forward(prefix[:20])
    chain_alone = other_alone.forward(new[:4])

    packed_tree, packed_other = LeanRunner(int8), LeanRunner(int8)
    packed_tree.forward(prefix)
    packed_other.forward(prefix[:20])
    other, tree_logits = forward_packed([packed_other, packed_tree], [new[:4], new], [None, None],
                                        trees=[None, Tree(parents)])
    assert torch.equal(tree_logits, tree_alone) and torch.equal(other, chain_alone)
    assert packed_other.tokens == prefix[:20] + new[:4]
    packed_other.forward([7])  # the neighbour goes on; the tree runner waits for keep_rows
    with pytest.raises(ValueError, match="keep_rows"):
        packed_tree.forward([7])
    packed_tree.keep_rows(len(prefix), [0, 2, 5])
    alone.keep_rows(len(prefix), [0, 2, 5])
    assert torch.equal(packed_tree.forward([7, 8]), alone.forward([7, 8]))


@pytest.mark.parametrize("runner_kind", list(RUNNERS))
def test_misuse_is_refused(runner_kind):
    runner = RUNNERS[runner_kind](model("int8 llama"))
    runner.forward([1, 2, 3])
    with pytest.raises(ValueError, match="parents"):
        runner.forward_tree([4, 5], [-1, 1])  # a parent after its child
    with pytest.raises(ValueError, match="parents"):
        runner.forward_tree([4, 5], [-1])
    assert runner.tokens == [1, 2, 3]
    runner.forward_tree([4, 5, 6], [-1, 0, 0])
    with pytest.raises(ValueError, match="keep_rows"):
        runner.forward([7])
    with pytest.raises(ValueError, match="keep_rows"):
        runner.rollback(4)
    with pytest.raises(ValueError, match="path"):
        runner.keep_rows(3, [0, 1, 2])  # siblings
    with pytest.raises(ValueError, match="path"):
        runner.keep_rows(3, [2])  # not from the root
    with pytest.raises(ValueError, match="forward_tree over 2"):
        runner.keep_rows(2, [0])
    runner.rollback(3)  # dropping the whole tree settles it
    assert runner.tokens == [1, 2, 3]
    assert torch.equal(runner.forward([4, 6]), RUNNERS[runner_kind](model("int8 llama")).forward([1, 2, 3, 4, 6])[-2:])


def test_runners_that_cannot_compute_trees_say_so():
    draft = LeanRunner(model("int8 llama"), int4=True)  # kernels/int4_layers.c: chains only
    assert draft.layer_set.native and not draft.capabilities.tree
    with pytest.raises(SpecdecError, match="token tree"):
        draft.forward_tree([1, 2], [-1, 0])
    from specdec.runtime.batching import BatchedTarget, SlotRunner

    batch = BatchedTarget(model("int8 llama"), 1)
    assert batch.runners[0].capabilities.tree and not SlotRunner(batch, 0).capabilities.tree
