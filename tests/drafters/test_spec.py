"""Drafter specs (specdec.drafters.spec): every form parses to its value, bad ones are one-line errors, the
registry builds each kind with its source, and no other module of the package reads a spec string."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import specdec
from specdec.algorithm.draft import LOOKUP, MODEL, RECYCLE, SUFFIX
from specdec.algorithm.sampling import SamplingParams
from specdec.drafters import spec as drafter_spec
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.recycling import RecycleMatrix, RecyclingDrafter
from specdec.drafters.spec import (
    DRAFTERS,
    DrafterSpec,
    DraftRequest,
    build_drafter,
    is_none,
    parse_drafter,
    resolve_drafter,
    split_drafter,
)
from specdec.drafters.suffix import SuffixDrafter, SuffixStore
from specdec.errors import SpecdecError

PAIR = (object(), object())  # a loaded (model, tokenizer) pair


@pytest.mark.parametrize("text,expected,kind", [
    ("lookup", DrafterSpec(LOOKUP), "lookup"),
    ("suffix", DrafterSpec(SUFFIX), "suffix"),
    ("Suffix", DrafterSpec(SUFFIX), "suffix"),
    ("qwen2.5-coder-0.5b", DrafterSpec(model="qwen2.5-coder-0.5b"), "model"),
    ("suffixes", DrafterSpec(model="suffixes"), "model"),
    ("lookup+qwen2.5-coder-0.5b", DrafterSpec(LOOKUP, "qwen2.5-coder-0.5b"), "lookup+model"),
    ("suffix+qwen2.5-coder-0.5b", DrafterSpec(SUFFIX, "qwen2.5-coder-0.5b"), "suffix+model"),
    ("recycle", DrafterSpec(RECYCLE), "recycle"),
    ("recycle+qwen2.5-coder-0.5b", DrafterSpec(RECYCLE, "qwen2.5-coder-0.5b"), "recycle+model"),
    ("lookup+ some/dir", DrafterSpec(LOOKUP, "some/dir"), "lookup+model"),
    ("head", DrafterSpec(head=""), "head"),
    ("HEAD", DrafterSpec(head=""), "head"),
    ("head:~/heads/h", DrafterSpec(head="~/heads/h"), "head"),
    ("head: /x ", DrafterSpec(head="/x"), "head"),
    ("lookup+head", DrafterSpec(LOOKUP, head=""), "lookup+head"),
    ("lookup+head:/x", DrafterSpec(LOOKUP, head="/x"), "lookup+head"),
    ("suffix+head:/x", DrafterSpec(SUFFIX, head="/x"), "suffix+head"),
    ("none", DrafterSpec(), "none"),
    ("None", DrafterSpec(), "none"),
    (None, DrafterSpec(), "none"),
    ("auto", DrafterSpec(auto=True), "auto"),
    (" Auto ", DrafterSpec(auto=True), "auto"),
    (PAIR, DrafterSpec(model=PAIR), "model"),
])
def test_every_form_parses_to_its_value(text, expected, kind):
    parsed = parse_drafter(text)
    assert parsed == expected and parsed.kind == kind
    assert parse_drafter(parsed) is parsed  # a parsed spec as it is
    assert parsed.drafts == (kind != "none")


@pytest.mark.parametrize("text", ["lookup", "suffix", "qwen2.5-coder-0.5b", "lookup+qwen2.5-coder-0.5b",
                                  "head", "head:/x", "lookup+head", "suffix+head:/x", "none", "auto"])
def test_a_spec_written_back_parses_to_itself(text):
    parsed = parse_drafter(text)
    assert parsed.name == text and parse_drafter(parsed.name) == parsed


@pytest.mark.parametrize("text,message", [("suffix+", "'suffix+' needs a draft model"),
                                          ("lookup+ ", "'lookup+' needs a draft model"),
                                          ("suffix+lookup", "two model-free drafters"),
                                          ("lookup+suffix+qwen2.5-coder-0.5b", "two model-free drafters"),
                                          ("head:", "'head:' needs a directory"),
                                          ("lookup+suffix", "two model-free drafters"),
                                          ("lookup+head: ", "'head:' needs a directory")])
def test_bad_specs_are_one_line_errors(text, message):
    with pytest.raises(SpecdecError, match=re.escape(message)) as error:
        parse_drafter(text)
    assert "\n" not in str(error.value)


def test_auto_resolves_to_a_spec_and_others_stay(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    from specdec.defaults import DEFAULT_TARGET, MODEL_DRAFTER, MODEL_FREE_DRAFTER

    assert resolve_drafter("auto", DEFAULT_TARGET) == parse_drafter(MODEL_DRAFTER)  # no head saved for it
    assert resolve_drafter("auto", "some-target") == parse_drafter(MODEL_FREE_DRAFTER)  # no draft known to fit it
    assert resolve_drafter("lookup+head:/x", "some-target") == DrafterSpec(LOOKUP, head="/x")
    assert split_drafter("suffix+head:/x") == (SUFFIX, None, DrafterSpec(head="/x"))
    assert split_drafter("lookup+m") == (LOOKUP, "m", None) and split_drafter(None) == (None, None, None)


@pytest.mark.parametrize("text,expected", [(None, True), ("none", True), (" NONE", True), ("lookup", False),
                                           ("suffix+", False), ("auto", False)])
def test_is_none_never_raises(text, expected):
    assert is_none(text) is expected


class Parts:
    """What an engine has loaded, as the factories read it (DraftingParts)."""

    def __init__(self) -> None:
        self.target_runner, self.draft_runner, self.head = object(), object(), None
        self.suffix_store = SuffixStore(1000)
        self.recycle_matrix = RecycleMatrix()
        self.made: list[tuple] = []

    def model_drafter(self, sampling, mode, confidence, runner):
        self.made.append((mode, confidence, runner))
        return LookupDrafter(max_ngram=7)  # a stand-in for a draft model's drafter


def request(**sampling) -> DraftRequest:
    return DraftRequest(SamplingParams(**sampling), "auto", None, object(), None)


def test_the_registry_builds_each_kind_with_its_source():
    parts = Parts()
    assert build_drafter(DrafterSpec(), parts, request()) is None
    lookup = build_drafter(DrafterSpec(LOOKUP), parts, request())
    assert isinstance(lookup, LookupDrafter) and lookup.source == DRAFTERS[LOOKUP].source == LOOKUP
    suffix = build_drafter(DrafterSpec(SUFFIX), parts, request())
    assert isinstance(suffix, SuffixDrafter) and suffix.source == DRAFTERS[SUFFIX].source == SUFFIX
    assert suffix.store is parts.suffix_store
    seeded = build_drafter(DrafterSpec(SUFFIX), parts, request(temperature=0.7, seed=1))
    assert isinstance(seeded, SuffixDrafter) and seeded.store is None  # its context only
    model = build_drafter(DrafterSpec(model="m"), parts, request())
    assert isinstance(model, LookupDrafter) and parts.made == [("auto", None, parts.draft_runner)]
    assert DRAFTERS[MODEL].source == DRAFTERS["head"].source == MODEL


@pytest.mark.parametrize("copier,first", [(LOOKUP, LookupDrafter), (SUFFIX, SuffixDrafter), (RECYCLE, RecyclingDrafter)])
def test_a_model_free_kind_goes_first_in_a_hybrid(copier, first):
    hybrid = build_drafter(DrafterSpec(copier, "m"), Parts(), request())
    assert isinstance(hybrid, HybridDrafter) and isinstance(hybrid.lookup, first) and hybrid.first == copier
    assert isinstance(hybrid.model, LookupDrafter) and hybrid.model.max_ngram == 7
    assert drafter_spec.COPIERS == drafter_spec.FREE == (LOOKUP, SUFFIX, RECYCLE)


def test_a_new_kind_is_one_registry_entry(monkeypatch):
    """A model-free drafter that drafts alone (docs/extending.md's example): named by its key, refused before a
    model, built by its factory through the engine."""
    from specdec.drafters.spec import DrafterKind

    class Repeat(LookupDrafter):
        source = "repeat"

    drafters = {**DRAFTERS, "repeat": DrafterKind("repeat", lambda parts, request: Repeat())}
    monkeypatch.setattr(drafter_spec, "DRAFTERS", drafters)
    monkeypatch.setattr(drafter_spec, "FREE", (*drafter_spec.FREE, "repeat"))
    assert parse_drafter("Repeat") == DrafterSpec("repeat") and parse_drafter("repeat").kind == "repeat"
    with pytest.raises(SpecdecError, match="'repeat' drafts alone"):
        parse_drafter("repeat+qwen2.5-coder-0.5b")
    with pytest.raises(SpecdecError, match="two model-free drafters"):
        parse_drafter("lookup+repeat")
    assert isinstance(build_drafter(parse_drafter("repeat"), Parts(), request()), Repeat)


# What reading a drafter spec string looks like: splitting at its '+', its prefixes, comparing a spec (a
# variable named draft, drafter, spec or draft_spec) with a string.
SPEC_READING = re.compile("|".join([
    r"""(partition|split)\(\s*["']\+["']""",
    r"""startswith\(\s*f?["'](lookup|suffix|head|none|auto)""",
    r"""startswith\([^)]*(HEAD|LOOKUP|SUFFIX|copier)""",
    r"""[=!]=\s*HEAD\b""",
    r"""["'](lookup|suffix)\+["']""",
    r"""["']head:["']""",
    r"""[=!]=\s*["'](lookup|suffix|head)["']""",
    r"""["'](lookup|suffix|head)["']\s*[=!]=""",
    r"""\b(draft|drafter|spec|draft_spec)(\.strip\(\))?(\.lower\(\))?\s*[=!]=\s*["']""",
]))
LEFT: dict[str, int] = {}  # files allowed a few such lines for now: none


def test_no_module_but_the_spec_module_reads_drafter_specs():
    root = Path(specdec.__file__).resolve().parent
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path == Path(drafter_spec.__file__).resolve():
            continue
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if SPEC_READING.search(line)]
        if lines:
            found[str(path.relative_to(root.parent))] = lines
    over = {name: lines for name, lines in found.items() if len(lines) > LEFT.get(name, 0)}
    assert not over, over
