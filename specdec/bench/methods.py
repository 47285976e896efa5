"""The decoding methods the benchmark compares, each an object with ``name`` and ``run(prompt_ids)``.

All methods share one loaded :class:`~specdec.runtime.engine.Engine` — the same target
and draft weights in the same dtype — so they differ only in the decoding
algorithm:

============= ===================================================================
plain         our loop with no drafter (autoregressive greedy: the reference)
specdec       our loop with the draft model, γ draft tokens per step
specdec-auto  our loop with the draft model, k chosen each step by the cost-model
              controller (specdec.algorithm.control; 0 = a plain step)
specdec-tree  specdec-auto with token trees (``--tree auto``: the drafter's runner-ups
              and lookup's other matches verified in the same forward; specdec.drafters.tree)
specdec-stairs our loop with γ draft tokens per step verified by stairs
              (specdec.algorithm.stairs: next-token queries on a staircase of prefixes; greedy)
hf            transformers' assisted generation with the same draft model, a
              constant γ (``num_assistant_tokens=γ``, schedule ``"constant"``,
              confidence-based early stop off), greedy
hf-auto       transformers' assisted generation as it comes out of the box: the
              draft model's own generation config, i.e. transformers' defaults
              (20 tokens, constant schedule, confidence threshold 0.4)
hf-plain      transformers' ``generate`` without an assistant, greedy
hf-pld        transformers' prompt lookup decoding (``prompt_lookup_num_tokens=γ``)
llamacpp      plain greedy decoding of the target's GGUF through llama.cpp in its
              fastest mode (weight repacking, tiled GEMMs): what a CPU user would
              otherwise run.  Its own numerics, so its output may differ from
              ``plain``'s on near-ties.
============= ===================================================================

Every run is timed by the harness around the whole call (``time.perf_counter``),
for our methods and transformers' alike.  Token ids are those generated after
the prompt (an end-of-sequence token that ends generation included, as
transformers' ``generate`` returns it).

transformers 5.24 reads ``num_assistant_tokens``,
``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold`` from
the **assistant model's** ``generation_config``, not from ``generate()``'s
keyword arguments (those are accepted and silently ignored for a draft model).
:class:`HFAssisted` therefore sets them on the draft model's generation config
for the duration of each call, then restores them.  Draft statistics for the hf
methods are observed through the candidate generator's
``update_candidate_strategy(input_ids, scores, num_matches)`` hook (private
transformers API; when it is missing they are reported as unavailable).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from specdec.algorithm.loop import Stats
from specdec.algorithm.sampling import SamplingParams
from specdec.drafters.spec import DrafterSpec, parse_drafter, split_drafter
from specdec.engine_config import HF, LLAMACPP
from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdec.runtime.engine import Engine

DEFAULT_GAMMA = 5


@dataclass
class Measurement:
    """One timed generation.  Draft counts are None where a method cannot report them."""

    token_ids: list[int]  # generated after the prompt
    wall_s: float = 0.0  # seconds, the whole call
    target_forwards: int | None = None  # target forward passes, prefill included
    drafted: int | None = None  # draft tokens proposed
    accepted: int | None = None  # draft tokens accepted
    draft_steps: int | None = None  # steps that verified at least one draft token
    proposed_at: list[int] | None = None  # [i]: steps that proposed a draft token at position i
    accepted_at: list[int] | None = None  # [i]: steps whose draft token at position i was accepted
    plain_steps: int | None = None  # one-token steps after the prefill (our loop: k = 0 chosen)
    draft_s: float | None = None  # seconds in the drafter (our loop)
    steps: list[list[float]] | None = None  # our loop: [draft tokens, tokens emitted, seconds] per step
    by_source: dict[str, list[int]] | None = None  # our loop: {draft source: [draft steps, drafted, accepted]}
    reused_prompt_tokens: int | None = None  # our loop: the prompt's first tokens taken from the cache (prefix reuse)
    tree_steps: int | None = None  # our loop: draft steps that verified a token tree
    tree_nodes: int | None = None  # our loop: draft tokens those trees held
    first_token_s: float | None = None  # seconds to the first output: the prompt's prefill (None: not reported)
    first_tokens: int = 1  # the tokens that first output held (transformers' assisted generation: a step's)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The tokens after the first output per second after it (decoding without the prefill); None when
        the time to the first output is not known or nothing followed it."""
        if self.first_token_s is None or self.new_tokens <= self.first_tokens or self.wall_s <= self.first_token_s:
            return None
        return (self.new_tokens - self.first_tokens) / (self.wall_s - self.first_token_s)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted and self.accepted is not None else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Mean draft tokens accepted per verified draft."""
        if self.accepted is None or not self.draft_steps:
            return None
        return self.accepted / self.draft_steps

    @property
    def tokens_per_target_forward(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def per_position_acceptance(self) -> list[float] | None:
        if self.proposed_at is None or self.accepted_at is None:
            return None
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "draft_steps": self.draft_steps,
            "proposed_at": self.proposed_at,
            "accepted_at": self.accepted_at,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_per_step": self.mean_accepted_per_step,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "per_position_acceptance": self.per_position_acceptance,
            "plain_steps": self.plain_steps,
            "draft_s": self.draft_s,
            "steps": self.steps,
            "by_source": self.by_source,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "tree_steps": self.tree_steps,
            "tree_nodes": self.tree_nodes,
            "first_token_s": self.first_token_s,
            "first_tokens": self.first_tokens,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "token_ids": self.token_ids,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        keys = ("wall_s", "target_forwards", "drafted", "accepted", "draft_steps", "proposed_at", "accepted_at",
                "plain_steps", "draft_s", "steps", "by_source", "reused_prompt_tokens", "tree_steps", "tree_nodes",
                "first_token_s")
        values: dict[str, Any] = {k: d.get(k) for k in keys}  # JSON, as to_dict wrote it
        return cls(token_ids=list(d["token_ids"]), first_tokens=d.get("first_tokens", 1), **values)


class DraftCounter(Stats):
    """Per-step draft outcomes of transformers' assisted generation, counted as our loop's Stats."""

    @property
    def forwards(self) -> int:
        """Target forwards observed."""
        return self.target_forwards

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One verification forward that checked `num_drafted` candidates and kept `num_accepted`."""
        self.target_forwards += 1
        if num_drafted > 0:  # else a plain step (e.g. prompt lookup found no match)
            self.record_draft(num_drafted, num_accepted)


class Method(ABC):
    """A decoding strategy under test.  ``run`` generates after `prompt_ids` and times it."""

    family: str = ""  # the method's name without its γ ("specdec", "hf", ...)
    uses_gamma: bool = False  # whether it takes a draft length γ (and is swept over --gammas)
    needs_draft: bool = False  # whether it needs a drafter (a draft model or prompt lookup)
    needs_draft_model: bool = False  # whether it needs a draft model itself
    needs_hf: tuple[str, ...] = ()  # models ("target", "draft") that must be loaded with transformers

    def __init__(self, engine: Engine, max_new_tokens: int, gamma: int | None = None, name: str | None = None,
                 sampling: SamplingParams | None = None) -> None:
        if self.needs_draft and not engine.can_draft:
            raise SpecdecError(f"method '{self.family}' needs a draft model: give --draft")
        if self.needs_draft_model and engine.draft_runner is None:
            raise SpecdecError(f"method '{self.family}' needs a draft model (not prompt lookup): give --draft")
        self.engine = engine
        self.sampling = sampling or SamplingParams()  # greedy unless a temperature is given
        self.base_seed = self.sampling.seed
        self.max_new_tokens = max_new_tokens
        self.gamma = gamma if self.uses_gamma else None
        self.name = name or self.family

    def run(self, prompt_ids: Sequence[int]) -> Measurement:
        """Generate greedily after `prompt_ids`; the Measurement's wall_s covers the whole call."""
        start = time.perf_counter()
        measurement = self.generate(list(prompt_ids))
        measurement.wall_s = time.perf_counter() - start
        return measurement

    @abstractmethod
    def generate(self, prompt_ids: list[int]) -> Measurement:
        """The untimed generation (``run`` times it)."""

    def start_repeat(self, repeat: int) -> None:
        """Repeat r of a sampled run draws with seed + r (every method of the repeat the same seed): the
        medians over ``--repeats`` are then over as many samples of each prompt, not one sample timed again.
        Greedy decoding, and a sampled run without a seed, are left as they are."""
        if not self.sampling.greedy and self.base_seed is not None:
            self.sampling = replace(self.sampling, seed=self.base_seed + repeat)

    def before_session(self) -> None:
        """Called before a session's first turn (and before every one-turn prompt): the method's
        engine forgets what its drafters learned from earlier requests (:meth:`Engine.forget`: the
        suffix drafts' store of answers), so a session's turns learn from that session's earlier turns
        only, and no run drafts from its own earlier repeat."""
        self.engine.forget()

    def close(self) -> None:  # noqa: B027 -- an optional hook: most methods hold nothing to release
        """Release what the method holds beyond the run (a peer's server process)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, gamma={self.gamma})"


# --- our loop -----------------------------------------------------------------------------------


class Plain(Method):
    """Our decode loop without a drafter: one target forward per token."""

    family = "plain"

    def generate(self, prompt_ids: list[int]) -> Measurement:
        result = self.engine.generate(prompt_ids, max_new_tokens=self.max_new_tokens, use_draft=False,
                                      sampling=self.sampling)
        return Measurement(result.token_ids, target_forwards=result.stats.target_forwards,
                           steps=result.stats.step_records(), reused_prompt_tokens=result.stats.reused_prompt_tokens,
                           first_token_s=result.stats.prefill_s)


class PlainInt8(Plain):
    """Plain decoding of the same target in specdec's int8 (its own engine: the int8 copy of the model), beside
    a run of another dtype: what specdec's default target was before the gguf target (a peer: its numbers,
    hence its text, are int8's)."""

    family = "int8-plain"

    def __init__(self, engine: Engine, max_new_tokens: int, gamma: int | None = None, name: str | None = None,
                 sampling: SamplingParams | None = None) -> None:
        from specdec.runtime.engine import Engine

        super().__init__(engine, max_new_tokens, gamma, name, sampling)
        if not isinstance(engine.target_name, str):
            raise SpecdecError("method int8-plain needs the target by name (a zoo name, .gguf, directory or hub id)")
        self.engine = Engine.load(engine.target_name, None, dtype="int8")


class Specdec(Method):
    """Our decode loop with the draft model proposing γ tokens per step (draft mode chosen automatically)."""

    family = "specdec"
    uses_gamma = True
    needs_draft = True
    draft_mode = "auto"
    verify = "causal"
    tree = "off"

    def generate(self, prompt_ids: list[int]) -> Measurement:
        result = self.engine.generate(
            prompt_ids, max_new_tokens=self.max_new_tokens, num_speculative_tokens=self.k(), use_draft=True,
            draft_mode=self.draft_mode, sampling=self.sampling, verify=self.verify, tree=self.tree,
        )
        s = result.stats
        return Measurement(
            result.token_ids,
            target_forwards=s.target_forwards,
            drafted=s.drafted,
            accepted=s.accepted,
            draft_steps=s.draft_steps,
            proposed_at=list(s.proposed_at),
            accepted_at=list(s.accepted_at),
            plain_steps=s.plain_steps,
            draft_s=s.draft_s,
            steps=s.step_records(),
            by_source={source: list(counts) for source, counts in s.by_source.items()},
            reused_prompt_tokens=s.reused_prompt_tokens,
            tree_steps=s.tree_steps,
            tree_nodes=s.tree_nodes,
            first_token_s=s.prefill_s,
        )

    def k(self) -> int | str:
        assert self.gamma is not None
        return self.gamma


class SpecdecAuto(Specdec):
    """Our decode loop with the cost-model controller choosing k (0..24) each step (`-k auto`)."""

    family = "specdec-auto"
    uses_gamma = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine.auto_controller()  # its step costs are measured (or read from disk) now, not in a timed run

    def k(self) -> int | str:
        return "auto"


class SpecdecTree(SpecdecAuto):
    """specdec-auto drafting token trees (`-k auto --tree auto`, specdec.drafters.tree)."""

    family = "specdec-tree"
    tree = "auto"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.engine.target_runner.capabilities.tree:
            raise SpecdecError(f"method 'specdec-tree': a {self.engine.target_runner.describe()} target verifies "
                               "chains only: drop it from --methods")


class SpecdecStairs(Specdec):
    """Our decode loop with γ draft tokens per step, verified by stairs (specdec.algorithm.stairs): the target
    asked only for next-token predictions on the staircase of prefixes (greedy only)."""

    family = "specdec-stairs"
    verify = "stairs"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.sampling.greedy:
            raise SpecdecError("method 'specdec-stairs' is greedy only: drop it from --methods or drop --temperature")


class SpecdecIntersection(Specdec):
    """Universal drafting restricted to the tokens both vocabularies share (another tokenizer only)."""

    family = "specdec-intersection"
    draft_mode = "intersection"
    needs_draft_model = True


# --- transformers' generate ---------------------------------------------------------------------


@contextmanager
def observe_candidates(model: PreTrainedModel, counter: DraftCounter) -> Iterator[bool]:
    """Count draft outcomes of transformers' assisted generation on `model` while the block runs.

    Wraps the candidate generator that ``generate`` builds so that every
    ``update_candidate_strategy(input_ids, scores, num_matches)`` call — one
    per target forward, `scores` [1, candidates + 1, V] — is also recorded.
    Yields False (and counts nothing) if this transformers has no such hook.
    """
    original = getattr(type(model), "_get_candidate_generator", None)
    if original is None:
        yield False
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        generator = original(model, *args, **kwargs)
        update = generator.update_candidate_strategy

        def observed(input_ids: Any, scores: Any, num_matches: Any) -> Any:
            counter.record(int(scores.shape[1]) - 1, int(num_matches))
            return update(input_ids, scores, num_matches)

        generator.update_candidate_strategy = observed
        return generator

    model.__dict__["_get_candidate_generator"] = wrapped  # shadows the class method on this instance only
    try:
        yield True
    finally:
        model.__dict__.pop("_get_candidate_generator", None)


@contextmanager
def generation_settings(model: PreTrainedModel, **settings: Any) -> Iterator[None]:
    """Set attributes of ``model.generation_config`` for the block, then restore them."""
    config = model.generation_config
    missing = object()
    saved = {k: getattr(config, k, missing) for k in settings}
    for k, v in settings.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                delattr(config, k)
            else:
                setattr(config, k, v)


class FirstToken:
    """A streamer for transformers' ``generate`` that notes when the first new tokens come: generate hands
    it the prompt first, then the tokens of each step (assisted generation: every step's accepted ones)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.calls = 0
        self.seconds: float | None = None  # from construction to the first new tokens
        self.tokens = 1  # how many came then

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.seconds = time.perf_counter() - self.start
            self.tokens = max(int(value.numel()), 1)

    def end(self) -> None:
        pass


class HFGenerate(Method):
    """Base of the methods that call transformers' ``model.generate`` on the engine's target."""

    observes_drafts = False  # whether draft outcomes are counted through the candidate generator
    needs_hf: tuple[str, ...] = ("target",)

    def generate_kwargs(self) -> dict[str, Any]:
        """Method-specific keyword arguments for ``generate``."""
        return {}

    @contextmanager
    def settings(self) -> Iterator[None]:
        """Context the call runs in (e.g. the assistant's generation config)."""
        yield

    def generate(self, prompt_ids: list[int]) -> Measurement:
        import torch

        model = self.engine.target_runner.model
        eos = sorted(self.engine.eos_token_ids)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # [1, prompt]
        kwargs: dict[str, Any] = dict(
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=self.max_new_tokens,
            do_sample=not self.sampling.greedy,
            num_beams=1,
            # Neutralise anything a model's generation_config.json may carry
            # (transformers fills unset options from it): plain greedy only.
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else None,
            **self.generate_kwargs(),
        )
        if not self.sampling.greedy:
            kwargs.update(temperature=self.sampling.temperature, top_k=self.sampling.top_k, top_p=self.sampling.top_p)
            torch.manual_seed(self.sampling.seed or 0)
        counter = DraftCounter()
        timer = FirstToken()
        with self.settings(), observe_candidates(model, counter) as observed, torch.inference_mode():
            try:
                out = model.generate(input_ids, streamer=timer, **kwargs)  # [1, prompt + new]
            except (AttributeError, ValueError, TypeError) as e:  # a combination transformers cannot run
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise SpecdecError(f"method {self.name}: transformers' generate failed here ({reason})") from e
        token_ids = out[0, len(prompt_ids) :].tolist()
        first: dict[str, Any] = dict(first_token_s=timer.seconds, first_tokens=timer.tokens)
        if not self.observes_drafts:
            return Measurement(token_ids, target_forwards=len(token_ids), **first)  # one forward per token
        if not observed or counter.forwards == 0:
            return Measurement(token_ids, **first)
        return Measurement(
            token_ids,
            **first,
            target_forwards=counter.forwards,
            drafted=counter.drafted,
            accepted=counter.accepted,
            draft_steps=counter.draft_steps,
            proposed_at=counter.proposed_at,
            accepted_at=counter.accepted_at,
        )


class HFPlain(HFGenerate):
    """transformers' greedy ``generate`` without an assistant."""

    family = "hf-plain"


class HFAssisted(HFGenerate):
    """transformers' assisted generation with the engine's draft model and a constant γ.

    The peer of ``specdec``: same models, same γ, greedy.  The confidence
    threshold (which would stop drafting early) is switched off so that every
    step drafts γ tokens, as ours does.
    """

    family = HF
    uses_gamma = True
    needs_draft = True
    needs_draft_model = True
    needs_hf = ("target", "draft")
    observes_drafts = True

    def assistant_settings(self) -> dict[str, Any]:
        return dict(
            num_assistant_tokens=self.gamma,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,  # 0 = no confidence-based early stop
        )

    @property
    def draft_model(self) -> PreTrainedModel:
        """The draft's transformers model (needs_draft_model: the engine has one)."""
        runner = self.engine.draft_runner
        assert runner is not None
        return runner.model

    def generate_kwargs(self) -> dict[str, Any]:
        draft = self.draft_model
        kwargs: dict[str, Any] = {"assistant_model": draft}
        target_vocab = self.engine.target_runner.model.config.get_text_config().vocab_size
        if draft.config.get_text_config().vocab_size != target_vocab or not self.engine.same_vocabulary:
            # Another tokenizer — or the same tokens in a padded embedding, where
            # transformers insists on tokenizers too: its universal, re-tokenising path.
            kwargs.update(tokenizer=self.engine.tokenizer, assistant_tokenizer=self.engine.draft_tokenizer)
        return kwargs

    @contextmanager
    def settings(self) -> Iterator[None]:
        with generation_settings(self.draft_model, **self.assistant_settings()):
            yield


class HFAuto(HFAssisted):
    """transformers' assisted generation with its own defaults (no γ: the draft's generation config)."""

    family = "hf-auto"
    uses_gamma = False

    def assistant_settings(self) -> dict[str, Any]:
        return {}


class HFPromptLookup(HFGenerate):
    """transformers' prompt lookup decoding: candidates are copied from earlier n-grams of the context."""

    family = "hf-pld"
    uses_gamma = True
    observes_drafts = True

    def generate_kwargs(self) -> dict[str, Any]:
        return {"prompt_lookup_num_tokens": self.gamma}


# --- llama.cpp ----------------------------------------------------------------------------------


class LlamaCppPlain(Method):
    """Plain greedy decoding of the target's GGUF through llama.cpp (fastest kernels), a peer to beat."""

    family = LLAMACPP

    def __init__(self, engine: Engine, max_new_tokens: int, gamma: int | None = None, name: str | None = None,
                 sampling: SamplingParams | None = None, llamacpp_target: Any = None) -> None:
        super().__init__(engine, max_new_tokens, gamma, name, sampling)
        if llamacpp_target is None:
            raise SpecdecError("method llamacpp needs the target as a GGUF model (a zoo name or a .gguf file)")
        from specdec.runtime.engine import Engine

        self.peer = Engine(*llamacpp_target)

    def generate(self, prompt_ids: list[int]) -> Measurement:
        result = self.peer.generate(prompt_ids, max_new_tokens=self.max_new_tokens, use_draft=False,
                                    sampling=self.sampling)
        return Measurement(result.token_ids, target_forwards=result.stats.target_forwards,
                           first_token_s=result.stats.prefill_s)


# --- llama.cpp's own server ---------------------------------------------------------------------


class LlamaServerPlain(Method):
    """llama.cpp's own server (``llama-server``) on the target's GGUF, plain: started once for the run on
    127.0.0.1, sent the same prompt token ids through its /completion API, one request at a time
    (specdec.bench.llamaserver).  Its own numerics, like ``llamacpp``.

    An option after "@" is the family's (:meth:`server_args`): the draft tokens a step for
    ``llama-server-draft@8``, the n-gram drafter for ``llama-server-ngram@ngram-simple``."""

    family = "llama-server"
    drafts = False  # whether the server speculates

    def __init__(self, engine: Engine, max_new_tokens: int, gamma: int | None = None, name: str | None = None,
                 sampling: SamplingParams | None = None, target_gguf: Any = None, draft_gguf: Any = None,
                 option: str | None = None, threads: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(engine, max_new_tokens, gamma, name, sampling)
        from specdec.bench.llamaserver import SERVER, SERVER_CTX, LlamaServer, require_tool

        binary = require_tool(SERVER)
        if target_gguf is None:
            raise SpecdecError(f"method {self.name} needs the target as a GGUF model (a zoo name or a .gguf file)")
        import torch

        threads = threads or torch.get_num_threads()
        args = ["-m", str(target_gguf), "-t", str(threads), "-c", str(n_ctx or SERVER_CTX), "-np", "1",
                *self.server_args(option, draft_gguf)]
        self.server = LlamaServer(binary, args)
        self.command = self.server.shown_command()

    @classmethod
    def check_option(cls, option: str | None) -> None:
        """A one-line SpecdecError for an option after "@" this family does not take."""
        if option is not None:
            raise SpecdecError(f"method '{cls.family}' takes no option after '{DRAFTER_SEPARATOR}'")

    def server_args(self, option: str | None, draft_gguf: Any) -> list[str]:
        return []

    def generate(self, prompt_ids: list[int]) -> Measurement:
        answer = self.server.complete(prompt_ids, self.max_new_tokens, self.sampling)
        tokens = [int(t) for t in answer.get("tokens") or []]  # the end-of-sequence token included, as ours
        timings = answer.get("timings") or {}
        prompt_ms = timings.get("prompt_ms")
        none = 0 if self.drafts else None  # a drafting server leaves draft_n out of an answer that drafted nothing
        drafted, accepted = timings.get("draft_n", none), timings.get("draft_n_accepted", none)
        return Measurement(tokens, first_token_s=None if prompt_ms is None else prompt_ms / 1000.0,
                           drafted=None if drafted is None else int(drafted),
                           accepted=None if accepted is None else int(accepted))

    def close(self) -> None:
        self.server.close()


class LlamaServerDraft(LlamaServerPlain):
    """llama-server with the run's draft model's GGUF (``--spec-type draft-simple -md``): llama.cpp's
    speculative decoding, its defaults (3 draft tokens a step), or ``--spec-draft-n-max N`` with
    ``llama-server-draft@N``."""

    family = "llama-server-draft"
    drafts = True
    needs_draft = True
    needs_draft_model = True

    @classmethod
    def check_option(cls, option: str | None) -> None:
        if option is not None and not (option.isdigit() and int(option) >= 1):
            raise SpecdecError(f"method '{cls.family}{DRAFTER_SEPARATOR}{option}': give the draft tokens a step "
                               f"as an integer >= 1 (--spec-draft-n-max), e.g. {cls.family}{DRAFTER_SEPARATOR}8")

    def server_args(self, option: str | None, draft_gguf: Any) -> list[str]:
        if draft_gguf is None:
            raise SpecdecError(f"method {self.name} needs the draft model as a GGUF (a zoo name or a .gguf file)")
        # -md alone loads the draft and drafts nothing in this llama.cpp (its --spec-type defaults to none)
        return (["--spec-type", "draft-simple", "-md", str(draft_gguf)]
                + ([] if option is None else ["--spec-draft-n-max", option]))


NGRAM_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")


class LlamaServerNgram(LlamaServerPlain):
    """llama-server drafting n-grams from the text itself (``--spec-type ngram-mod``, or the type after "@")."""

    family = "llama-server-ngram"
    drafts = True

    @classmethod
    def check_option(cls, option: str | None) -> None:
        if option is not None and option not in NGRAM_TYPES:
            raise SpecdecError(f"method '{cls.family}{DRAFTER_SEPARATOR}{option}': expected one of "
                               f"{', '.join(NGRAM_TYPES)} after '{DRAFTER_SEPARATOR}'")

    def server_args(self, option: str | None, draft_gguf: Any) -> list[str]:
        return ["--spec-type", option or NGRAM_TYPES[0]]


SERVER_METHODS = (LlamaServerPlain, LlamaServerDraft, LlamaServerNgram)

METHODS: dict[str, type[Method]] = {
    cls.family: cls
    for cls in (Plain, PlainInt8, Specdec, SpecdecAuto, SpecdecTree, SpecdecStairs, SpecdecIntersection, HFAssisted, HFAuto,
                HFPlain, HFPromptLookup, LlamaCppPlain, *SERVER_METHODS)
}
REFERENCE = "plain"  # speedups and identical outputs are measured against it
DEFAULT = "default"  # --methods: default_methods()


def default_methods(drafts: bool, draft_model: bool, backend: str, draft_backend: str, draft_dtype: str | None,
                    llamacpp: bool, llama_server: bool = False) -> list[str]:
    """What `specdec bench` runs without --methods: plain (the reference); with a drafter, what
    `specdec generate` runs (specdec-auto) and a fixed γ (specdec); beside them what a user would
    otherwise run: transformers' prompt lookup (hf-pld) and its assisted generation with the same
    draft model (hf: only when the draft runs in transformers, not in int4 or on llama.cpp), and
    plain llama.cpp on the target's GGUF when llama-cpp-python is installed (`llamacpp`), and llama.cpp's
    own server, plain, with the draft model and with n-gram drafts, when llama-server is built or on
    PATH and the target is a GGUF (`llama_server`; the draft method only with a draft model)."""
    families = ["plain"]
    if drafts:
        families += ["specdec-auto", "specdec"]
    if backend == HF:
        families.append("hf-pld")
        if draft_model and draft_backend == HF and draft_dtype != "int4":
            families.append(HF)
    if llamacpp:
        families.append(LLAMACPP)
    if llama_server:
        families += ["llama-server"] + (["llama-server-draft"] if draft_model else []) + ["llama-server-ngram"]
    return families


DRAFTER_SEPARATOR = "@"  # "specdec-auto@lookup": a method of our loop that drafts with another drafter


def split_method(entry: str) -> tuple[str, str | None]:
    """"specdec-auto@lookup" -> ("specdec-auto", "lookup"); "specdec" -> ("specdec", None)."""
    family, sep, drafter = entry.partition(DRAFTER_SEPARATOR)
    return family, (drafter if sep else None)


def parse_methods(text: str) -> list[str]:
    """"plain,specdec,hf" -> method entries, validated, duplicates dropped; plain is always included (first).

    An entry of our loop's families may name its own drafter after "@" ("specdec-auto@lookup",
    "specdec-tree@suffix+qwen2.5-coder-0.5b"): the run's loaded models drafting otherwise, so that
    drafters are compared in one run (check_drafters says which drafters a run can give)."""
    entries = []
    for raw in text.split(","):
        family, drafter = split_method(raw.strip())
        family = family.strip().lower()
        if drafter is not None:
            drafter = drafter.strip()
            method = METHODS.get(family)
            if method is not None and issubclass(method, LlamaServerPlain):
                method.check_option(drafter)  # its own option: llama-server-draft@8
            elif family in METHODS and not issubclass(METHODS[family], Specdec):
                raise SpecdecError(f"method '{family}' drafts as transformers or llama.cpp do: only our loop's "
                                   f"methods (specdec, specdec-auto, ...) take a drafter after '{DRAFTER_SEPARATOR}'")
            if not drafter:
                raise SpecdecError(f"method '{raw.strip()}': name a drafter after '{DRAFTER_SEPARATOR}' "
                                   "(lookup, suffix, lookup+<the run's draft>, ...)")
        entries.append(family if drafter is None else f"{family}{DRAFTER_SEPARATOR}{drafter}")
    if not any(entries):
        raise SpecdecError(f"--methods is empty: expected a comma-separated list of {', '.join(METHODS)}")
    unknown = [e for e in entries if e and split_method(e)[0] not in METHODS]
    if unknown:
        raise SpecdecError(f"unknown method '{split_method(unknown[0])[0]}': expected a comma-separated list of "
                           f"{', '.join(METHODS)}")
    families = list(dict.fromkeys(e for e in entries if e))
    if REFERENCE not in families:
        families.insert(0, REFERENCE)
    return families


MethodDrafter = tuple[str | None, bool, DrafterSpec | None]  # what check_drafters says of an entry


def check_drafters(entries: Sequence[str], draft_model: Any,
                   head: DrafterSpec | None) -> dict[str, MethodDrafter]:
    """The drafters of the entries that name one ("specdec-auto@lookup"), as (model-free drafter, whether
    the run's draft model or head drafts too, a head the run must load for it or None) for
    Engine.fork_drafting, keyed by entry; a one-line SpecdecError for a drafter the run cannot give.
    `draft_model`, `head`: the run's own (the model and the head alone of specdec.drafters.spec.split_drafter
    of --draft): a method may name any model-free drafter, the run's draft model and any head ("head",
    "head:<dir>": small, it reads the run's target), or leave them out, but not load another model."""
    drafters: dict[str, MethodDrafter] = {}
    for entry in entries:
        family, spec = split_method(entry)
        if spec is None or issubclass(METHODS[family], LlamaServerPlain):  # a server's option, not a drafter
            continue
        if parse_drafter(spec).auto:
            raise SpecdecError(f"method '{entry}': name the drafter (lookup, suffix, lookup+<model>...), not auto")
        other_copier, model, other_head = split_drafter(spec)
        if model is not None and model != draft_model:
            loaded = f"the draft {draft_model}" if draft_model is not None else "no draft model"
            raise SpecdecError(f"method '{entry}' drafts with {model}, but this run loads {loaded} (--draft): "
                               f"a method's drafter after '{DRAFTER_SEPARATOR}' loads no other draft model")
        own = model is not None or (other_head is not None and other_head == head)
        drafters[entry] = (other_copier, own, None if own else other_head)
    return drafters


def load_method_heads(engine: Engine, drafters: dict[str, MethodDrafter]) -> dict[DrafterSpec, Any]:
    """The heads the entries of check_drafters name beside the run's drafter, loaded once each for the
    engine's target (specdec.head.use.load_head), by spec."""
    from specdec.head.use import load_head

    specs = dict.fromkeys(head for _, _, head in drafters.values() if head is not None)
    return {spec: load_head(spec, engine.target_runner, engine.target_name) for spec in specs}


def parse_gammas(text: str) -> list[int]:
    """"1,3,5" -> [1, 3, 5] (sorted, duplicates dropped); each γ an integer >= 1."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise SpecdecError("--gammas is empty: expected comma-separated integers >= 1, e.g. 1,3,5")
    gammas: list[int] = []
    for p in parts:
        try:
            g = int(p)
        except ValueError:
            raise SpecdecError(f"--gammas: '{p}' is not an integer (expected e.g. 1,3,5)") from None
        if g < 1:
            raise SpecdecError(f"--gammas: γ must be >= 1, got {g}")
        gammas.append(g)
    return sorted(set(gammas))


def needs_draft(families: Sequence[str]) -> list[str]:
    """The families in `families` that need a draft model."""
    return [f for f in families if METHODS[split_method(f)[0]].needs_draft]


def check_backends(families: Sequence[str], backend: str, draft_backend: str, draft_dtype: str | None = None) -> None:
    """Raise a one-line SpecdecError if a family calls transformers on a model loaded with llama.cpp, or
    on an int4 draft (transformers has no int4 form of it: its generate would draft in int8)."""
    backends = {"target": backend, "draft": draft_backend}
    for family in (split_method(f)[0] for f in families):
        if draft_dtype == "int4" and "draft" in METHODS[family].needs_hf:
            raise SpecdecError(f"method {family} runs transformers' generate with the draft model, which has no int4 "
                               "form there: drop it from --methods or use --draft-dtype int8")
        for which in METHODS[family].needs_hf:
            if backends[which] != HF:
                flag = "--backend" if which == "target" else "--draft-backend"
                raise SpecdecError(
                    f"method {family} runs transformers' generate, so it needs the {which} on transformers "
                    f"({flag} hf); drop it from --methods or load the {which} with transformers"
                )


def build_methods(
    engine: Engine, families: Sequence[str], gammas: Sequence[int], max_new_tokens: int,
    sampling: SamplingParams | None = None, llamacpp_target: Any = None, target_gguf: Any = None,
    draft_gguf: Any = None, threads: int | None = None, n_ctx: int | None = None,
    skipped: dict[str, str] | None = None,
) -> list[Method]:
    """One Method per family, and per γ for families that take one (named ``family-g<γ>`` in a sweep),
    each on a fork of `engine` (the same models; what drafters learn across requests stays the
    method's own: Engine.fork).

    llamacpp_target: (LlamaCppRunner, tokenizer) of the target's GGUF, for the llamacpp peer.
    target_gguf, draft_gguf, threads, n_ctx: the files and settings llama-server's methods start with;
    a server that cannot start (its binary missing, a file it cannot load) leaves its method out of the
    run, the one-line reason in `skipped` (by method name), where one is given, else raised.

    An entry "family@drafter" (parse_methods) runs on a fork drafting with that drafter
    (Engine.fork_drafting) and keeps the entry as its name ("specdec-g3@lookup" in a sweep)."""
    drafters = check_drafters(families, *engine_drafter(engine))
    heads = load_method_heads(engine, drafters)
    if any(issubclass(METHODS[split_method(f)[0]], SpecdecAuto) for f in families):
        engine.auto_controller()  # made before the forks, so they share it as methods always have

    def fork(entry: str) -> Engine:
        if entry not in drafters:
            return engine.fork()
        copier, own, head = drafters[entry]
        return engine.fork_drafting(copier, own, heads[head] if head is not None else None)

    methods: list[Method] = []
    for entry in families:
        family, drafter = split_method(entry)
        cls = METHODS[family]
        if cls.uses_gamma:
            for g in gammas:
                name = entry if len(gammas) == 1 else f"{family}-g{g}" + (f"@{drafter}" if drafter else "")
                methods.append(cls(fork(entry), max_new_tokens, gamma=g, name=name, sampling=sampling))
        elif cls is LlamaCppPlain:
            methods.append(cls(engine.fork(), max_new_tokens, sampling=sampling, llamacpp_target=llamacpp_target))
        elif issubclass(cls, LlamaServerPlain):
            try:
                methods.append(cls(engine.fork(), max_new_tokens, name=entry, sampling=sampling, target_gguf=target_gguf,
                                   draft_gguf=draft_gguf, option=drafter, threads=threads, n_ctx=n_ctx))
            except SpecdecError as err:
                if skipped is None:
                    for m in methods:
                        m.close()
                    raise
                skipped[entry] = str(err)
        else:
            methods.append(cls(fork(entry), max_new_tokens, sampling=sampling, name=entry))
    return methods


def engine_drafter(engine: Engine) -> tuple[Any, DrafterSpec | None]:
    """(draft model's name, the head alone) of what `engine` drafts with (Engine.drafter_spec), as
    check_drafters takes them."""
    _, model, head = split_drafter(engine.drafter_spec)
    return model, head
