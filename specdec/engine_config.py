"""The models an engine loads: :class:`EngineConfig`, declared once, whoever asks.

The CLI's model options (``--target``, ``--draft``, ``--dtype``, ... of ``specdec generate``, ``serve``,
``bench``, ``profile``, ``quality`` and ``train-drafter``), ``Engine.from_config``, the Ray replicas' spec
(``specdec.serve.replicas.EngineSpec`` is this class; a replica loads it with ``Engine.from_config``) and
``BenchOptions.engine`` all come from its fields.  Each field carries an :class:`specdec.request.Option`
in its metadata, as RequestConfig's do: its CLI flags, help and choices; ``specdec.cli.options.engine_options``
makes a command's options of them, so a new model option is one new field here.  A command whose option
says something of its own (bench's ``--draft`` help, profile's ``--draft`` default "none",
train-drafter's required ``--target``) changes the field's help or default there, never its flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specdec.defaults import DEFAULT_DRAFTER, DEFAULT_SUFFIX_MEMORY, DEFAULT_TARGET, MODEL_DRAFTER
from specdec.drafters.draft_vocab import AUTO_MIN_VOCAB, DEFAULT_DRAFT_VOCAB, VOCAB_AUTO, VOCAB_FULL, parse_draft_vocab
from specdec.request import Option, option

DTYPES = ("auto", "gguf", "int8", "fp32", "bf16")  # the target's, on specdec's side (specdec.runtime.loading)
DRAFT_DTYPES = ("gguf", "fp32", "bf16", "int8", "int4")  # int4: drafts only (specdec.native.int4)
# the runtimes a model runs on (specdec.runtime.loading checks a backend's name against these): transformers,
# with specdec's own runners and kernels, and llama.cpp
# The --backend values, spelt here only, where the flags are parsed (specdec.runtime.runners names the runtimes
# under each; tests/test_structure.py checks that no other module spells them): transformers with specdec's native
# engine, and llama.cpp.
HF = "hf"
LLAMACPP = "llamacpp"
BACKENDS = (HF, LLAMACPP)


def feeds_heads(backend: str) -> bool:
    """Whether a target on `backend` gives the hidden states a draft head reads: transformers' and the native
    engine's runners do, llama.cpp's does not."""
    return backend == HF
AUTO_BACKEND = "auto"  # the draft's backend: llama.cpp where it can run the draft, else the target's
DRAFT_BACKENDS = (*BACKENDS, AUTO_BACKEND)
DEVICES = ("cpu", "cuda", "auto")

DTYPE_HELP = ("The target's dtype on specdec's side (--backend hf): auto (default: gguf for a GGUF model and int8 "
              "for others on CPUs with AVX2 or AVX-512 VNNI, where specdec's exact kernels run; fp32 elsewhere), "
              "gguf (a GGUF model's own quantised blocks on specdec's kernels), int8 (int8 weights and "
              "activations), both batch-invariant: speculative output is exactly their plain output; fp32 (the "
              "reference; `specdec quality` measures what the others change) or bf16.")
DRAFT_HELP = ("The drafter: a draft model, 'lookup' (prompt lookup: no draft model), 'lookup+<model>' (lookup where it "
              "matches, the model elsewhere), 'head' (the draft head trained for the target with specdec train-drafter) "
              "or 'head:<dir>' (a head saved in <dir>), 'lookup+head[:<dir>]' (lookup where it matches, the head "
              "elsewhere), 'suffix' (suffix drafts: matches in the context and in recent answers, no draft model), "
              "'suffix+<model>' or 'suffix+head' (suffix drafts where they score well, the model or head elsewhere), "
              "'recycle' (Token Recycling: the target's own top candidates from earlier steps, no draft model) or "
              "'recycle+<model>' (recycled drafts where the target was sure of them, the model elsewhere), "
              "'none' for plain decoding, or 'auto' (the default): lookup+head when a head was trained for "
              f"the target and it runs on transformers (--backend hf), else {MODEL_DRAFTER}.")
SUFFIX_MEMORY_HELP = (f"With suffix drafts: the tokens of recent answers the engine keeps to draft from (default "
                      f"{DEFAULT_SUFFIX_MEMORY:,}, ~20 MB; the oldest answers go first; 0: each request's own context only).")
DRAFT_VOCAB_HELP = (f"The tokens the draft model proposes among (FR-Spec): a number N (its head computes the logits of the "
                    f"N most frequent tokens only: a cheaper drafted token, never another output), {VOCAB_FULL}, or "
                    f"{VOCAB_AUTO} (the default: {DEFAULT_DRAFT_VOCAB} for a draft of over {AUTO_MIN_VOCAB:,} tokens on "
                    f"specdec's int4 or int8 kernel that shares the target's tokenizer, else {VOCAB_FULL}).")
DEVICE_HELP = "Where transformers models run: cpu, cuda, or auto (cuda when available). int8 is CPU-only."


@dataclass(frozen=True)
class EngineConfig:
    """The models to load and how: every field a CLI model option (generate's flags, defaults and help).

    draft: a drafter spec (specdec.drafters.spec), "auto" (the default), or None for plain decoding
    ("none" becomes None).  threads: torch's (set by Engine.from_config) and llama.cpp's CPU threads.
    """

    target: str = option(DEFAULT_TARGET, "--target", "-t", help="Target model: zoo name, .gguf, directory or hub id.")
    draft: str | None = option(DEFAULT_DRAFTER, "--draft", "-d", cli_type=str, help=DRAFT_HELP)
    dtype: str = option("auto", "--dtype", choices=DTYPES, help=DTYPE_HELP)
    draft_dtype: str | None = option(
        None, "--draft-dtype", choices=DRAFT_DTYPES,
        help="The draft's dtype (default: --dtype); gguf runs a GGUF draft's own blocks, bf16 makes a transformers "
             "draft cheaper without changing the output, and int4 (drafts only: the int8 draft's weights in 4 bits, "
             "llama-family and Gemma 3 models) cheaper still.")
    backend: str = option(HF, "--backend", choices=BACKENDS,
                          help="Target's backend: hf (transformers) or llamacpp (GGUF via llama.cpp).")
    device: str = option("cpu", "--device", choices=DEVICES, help=DEVICE_HELP)
    draft_backend: str | None = option(
        AUTO_BACKEND, "--draft-backend", choices=DRAFT_BACKENDS,
        help="Draft's backend: hf, llamacpp, or auto (with --draft-dtype: transformers; without: specdec's int8 kernel "
             "for a zoo draft on CPUs with AVX-512 VNNI, its int4 kernel on other AVX2 CPUs, else llama.cpp when it "
             "is installed and the draft is a GGUF, else the target's).")
    n_ctx: int | None = option(None, "--n-ctx", help="llama.cpp context size in tokens (default 4096).")
    threads: int | None = option(
        None, "--threads",
        help="CPU threads for llama.cpp and torch (default: llama.cpp all CPUs, torch its own choice).")
    suffix_memory: int = option(DEFAULT_SUFFIX_MEMORY, "--suffix-memory", minimum=0, help=SUFFIX_MEMORY_HELP)
    draft_vocab: str = option(VOCAB_AUTO, "--draft-vocab", cli_type=str, help=DRAFT_VOCAB_HELP)

    def __post_init__(self) -> None:
        from specdec.drafters.spec import is_none

        if is_none(self.draft):
            object.__setattr__(self, "draft", None)
        object.__setattr__(self, "draft_vocab", str(parse_draft_vocab(self.draft_vocab)))  # refused here if wrong


def engine_fields() -> list[tuple[dataclasses.Field, Option]]:
    """EngineConfig's fields with their Options, in order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(EngineConfig)]


def load_options() -> set[str]:
    """The names Engine.load takes as options: EngineConfig's fields but the target and the draft (its own
    arguments, models or names)."""
    return {f.name for f, _ in engine_fields()} - {"target", "draft"}


def with_options(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """`config` (default: EngineConfig's defaults) with `options` in place: how Engine.load takes its options, one
    set of defaults for the CLI, the Python API and the replicas.  The target and the draft are Engine.load's own
    arguments (models or names), not options; any other name is a TypeError naming it."""
    names = load_options()
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"Engine.load() got unexpected option(s) {', '.join(unknown)}: expected some of "
                        f"{', '.join(sorted(names))}")
    return dataclasses.replace(config or EngineConfig(), **options)


def command_line(config: EngineConfig) -> list[str]:
    """`config` as the CLI's model options, each that is not its default ("--draft none" for no drafter):
    ``specdec generate PROMPT *command_line(config)`` loads the same models."""
    args: list[str] = []
    for f, o in engine_fields():
        value = getattr(config, f.name)
        if value != f.default:
            args += [o.flags[0], "none" if value is None else str(value)]
    return args
