"""The head's model: the reduced vocabulary maps back to target ids, the KV cache feeds and rolls back."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.head.model import DraftHead, HeadCache, band, draft_vocabulary, tree_mask
from tests.head.conftest import target_pass
from tests.tiny import tiny_model


def test_draft_vocabulary_is_most_frequent_first_then_by_id() -> None:
    vocab = draft_vocabulary([[5, 5, 7, 3], [7, 5, 9]], size=6, vocab_size=10)
    assert vocab.tolist() == [5, 7, 3, 9, 0, 1]  # 5 thrice, 7 twice, then seen once by id, then unseen by id
    assert draft_vocabulary([[1]], size=50, vocab_size=10).tolist() == [1, 0, 2, 3, 4, 5, 6, 7, 8, 9]


def test_draft_vocabulary_fills_by_id_beyond_the_texts_share() -> None:
    text = [[9, 9, 9, 8, 8, 7]]
    # half of 6 by frequency (9, 8, 7), then the lowest ids not taken (0, 1, 2)
    assert draft_vocabulary(text, size=6, vocab_size=10, text_share=0.5).tolist() == [9, 8, 7, 0, 1, 2]
    # a third: 9 and 8, then ids; a frequent id already taken is skipped in the fill
    assert draft_vocabulary([[1, 1, 5]], size=6, vocab_size=10, text_share=1 / 3).tolist() == [1, 5, 0, 2, 3, 4]
    assert draft_vocabulary(text, size=4, vocab_size=10, text_share=0.0).tolist() == [0, 1, 2, 3]
    assert sorted(draft_vocabulary(text, size=50, vocab_size=10, text_share=0.25).tolist()) == list(range(10))


def test_reduced_vocabulary_maps_back_to_target_ids(target: torch.nn.Module, text: list[list[int]]) -> None:
    vocab = draft_vocabulary(text, 40, target.config.vocab_size)
    head = DraftHead(target, vocab)
    features, logits = target_pass(target, torch.tensor(text[0])[None])  # [1, T, H], [1, T, V]
    # at initialisation draft row i is the target's LM-head row of target id vocab[i]
    assert torch.allclose(head.lm_head(features), logits[..., vocab], atol=1e-5)
    draft_ids = head.lm_head(features).argmax(-1)  # [1, T] draft ids
    restricted = logits.masked_fill(~torch.isin(torch.arange(logits.shape[-1]), vocab), float("-inf"))
    assert torch.equal(head.target_ids(draft_ids), restricted.argmax(-1))


def test_band_sees_the_last_window_positions() -> None:
    assert band(2, 3).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert band(2, 3, window=2).int().tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert band(3, 0, window=1).int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    visible = torch.tensor([[True, False], [True, True]])  # two tree positions: a node, then its child
    allowed = tree_mask(3, visible, torch.float32, window=3)[0, 0] == 0  # [2, 5]
    assert allowed.int().tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]  # each sees 3 keys, its path's last
    assert (tree_mask(3, visible, torch.float32)[0, 0] == 0).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_a_windowed_head_reads_only_its_last_window_of_pairs(target: torch.nn.Module) -> None:
    """With a window of w, the head's output at a position is its output over just the last w pairs up to
    there (rotary attention depends on distances only): what it saw in training windows of w positions."""
    head = DraftHead(target, torch.arange(50), window=4)
    free = DraftHead(target, torch.arange(50))
    free.load_state_dict(head.state_dict())
    torch.manual_seed(2)
    features, tokens = torch.randn(1, 10, 32), torch.randint(0, 96, (1, 10))  # [1, 10, H], [1, 10]
    with torch.no_grad():
        windowed = head(features, tokens)[1]  # [1, 10, N]
        for end in (3, 7, 10):
            alone = free(features[:, max(end - 4, 0): end], tokens[:, max(end - 4, 0): end], max(end - 4, 0))[1]
            assert torch.allclose(windowed[0, end - 1], alone[0, -1], atol=1e-5)
        assert not torch.allclose(windowed[0, -1], free(features, tokens)[1][0, -1], atol=1e-3)


@pytest.mark.parametrize("window", [None, 3])
def test_cache_feeds_in_pieces_as_in_one_forward_and_rolls_back(window: int | None, target: torch.nn.Module) -> None:
    head = DraftHead(target, torch.arange(50), window=window)
    torch.manual_seed(1)
    features, tokens = torch.randn(1, 9, 32), torch.randint(0, 96, (1, 9))  # [1, 9, H], [1, 9]
    whole = head(features, tokens)[1]  # [1, 9, N]
    cache = HeadCache()
    parts = [head(features[:, a:b], tokens[:, a:b], a, cache)[1] for a, b in [(0, 4), (4, 5), (5, 9)]]
    assert torch.allclose(torch.cat(parts, dim=1), whole, atol=1e-5)
    cache.crop(4)
    again = head(features[:, 4:], tokens[:, 4:], 4, cache)[1]  # after a rollback the positions follow
    assert torch.allclose(again, whole[:, 4:], atol=1e-5)


def test_draft_rolls_its_own_positions_back(target: torch.nn.Module, text: list[list[int]]) -> None:
    head = DraftHead(target, torch.arange(96))
    features, _ = target_pass(target, torch.tensor(text[0])[None])
    ids = torch.tensor(text[0])
    cache = HeadCache()
    first = head.draft(cache, features[0, :5], ids[1:6], k=4)
    assert cache.length == 5 and len(first) == 4 and all(0 <= t < 96 for t in first)
    cache.crop(4)
    assert head.draft(cache, features[0, 4:5], ids[5:6], k=4) == first  # the last pair fed again: the same draft
    with pytest.raises(ValueError, match="at least one"):
        head.draft(cache, features[0, 5:5], ids[6:6], k=4)
    cache.crop(3)
    assert head.draft(cache, features[0, 3:5], ids[4:6], k=4) == first


def test_other_architectures_are_refused_in_one_line() -> None:
    with pytest.raises(SpecdecError, match="llama or qwen2 target, not gemma3"):
        DraftHead(tiny_model("gemma3"), torch.arange(10))


def test_the_heads_mlp_width_is_two_thirds_of_its_hidden_size_at_most_the_targets() -> None:
    from types import SimpleNamespace

    from specdec.head.model import head_intermediate

    assert head_intermediate(SimpleNamespace(hidden_size=1536, intermediate_size=8960)) == 1024
    assert head_intermediate(SimpleNamespace(hidden_size=896, intermediate_size=4864)) == 576
    assert head_intermediate(SimpleNamespace(hidden_size=32, intermediate_size=64)) == 64  # never below 64
    assert head_intermediate(SimpleNamespace(hidden_size=1536, intermediate_size=768)) == 768  # nor above the target's


def test_a_fused_head_starts_as_the_final_features_head_and_learns_from_its_taps(target: torch.nn.Module) -> None:
    """A head with tapped layers reads [.., F] features: at first (its fuse projection zero) exactly what the
    head of the final feature alone computes from their first H columns; a fuse weight makes the taps count,
    each tap RMS-normalised (its scale does not matter).  Predicted features [.., H] go in as they are."""
    torch.manual_seed(0)
    plain = DraftHead(target, torch.arange(50))
    fused = DraftHead(target, torch.arange(50), taps=(0,))
    fused.load_state_dict(plain.state_dict() | {"fuse.weight": fused.fuse.weight})
    h = target.config.hidden_size
    features, tokens = torch.randn(1, 6, 2 * h), torch.randint(0, 96, (1, 6))  # [1, 6, F], [1, 6]
    assert fused.width == 2 * h
    for a, b in zip(fused(features, tokens), plain(features[..., :h], tokens)):
        assert torch.equal(a, b)
    assert torch.equal(fused(features[..., :h], tokens)[1], plain(features[..., :h], tokens)[1])
    with torch.no_grad():
        fused.fuse.weight.normal_()
    moved = fused(features, tokens)[1]
    assert not torch.allclose(moved, plain(features[..., :h], tokens)[1], atol=1e-3)
    scaled = torch.cat([features[..., :h], 100 * features[..., h:]], dim=-1)
    assert torch.allclose(fused(scaled, tokens)[1], moved, atol=1e-4)
    with pytest.raises(ValueError, match="width"):
        fused(torch.randn(1, 6, 3 * h), tokens)
