"""The Engine: a loaded target (and optional draft) ready to generate text.

It turns text into token ids (optionally through the target's chat template),
builds the strategy objects for a request — a drafter, a verifier, a stop
condition — and runs the one decode loop of :mod:`specdec.loop`.  The CLI,
the Python API and the benchmark all go through here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.backends.base import ModelRunner
from specdec.backends import lean
from specdec.backends.hf import HFRunner
from specdec.backends.lean import LeanRunner
from specdec.backends.seq2seq import Seq2SeqRunner, is_seq2seq
from specdec.bridge import TextBridge, VocabularyMap
from specdec.control import AUTO, AutoK, Controller, Costs, parse_speculation
from specdec.drafters.base import Drafter
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookup import LookupDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.universal import UniversalDrafter
from specdec.errors import IncompatibleDraftError, SpecdecError
from specdec.loop import Stats, Step, StopCondition, collect, decode
from specdec.sampling import SamplingParams
from specdec.stairs import StairsRunner, check_verify_mode, stairs_runner
from specdec.verify import make_verifier
from specdec.vocab import same_vocabulary

# A name, or a loaded (transformers model or ModelRunner, tokenizer) pair.
ModelSpec = str | tuple[Any, PreTrainedTokenizerBase]
BACKENDS = ("hf", "llamacpp")
LOOKUP = "lookup"  # the draft name for prompt lookup (no draft model)
MAX_AUTO_K = 8  # the most tokens the controller drafts in one step


AUTO_BACKEND = "auto"  # the draft's backend: llama.cpp where it can run the draft, else the target's


def fastest_draft_backend(draft: ModelSpec | None, backend: str) -> str:
    """The draft backend "auto" stands for: llama.cpp when llama-cpp-python is installed and the draft is
    a GGUF (a zoo name or a .gguf file): the 0.5B drafts a token in 44 ms there against 75 ms in
    transformers int8 (2-core AMD EPYC, Zen 1) and ~160 ms in fp32 (Zen 3), and a draft's numerics never
    change the output.  Otherwise the target's backend."""
    from specdec.loading import llamacpp_can_run

    return "llamacpp" if backend != "llamacpp" and llamacpp_can_run(draft) else backend


INT4_ZOO_ARCHS = ("llama", "qwen2", "mistral", "gemma3")  # zoo (GGUF) architectures lean runs as int4 drafts


def fastest_spec_draft_dtype(draft: ModelSpec | None, backend: str, device: str) -> str | None:
    """The draft dtype the draft backend "auto" means on specdec's own kernels, or None for llama.cpp.

    Only for a transformers target on the CPU and a zoo draft (decoder-only models that int8 runs; a
    directory or hub model may be an encoder-decoder one, so those keep llama.cpp), as measured with
    `specdec profile` (a draft's numerics never change the output):
    - "int8" on CPUs where the int8 kernel multiplies with AVX-512 VNNI: the 0.5B drafts a token in
      28.6 ms against 45.2 ms on llama.cpp (2-core Xeon);
    - "int4" on other CPUs with AVX2, for the drafts lean runs in int4 (llama family, Gemma 3): in
      the Q4_1-like format (kernels/int4_linear.c), with the layers in one C call, on a 2-core AMD
      EPYC (Zen 3), ms per drafted token / per 64-token catch-up against llama.cpp's in the same
      process: smollm2-135m 10.5 / 175 against 17.7 / 421, the 0.5B 25.2 / 464 against 47.4 / 1111,
      gemma3-270m 13.5 / 188 against 25.1 / 309 (benchmarks/runs/int4-q41-zen3/)."""
    if backend != "hf" or device != "cpu" or not isinstance(draft, str):
        return None
    from specdec import zoo
    from specdec.loading import resolve

    try:
        kind, location = resolve(draft)
        if kind != "zoo":
            return None
        from specdec.backends import kernel

        isa = kernel.isa()
    except SpecdecError:  # no C compiler for the kernel, or a name that loading will report
        return None
    if isa == "avx512-vnni":
        return "int8"
    entry = zoo.get(location)
    if isa == "avx2" and entry.arch in INT4_ZOO_ARCHS:
        return "int4"
    return None


def int4_draft_backend(draft_backend: str | None, draft_dtype: str | None) -> str | None:
    """The draft's backend given its dtype: an int4 draft runs on specdec's int4 kernel, on the
    transformers side ("hf"; a SpecdecError for llama.cpp); other dtypes leave it as it is."""
    if draft_dtype != "int4":
        return draft_backend
    if draft_backend not in (None, AUTO_BACKEND, "hf"):
        raise SpecdecError("--draft-dtype int4 runs the draft on specdec's int4 kernel: use --draft-backend hf")
    return "hf"


def split_lookup(draft: ModelSpec | None) -> tuple[bool, ModelSpec | None]:
    """(whether prompt lookup drafts, the draft model or None) of a drafter spec: "lookup" -> (True,
    None), "lookup+<model>" (a hybrid) -> (True, model), anything else -> (False, it)."""
    if not (isinstance(draft, str) and (draft.lower() == LOOKUP or draft.lower().startswith(LOOKUP + "+"))):
        return False, draft
    rest = draft[len(LOOKUP) + 1:].strip()  # "lookup+<model>": a hybrid with that draft model
    if draft.lower() != LOOKUP and not rest:
        raise SpecdecError("'lookup+' needs a draft model after the '+', e.g. lookup+qwen2.5-coder-0.5b")
    return True, rest or None


def resolve_draft(draft: ModelSpec | None, backend: str, draft_backend: str | None, draft_dtype: str | None,
                  device: str = "cpu") -> tuple[str, str, str | None]:
    """(target's backend, draft's backend, draft's dtype) as Engine.load will load them: an int4 draft on
    specdec's kernel; the draft backend "auto" with a draft dtype given: transformers (a dtype is a
    transformers model's); with none: the draft on specdec's int8 / int4 kernel where that is fastest
    (fastest_spec_draft_dtype), else llama.cpp where it can run the draft, else the target's backend.
    `draft` is the draft model (without a "lookup+" prefix)."""
    draft_backend = int4_draft_backend(draft_backend, draft_dtype)
    if draft_backend == AUTO_BACKEND and draft_dtype is not None and backend == "hf":
        draft_backend = "hf"  # a dtype is a transformers model's: the user asked for the draft there
    if draft_backend == AUTO_BACKEND and draft_dtype is None:
        draft_dtype = fastest_spec_draft_dtype(draft, backend, device)
        if draft_dtype is not None:
            draft_backend = "hf"
    backend, draft_backend = resolve_backends(backend, draft_backend, draft)
    return backend, draft_backend, draft_dtype


def resolve_backends(backend: str, draft_backend: str | None, draft: ModelSpec | None = None) -> tuple[str, str]:
    """(target's, draft's) backend, the draft's defaulting to the target's ("auto": see
    fastest_draft_backend); a SpecdecError names an unknown one."""
    if draft_backend == AUTO_BACKEND:
        draft_backend = fastest_draft_backend(draft, backend)
    draft_backend = draft_backend or backend
    for b in (backend, draft_backend):
        if b not in BACKENDS:
            raise SpecdecError(f"unknown backend '{b}': expected one of {', '.join(BACKENDS)}")
    return backend, draft_backend


# How the draft model drafts: "same" (shared tokenizer: ids are used as they
# are), "text" (another tokenizer: proposals cross over as text, verified
# without q), "intersection" (another tokenizer: the draft is restricted to the
# shared tokens and its q is used).  "auto" = "same" when the vocabularies are
# identical, else "text".
DRAFT_MODES = ("auto", "same", "text", "intersection")


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: Stats

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


def as_runner(model: PreTrainedModel | ModelRunner) -> ModelRunner:
    """A ModelRunner for `model`: a runner as it is; for a transformers model, a Seq2SeqRunner when it
    is an encoder-decoder model (T5, BART), a LeanRunner when it is an int8 llama-family model (the
    same numbers, less overhead), else an HFRunner."""
    if isinstance(model, PreTrainedModel):
        if is_seq2seq(model):
            return Seq2SeqRunner(model)
        return LeanRunner(model) if lean.supports(model) else HFRunner(model)
    if isinstance(model, ModelRunner):
        return model
    raise TypeError(f"expected a transformers model or a ModelRunner, got {type(model).__name__}")


def check_seq2seq_pair(target: ModelRunner, draft: ModelRunner | None, same_vocab: bool,
                       target_name: str = "target", draft_name: str = "draft") -> None:
    """Refuse a draft model across the encoder-decoder divide: an encoder-decoder target drafts with an
    encoder-decoder draft of the same vocabulary (its decoder drafts over the same source), a
    decoder-only target with a decoder-only draft.  Prompt lookup works with either."""
    if draft is None:
        return
    target_s2s, draft_s2s = isinstance(target, Seq2SeqRunner), isinstance(draft, Seq2SeqRunner)
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


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """Text up to (not including) the first stop string, as OpenAI-style APIs return it."""
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
    return text[:cut]


class TextStream:
    """Turns a growing list of token ids into text deltas that are safe to print.

    Holds back a trailing partial UTF-8 character, and the last few characters
    that might be the start of a stop string, until they are known.
    """

    def __init__(self, decode_fn: Callable[[Sequence[int]], str], stop_strings: Sequence[str] = ()) -> None:
        self.decode_fn = decode_fn
        self.stop_strings = tuple(stop_strings)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.printed = 0

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        self.token_ids.extend(tokens)
        text = cut_at_stop(self.decode_fn(self.token_ids), self.stop_strings)
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character
            text = text[: max(self.printed, len(text) - self.hold)]
        delta = text[self.printed :]
        self.printed = len(text)
        return delta


class Engine:
    """A target model and an optional draft model (any tokenizer, any backend), ready for requests.

    `target` and `draft` are each a transformers model (run by an HFRunner) or
    a ready ModelRunner (e.g. a LlamaCppRunner), each with its own tokenizer.

    An encoder-decoder target (T5, BART: specdec.backends.seq2seq) reads the prompt with its encoder
    and the loop runs its decoder; it drafts with an encoder-decoder draft of the same vocabulary,
    or with prompt lookup, which looks up in the decoder's output so far (not in the prompt).
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
    ) -> None:
        # lookup: draft by prompt lookup (specdec.drafters.lookup); with a draft model too, by
        # lookup where it matches and the draft model elsewhere (specdec.drafters.hybrid)
        self.lookup = lookup
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
        self._measured_costs: Costs | None = None
        self._stairs: StairsRunner | None = None
        self.dtype = "as loaded"  # the target's dtype, as Engine.load resolved it ("gguf" on llama.cpp)
        self.draft_dtype = "as loaded" if draft is not None else None  # the draft model's, likewise

    def speculation(self, k: int | str | Controller, sampling: SamplingParams | None = None) -> int | Controller:
        """A draft length for the loop: an int γ as it is, a Controller as it is, or "auto": this
        engine's cost-model controller (specdec.control.AutoK; its costs measured on first use and
        cached on disk, see specdec.profile.step_costs; what it learns carries over between requests).

        A seeded sampled request gets a controller of its own instead, started afresh from the
        measured costs and never updated from timings: a seed's text depends on which tokens were
        drafted, so k must depend on nothing but the seed and the tokens (the same seed then gives
        the same text, run after run, whatever the machine's load)."""
        if isinstance(k, Controller):
            return k
        try:
            parsed = parse_speculation(k)
        except SpecdecError as e:
            raise SpecdecError(f"the number of speculative tokens {e}") from None
        if parsed != AUTO:
            return parsed
        shared = self.auto_controller()
        if sampling is not None and not sampling.greedy and sampling.seed is not None:
            return AutoK(replace(self._measured_costs), max_k=shared.max_k, cost_ewma=0.0)
        return shared

    def auto_controller(self) -> AutoK:
        """The engine's controller for `-k auto` (measures the step costs the first time, seconds)."""
        if self._auto is None:
            from specdec.profile import step_costs
            from specdec.zoo import home

            self._set_sources()  # an encoder-decoder model is timed over a stand-in source
            costs = step_costs(self.target_runner, self.draft_runner, MAX_AUTO_K, lookup=self.lookup,
                               cache_dir=home() / "profiles")
            self._measured_costs = replace(costs)  # as measured, before any online update
            self._auto = AutoK(costs, max_k=MAX_AUTO_K)
        return self._auto

    def resolve_draft_mode(self, mode: str = "auto") -> str:
        """The concrete drafting mode for `mode` with this pair of models."""
        if mode not in DRAFT_MODES:
            raise SpecdecError(f"unknown draft mode '{mode}': expected one of {', '.join(DRAFT_MODES)}")
        if mode in ("text", "intersection") and isinstance(self.target_runner, Seq2SeqRunner):
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
    def can_draft(self) -> bool:
        """Whether requests can be speculative: a draft model, or prompt lookup."""
        return self.lookup or self.draft_runner is not None

    def make_drafter(self, sampling: SamplingParams, mode: str = "auto", confidence: float | None = None,
                     draft_runner: ModelRunner | None = None) -> Drafter | None:
        """The drafter for one request, or None without a draft model or lookup.  confidence: the
        draft model stops after a token it gave less probability (None: it drafts all k).
        draft_runner: the draft model's runner to use (default: the engine's; a batch gives each
        request its own cache over the same model)."""
        if confidence is not None and not 0 < confidence < 1:
            raise SpecdecError(f"the draft confidence must be between 0 and 1, got {confidence}")
        if self.draft_runner is None:
            return LookupDrafter() if self.lookup else None
        model = self._model_drafter(sampling, mode, confidence, draft_runner or self.draft_runner)
        return HybridDrafter(model) if self.lookup else model

    def _model_drafter(self, sampling: SamplingParams, mode: str, confidence: float | None,
                       runner: ModelRunner) -> Drafter:
        mode = self.resolve_draft_mode(mode)
        if mode == "same":
            return ModelDrafter(runner, sampling, target_vocab_size=self.target_runner.vocab_size,
                                confidence=confidence)
        if self._bridge is None:
            self._bridge = TextBridge(self.tokenizer, self.draft_tokenizer)
        if mode == "intersection" and self._vocab_map is None:
            self._vocab_map = VocabularyMap.from_tokenizers(
                self.tokenizer, self.draft_tokenizer, self.target_runner.vocab_size, self.draft_runner.vocab_size
            )
        vocab_map = self._vocab_map if mode == "intersection" else None
        return UniversalDrafter(runner, self._bridge, sampling, vocab_map, confidence=confidence)

    @classmethod
    def load(
        cls,
        target: ModelSpec,
        draft: ModelSpec | None = None,
        dtype: str = "auto",
        progress: Callable[[str, int, int], None] | None = None,
        backend: str = "hf",
        draft_backend: str | None = AUTO_BACKEND,
        n_ctx: int | None = None,
        threads: int | None = None,
        draft_dtype: str | None = None,
        device: str = "cpu",
    ) -> "Engine":
        """Load models by name (zoo name, .gguf path, model directory, hub id) or take loaded ones.

        draft: a model, "lookup" for prompt lookup drafting (no draft model), or "lookup+<model>":
        prompt lookup where it matches and the draft model elsewhere.
        dtype: the target's, for transformers models: "fp32", "bf16", "int8", or "auto" (the
        default: int8 on CPUs where specdec's int8 kernel runs, fp32 elsewhere; see
        specdec.loading.fastest_dtype); the engine's `dtype` says which it took.
        backend / draft_backend: "hf" (transformers, in `dtype`) or "llamacpp" (the GGUF
        through llama.cpp; zoo names and .gguf files only); the draft's defaults to the
        target's; "auto": llama.cpp where it can run the draft (fastest_draft_backend), except
        on CPUs where a draft on specdec's int8 or int4 kernel is faster
        (fastest_spec_draft_dtype; when draft_dtype is not given).
        n_ctx / threads: llama.cpp's context size (default DEFAULT_N_CTX) and CPU threads
        (default: all the process may use).  A llama.cpp target is loaded in exact mode (batch-invariant logits), a llama.cpp draft in
        llama.cpp's fastest mode (a draft's numerics never change the output).
        draft_dtype: a transformers draft's dtype (default: `dtype`); a bf16 draft for an
        fp32 target halves the draft's cost and leaves the output as it is; "int4" (drafts only,
        llama-family and Gemma 3 models) runs the draft's int8 weights requantized to 4 bits on specdec's int4
        kernel (specdec.backends.int4), a cheaper draft token for the same output.
        device: where transformers models run: "cpu", "cuda" or "auto" (cuda when available).
        """
        from specdec.loading import (AUTO_DTYPE, INT4, check_spec, fastest_dtype, load_hf, load_int4_draft,
                                     load_llamacpp, resolve_device)

        lookup, draft = split_lookup(draft)
        auto = dtype == AUTO_DTYPE
        if auto:
            dtype = fastest_dtype(target, backend, device)
        if dtype == INT4:
            raise SpecdecError("int4 is a draft's dtype only (--draft-dtype int4): a target's numbers are its "
                               "output, and int4 weights would change them")
        backend, draft_backend, draft_dtype = resolve_draft(draft, backend, draft_backend, draft_dtype, device)
        if auto and draft_dtype is None and draft is not None:
            draft_dtype = fastest_dtype(draft, draft_backend, device)  # "auto" for the draft on its own
        for which, d, spec in ((backend, dtype, target), (draft_backend, draft_dtype or dtype, draft)):
            if which == "hf" and spec is not None:
                resolve_device(device, d)  # a bad device / dtype pair is refused before any load
        for spec, which in ((target, backend), (draft, draft_backend)):
            if isinstance(spec, str):
                check_spec(spec, which)  # every name checked before anything is loaded

        def get(spec: ModelSpec, which: str, exact: bool, dtype: str) -> tuple[Any, PreTrainedTokenizerBase, str]:
            if isinstance(spec, tuple):
                model, tok = spec
                config = getattr(model, "config", None)
                return model, tok, getattr(config, "_name_or_path", "") or type(model).__name__
            if which == "llamacpp":
                runner, tok = load_llamacpp(spec, n_ctx=n_ctx, exact=exact, progress=progress, n_threads=threads)
                return runner, tok, spec
            if dtype == INT4:
                runner, tok = load_int4_draft(spec, progress=progress)
                return runner, tok, spec
            model, tok = load_hf(spec, dtype=dtype, progress=progress, device=device)
            return model, tok, spec

        t_model, t_tok, t_name = get(target, backend, exact=True, dtype=dtype)
        if draft is None:
            engine = cls(t_model, t_tok, target_name=t_name, draft_name=LOOKUP if lookup else "draft", lookup=lookup)
        else:
            d_model, d_tok, d_name = get(draft, draft_backend, exact=False, dtype=draft_dtype or dtype)
            engine = cls(t_model, t_tok, d_model, d_tok, target_name=t_name,
                         draft_name=f"{LOOKUP}+{d_name}" if lookup else d_name, lookup=lookup)
        engine.dtype = dtype if backend == "hf" else "gguf"
        if draft is not None:
            engine.draft_dtype = (draft_dtype or dtype) if draft_backend == "hf" else "gguf"
        return engine

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (or ids) -> token ids, through the chat template when chat=True."""
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            raise SpecdecError("the prompt is empty: give some text to continue")
        if chat:
            return self.encode_messages([("user", prompt)])
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_messages(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """A conversation, (role, content) pairs ending with the pending user turn -> token ids
        through the chat template, with the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpecdecError(f"target '{self.target_name}' has no chat template; drop --chat")
        ids = self.tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages], add_generation_prompt=True,
            tokenize=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def decode_text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        num_speculative_tokens: int | str | Controller = AUTO,
        use_draft: bool = True,
        stop: Sequence[str] = (),
        chat: bool = False,
        sampling: SamplingParams | None = None,
        draft_mode: str = "auto",
        draft_confidence: float | None = None,
        verify: str = "causal",
    ) -> Iterator[Step]:
        """Decode steps for one request (see :func:`specdec.loop.decode`).

        num_speculative_tokens: a fixed γ, "auto" (the cost-model controller), or a Controller.
        draft_confidence: the draft model stops drafting after a token it gave less probability
        (an optional early stop; None: it drafts the k it is asked for).
        verify: "causal" (the draft checked by one target forward over its tokens) or "stairs"
        (the target asked only for next-token predictions on a staircase of prefixes,
        specdec.stairs; greedy only).
        """
        sampling = sampling or SamplingParams()
        target = self.verification_target(verify, sampling)
        prompt_ids = self.encode(prompt, chat=chat)
        condition = self.stop_condition(max_new_tokens, stop)
        drafter = self.make_drafter(sampling, draft_mode, draft_confidence) if use_draft else None
        source = None
        if isinstance(self.target_runner, Seq2SeqRunner):  # the prompt is the encoder's input
            source, prompt_ids = prompt_ids, self.target_runner.decoder_prompt()
        steps = decode(
            target,
            prompt_ids,
            condition,
            drafter=drafter,
            num_speculative_tokens=self.speculation(num_speculative_tokens, sampling) if drafter is not None else 1,
            verifier=make_verifier(sampling),
        )
        return steps if source is None else self._encoded(source, steps)

    def stop_condition(self, max_new_tokens: int, stop: Sequence[str] = ()) -> StopCondition:
        """When a request ends: max_new_tokens, the target's end-of-sequence tokens, stop strings."""
        return StopCondition(max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids,
                             stop_strings=tuple(stop), decode=self.decode_text)

    def _encoded(self, source: list[int], steps: Iterator[Step]) -> Iterator[Step]:
        """An encoder-decoder request's `steps`, its encoders run over `source` when the first step is
        asked for (not before: the runners serve whichever request decodes now)."""
        self._set_sources(source)
        yield from steps

    def _set_sources(self, source: Sequence[int] | None = None) -> None:
        """Run the encoder of the target and of the draft, where they are encoder-decoder models, over
        `source`; None: only where no source is set yet, over the decoder start token (a stand-in
        for timing the decoder, see auto_controller)."""
        for runner in (self.target_runner, self.draft_runner):
            if isinstance(runner, Seq2SeqRunner) and (source is not None or runner.source is None):
                runner.set_source(source if source is not None else runner.decoder_prompt())

    def verification_target(self, verify: str, sampling: SamplingParams) -> ModelRunner:
        """The runner the loop verifies with: the target itself, or its stairs view (specdec.stairs)."""
        if check_verify_mode(verify, sampling.greedy) == "causal":
            return self.target_runner
        if self._stairs is None:
            self._stairs = stairs_runner(self.target_runner)
        return self._stairs

    def generate(self, prompt: str | Sequence[int], **options: Any) -> Result:
        """Run a request to the end; options as for :meth:`stream`."""
        return self.generate_from(self.stream(prompt, **options), options.get("stop", ()))

    def generate_from(self, steps: Iterable[Step], stop: Sequence[str] = ()) -> Result:
        """Run already-created decode steps to the end and build the Result."""
        out = collect(steps)
        text = cut_at_stop(self.decode_text(out.token_ids), stop)
        return Result(text, out.token_ids, out.finish_reason, out.stats)
