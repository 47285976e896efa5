"""The Engine: a loaded target (and optional draft) ready to generate text.

It turns text into token ids (optionally through the target's chat template) and
checks them (:mod:`specdec.text`: the prompt's one check), builds the strategy
objects for a request — a drafter, a verifier, a stop condition, a controller —
from its :class:`~specdec.request.RequestConfig`, and runs the one decode loop of
:mod:`specdec.algorithm.loop` over runners its pool lends it
(:mod:`specdec.runtime.pool`: one request at a time, or a batch's slots after
:meth:`Engine.enable_batching`).  :meth:`Engine.stream` is the one place a
request is set up: the CLI, the server, the Python API and the benchmark all go
through it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, overload

from specdec.algorithm.control import AutoK, Controller, Costs, parse_speculation
from specdec.algorithm.draft import Drafter
from specdec.algorithm.logprobs import TokenLogprob
from specdec.algorithm.loop import Stats, Step, StopCondition, collect, decode
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.stairs import StairsRunner, stairs_runner
from specdec.algorithm.verify import make_verifier
from specdec.backends.base import ModelRunner, trimmable
from specdec.bridge import TextBridge, VocabularyMap
from specdec.constrain import Constraint
from specdec.defaults import DEFAULT_SUFFIX_MEMORY
from specdec.drafters.draft_vocab import (
    AUTO_MIN_VOCAB,
    DEFAULT_DRAFT_VOCAB,
    VOCAB_AUTO,
    draft_vocabulary,
    parse_draft_vocab,
)
from specdec.drafters.model import ModelDrafter
from specdec.drafters.recycling import RecycleMatrix
from specdec.drafters.spec import (
    COPIERS,
    FREE,
    LOOKUP,
    RECYCLE,
    SUFFIX,
    DrafterSpec,
    DraftModel,
    DraftRequest,
    build_drafter,
    resolve_drafter,
)
from specdec.drafters.suffix import SuffixStore
from specdec.drafters.universal import UniversalDrafter
from specdec.engine_config import HF, EngineConfig, feeds_heads, with_options
from specdec.errors import IncompatibleDraftError, SpecdecError
from specdec.request import RequestConfig, RequestError, check_draft_mode, check_verify_mode
from specdec.runtime import runners
from specdec.runtime.loading import ModelSpec, resolve_draft
from specdec.runtime.memory import DRAFT_ROWS, TRIM_RETURN_BYTES, Need, request_need, return_freed_memory
from specdec.runtime.pool import Lease, RunnerPool, SinglePool
from specdec.runtime.runners import as_runner, fastest_dtype, is_seq2seq_runner
from specdec.text import chat_ids, check_prompt, cut_at_stop
from specdec.vocab import decoded, same_vocabulary

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdec.head.use import LoadedHead

# The most tokens the controller drafts in one step: a free source's long match (a suffix draft after a
# 16-token match is right 98% of the time per token) pays up to here; a draft model's rate stops it sooner
MAX_AUTO_K = 24
# Steps a generation must have run before its controller's learnt cost scale may renew the cached step costs
RENEW_AFTER_STEPS = 16



@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: Stats
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, where the request asked for them

    def to_dict(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs:
            out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": [list(pair) for pair in lp.top]}
                               for lp in self.logprobs]
        return out


@overload
def _own_runner(runner: ModelRunner) -> tuple[ModelRunner, bool]: ...
@overload
def _own_runner(runner: ModelRunner | None) -> tuple[ModelRunner | None, bool]: ...
def _own_runner(runner: ModelRunner | None) -> tuple[ModelRunner | None, bool]:
    """(a runner over the same weights with a cache of its own, False), or (`runner` itself, True) where
    it cannot be cloned."""
    if runner is None:
        return None, False
    try:
        return runner.clone(), False
    except SpecdecError:
        return runner, True


def check_seq2seq_pair(target: ModelRunner, draft: ModelRunner | None, same_vocab: bool,
                       target_name: str = "target", draft_name: str = "draft") -> None:
    """Refuse a draft model across the encoder-decoder divide: an encoder-decoder target drafts with an
    encoder-decoder draft of the same vocabulary (its decoder drafts over the same source), a
    decoder-only target with a decoder-only draft.  Prompt lookup works with either."""
    if draft is None:
        return
    target_s2s, draft_s2s = is_seq2seq_runner(target), is_seq2seq_runner(draft)
    if target_s2s and not draft_s2s:
        raise IncompatibleDraftError(
            f"target '{target_name}' is an encoder-decoder model but draft '{draft_name}' is decoder-only: "
            "draft with an encoder-decoder model of the same tokenizer (e.g. a small T5 for a large T5), "
            "with 'lookup', or not at all (--draft none)")
    if draft_s2s and not target_s2s:
        raise IncompatibleDraftError(
            f"draft '{draft_name}' is an encoder-decoder model but target '{target_name}' is decoder-only: "
            "draft with a decoder-only model, with 'lookup', or not at all (--draft none)")
    if target_s2s and not same_vocab:
        raise IncompatibleDraftError(
            f"encoder-decoder draft '{draft_name}' has another vocabulary than target '{target_name}': "
            "an encoder-decoder pair must share its tokenizer (e.g. t5-small for t5-large)")


def runner_eos_token_ids(runner: ModelRunner, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End-of-sequence ids for a runner: its model's (ModelRunner.eos_token_ids) and the tokenizer's."""
    ids = set(runner.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _check_load(drafter: DrafterSpec, target: ModelSpec, dtype: str, backend: str, draft_backend: str | None,
                draft_dtype: str | None, device: str, suffix_memory: int) -> tuple[str, str, str, str | None]:
    """(target's dtype, target's backend, draft's backend, draft's dtype) as Engine.load loads them, every
    "auto" resolved; each mistake refused in one line before anything is loaded: a head that cannot draft or
    is missing, an int4 target, a bad device / dtype pair, a name that no backend can load."""
    from specdec.runtime.loading import AUTO_DTYPE, check_spec, resolve_device

    if suffix_memory < 0:
        raise SpecdecError(f"the suffix memory must be >= 0 tokens, got {suffix_memory}")
    if drafter.head is not None:
        from specdec.head.use import precheck

        precheck(drafter, backend, target, feeds_heads(backend))
    auto = dtype == AUTO_DTYPE
    if auto:
        dtype = fastest_dtype(target, backend, device)
    runners.check_role(runners.of_dtype(dtype), dtype, runners.TARGET)  # an int4 target refused in its words
    draft = drafter.model
    backend, draft_backend, draft_dtype = resolve_draft(draft, backend, draft_backend, draft_dtype, device)
    if auto and draft_dtype is None and draft is not None:
        draft_dtype = fastest_dtype(draft, draft_backend, device)  # "auto" for the draft on its own
    for which, d, spec in ((backend, dtype, target), (draft_backend, draft_dtype or dtype, draft)):
        if which == HF and spec is not None:
            resolve_device(device, d)  # a bad device / dtype pair is refused before any load
    for spec, which in ((target, backend), (draft, draft_backend)):
        if isinstance(spec, str):
            check_spec(spec, which)  # every name checked before anything is loaded
    return dtype, backend, draft_backend, draft_dtype


@dataclass
class _Loader:
    """Loads Engine.load's models by name (or takes loaded ones), timing each (Engine.timings)."""

    progress: Callable[[str, int, int], None] | None
    device: str
    n_ctx: int | None
    threads: int | None
    timings: dict[str, float] = field(default_factory=dict)

    def timed(self, which: str, load: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        try:
            return load()
        finally:
            self.timings[which] = time.perf_counter() - began

    def model(self, spec: DraftModel, which: str, exact: bool, dtype: str) -> tuple[Any, PreTrainedTokenizerBase, str]:
        """(model or runner, tokenizer, name) of `spec` on the runtime backend `which` and `dtype` name
        (specdec.runtime.runners); exact: a target's (llama.cpp's batch-invariant mode)."""
        from specdec.runtime import runners

        if isinstance(spec, tuple):
            model, tok = spec
            config = getattr(model, "config", None)
            return model, tok, getattr(config, "_name_or_path", "") or type(model).__name__
        options = runners.LoadOptions(progress=self.progress, device=self.device, n_ctx=self.n_ctx,
                                      threads=self.threads, exact=exact)
        model, tok = runners.load(spec, which, dtype, options, runners.TARGET if exact else runners.DRAFT)
        return model, tok, spec


class Engine:
    """A target model and an optional draft model (any tokenizer, any backend), ready for requests.

    `target` and `draft` are each a transformers model (run by an HFRunner) or
    a ready ModelRunner (e.g. a LlamaCppRunner), each with its own tokenizer.

    An encoder-decoder target (T5, BART: specdec.backends.seq2seq) reads the prompt with its encoder
    and the loop runs its decoder; it drafts with an encoder-decoder draft of the same vocabulary,
    or with prompt lookup, which looks up in the decoder's output so far (not in the prompt).

    head: a draft head trained for the target (specdec.head.use.LoadedHead; Engine.load loads it for
    the drafter specs "head", "lookup+head", ...): it drafts in place of a draft model, from the
    hidden states of the runner each request verifies with.

    suffix: draft from suffix matches (specdec.drafters.suffix) in the request's context and in the
    engine's store of recent requests' outputs (`suffix_store`: at most `suffix_memory` tokens, shared by
    every request and batch slot; each request's output enters it when the request ends); with a draft
    model or a head too, suffix drafts where they score well and the model elsewhere (the hybrid).

    copier="recycle": Token Recycling (specdec.drafters.recycling), drafts from the target's own top
    candidates of earlier forwards, kept in the engine's `recycle_matrix`, which every request's (and
    batch slot's) target forwards update; a seeded sampled request keeps a matrix of its own.

    Prefix reuse (`prefix_cache`, on by default): one request at a time, the runners keep their caches
    between requests, and a request whose prompt starts with what the target's cache holds (the earlier
    turns of a conversation, a system prompt) prefills only the rest -- where that is exact, a
    batch-invariant target (int8; specdec.backends.base.reusable_prefix); the draft model's cache does
    the same (specdec.drafters.model.DraftCache).  Like vLLM's automatic prefix caching, but of the last
    request only (in a batch, enable_batching: of the last request its slot ran).
    """

    def __init__(
        self,
        target: PreTrainedModel | ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        draft: PreTrainedModel | ModelRunner | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
        target_name: str = "target",
        draft_name: str = "draft",
        lookup: bool = False,
        head: LoadedHead | None = None,
        suffix: bool = False,
        suffix_memory: int = DEFAULT_SUFFIX_MEMORY,
        copier: str | None = None,
    ) -> None:
        # lookup: draft by prompt lookup (specdec.drafters.lookup); with a draft model too, by
        # lookup where it matches and the draft model elsewhere (specdec.drafters.hybrid); suffix: the same
        # with suffix drafts; copier: any model-free drafter of specdec.drafters.spec.DRAFTERS, by its name
        if lookup + suffix + (copier is not None) > 1:
            raise SpecdecError("draft with prompt lookup or suffix drafts, not both (suffix searches the context too)")
        copier = LOOKUP if lookup else SUFFIX if suffix else copier
        if copier is not None and copier not in FREE:
            raise ValueError(f"copier must be one of {FREE} or None, not {copier!r}")
        self.suffix_store = SuffixStore(suffix_memory) if copier == SUFFIX else None
        # Token Recycling's matrix (specdec.drafters.recycling), which every request's target forwards update
        self.recycle_matrix = RecycleMatrix() if copier == RECYCLE else None
        if head is not None and draft is not None:
            raise SpecdecError("draft with a draft model or a draft head, not both")
        self.head = head
        # what drafts, parsed (specdec.drafters.spec): make_drafter builds it through the registry, DRAFTERS
        self.drafter_spec = DrafterSpec(copier, draft_name if draft is not None else None,
                                        head.spec.head if head is not None else None)
        self.tokenizer = tokenizer
        self.target_runner = as_runner(target)
        self.draft_runner = as_runner(draft) if draft is not None else None
        self.draft_tokenizer = draft_tokenizer or tokenizer
        self.target_name, self.draft_name = target_name, draft_name
        self.same_vocabulary = draft is not None and same_vocabulary(tokenizer, self.draft_tokenizer)
        check_seq2seq_pair(self.target_runner, self.draft_runner, self.same_vocabulary, target_name, draft_name)
        self.eos_token_ids = runner_eos_token_ids(self.target_runner, tokenizer)
        self._bridge: TextBridge | None = None
        self._vocab_map: VocabularyMap | None = None
        self._auto: AutoK | None = None
        self._costs_forgotten = False  # the cached step costs were found off and dropped (_check_step_costs)
        # where start-up time went, in seconds: "target", "draft" (Engine.load), "step costs" (the controller's,
        # at its first use: read from the cache, or measured); `specdec generate --timings`
        self.timings: dict[str, float] = {}
        self._measured_costs: Costs | None = None
        self._stairs: StairsRunner | None = None
        self.prefix_cache = True  # requests reuse the target's cached prefix where exact (see the class doc)
        self.dtype = "as loaded"  # the target's dtype, as Engine.load resolved it ("gguf" on llama.cpp)
        self.draft_dtype = "as loaded" if draft is not None else None  # the draft model's, likewise
        self.pool: RunnerPool = self._single_pool()  # lends the runners to requests (specdec.runtime.pool)
        # After each request its runners keep at most this many cached tokens (prefix reuse) and free the rest of
        # their caches, handing a large freed block back to the OS (ModelRunner.trim; specdec.runtime.memory); None: they
        # keep all of it until the next request (the library's default; `specdec serve` sets RETAIN_TOKENS).
        self.retain_tokens: int | None = None

    def enable_batching(self, max_batch: int) -> None:
        """Decode up to `max_batch` requests (streams consumed from as many threads) together, one packed
        target forward per step (specdec.runtime.batching); 1: one request at a time, the engine's own runners."""
        if max_batch < 1:
            raise SpecdecError(f"the batch size must be >= 1, got {max_batch}")
        if max_batch == 1:
            self.pool = self._single_pool()
            return
        from specdec.runtime.batching import BatchPool

        self.pool = BatchPool(self.target_runner, self.draft_runner, max_batch, speculation=self.speculation,
                              shared=self.auto_controller, drafts=self.can_draft)

    def forget(self) -> None:
        """Drop what this engine keeps of its earlier requests: what drafters learned (the suffix drafts'
        store of recent answers, specdec.drafters.suffix; Token Recycling's matrix, specdec.drafters.recycling)
        and the runners' cached prompts (prefix reuse), so that the next request drafts from its own context
        only and prefills all of it.  The store is a new, empty one of the same memory (the matrix a new,
        empty one), not the one the engine holds emptied, for a fork
        (:meth:`fork`) shares its parent's objects until its forget() runs.  The cost-model
        controller is not such state (what it learns is the machine's speed): it is kept.
        """
        if self.suffix_store is not None:
            self.suffix_store = SuffixStore(self.suffix_store.memory)
        if self.recycle_matrix is not None:
            self.recycle_matrix = RecycleMatrix(self.recycle_matrix.width)
        for runner in (self.target_runner, self.draft_runner):
            if runner is not None:
                runner.reset()

    def fork(self) -> Engine:
        """Another engine over the same loaded models (tokenizers, head, and the `-k auto` controller if
        this engine has made it; one request at a time) whose drafters remember nothing of this one's
        requests (:meth:`forget`), with runners of its own over the same weights (ModelRunner.clone), so
        that its cached prompts are its own.  Where a runner cannot be cloned (llama.cpp) the fork
        shares it and reuses no prefix: two engines taking turns on one cache would each find the
        other's prompt there.

        The benchmark gives every method a fork of its own: one method's answers never reach
        another's drafts or caches, while each still learns from its own earlier turns of a session."""
        twin = copy.copy(self)
        twin.target_runner, shared = _own_runner(self.target_runner)
        twin.draft_runner, draft_shared = _own_runner(self.draft_runner)
        twin.prefix_cache = self.prefix_cache and not (shared or draft_shared)
        twin._stairs = None  # built over the twin's own target when asked for
        twin.pool = twin._single_pool()  # leases bound to the twin, not to this engine
        twin.forget()
        return twin

    @property
    def copier(self) -> str | None:
        """The model-free drafter: LOOKUP, SUFFIX, RECYCLE or None."""
        return self.drafter_spec.copier

    def fork_drafting(self, copier: str | None, model: bool, head: LoadedHead | None = None) -> Engine:
        """A fork (:meth:`fork`) that drafts otherwise over the same loaded models: with the model-free
        drafter `copier` (one of FREE alone, one of COPIERS in front; or None) in front of this engine's draft
        model or head when `model`, without them when not, or in front of another `head` loaded for this engine's target
        (specdec.head.use.load_head) in their place -- so that one benchmark run compares drafters on one
        target (``specdec-auto@lookup`` beside ``specdec-auto`` with ``--draft suffix``; a head beside
        the draft model).  Where it drafts otherwise than this engine, its `-k auto` controller is its
        own (what it prices depends on the drafters: specdec.runtime.profile.step_costs)."""
        if copier is not None and copier not in (COPIERS if model or head is not None else FREE):
            raise ValueError(f"copier must be one of {COPIERS} (or alone, {FREE}) or None, not {copier!r}")
        if head is not None and model:
            raise ValueError("a fork drafts with this engine's draft model or head, or with another head: not both")
        has_model = self.draft_runner is not None or self.head is not None
        if model and not has_model:
            raise SpecdecError("this engine has no draft model or head to draft with: name a model-free drafter "
                               f"({', '.join(FREE)}) alone")
        if copier is None and not model and head is None:
            raise SpecdecError(f"a drafter needs {', '.join(FREE)}, a draft model or a head")
        twin = self.fork()
        if (copier, model, head) == (self.copier, has_model, None):
            return twin
        memory = self.suffix_store.memory if self.suffix_store is not None else DEFAULT_SUFFIX_MEMORY
        twin.suffix_store = SuffixStore(memory) if copier == SUFFIX else None
        twin.recycle_matrix = RecycleMatrix() if copier == RECYCLE else None
        mine = self.drafter_spec
        twin.drafter_spec = DrafterSpec(copier, mine.model if model else None,
                                        mine.head if model else head.spec.head if head is not None else None)
        if not model:
            twin.draft_runner, twin.head, twin.draft_dtype = None, head, None
            twin.same_vocabulary = False
            twin.pool = twin._single_pool()
        twin.draft_name = twin.drafter_spec.name
        twin._auto, twin._measured_costs = None, None  # priced for its own drafters on first use
        return twin

    def _single_pool(self) -> SinglePool:
        """The default pool: this engine's own runners, one request at a time."""
        return SinglePool(Lease(self.target_runner, self.draft_runner, self.speculation))

    def speculation(self, k: int | str | Controller, sampling: SamplingParams | None = None) -> int | Controller:
        """A draft length for the loop: an int γ as it is, a Controller as it is, or "auto": this
        engine's cost-model controller (specdec.algorithm.control.AutoK; its costs measured on first use and
        cached on disk, see specdec.runtime.profile.step_costs; what it learns carries over between requests).

        A seeded sampled request gets a controller of its own instead, started afresh from the
        measured costs and never updated from timings: a seed's text depends on which tokens were
        drafted, so k must depend on nothing but the seed and the tokens (the same seed then gives
        the same text, run after run, whatever the machine's load).  Since it cannot learn what rows
        cost, its table prices each row at least at the table's average row (Costs.with_row_floor)."""
        if isinstance(k, Controller):
            return k
        try:
            parsed = parse_speculation(k)
        except SpecdecError as e:
            raise SpecdecError(f"the number of speculative tokens {e}") from None
        if isinstance(parsed, int):  # else AUTO
            return parsed
        shared = self.auto_controller()
        if sampling is not None and not sampling.greedy and sampling.seed is not None:
            assert self._measured_costs is not None  # auto_controller() measured them
            return AutoK(self._measured_costs.with_row_floor(), max_k=shared.max_k, cost_ewma=0.0)
        return shared

    def _check_step_costs(self, steps: int) -> None:
        """After a generation of `steps` steps: where the shared controller has learnt that the target's steps
        cost more than twice or less than half what the cached table says (a table timed while the machine
        was busy, or a machine that changed under the same CPU name), drop the cached table so that the next
        start times it again (specdec.runtime.profile.forget_step_costs); this engine goes on with what it learnt."""
        from specdec.runtime.profile import SPOT_TOLERANCE, forget_step_costs
        from specdec.zoo import home

        auto = self._auto
        if auto is None or self._costs_forgotten or steps < RENEW_AFTER_STEPS:
            return
        if not 1 / SPOT_TOLERANCE <= auto.costs.target_scale <= SPOT_TOLERANCE:
            forget_step_costs(self.target_runner, MAX_AUTO_K, home() / "profiles")
            self._costs_forgotten = True  # once: this engine goes on with what it learnt

    def auto_controller(self) -> AutoK:
        """The engine's controller for `-k auto` (measures the step costs the first time, seconds)."""
        if self._auto is None:
            from specdec.runtime.head_cost import head_ms_per_token
            from specdec.runtime.profile import step_costs
            from specdec.zoo import home

            self._set_sources()  # an encoder-decoder model is timed over a stand-in source
            began = time.perf_counter()
            costs = step_costs(self.target_runner, self.draft_runner, MAX_AUTO_K, lookup=self.copies,
                               cache_dir=home() / "profiles")
            if self.head is not None:  # priced like a draft model: its measured ms per drafted token
                costs = replace(costs, draft_ms=head_ms_per_token(self.head, home() / "profiles"))
            self._measured_costs = replace(costs)  # as measured, before any online update
            self._auto = AutoK(costs, max_k=MAX_AUTO_K)
            self.timings["step costs"] = time.perf_counter() - began
        return self._auto

    def resolve_draft_mode(self, mode: str = "auto") -> str:
        """The concrete drafting mode for `mode` with this pair of models."""
        check_draft_mode(mode)
        if mode in ("text", "intersection") and is_seq2seq_runner(self.target_runner):
            raise SpecdecError(f"draft mode '{mode}' is for a draft with another tokenizer; an encoder-decoder "
                               "pair shares one: use draft mode 'same' or 'auto'")
        if mode == "auto":
            return "same" if self.same_vocabulary else "text"
        if mode == "same" and not self.same_vocabulary:
            raise IncompatibleDraftError(
                f"draft '{self.draft_name}' has a different vocabulary from target '{self.target_name}', "
                "so its token ids cannot be used as they are: use draft mode 'text' or 'intersection'"
            )
        return mode

    @property
    def copies(self) -> bool:
        """Whether a model-free drafter (prompt lookup, suffix drafts, Token Recycling) drafts, alone or first in a
        hybrid."""
        return self.drafter_spec.copier is not None

    @property
    def can_draft(self) -> bool:
        """Whether requests can be speculative: a draft model, a draft head, prompt lookup or suffix drafts."""
        return self.drafter_spec.drafts

    def make_drafter(self, sampling: SamplingParams, mode: str = "auto", confidence: float | None = None,
                     draft_runner: ModelRunner | None = None, target_runner: ModelRunner | None = None) -> Drafter | None:
        """The drafter for one request, or None without a draft model, a head or lookup.  confidence: the
        draft model stops after a token it gave less probability (None: it drafts all k; checked by
        RequestConfig).  draft_runner: the draft model's runner to use (default: the engine's; a batch
        gives each request its own cache over the same model).  target_runner: the runner the request
        verifies with, whose hidden states a head reads (default: the engine's; a batch slot's).  Built by
        the registry of drafters (specdec.drafters.spec.DRAFTERS) from the engine's drafter_spec."""
        request = DraftRequest(sampling, mode, confidence, target_runner or self.target_runner,
                               draft_runner or self.draft_runner)
        return build_drafter(self.drafter_spec, self, request)

    def trim_draft_vocabulary(self, draft_vocab: str | int = VOCAB_AUTO) -> None:
        """Let the draft model propose among some of its vocabulary only, its head computing their logits alone
        (FR-Spec: specdec.drafters.draft_vocab): a number of tokens, "full" (all of them) or "auto" (the default:
        DEFAULT_DRAFT_VOCAB tokens for a draft of more than AUTO_MIN_VOCAB whose head can be trimmed, the
        whole vocabulary for any other).  Only a draft that shares the target's tokenizer, on specdec's kernels
        (int4, int8, or a GGUF draft's blocks), can be trimmed; a number given for another is refused.  Never changes
        the output."""
        draft_vocab = parse_draft_vocab(draft_vocab)
        runner = self.draft_runner
        if runner is None:
            return
        head = trimmable(runner)  # a lean or gguf draft's (specdec.native.lean, .gguf)
        trim = None if head is None else head.trim_head
        auto = draft_vocab == VOCAB_AUTO
        size = DEFAULT_DRAFT_VOCAB if auto else draft_vocab
        ids = None  # the whole vocabulary
        if isinstance(size, int) and (not auto or runner.vocab_size > AUTO_MIN_VOCAB):
            if trim is not None and self.same_vocabulary:
                ids = draft_vocabulary(self.draft_tokenizer, size, runner.vocab_size, self.eos_token_ids)
                ids = ids if len(ids) < runner.vocab_size else None
            elif not auto:
                raise SpecdecError(f"--draft-vocab {size}: only a draft with the target's tokenizer on specdec's "
                                   f"kernels ({self.draft_name} runs on {runner.describe()}) proposes among "
                                   "some tokens; use --draft-vocab full")
        if trim is None:
            return
        try:
            trim(ids)
        except SpecdecError as e:  # a head that cannot be trimmed: refused where asked for
            trim(None)
            if not auto:
                raise SpecdecError(f"--draft-vocab {size}: {e}; use --draft-vocab full") from None

    def model_drafter(self, sampling: SamplingParams, mode: str, confidence: float | None,
                      runner: ModelRunner) -> Drafter:
        """A request's drafter over the draft model's `runner`, in draft mode `mode` (resolve_draft_mode): its
        token ids as they are (same vocabulary), or through the text (specdec.drafters.universal)."""
        mode = self.resolve_draft_mode(mode)
        if mode == "same":
            return ModelDrafter(runner, sampling, target_vocab_size=self.target_runner.vocab_size,
                                confidence=confidence)
        if self._bridge is None:
            self._bridge = TextBridge(self.tokenizer, self.draft_tokenizer)
        if mode == "intersection" and self._vocab_map is None:
            assert self.draft_runner is not None  # a draft mode (same, text, intersection) of a draft model
            self._vocab_map = VocabularyMap.from_tokenizers(
                self.tokenizer, self.draft_tokenizer, self.target_runner.vocab_size, self.draft_runner.vocab_size
            )
        vocab_map = self._vocab_map if mode == "intersection" else None
        return UniversalDrafter(runner, self._bridge, sampling, vocab_map, confidence=confidence)

    @classmethod
    def load(
        cls,
        target: ModelSpec,
        draft: DrafterSpec | DraftModel | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        config: EngineConfig | None = None,
        **options: Any,
    ) -> Engine:
        """Load models by name (zoo name, .gguf path, model directory, hub id) or take loaded ones.

        How: EngineConfig's fields (the CLI's model options, with its defaults), given as `config` (its target
        and draft aside: these arguments are the models), as keyword `options` (dtype="int8", backend=...),
        or both (the options win); an unknown option is a TypeError naming it.  Each is below.

        draft: a drafter spec, or one parsed (specdec.drafters.spec): a model, "lookup" for prompt lookup
        drafting (no draft model), or "lookup+<model>": prompt lookup where it matches and the draft model
        elsewhere; "suffix" or "suffix+<model>": the same with suffix drafts (the context and recent
        requests' answers, specdec.drafters.suffix) in lookup's place; "recycle" or "recycle+<model>": Token
        Recycling (the target's own top candidates from earlier forwards, specdec.drafters.recycling), alone
        or where the target was sure of them, before the model; "head" (the draft head trained for
        the target: specdec.head.store.default_directory(target)) or "head:<dir>" (the head saved in
        <dir>), alone or as "lookup+head[:<dir>]" or "suffix+head[:<dir>]" (specdec.head.use); "none" (or
        None): no drafter; "auto" (specdec.generate's and the CLI's default): "lookup+head" when a head is
        saved for the target and it runs on transformers, else "lookup+<a zoo model with the target's tokenizer and
        at most a third of its parameters>" (the 0.5B for the default target), or "lookup" where none fits
        (specdec.drafters.spec.resolve_drafter, specdec.drafters.choice).
        suffix_memory: with suffix drafts, the tokens of recent answers the engine keeps
        (specdec.defaults.DEFAULT_SUFFIX_MEMORY).
        dtype: the target's on specdec's side (backend "hf"): "gguf" (a GGUF model's own blocks on
        specdec's kernels: specdec.native.gguf), "int8", "fp32", "bf16", or "auto" (the default: gguf
        for a GGUF model and int8 for others on CPUs where specdec's kernels run SIMD, fp32 elsewhere;
        see specdec.runtime.runners.fastest_dtype); the engine's `dtype` says which it took.
        backend / draft_backend: "hf" (transformers, in `dtype`) or "llamacpp" (the GGUF
        through llama.cpp; zoo names and .gguf files only); the draft's defaults to the
        target's; "auto": llama.cpp where it can run the draft (fastest_draft_backend), except
        on CPUs where a draft on specdec's int8 or int4 kernel is faster
        (fastest_spec_draft_dtype; when draft_dtype is not given).
        n_ctx / threads: llama.cpp's context size (default DEFAULT_N_CTX) and CPU threads
        (default: all the process may use).  A llama.cpp target is loaded in exact mode (batch-invariant logits), a
        llama.cpp draft in
        llama.cpp's fastest mode (a draft's numerics never change the output).
        draft_dtype: the draft's dtype (default: `dtype`); a bf16 draft for an
        fp32 target halves the draft's cost and leaves the output as it is; "gguf" runs a GGUF
        draft's own blocks; "int4" (drafts only,
        llama-family and Gemma 3 models) runs the draft's int8 weights requantized to 4 bits on specdec's int4
        kernel (specdec.native.int4), a cheaper draft token for the same output.
        device: where transformers models run: "cpu", "cuda" or "auto" (cuda when available).
        draft_vocab: the tokens the draft model proposes among (:meth:`trim_draft_vocabulary`): "auto" (the
        default), "full", or a number of tokens.
        """
        settings = with_options(config, options)
        draft_vocab, suffix_memory = parse_draft_vocab(settings.draft_vocab), settings.suffix_memory
        drafter = resolve_drafter(draft, target, feeds_heads(settings.backend))
        dtype, backend, draft_backend, draft_dtype = _check_load(drafter, target, settings.dtype, settings.backend,
                                                                 settings.draft_backend, settings.draft_dtype,
                                                                 settings.device, suffix_memory)
        loader = _Loader(progress, settings.device, settings.n_ctx, settings.threads)
        t_model, t_tok, t_name = loader.timed("target", lambda: loader.model(target, backend, True, dtype))
        copying: dict[str, Any] = dict(copier=drafter.copier, suffix_memory=suffix_memory)
        if drafter.head is not None:
            from specdec.head.use import load_head

            runner = as_runner(t_model)
            head = loader.timed("draft", lambda: load_head(drafter, runner, target if isinstance(target, str) else t_name))
            engine = cls(runner, t_tok, target_name=t_name, head=head, **copying)
        elif (draft := drafter.model) is None:
            engine = cls(t_model, t_tok, target_name=t_name, **copying)
        else:
            d_model, d_tok, d_name = loader.timed("draft", lambda: loader.model(draft, draft_backend, False,
                                                                                draft_dtype or dtype))
            engine = cls(t_model, t_tok, d_model, d_tok, target_name=t_name, draft_name=d_name, **copying)
            engine.draft_dtype = (draft_dtype or dtype) if draft_backend == HF else "gguf"
            engine.trim_draft_vocabulary(draft_vocab)
        if engine.can_draft:  # the spec as loaded: "lookup+qwen2.5-coder-0.5b", "head:<dir>", "suffix"
            engine.draft_name = engine.drafter_spec.name
        engine.timings.update(loader.timings)
        engine.dtype = dtype if backend == HF else "gguf"
        return engine

    @classmethod
    def from_config(cls, config: EngineConfig, progress: Callable[[str, int, int], None] | None = None) -> Engine:
        """Engine.load with `config`'s models and options (specdec.engine_config.EngineConfig: the CLI's model
        options); its threads, when given, are torch's too, as the CLI sets them."""
        if config.threads:
            import torch

            torch.set_num_threads(config.threads)
        return cls.load(config.target, config.draft, progress=progress, config=config)

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (or ids) -> token ids, through the chat template when chat=True (unchecked: see prompt_ids)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if chat:
            return self.encode_messages([("user", prompt)])
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_messages(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """A conversation, (role, content) pairs ending with the pending user turn -> token ids
        through the chat template, with the assistant's turn opened (specdec.text.chat_ids: a
        ChatTemplateError where the target has none, or where it refuses the turns)."""
        return chat_ids(self.tokenizer, messages, self.target_name)

    def prompt_ids(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """A request's prompt as the ids the target reads (encode), checked by the one check every prompt
        passes (specdec.text.check_prompt: a PromptError for an empty one, ids outside the target's
        vocabulary, or more than its context window holds).  Empty text is refused before the tokenizer
        sees it (which may make a lone start token of nothing).  Engine.stream's, and the server's before
        it queues a request."""
        ids = [] if isinstance(prompt, str) and not prompt else self.encode(prompt, chat)
        check_prompt(ids, self.target_runner.max_context, self.target_runner.vocab_size)
        return ids

    def decode_text(self, token_ids: Sequence[int]) -> str:
        return decoded(self.tokenizer.decode(list(token_ids), skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False))

    def stream(self, prompt: str | Sequence[int], config: RequestConfig | None = None,
               **options: Any) -> Generator[Step, None, None]:
        """Decode steps for one request (see :func:`specdec.algorithm.loop.decode`): the one place a request is set up.

        config: the request's options (specdec.request.RequestConfig), changed by keyword `options`
        (RequestConfig.from_options: max_new_tokens, num_speculative_tokens / k -- a fixed γ, "auto" or a
        Controller --, use_draft / speculative, stop, chat, sampling, draft_mode, draft_confidence, verify
        -- "causal", "block": sampled drafts verified as blocks, specdec.algorithm.block, or "stairs": next-token
        queries only, greedy; specdec.algorithm.stairs -- and tree: "off", "auto" or "WxD", specdec.algorithm.draft.parse_tree).
        The options, the prompt (prompt_ids) and the draft mode are checked now; the runners are taken from
        the engine's pool when the first step is asked for, and given back when the steps end or are closed.
        """
        config = RequestConfig.from_options(config, **options)
        self.pool.check(config)
        if config.logit_bias and config.logit_bias[-1][0] >= self.target_runner.vocab_size:  # (pairs in id order)
            raise RequestError("logit_bias", f"token id {config.logit_bias[-1][0]} is not in the target's vocabulary "
                                             f"(0..{self.target_runner.vocab_size - 1})", "logit_bias")
        prompt_ids = self.prompt_ids(prompt, chat=config.chat)
        condition = self.stop_condition(config.max_new_tokens, config.stop)
        drafting = config.speculative and self.can_draft
        if drafting and self.draft_runner is not None:
            self.resolve_draft_mode(config.draft_mode)
        if drafting and config.tree_shape is not None and config.tree != "auto" \
                and not self.target_runner.capabilities.tree:
            raise SpecdecError(f"--tree {config.tree}: a {self.target_runner.describe()} target verifies chains "
                               "only (token trees need the int8 or transformers backend): use --tree off or auto")
        if drafting and self.head is not None:
            from specdec.head.use import check_hidden_states

            check_hidden_states(self.target_runner, config.verify)
        grammar = self.grammar(config.constraint) if config.constraint is not None else None
        return self._steps(prompt_ids, condition, config, drafting, grammar)

    def grammar(self, constraint: Constraint) -> Any:
        """`constraint` compiled for the target's tokenizer and logits (specdec.constrain.Grammar, cached): its
        output ends at one of the target's end-of-sequence tokens.  A one-line SpecdecError for a grammar the
        library refuses."""
        return constraint.grammar(self.tokenizer, self.target_runner.vocab_size, sorted(self.eos_token_ids))

    def _steps(self, prompt_ids: list[int], condition: StopCondition, config: RequestConfig,
               drafting: bool, grammar: Any = None) -> Generator[Step, None, None]:
        """The request's steps, decoded over runners the pool lends for as long as they run; with suffix
        drafts, its output (all of it, or what was decoded before its steps were closed) then enters the
        engine's store of recent answers.  A request that fails inside a step empties the runners' caches:
        a forward or a token tree it left half done must not reach the next request's prefix reuse (steps
        closed between two steps leave them consistent, and reusable)."""
        output: list[int] = []
        try:
            with self.pool.lease(config) as lease:
                try:
                    for decoded_steps, step in enumerate(self._decode(lease, prompt_ids, condition, config, drafting, grammar)):
                        output.extend(step.tokens)
                        if step.finish_reason is not None:
                            self._check_step_costs(decoded_steps)  # the steps after the prefill's
                        yield step
                except Exception:
                    for runner in (lease.target, lease.draft):
                        if runner is not None:
                            runner.reset()
                    raise
                finally:
                    self._release(lease)
        finally:
            if self.suffix_store is not None:  # after its prompt's end (an encoder's input is not the context)
                lead = () if is_seq2seq_runner(self.target_runner) else prompt_ids
                self.suffix_store.add(output, lead)

    def memory_need(self, prompt_tokens: int, max_new_tokens: int) -> Need:
        """The memory a request of `prompt_tokens` asking for `max_new_tokens` needs from the runners this
        engine's pool lends (specdec.runtime.memory.request_need): its KV caches and its largest forward's activations."""
        target, draft = self.pool.footprints()
        return request_need(target, draft, prompt_tokens, max_new_tokens)

    def _release(self, lease: Lease) -> None:
        """After a request: its runners keep at most retain_tokens cached tokens, and a large cache freed goes
        back to the OS (specdec.runtime.memory.return_freed_memory)."""
        if self.retain_tokens is None:
            return
        freed = sum(runner.trim(self.retain_tokens) for runner in (lease.target, lease.draft) if runner is not None)
        if freed >= TRIM_RETURN_BYTES:
            return_freed_memory()

    def _decode(self, lease: Lease, prompt_ids: list[int], condition: StopCondition, config: RequestConfig,
                drafting: bool, grammar: Any = None) -> Iterator[Step]:
        sampling = config.sampling
        # the most the caches will hold: the runners that preallocate theirs size them once (ModelRunner.expect)
        for runner in (lease.target, lease.draft if drafting else None):
            if runner is not None:
                runner.expect(len(prompt_ids) + config.max_new_tokens + DRAFT_ROWS)
        drafter = (self.make_drafter(sampling, config.draft_mode, config.draft_confidence, draft_runner=lease.draft,
                                     target_runner=lease.target) if drafting else None)
        k = lease.controller(config.k, sampling) if drafter is not None else 1
        target = lease.target if config.verify != "stairs" else self.verification_target(config.verify, sampling)
        if is_seq2seq_runner(lease.target):  # the prompt is the encoders' input
            self._set_sources(prompt_ids)
            prompt_ids = lease.target.decoder_prompt()
        return decode(target, prompt_ids, condition, drafter=drafter, num_speculative_tokens=k,
                      verifier=make_verifier(sampling, block=config.verify == "block"), tree=config.tree_shape,
                      reuse_prefix=self.prefix_cache, processor=config.processor(grammar), logprobs=config.logprobs)

    def stop_condition(self, max_new_tokens: int, stop: Sequence[str] = ()) -> StopCondition:
        """When a request ends: max_new_tokens, the target's end-of-sequence tokens, stop strings."""
        return StopCondition(max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids,
                             stop_strings=tuple(stop), decode=self.decode_text)

    def _set_sources(self, source: Sequence[int] | None = None) -> None:
        """Run the encoder of the target and of the draft, where they are encoder-decoder models, over
        `source`; None: only where no source is set yet, over the decoder start token (a stand-in
        for timing the decoder, see auto_controller)."""
        for runner in (self.target_runner, self.draft_runner):
            if is_seq2seq_runner(runner) and (source is not None or runner.source is None):
                runner.set_source(source if source is not None else runner.decoder_prompt())

    def verification_target(self, verify: str, sampling: SamplingParams) -> ModelRunner:
        """The runner the loop verifies with: the target itself, or its stairs view (specdec.algorithm.stairs)."""
        if check_verify_mode(verify, sampling.greedy) != "stairs":
            return self.target_runner
        if self._stairs is None:
            self._stairs = stairs_runner(self.target_runner)
        return self._stairs

    def generate(self, prompt: str | Sequence[int], config: RequestConfig | None = None, **options: Any) -> Result:
        """Run a request to the end; config and options as for :meth:`stream`."""
        config = RequestConfig.from_options(config, **options)
        return self.generate_from(self.stream(prompt, config), config.stop)

    def generate_from(self, steps: Generator[Step, None, None], stop: Sequence[str] = ()) -> Result:
        """Run already-created decode steps to the end and build the Result."""
        try:
            out = collect(steps)
        finally:
            steps.close()  # the runners go back to the pool now, not when the steps are collected as garbage
        text = cut_at_stop(self.decode_text(out.token_ids), stop)
        return Result(text, out.token_ids, out.finish_reason, out.stats, out.logprobs)
