"""Save and load a draft head: a directory with a manifest and the weights, tied to one target.

Layout (default ``$SPECDEC_HOME/drafters/<target>-head/``, see ``specdec.zoo.home``)::

    manifest.json             target identity, draft vocabulary, training record, weights file + sha256
    head-<sha256[:16]>.safetensors   the head's own state dict (not the target's embedding table)

The target identity is its name, architecture, hidden size, vocabulary size and a sha256 of its
input embedding table rounded to bf16: a head is loaded only for a target with the same identity (the
name aside: the same weights under another path are the same target).  The embedding alone, rounded to
bf16, because it is what every form of one target keeps alike: an int8 target's LM head is quantized
(specdec.native.quant; its embedding stays fp32), and a bf16 target holds the fp32 table rounded to
bf16, so a head trained on the fp32, bf16 or int8 form of a target loads for any of them.  Saving is atomic: the
weights go to a new file named by their hash, then the manifest is replaced (temp file + rename),
then older weights files are removed, so a run interrupted at any point leaves the last complete
checkpoint.  Every failure to load is a one-line SpecdecError.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.head.manifest import FORMAT, MANIFEST, OLD_WINDOW, read_manifest
from specdec.head.model import DraftHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class TrainResult:
    """A trained head and the record of its training that save() keeps in the manifest (specdec.training.train
    returns one, and its checkpoints are these)."""

    head: DraftHead
    tokens: int
    seconds: float
    steps: int
    agreement: tuple[float | None, ...]
    losses: list[float] = field(default_factory=list)  # per step
    produced: int = 0  # positions whose features were produced
    cursor: list[int] = field(default_factory=list)  # per source, how far it got (Source.consumed; 0: unknown)


_ROWS = 4096  # rows hashed at a time (bounds the fp32 copy of a large embedding table)


def weights_checksum(*weights: torch.Tensor) -> str:
    """sha256 of the tensors' values rounded to bf16 (an fp32 table and its bf16 copy give the same sum)."""
    digest = hashlib.sha256()
    for weight in weights:
        for rows in weight.detach().split(_ROWS):
            digest.update(rows.to(torch.bfloat16).view(torch.int16).contiguous().numpy().tobytes())
    return digest.hexdigest()


def target_identity(target: PreTrainedModel, name: str) -> dict[str, Any]:
    """What a head is tied to: the target's name, architecture, sizes and embedding checksum (see the
    module docstring: the same for the target's fp32, bf16 and int8 forms)."""
    embed = embedding_table(target)  # [V, H]
    return {
        "name": name,
        "architecture": target.config.model_type,
        "hidden_size": int(target.config.hidden_size),
        "vocab_size": int(embed.shape[0]),
        "checksum": weights_checksum(embed),
    }


def embedding_table(target: PreTrainedModel) -> torch.Tensor:
    """The target's input embedding table [V, H] (a Parameter; nn.Module types it as Tensor | Module)."""
    weight = target.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight


class _Skeleton:
    """`target` as DraftHead's constructor reads it, for a target whose LM head has no float weight (an
    int8 one): its config, decoder and embedding, and a zero LM-head table (the saved state replaces
    the head's LM head anyway)."""

    def __init__(self, target: PreTrainedModel) -> None:
        self.target, self.config = target, target.config

    def get_decoder(self) -> nn.Module:
        return self.target.get_decoder()

    def get_input_embeddings(self) -> nn.Module:
        return self.target.get_input_embeddings()

    def get_output_embeddings(self) -> Any:
        rows, width = embedding_table(self.target).shape
        return SimpleNamespace(weight=torch.zeros(1, width).expand(rows, width))  # [V, H], one row in memory


def _replace(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (a temp file in the same directory, then a rename)."""
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def save(head: DraftHead, directory: str | Path, identity: dict[str, Any], result: TrainResult | None = None,
         data: Sequence[str] = (), before: dict[str, Any] | None = None) -> Path:
    """Save `head` (trained for the target of `identity`) with its training record; returns the directory.
    `before`: the manifest of the run this one went on from (train-drafter --resume): tokens, steps and
    seconds are then counted over every run, and the data of each is listed."""
    before = before or {}
    from safetensors.torch import save as to_bytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    blob = to_bytes({k: v.contiguous() for k, v in head.state_dict().items()})
    digest = hashlib.sha256(blob).hexdigest()
    weights = f"head-{digest[:16]}.safetensors"
    _replace(directory / weights, blob)
    manifest = {
        "format": FORMAT,
        "target": identity,
        "draft_vocab": head.vocab.tolist(),
        "intermediate_size": int(head.config.intermediate_size),
        "attention_window": head.window,
        "tapped_layers": list(head.taps),
        "tokens_seen": int(before.get("tokens_seen", 0)) + (result.tokens if result else 0),
        "steps": int(before.get("steps", 0)) + (result.steps if result else 0),
        "agreement_by_position": list(result.agreement) if result else [],
        "training_seconds": round(float(before.get("training_seconds", 0.0)) + (result.seconds if result else 0.0), 3),
        "runs": int(before.get("runs", 1 if before else 0)) + 1,
        "cursor": list(result.cursor) if result else [],
        "data": list(dict.fromkeys([*before.get("data", []), *data])),
        "weights": weights,
        "weights_sha256": digest,
    }
    _replace(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    for old in directory.glob("head-*.safetensors"):
        if old.name != weights:
            old.unlink(missing_ok=True)
    return directory


def checkpointer(directory: str | Path, identity: dict[str, Any], data: Sequence[str] = (),
                 before: dict[str, Any] | None = None) -> Callable[[TrainResult], None]:
    """A train() checkpoint callback that saves each checkpoint to `directory` (`before`: see save)."""
    def save_checkpoint(result: TrainResult) -> None:
        save(result.head, directory, identity, result, data, before)

    return save_checkpoint


def load(directory: str | Path, target: PreTrainedModel, name: str = "") -> tuple[DraftHead, dict[str, Any]]:
    """The head saved in `directory` for `target`, with its manifest; refuses another target's head."""
    from safetensors import SafetensorError
    from safetensors.torch import load as from_bytes

    manifest = read_manifest(directory)
    theirs, ours = manifest["target"], target_identity(target, name)
    for key in ("architecture", "hidden_size", "vocab_size", "checksum"):
        if theirs.get(key) != ours[key]:
            raise SpecdecError(f"the draft head in {directory} was trained for another target "
                               f"({theirs.get('name') or '?'}: {key} {theirs.get(key)} != {ours[key]})")
    path = Path(directory) / str(manifest["weights"])
    if not path.is_file():
        raise SpecdecError(f"draft head weights {path} are missing")
    blob = path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != manifest["weights_sha256"]:
        raise SpecdecError(f"draft head weights {path} are corrupt (checksum mismatch)")
    try:
        state = from_bytes(blob)
        float_head = isinstance(getattr(target.get_output_embeddings(), "weight", None), torch.Tensor)
        width = state["layer.mlp.gate_proj.weight"].shape[0]  # the MLP width it was trained with
        head = DraftHead(target if float_head else _Skeleton(target), state["vocab"], width,
                         taps=tuple(manifest.get("tapped_layers", [])))
        head.load_state_dict(state)
        head.window = manifest.get("attention_window", OLD_WINDOW)  # checked by read_manifest
    except (SafetensorError, KeyError, RuntimeError) as e:
        raise SpecdecError(f"draft head weights {path} do not fit the head: {str(e).splitlines()[0]}") from None
    return head.eval(), manifest
