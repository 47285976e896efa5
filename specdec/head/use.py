"""Using a trained draft head: the drafter specs that name one, finding and loading it for a target, its cost.

A drafter spec names a head as ``head`` (the head trained for the target, in
``specdec.head.store.default_directory(<target>)``) or ``head:<dir>`` (the head saved in <dir>), alone
or behind prompt lookup (``lookup+head``, ``lookup+head:<dir>``) or suffix drafts (``suffix+head``):
specdec.drafters.spec parses them, and the functions here take the parsed spec.  The Engine loads a head
once (:func:`load_head`, checked against the target's weights by the store) and gives every request, every
batch slot, a HeadDrafter of its own over the runner it verifies with (the drafter keeps per-request state).
A head reads the target's hidden states, so it drafts only for a target runner that gives them (the
transformers backend: LeanRunner, HFRunner, a batch's SlotRunner); llama.cpp and stairs verification do not.

What a head costs per drafted token, which the speculation controller prices it by, is measured a floor
up, beside the runners' timings (specdec.runtime.head_cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecdecError
from specdec.head.manifest import MANIFEST, default_directory

if TYPE_CHECKING:
    from specdec.algorithm.sampling import SamplingParams
    from specdec.backends.base import ModelRunner
    from specdec.drafters.spec import DrafterSpec
    from specdec.head.drafter import HeadDrafter
    from specdec.head.fast import FastHead
    from specdec.head.model import DraftHead

TRAIN_COMMAND = "specdec train-drafter"
NO_HIDDEN_STATES = ("a draft head reads the target's hidden states, which {what} does not give: use the "
                    "transformers backend (--backend hf){also}, or draft with lookup or a draft model")


def head_directory(given: str, target_name: str) -> Path:
    """The head's directory for `target_name`: `given` (DrafterSpec.head: "" for the target's default one); a
    one-line SpecdecError when it holds no head."""
    directory = Path(given).expanduser() if given else default_directory(target_name)
    if not (directory / MANIFEST).is_file():
        if given:
            raise SpecdecError(f"no draft head in {directory}: its manifest.json is missing")
        raise SpecdecError(f"no draft head for {target_name}: train one with {TRAIN_COMMAND} --target {target_name}")
    return directory


def precheck(spec: DrafterSpec, backend: str, target: object, hidden_states: bool) -> None:
    """The one-line SpecdecError loading the head of `spec` for `target` on `backend` would end with, where
    it can be known before anything is loaded: a backend without hidden states (`hidden_states` False), no head
    where `spec` says."""
    assert spec.head is not None  # a spec that names a head
    if not hidden_states:
        raise SpecdecError(NO_HIDDEN_STATES.format(what=f"a {backend} target", also=""))
    if isinstance(target, str) or spec.head:  # a model passed in: its name is known later
        head_directory(spec.head, str(target))


def check_hidden_states(runner: ModelRunner, verify: str = "causal") -> None:
    """A one-line SpecdecError when a head cannot draft for `runner` (verifying with `verify`)."""
    if verify == "stairs":
        raise SpecdecError(NO_HIDDEN_STATES.format(what="stairs verification", also=" with --verify causal"))
    if not runner.capabilities.hidden_states or runner.model is None:
        raise SpecdecError(NO_HIDDEN_STATES.format(what=f"a {runner.describe()} target", also=""))


@dataclass
class LoadedHead:
    """A head loaded for one target: what its manifest says, and a drafter per request."""

    head: DraftHead | FastHead  # a FastHead once loaded for drafting (for_drafting)
    manifest: dict[str, Any]
    directory: Path
    spec: DrafterSpec  # the head alone, as the drafter spec named it: head, or head:<dir>

    @property
    def name(self) -> str:
        """The head's drafter spec: "head" or "head:<dir>"."""
        return self.spec.name

    def drafter(self, target: ModelRunner, sampling: SamplingParams) -> HeadDrafter:
        """A drafter of its own for one request over `target` (the runner it is verified with)."""
        from specdec.head.drafter import HeadDrafter

        return HeadDrafter(self.head, target, sampling)

    def describe(self) -> str:
        """The head in a few words, as the CLI names a draft's backend."""
        return f"a draft head of {len(self.head.vocab)} tokens ({self.directory})"


def load_head(spec: DrafterSpec, target: ModelRunner, target_name: str) -> LoadedHead:
    """The head `spec` names, for `target` (its runner: a transformers model that gives hidden states);
    the store refuses another target's head in one line."""
    from specdec.drafters.spec import DrafterSpec
    from specdec.head import store
    from specdec.head.fast import for_drafting

    assert spec.head is not None  # a spec that names a head
    directory = head_directory(spec.head, target_name)
    check_hidden_states(target)
    head, manifest = store.load(directory, target.model, target_name)
    return LoadedHead(for_drafting(head), manifest, directory, DrafterSpec(head=spec.head))
