"""Drafter specs: the one place a drafter's name is read, and the one table of the drafters a spec can name.

A drafter spec (``--draft``, ``specdec.generate(draft=...)``, ``Engine.load(draft=...)``, a bench method's
``@<drafter>``, ``EngineSpec.draft``) is parsed here once into a :class:`DrafterSpec`, a frozen value
the rest of specdec reads instead of the string:

- ``lookup``, ``suffix``, ``recycle``: a model-free drafter alone (prompt lookup, suffix drafts, the target's
  own recycled top candidates);
- ``<model>``: a draft model (a zoo name, a .gguf file, a model directory, a hub id, or a loaded
  ``(model, tokenizer)`` pair);
- ``head``, ``head:<dir>``: a draft head trained for the target (its default directory, or <dir>);
- ``lookup+<model or head>``, ``suffix+<model or head>``: the model-free drafter first, the model or
  head where it has nothing good to offer (specdec.drafters.hybrid);
- ``none`` (or None): no drafter, plain decoding; ``auto``: :func:`resolve_drafter` chooses.

:data:`DRAFTERS` maps each kind of drafter to its :class:`DrafterKind`: the controller source its
proposals are counted under (specdec.algorithm.draft) and the factory that builds it for one request from
what the engine loaded (:class:`DraftingParts`).  :func:`build_drafter` composes a spec's kinds: one
alone, or a model-free kind's ``first`` drafter in front of the other's in a HybridDrafter.  Adding a
drafter is one class and one entry here (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, overload

from specdec.algorithm import draft as sources
from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from specdec.algorithm.draft import Drafter
    from specdec.algorithm.sampling import SamplingParams
    from specdec.backends.base import ModelRunner
    from specdec.drafters.lookup import LookupDrafter
    from specdec.drafters.recycling import RecycleMatrix, RecyclingDrafter
    from specdec.drafters.suffix import SuffixDrafter, SuffixStore

# A draft model: a name, or a loaded (transformers model or ModelRunner, tokenizer) pair (specdec.runtime.loading.ModelSpec).
DraftModel = str | tuple[Any, Any]

LOOKUP = sources.LOOKUP  # prompt lookup (specdec.drafters.lookup): no draft model
SUFFIX = sources.SUFFIX  # suffix drafts over the context and recent answers (specdec.drafters.suffix): no draft model
RECYCLE = sources.RECYCLE  # the target's own earlier top candidates (specdec.drafters.recycling): no draft model
MODEL = sources.MODEL  # a draft model (specdec.drafters.model, specdec.drafters.universal)
HEAD = "head"  # a draft head trained for the target (specdec.head): "head" or "head:<dir>"
NONE = "none"  # no drafter: plain decoding
AUTO = "auto"  # the default (specdec.defaults.DEFAULT_DRAFTER): resolve_drafter chooses
PLUS, COLON = "+", ":"  # "<model-free drafter>+<model or head>", "head:<dir>"


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter spec, parsed (:func:`parse_drafter`): which drafters draft, in the order they are tried.

    copier: the model-free drafter (a DRAFTERS kind that loads nothing: LOOKUP, SUFFIX), alone or first;
    model: the draft model (its spec, or its name once loaded); head: the head's directory ("" for the
    target's default one); auto: "auto", not resolved yet (resolve_drafter).  At most one of model and head."""

    copier: str | None = None
    model: DraftModel | None = None
    head: str | None = None
    auto: bool = field(default=False, repr=False)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The DRAFTERS keys of its drafters, the one tried first first: ("lookup", "model"), ("head",), ()."""
        backed = (MODEL,) if self.model is not None else (HEAD,) if self.head is not None else ()
        return ((self.copier,) if self.copier is not None else ()) + backed

    @property
    def kind(self) -> str:
        """The kinds joined as a spec joins them ("lookup+model", "head"), or "none" / "auto"."""
        return AUTO if self.auto else PLUS.join(self.kinds) or NONE

    @property
    def drafts(self) -> bool:
        """Whether anything drafts (not "none"; "auto" always resolves to a drafter)."""
        return self.auto or bool(self.kinds)

    @property
    def model_name(self) -> str | None:
        """The draft model's or head's part of the spec as written ("qwen2.5-coder-0.5b", "head:<dir>"), or None."""
        if self.head is not None:
            return f"{HEAD}{COLON}{self.head}" if self.head else HEAD
        if self.model is None:
            return None
        return self.model if isinstance(self.model, str) else type(self.model[0]).__name__

    @property
    def name(self) -> str:
        """The spec written back: "lookup+qwen2.5-coder-0.5b", "head:<dir>", "suffix", "none", "auto"."""
        if not self.kinds:
            return self.kind
        return PLUS.join(part for part in (self.copier, self.model_name) if part is not None)

    def __str__(self) -> str:
        return self.name


def _head(text: str) -> str | None:
    """The directory of a head spec ("" for "head"), or None when `text` names no head."""
    word, colon, directory = text.strip().partition(COLON)
    if word.strip().lower() != HEAD:
        return None
    if colon and not directory.strip():
        raise SpecdecError("'head:' needs a directory after the ':', e.g. head:~/heads/my-head")
    return directory.strip()


def parse_drafter(draft: DrafterSpec | DraftModel | None) -> DrafterSpec:
    """`draft` parsed (see the module doc); a DrafterSpec as it is.  A one-line SpecdecError for a '+' with
    nothing after it, two model-free drafters together, or "head:" without a directory.  Any other name is a
    draft model's (loading says whether it names one)."""
    if isinstance(draft, DrafterSpec):
        return draft
    if draft is None:
        return DrafterSpec()
    if not isinstance(draft, str):
        return DrafterSpec(model=draft)
    if draft.strip().lower() in (NONE, AUTO):
        return DrafterSpec(auto=draft.strip().lower() == AUTO)
    first, plus, rest = draft.partition(PLUS)
    copier, rest = first.strip().lower(), rest.strip()
    if copier not in FREE:
        copier, rest = "", draft
    elif plus and not rest:
        raise SpecdecError(f"'{copier}+' needs a draft model after the '+', e.g. {copier}+qwen2.5-coder-0.5b")
    elif plus and copier not in COPIERS:
        raise SpecdecError(f"'{copier}' drafts alone: it cannot go before a draft model or head ('{draft}')")
    elif rest.partition(PLUS)[0].strip().lower() in FREE:
        raise SpecdecError(f"'{draft}' puts two model-free drafters together: use one of them ('suffix' searches "
                           "the context as 'lookup' does, and recent answers too), alone or before a draft model")
    head = _head(rest) if rest else None
    return DrafterSpec(copier or None, rest if rest and head is None else None, head)


def resolve_drafter(draft: DrafterSpec | DraftModel | None, target: object, hidden_states: bool = True) -> DrafterSpec:
    """`draft` parsed, "auto" (specdec.defaults) resolved by specdec.drafters.choice.auto_drafter: HEAD_DRAFTER
    ("lookup+head") when a head is saved for `target` (named as the user named it) and the target's runtime
    gives the hidden states a head reads (`hidden_states`: transformers' and the native engine's runners do,
    llama.cpp's does not); else "lookup+<a zoo model with the target's tokenizer and at most a third of its
    parameters>" (MODEL_DRAFTER for the default target), or "lookup" alone where none fits."""
    spec = parse_drafter(draft)
    if not spec.auto:
        return spec
    from specdec.drafters.choice import auto_drafter

    return parse_drafter(auto_drafter(target, hidden_states).drafter)


@overload
def split_drafter(draft: DrafterSpec | str | None) -> tuple[str | None, str | None, DrafterSpec | None]: ...
@overload
def split_drafter(draft: DrafterSpec | DraftModel | None) -> tuple[str | None, DraftModel | None,
                                                                    DrafterSpec | None]: ...
def split_drafter(draft: DrafterSpec | DraftModel | None) -> tuple[str | None, DraftModel | None, DrafterSpec | None]:
    """(the model-free drafter or None, the draft model or None, the head alone as a spec or None) of `draft`
    (parse_drafter): what the bench's runner asks of a drafter."""
    spec = parse_drafter(draft)
    return spec.copier, spec.model, (DrafterSpec(head=spec.head) if spec.head is not None else None)


def is_none(draft: DrafterSpec | DraftModel | None) -> bool:
    """Whether `draft` says not to draft (None or "none"): the command line's --draft none.  Never raises."""
    return draft is None or (isinstance(draft, str) and draft.strip().lower() == NONE)


# --- the registry: what builds each kind of drafter for a request ---


class LoadedDrafter(Protocol):
    """Something loaded once that gives each request a drafter of its own (specdec.head.use.LoadedHead)."""

    def drafter(self, target: ModelRunner, sampling: SamplingParams) -> Drafter: ...


class DraftingParts(Protocol):
    """What an engine has loaded for drafting (specdec.runtime.engine.Engine): the factories read it."""

    @property
    def target_runner(self) -> ModelRunner: ...
    @property
    def draft_runner(self) -> ModelRunner | None: ...
    @property
    def head(self) -> LoadedDrafter | None: ...  # a draft head (specdec.head.use.LoadedHead)
    @property
    def suffix_store(self) -> SuffixStore | None: ...
    @property
    def recycle_matrix(self) -> RecycleMatrix | None: ...  # the engine's Token Recycling matrix (specdec.drafters.recycling)

    def model_drafter(self, sampling: SamplingParams, mode: str, confidence: float | None,
                      runner: ModelRunner) -> Drafter: ...


@dataclass(frozen=True)
class DraftRequest:
    """One request's drafting options, and the runners it was lent (a batch slot's, or the engine's own)."""

    sampling: SamplingParams
    mode: str  # the draft mode (RequestConfig.draft_mode): same, text, intersection, auto
    confidence: float | None  # the draft model stops after a token it gave less probability (None: never)
    target_runner: ModelRunner  # the runner the request verifies with (a head reads its hidden states)
    draft_runner: ModelRunner | None  # the draft model's runner lent to the request


Factory = Callable[[DraftingParts, DraftRequest], "Drafter"]
# a model-free drafter in front of a model or head: HybridDrafter asks it whether it matches, and for its shorter()
FirstFactory = Callable[[DraftingParts, DraftRequest], "LookupDrafter | SuffixDrafter | RecyclingDrafter"]


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter: the controller source its proposals are counted under (specdec.algorithm.draft:
    the speculation controller keeps acceptance, and prices a step, per source), how to build it for a
    request alone, and -- a model-free kind only -- how to build it in front of a model or head (`first`,
    in a HybridDrafter); None: it needs something loaded (`loads`: "model" or "head") and stands last."""

    source: str
    build: Factory
    first: FirstFactory | None = None
    loads: str | None = None


def _lookup(parts: DraftingParts, request: DraftRequest) -> LookupDrafter:
    from specdec.drafters.lookup import LookupDrafter

    return LookupDrafter()


def _lookup_first(parts: DraftingParts, request: DraftRequest) -> LookupDrafter:
    from specdec.drafters.lookup import LookupDrafter

    return LookupDrafter(max_ngram=4, min_ngram=2)


def _suffix(parts: DraftingParts, request: DraftRequest, **options: Any) -> SuffixDrafter:
    """A request's suffix drafter over its context and the engine's store; a seeded sampled request's over
    its context only (its text then depends on its seed and tokens, not on other requests' answers)."""
    from specdec.drafters.suffix import SuffixDrafter

    seeded = not request.sampling.greedy and request.sampling.seed is not None
    return SuffixDrafter(None if seeded else parts.suffix_store, **options)


def _suffix_first(parts: DraftingParts, request: DraftRequest) -> SuffixDrafter:
    from specdec.drafters.suffix import HYBRID_MIN_SCORE

    return _suffix(parts, request, min_ngram=2, min_score=HYBRID_MIN_SCORE)


def _recycle(parts: DraftingParts, request: DraftRequest, **options: Any) -> RecyclingDrafter:
    """A request's Token Recycling drafter over the engine's matrix, which every request's target forwards
    update; a seeded sampled request's over a matrix of its own, empty at its start (its text then depends
    on its seed and tokens, not on what other requests fed the target)."""
    from specdec.drafters.recycling import RecyclingDrafter

    seeded = not request.sampling.greedy and request.sampling.seed is not None
    return RecyclingDrafter(None if seeded else parts.recycle_matrix, **options)


def _recycle_first(parts: DraftingParts, request: DraftRequest) -> RecyclingDrafter:
    from specdec.drafters.recycling import HYBRID_MIN_MARGIN

    return _recycle(parts, request, min_margin=HYBRID_MIN_MARGIN)


def _model(parts: DraftingParts, request: DraftRequest) -> Drafter:
    runner = request.draft_runner or parts.draft_runner
    assert runner is not None  # Engine.load loaded the draft model the spec names
    return parts.model_drafter(request.sampling, request.mode, request.confidence, runner)


def _head_drafter(parts: DraftingParts, request: DraftRequest) -> Drafter:
    assert parts.head is not None  # Engine.load loaded the head the spec names
    return parts.head.drafter(request.target_runner, request.sampling)


DRAFTERS: dict[str, DrafterKind] = {
    LOOKUP: DrafterKind(LOOKUP, _lookup, first=_lookup_first),
    SUFFIX: DrafterKind(SUFFIX, _suffix, first=_suffix_first),
    RECYCLE: DrafterKind(RECYCLE, _recycle, first=_recycle_first),
    MODEL: DrafterKind(MODEL, _model, loads=MODEL),
    HEAD: DrafterKind(MODEL, _head_drafter, loads=HEAD),  # priced like a draft model (its measured ms a token)
}
FREE = tuple(kind for kind, entry in DRAFTERS.items() if entry.loads is None)  # the model-free drafters: named alone
COPIERS = tuple(kind for kind in FREE if DRAFTERS[kind].first is not None)  # those that may go before a model or head


def build_drafter(spec: DrafterSpec, parts: DraftingParts, request: DraftRequest) -> Drafter | None:
    """The drafter `spec` names for one request, built by DRAFTERS' factories: None for "none"; one kind
    alone; a model-free kind first and a model or head behind it in a HybridDrafter."""
    kinds = spec.kinds
    if not kinds:
        return None
    last = DRAFTERS[kinds[-1]].build(parts, request)
    if len(kinds) == 1:
        return last
    first = DRAFTERS[kinds[0]].first
    assert first is not None and len(kinds) == 2  # parse_drafter: one model-free drafter, before the rest
    from specdec.drafters.hybrid import HybridDrafter

    return HybridDrafter(last, first(parts, request))
