"""Which drafter "auto" means for a target (specdec.drafters.spec.resolve_drafter), and why.

A draft model helps only when its tokens are the target's tokens and it costs much less than the target.
So "auto" drafts with a model only when one is at hand (the zoo's, specdec.zoo: pulled on first use) that
has **the target's tokenizer** (the same token -> id map: specdec.native.gguf.GGUFFile.vocabulary_digest
of the token strings) and **at most a third of the target's parameters** (the tensor table's count, a tied
output head counted once); of several, the largest.  Otherwise prompt lookup drafts alone (no model): a
gemma3 target has no zoo model with its tokenizer, the 135M SmolLM2 none of a third its size.  The
default target (qwen2.5-coder-1.5b, 1.54B) gets lookup + qwen2.5-coder-0.5b (0.49B).  A draft the user
names (--draft <model>) is used as named: this rule is auto's alone.

What is read for a target, without loading it: a zoo name's recorded digest and count (ZooModel); a .gguf
file's tokenizer.ggml.tokens and tensor table (GGUFFile, whose parsed header is cached); a model directory's
tokenizer.json and its safetensors headers; a loaded (model, tokenizer) pair's tokenizer and parameters.
A hub id's tokenizer is not known before it is downloaded: lookup alone, and the reason says so.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

DRAFT_SHARE = 3  # a draft model has at most 1/DRAFT_SHARE of the target's parameters


@dataclass(frozen=True)
class ModelFacts:
    """What auto's rule reads of a model: its vocabulary's digest and its parameter count (None: not known)."""

    vocabulary: str | None
    parameters: int | None


@dataclass(frozen=True)
class DraftChoice:
    """auto's drafter for a target ("lookup+qwen2.5-coder-0.5b", "lookup+head", "lookup") and the reason, one line."""

    drafter: str
    reason: str


def size(parameters: int) -> str:
    """A parameter count as a model card writes it: "1.54B", "0.49B", "135M" (a test's tiny one whole: "2,070")."""
    if parameters < 1e6:
        return f"{parameters:,}"
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.0f}M"


def _tokens_by_id(vocab: dict[str, int]) -> list[str] | None:
    """A token -> id map's tokens in id order; None where its ids leave a gap (not one vocabulary of 0..n-1)."""
    tokens: list[str | None] = [None] * len(vocab)
    for token, i in vocab.items():
        if not 0 <= i < len(tokens) or tokens[i] is not None:
            return None
        tokens[i] = token
    return [t for t in tokens if t is not None] if all(t is not None for t in tokens) else None


def _digest(tokens: list[str] | None) -> str | None:
    from specdec.native.gguf import GGUFFile

    return None if tokens is None else GGUFFile.vocabulary_digest(tokens)


def _safetensors_parameters(folder: Path) -> int | None:
    """The parameters in `folder`'s safetensors files, from their headers, counted as GGUFFile.parameters counts
    them: an output head of the embedding's shape as the embedding (a GGUF file converted here writes it out);
    None without any."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            shapes.update({name: entry["shape"] for name, entry in json.loads(f.read(n)).items()
                           if name != "__metadata__"})
    count = sum(math.prod(int(d) for d in shape) for shape in shapes.values())
    embedding = next((shape for name, shape in shapes.items() if name.endswith("embed_tokens.weight")), None)
    if embedding is not None and shapes.get("lm_head.weight") == embedding:
        count -= math.prod(int(d) for d in embedding)
    return count


def _folder_vocabulary(folder: Path) -> str | None:
    """The digest of `folder`'s tokenizer.json vocabulary (its model's tokens and the added ones); None without."""
    try:
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, list):  # a unigram model's [token, score] pairs, in id order
        vocab = {entry[0]: i for i, entry in enumerate(vocab)}
    if not isinstance(vocab, dict):
        return None
    vocab = {**vocab, **{added["content"]: added["id"] for added in data.get("added_tokens", [])}}
    return _digest(_tokens_by_id(vocab))


@lru_cache(maxsize=32)
def _file_facts(kind: str, path: str, identity: tuple[int, int]) -> ModelFacts:
    """facts() of a .gguf file or a model directory (`identity`: its size and modification time, the cache's key)."""
    if kind == "gguf":
        from specdec.native.gguf import GGUFFile

        file = GGUFFile(path)
        return ModelFacts(file.vocabulary, file.parameters())
    folder = Path(path)
    try:
        parameters = _safetensors_parameters(folder)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        parameters = None
    return ModelFacts(_folder_vocabulary(folder), parameters)


def facts(model: object) -> ModelFacts:
    """What auto's rule knows of `model` (a zoo name, a .gguf file, a model directory, a hub id or a loaded
    (model, tokenizer) pair) without loading it; ModelFacts(None, None) for what cannot be known so."""
    from specdec import zoo

    if isinstance(model, str):
        if model in zoo.ZOO:
            entry = zoo.ZOO[model]
            return ModelFacts(entry.vocabulary or None, entry.parameters or None)
        path = Path(model).expanduser()  # as specdec.runtime.loading.resolve classifies a name
        kind = "gguf" if model.lower().endswith(".gguf") and path.is_file() else "dir" if model.strip() and path.is_dir() else ""
        if not kind:
            return ModelFacts(None, None)  # a hub id (nothing here before it downloads), or a name loading refuses
        stat = path.stat()
        return _file_facts(kind, str(path.resolve()), (stat.st_size, stat.st_mtime_ns))
    if isinstance(model, tuple) and len(model) == 2:
        return _pair_facts(*model)
    return ModelFacts(None, None)


def _pair_facts(model: Any, tokenizer: Any) -> ModelFacts:
    """facts() of a loaded pair: its tokenizer's get_vocab(), its torch module's parameters (each tensor once)."""
    try:
        vocabulary = _digest(_tokens_by_id(dict(tokenizer.get_vocab())))
    except (AttributeError, TypeError):
        vocabulary = None
    module = model if hasattr(model, "parameters") else getattr(model, "model", None)
    try:
        seen = {p.data_ptr(): p.numel() for p in module.parameters()} if module is not None else {}
    except (AttributeError, TypeError):
        seen = {}
    return ModelFacts(vocabulary, sum(seen.values()) or None)


def auto_model(target: object) -> DraftChoice:
    """auto's drafter for `target` by the module's rule, without a head: lookup + the largest zoo model with
    the target's tokenizer and at most a third of its parameters, else lookup alone; the reason says which
    and why."""
    from specdec.defaults import MODEL_FREE_DRAFTER
    from specdec.zoo import ZOO

    mine = facts(target)
    alone = f"{MODEL_FREE_DRAFTER} alone"
    if mine.vocabulary is None or mine.parameters is None:
        what = "tokenizer" if mine.vocabulary is None else "size"
        return DraftChoice(MODEL_FREE_DRAFTER, f"{alone}: the target's {what} is not known before it loads "
                                               "(--draft <model> names a draft model)")
    # the zoo's other models with the target's vocabulary (not the target itself: the same vocabulary and size)
    kin = [m for m in ZOO.values() if m.vocabulary == mine.vocabulary and m.parameters not in (0, mine.parameters)]
    fits = [m for m in kin if m.parameters * DRAFT_SHARE <= mine.parameters]
    if fits:
        best = max(fits, key=lambda m: m.parameters)
        return DraftChoice(f"{MODEL_FREE_DRAFTER}+{best.name}",  # as MODEL_DRAFTER is spelt
                           f"{best.name} has the target's tokenizer and {size(best.parameters)} parameters "
                           f"to its {size(mine.parameters)} (at most a third)")
    if kin:
        smallest = min(kin, key=lambda m: m.parameters)
        return DraftChoice(MODEL_FREE_DRAFTER, f"{alone}: the zoo's models with the target's tokenizer are too large "
                                               f"for it ({smallest.name}: {size(smallest.parameters)} to its "
                                               f"{size(mine.parameters)}, more than a third)")
    return DraftChoice(MODEL_FREE_DRAFTER, f"{alone}: no other zoo model has the target's tokenizer")


def auto_drafter(target: object, hidden_states: bool = True) -> DraftChoice:
    """What "auto" resolves to for `target` (specdec.drafters.spec.resolve_drafter) and why: HEAD_DRAFTER when a
    head is saved for it and its runtime gives the hidden states a head reads, else auto_model(target)."""
    from specdec.defaults import HEAD_DRAFTER
    from specdec.head.manifest import has_head

    if hidden_states and has_head(target):
        return DraftChoice(HEAD_DRAFTER, "a draft head is saved for the target (specdec train-drafter)")
    return auto_model(target)


def auto_note(draft: object, target: object, hidden_states: bool = True) -> str:
    """" (auto: <reason>)" where `draft` is "auto" (the reason auto_drafter gives for `target`, whose runtime gives
    a head its hidden states or not), for the summary lines of generate and bench; nothing for a drafter the user
    named."""
    from specdec.defaults import DEFAULT_DRAFTER

    if not (isinstance(draft, str) and draft.strip().lower() == DEFAULT_DRAFTER):
        return ""
    return f" (auto: {auto_drafter(target, hidden_states).reason})"
