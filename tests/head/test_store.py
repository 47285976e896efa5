"""Saving and loading a head: the same proposals after a round trip; other targets' and broken heads refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.head.manifest import default_directory
from specdec.head.model import DraftHead, HeadCache
from specdec.head.store import MANIFEST, TrainResult, checkpointer, load, save, target_identity
from specdec.training.train import train
from tests.head.conftest import QUICK, target_pass
from tests.tiny import tiny_model


def proposals(head: DraftHead, target: torch.nn.Module, stream: list[int], k: int = 3) -> list[list[int]]:
    """The head's k-token draft after each prefix of `stream` (fed one verified pair at a time)."""
    features, _ = target_pass(target, torch.tensor(stream)[None])  # [1, T, H]
    ids, cache = torch.tensor(stream), HeadCache()
    return [head.draft(cache, features[0, n - 1: n], ids[n: n + 1], k) for n in range(1, len(stream))]


@pytest.fixture
def saved(tmp_path: Path, target: torch.nn.Module, trained: TrainResult) -> Path:
    return save(trained.head, tmp_path / "head", target_identity(target, "tiny"), trained, data=["own greedy text"])


def test_round_trip_proposes_the_same_tokens(saved: Path, target: torch.nn.Module, trained: TrainResult,
                                             text: list[list[int]]) -> None:
    head, manifest = load(saved, target, "tiny")
    assert proposals(head, target, text[0]) == proposals(trained.head, target, text[0])
    assert manifest["tokens_seen"] == trained.tokens and manifest["agreement_by_position"] == list(trained.agreement)
    assert manifest["draft_vocab"] == trained.head.vocab.tolist() and manifest["data"] == ["own greedy text"]
    assert manifest["target"]["architecture"] == "llama" and manifest["target"]["vocab_size"] == 96
    assert sorted(p.name for p in saved.iterdir()) == sorted([MANIFEST, manifest["weights"]])  # no temp files left
    assert manifest["attention_window"] == head.window == trained.head.window == QUICK.window  # as it was trained


def test_a_head_saved_without_an_attention_window_attends_to_all(saved: Path, target: torch.nn.Module) -> None:
    """Manifests from before the window was recorded: the head attends to every position, as it did then."""
    manifest = json.loads((saved / MANIFEST).read_text())
    del manifest["attention_window"]
    (saved / MANIFEST).write_text(json.dumps(manifest))
    assert load(saved, target, "tiny")[0].window is None
    for broken in (0, "64", 2.5, True):
        manifest["attention_window"] = broken
        (saved / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(SpecdecError, match="attention_window .* is not a positive whole number"):
            load(saved, target, "tiny")


def test_a_narrower_head_round_trips(tmp_path: Path, target: torch.nn.Module, text: list[list[int]]) -> None:
    """A head whose MLP is narrower than the target's layer reloads with its own width."""
    result = train(target, text[1:], dataclasses.replace(QUICK, max_steps=3, intermediate=32), heldout=text[0])
    assert result.head.layer.mlp.gate_proj.out_features == 32 < target.config.intermediate_size
    head, manifest = load(save(result.head, tmp_path / "narrow", target_identity(target, "tiny")), target, "tiny")
    assert manifest["intermediate_size"] == head.config.intermediate_size == 32
    assert proposals(head, target, text[0]) == proposals(result.head, target, text[0])


@pytest.mark.parametrize("other", [("llama", 1), ("qwen2", 0)], ids=["other-seed", "other-config"])
def test_a_head_for_another_target_is_refused(saved: Path, other: tuple[str, int]) -> None:
    with pytest.raises(SpecdecError, match=r"trained for another target \(tiny: (checksum|architecture) ") as e:
        load(saved, tiny_model(*other))
    assert "\n" not in str(e.value)


def test_broken_files_are_refused_in_one_line(saved: Path, target: torch.nn.Module) -> None:
    manifest = json.loads((saved / MANIFEST).read_text())
    weights = saved / manifest["weights"]
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(SpecdecError, match="corrupt"):
        load(saved, target)
    weights.unlink()
    with pytest.raises(SpecdecError, match="are missing"):
        load(saved, target)
    (saved / MANIFEST).write_text(json.dumps(manifest)[:-20])
    with pytest.raises(SpecdecError, match="broken draft-head manifest"):
        load(saved, target)
    (saved / MANIFEST).write_text(json.dumps({k: v for k, v in manifest.items() if k != "weights"}))
    with pytest.raises(SpecdecError, match="broken draft-head manifest .*weights"):
        load(saved, target)
    (saved / MANIFEST).unlink()
    with pytest.raises(SpecdecError, match="no draft head in"):
        load(saved, target)


def test_interrupted_training_keeps_its_last_checkpoint(tmp_path: Path, target: torch.nn.Module,
                                                        text: list[list[int]]) -> None:
    def interrupt(progress) -> None:
        if progress.step == 4:
            raise KeyboardInterrupt

    config = dataclasses.replace(QUICK, max_steps=None, eval_every_s=0.0, eval_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        train(target, text, config, progress=interrupt,
              checkpoint=checkpointer(tmp_path, target_identity(target, "tiny"), ["text"]))
    head, manifest = load(tmp_path, target)
    assert manifest["steps"] == 4 and len(list(tmp_path.glob("head-*.safetensors"))) == 1
    assert len(proposals(head, target, text[0][:8])) == 7


def test_default_directory_is_under_specdec_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert default_directory("qwen2.5-1.5b") == tmp_path / "drafters" / "qwen2.5-1.5b-head"
    assert default_directory("/models/org/name/") == tmp_path / "drafters" / "models--org--name-head"


def test_a_fused_head_trains_and_round_trips_with_its_taps(tmp_path: Path) -> None:
    """Trained with a tapped layer, the head's fuse projection learns (it starts at zero); the manifest records
    the taps and the reloaded head drafts the same tokens from the same tapped features."""
    from specdec.training.features import features
    from tests.head.conftest import own_text

    target = tiny_model("llama", 0, layers=3)
    text = own_text(target)
    result = train(target, text[1:], dataclasses.replace(QUICK, max_steps=20, taps=(1,)), heldout=text[0])
    assert result.head.taps == (1,) and result.head.fuse.weight.abs().sum() > 0
    head, manifest = load(save(result.head, tmp_path / "fused", target_identity(target, "tiny")), target, "tiny")
    assert manifest["tapped_layers"] == [1] and head.taps == (1,)
    feats, ids = features(target, torch.tensor([text[0]]), taps=(1,))[0], torch.tensor(text[0])  # [T, 2H], [T]
    drafts = [[h.draft(HeadCache(), feats[: n], ids[1: n + 1], 3) for n in (3, 9, 20)] for h in (head, result.head)]
    assert drafts[0] == drafts[1]
    with pytest.raises(SpecdecError, match="tapped layers"):
        train(target, text[1:], dataclasses.replace(QUICK, max_steps=1, taps=(2,)), heldout=text[0])


def test_a_resumed_runs_record_counts_every_run(saved: Path, target: torch.nn.Module, trained: TrainResult) -> None:
    first = json.loads((saved / MANIFEST).read_text())
    assert first["runs"] == 1 and first["tokens_seen"] == trained.tokens
    save(trained.head, saved, target_identity(target, "tiny"), trained, data=["more text"], before=first)
    second = json.loads((saved / MANIFEST).read_text())
    assert second["runs"] == 2 and second["tokens_seen"] == 2 * trained.tokens and second["steps"] == 2 * trained.steps
    assert second["data"] == ["own greedy text", "more text"]
    for broken, message in (({"cursor": [3, -1]}, r"cursor \[3, -1\] is not a list of counts"),
                            ({"steps": "7"}, "steps '7' is not a count"), ({"data": "text"}, "data 'text' is not a list")):
        (saved / MANIFEST).write_text(json.dumps(second | broken))
        with pytest.raises(SpecdecError, match=f"broken draft-head manifest .*{message}"):
            load(saved, target)
