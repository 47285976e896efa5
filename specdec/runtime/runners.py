"""The runtimes a model runs on, named as such: one registry (RUNNERS), and the choice among its entries.

specdec runs a model on one of three runtimes: **transformers** (PyTorch modules: fp32 or bf16, on the CPU or a
GPU), **llama.cpp** (through llama-cpp-python: a GGUF file as it is) and its own **native engine** (C kernels over
exact integer formats: a GGUF file's own quantised blocks, int8 weights and activations, a draft's weights in 4
bits).  Each way of running a model is one :class:`Runtime` entry: which ``--backend`` / ``--dtype`` name it, the
roles it takes (target, draft), whether it runs a given model fast and exactly on this CPU (``auto``'s test), how
it loads one, and what it offers the rest of the engine (slots of a continuous batch, the weight bytes a step
reads).  The engine, the batch, the profile and the bench ask the registry, never a runner's class.

``auto`` (a target's ``--dtype auto``) is the first entry in RUNNERS' order, on the requested backend, whose
test passes: native-gguf (a GGUF of an architecture the gguf kernels compute, where they run SIMD), then
native-int8 (a decoder-only transformers model, where the int8 kernel runs SIMD), then transformers fp32, the
reference.  Every entry is exact for a target: speculative output is its plain output, bit for bit (see
docs/guarantees.md).  Adding a runtime is adding an entry (docs/extending.md, "Add a runtime").
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

from specdec.backends.base import ModelRunner
from specdec.engine_config import HF, LLAMACPP
from specdec.errors import SpecdecError
from specdec.runtime import loading
from specdec.runtime.loading import GGUF, INT4, ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdec.backends.seq2seq import Seq2SeqRunner

TARGET, DRAFT = "target", "draft"
SIMD = ("avx512-vnni", "avx2")  # the native kernels' paths that beat fp32 (kernels.*.isa())


@dataclass(frozen=True)
class LoadOptions:
    """What loading a model takes besides its name: where it is told of progress, the transformers device,
    llama.cpp's context and threads, and whether llama.cpp must verify in batch-invariant mode (a target's)."""

    progress: Callable[[str, int, int], None] | None = None
    device: str = "cpu"
    n_ctx: int | None = None
    threads: int | None = None
    exact: bool = True


Loaded = tuple[Any, "PreTrainedTokenizerBase"]  # (a transformers model or a ModelRunner, its tokenizer)


@dataclass(frozen=True)
class Runtime:
    """One way of running a model.

    name: what the docs, `specdec models` and errors call it; backend: the --backend value it sits under ("hf":
    transformers and the native engine, "llamacpp"); dtypes: the --dtype / --draft-dtype values that choose it
    there (the first is the one `auto` means); roles: TARGET and / or DRAFT; about: one line for users.
    fast: (spec, device) -> whether `auto` may pick it for this model on this machine (fast and exact here);
    load: (spec, dtype, options) -> the loaded model; owns: whether a built runner is this runtime's;
    batchable: its target's runners can be slots of one continuous batch (specdec.runtime.batching);
    step_bytes: the weight bytes a one-token step of its runner reads (None: unknown)."""

    name: str
    backend: str
    dtypes: tuple[str, ...]
    roles: tuple[str, ...]
    about: str
    fast: Callable[[str, str], bool]
    load: Callable[[str, str, LoadOptions], Loaded]
    owns: Callable[[Any], bool]
    batchable: bool = False
    step_bytes: Callable[[Any], int | None] = lambda runner: None


# ------------------------------------------------------------------ tests: can it run this model fast, here?

def _cpu(device: str) -> bool:
    try:
        return loading.resolve_device(device, "fp32") == "cpu"
    except SpecdecError:
        return False


def _gguf_fast(spec: str, device: str) -> bool:
    """A GGUF (zoo name or .gguf file) of an architecture the gguf kernels compute, on a CPU where they run SIMD."""
    from specdec.native import kernels

    try:
        kind, _ = loading.resolve(spec)
        return (_cpu(device) and kind in ("zoo", "gguf") and kernels.gguf.isa() in SIMD
                and loading.gguf_runs(spec))
    except SpecdecError as e:
        from specdec.native.gguf import GGUFFile

        if isinstance(e, GGUFFile.PartError):
            raise  # a split GGUF model's later or missing part: no dtype can load it (gguf_runs)
        return False


def _int8_fast(spec: str, device: str) -> bool:
    """A decoder-only model on a CPU where the int8 kernel runs SIMD (an encoder-decoder one is fp32's)."""
    from specdec.native import kernels

    try:
        if not _cpu(device) or kernels.int8.isa() not in SIMD:
            return False
        loading.refuse_int8_seq2seq(spec, *loading.resolve(spec))
    except SpecdecError:  # an encoder-decoder model, no C compiler, or a name that loading will report
        return False
    return True


def _always(spec: str, device: str) -> bool:
    return True


def _never(spec: str, device: str) -> bool:
    return False


# ------------------------------------------------------------------ loads

def _load_gguf(spec: str, dtype: str, options: LoadOptions) -> Loaded:
    return loading.load_gguf(spec, progress=options.progress)


def _load_int4(spec: str, dtype: str, options: LoadOptions) -> Loaded:
    """A draft's weights in 4 bits: a GGUF the gguf kernel runs in Q4_1 blocks there, another model's int8 copy
    requantised for the int4 kernel."""
    from specdec.native.gguf import Q4_1

    if loading.gguf_runs(spec):
        return loading.load_gguf(spec, progress=options.progress, requantize=Q4_1)
    return loading.load_int4_draft(spec, progress=options.progress)


def _load_transformers(spec: str, dtype: str, options: LoadOptions) -> Loaded:
    return loading.load_hf(spec, dtype=dtype, progress=options.progress, device=options.device)


def _load_llamacpp(spec: str, dtype: str, options: LoadOptions) -> Loaded:
    return loading.load_llamacpp(spec, n_ctx=options.n_ctx, exact=options.exact, progress=options.progress,
                                 n_threads=options.threads)


# ------------------------------------------------------------------ which runner is whose

INT4_LAYERS = ("int4", "int4+int8", "q4_1")  # a 4-bit draft's layer sets (LayerSet.dtype): lean's, a GGUF's


def _is_native(runner: Any, dtype: str) -> bool:
    """Whether `runner` is the native engine's, in `dtype`: its layer set says which (a gguf target's blocks,
    int8, or a draft's 4 bits on either kernel)."""
    from specdec.native.lean import Int8Layers, LeanRunner

    if not isinstance(runner, LeanRunner):
        return False
    layers = runner.layer_set
    if dtype == "int8":
        return isinstance(layers, Int8Layers)
    return layers.dtype in (INT4_LAYERS if dtype == INT4 else (dtype,))


def _is_transformers(runner: Any) -> bool:
    """A runner over a transformers model (HFRunner, Seq2SeqRunner): neither the native engine's nor llama.cpp's,
    and holding a model."""
    from specdec.native.lean import LeanRunner

    return (not isinstance(runner, LeanRunner) and not _is_llamacpp(runner)
            and getattr(runner, "model", None) is not None)


def _built_by(runner: object, module_name: str, class_name: str) -> bool:
    """Whether `runner` is an instance of `module_name`.`class_name`, without importing that module (and what it
    imports: transformers, llama-cpp-python) where no runner can be one: none was built unless it was imported."""
    module = sys.modules.get(module_name)
    return module is not None and isinstance(runner, getattr(module, class_name))


def _is_llamacpp(runner: Any) -> bool:
    return _built_by(runner, "specdec.backends.llamacpp", "LlamaCppRunner")


def _lean_step_bytes(runner: Any) -> int | None:
    return int(runner.layer_set.step_bytes(runner.head))


def _gguf_file_bytes(runner: Any) -> int | None:
    """A llama.cpp step reads the file's tensors (the embedding aside, unless the head is tied to it)."""
    from specdec.native.gguf import GGUFFile

    tensors = list(GGUFFile(runner.session.path).tensors.values())
    tied = "output.weight" not in {t.name for t in tensors}
    return sum(max(0, t.nbytes()) for t in tensors if t.name != "token_embd.weight" or tied)


def _parameter_bytes(runner: Any) -> int | None:
    """A transformers model's parameters (the input embedding aside, unless the output head is tied to it)."""
    model = runner.model
    if model is None:
        return None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        skip -= {id(p) for p in head.parameters()}  # a tied head is read every step
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


# ------------------------------------------------------------------ the registry

RUNNERS: tuple[Runtime, ...] = (
    Runtime("native-gguf", HF, (GGUF,), (TARGET, DRAFT),
            "specdec's kernels on a GGUF file's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1), every layer in one C call",
            fast=_gguf_fast, load=_load_gguf, owns=lambda r: _is_native(r, GGUF), batchable=True, step_bytes=_lean_step_bytes),
    Runtime("native-int8", HF, ("int8",), (TARGET, DRAFT),
            "specdec's kernels on int8 weights and per-token int8 activations (a transformers model quantised once)",
            fast=_int8_fast, load=_load_transformers, owns=lambda r: _is_native(r, "int8"), batchable=True,
            step_bytes=_lean_step_bytes),
    Runtime("transformers", HF, ("fp32", "bf16"), (TARGET, DRAFT),
            "transformers' PyTorch modules: fp32 (the reference) or bf16, on the CPU or a CUDA GPU",
            fast=_always, load=_load_transformers, owns=_is_transformers, step_bytes=_parameter_bytes),
    Runtime(LLAMACPP, LLAMACPP, ("fp32",), (TARGET, DRAFT),
            "llama.cpp through llama-cpp-python, a GGUF file as it is (batch-invariant build for a target)",
            fast=_always, load=_load_llamacpp, owns=_is_llamacpp, step_bytes=_gguf_file_bytes),
    Runtime("native-int4", HF, (INT4,), (DRAFT,),
            "a draft's weights in 4 bits on specdec's kernels (a GGUF's as Q4_1 blocks, another model's int8 copy "
            "requantised); never a target's: its numbers would change the output",
            fast=_never, load=_load_int4, owns=lambda r: _is_native(r, INT4), step_bytes=_lean_step_bytes),
)


def register(entry: Runtime, before: str | None = None) -> None:
    """Add a runtime to RUNNERS: ahead of the entry called `before` (auto's order, and which entry of() names a
    runner first), else last; a SpecdecError where its name is taken or a --dtype it claims on its backend is
    another entry's (docs/extending.md, "A runtime")."""
    global RUNNERS
    taken = {e.name for e in RUNNERS}
    claimed = {d for e in RUNNERS if e.backend == entry.backend for d in e.dtypes}
    if entry.name in taken or (entry.backend == HF and claimed & set(entry.dtypes)):
        raise SpecdecError(f"runtime '{entry.name}' names a runtime or a --dtype that another entry has")
    at = len(RUNNERS) if before is None else [e.name for e in RUNNERS].index(named(before).name)
    RUNNERS = (*RUNNERS[:at], entry, *RUNNERS[at:])


# ------------------------------------------------------------------ runners for models passed in loaded

def as_runner(model: PreTrainedModel | ModelRunner) -> ModelRunner:
    """A ModelRunner for `model`: a runner as it is; for a transformers model, a Seq2SeqRunner when it
    is an encoder-decoder model (T5, BART), a LeanRunner when it is an int8 llama-family model (the
    same numbers, less overhead), else an HFRunner."""
    # a lean runner first: Python 3.11 checks a runtime protocol with hasattr, which would run the gguf runner's
    # `model` property (transformers' model of its config: a second of imports it otherwise never needs)
    from specdec.native import lean

    if isinstance(model, lean.LeanRunner) or isinstance(model, ModelRunner):
        return model
    # here, as the runners over transformers models: their imports take a second a GGUF target never needs
    from transformers import PreTrainedModel

    from specdec.backends.hf import HFRunner
    from specdec.backends.seq2seq import Seq2SeqRunner, is_seq2seq

    if isinstance(model, PreTrainedModel):
        if is_seq2seq(model):
            return Seq2SeqRunner(model)
        return lean.LeanRunner(model) if lean.supports(model) else HFRunner(model)
    raise TypeError(f"expected a transformers model or a ModelRunner, got {type(model).__name__}")


def is_seq2seq_runner(runner: object) -> TypeGuard[Seq2SeqRunner]:
    """Whether `runner` is a Seq2SeqRunner (its module not imported where none can be one: _built_by)."""
    return _built_by(runner, "specdec.backends.seq2seq", "Seq2SeqRunner")



# ------------------------------------------------------------------ choosing

def named(name: str) -> Runtime:
    """The entry called `name`."""
    for entry in RUNNERS:
        if entry.name == name:
            return entry
    raise SpecdecError(f"unknown runtime '{name}': expected one of {', '.join(e.name for e in RUNNERS)}")


def auto(spec: ModelSpec, backend: str = HF, device: str = "cpu", role: str = TARGET) -> Runtime:
    """The runtime `auto` means for `spec` on `backend`: the first entry in RUNNERS' order, on that backend and
    for that role, that runs it fast and exactly here.  A model passed in already loaded is used as it is
    (transformers)."""
    loading.resolve_backends(backend, None)  # an unknown backend: one line, naming those there are
    if not isinstance(spec, str):
        return named("transformers")
    for entry in RUNNERS:
        if entry.backend == backend and role in entry.roles and entry.fast(spec, device):
            return entry
    raise SpecdecError(f"no runtime on backend '{backend}' runs '{spec}' as a {role}")


def fastest_dtype(spec: Any, backend: str = HF, device: str = "cpu") -> str:
    """The dtype "auto" stands for: that of the first runtime in RUNNERS' order that runs
    `spec` fast and exactly here -- "gguf" for a GGUF model (a zoo name or a .gguf file) of an architecture the
    gguf target runs, where the GGUF block kernel multiplies in SIMD (AVX-512 VNNI or AVX2): the file's own
    blocks, about half int8's bytes a step, and faster than int8 on the bench (BENCHMARKS.md); "int8" for
    another decoder-only model where the int8 kernel runs SIMD; else "fp32" (the reference: a GPU, a CPU without
    AVX2, an encoder-decoder model, a model passed in already loaded, or a llama.cpp backend, which reads its
    GGUF as it is).  Each is exact: speculative output is the chosen target's plain output.  `specdec quality`
    measures what each changes against fp32."""
    return auto(spec, backend, device).dtypes[0]


def for_load(backend: str, dtype: str, role: str = TARGET) -> Runtime:
    """The entry that `--backend backend --dtype dtype` names for a model in `role` (llama.cpp: every dtype is
    its file's own); a SpecdecError where none does, or where that entry does not take the role."""
    for entry in RUNNERS:
        if entry.backend == backend and (backend != HF or dtype in entry.dtypes):
            check_role(entry, dtype, role)
            return entry
    raise SpecdecError(f"no runtime runs --backend {backend} --dtype {dtype}")


def check_role(entry: Runtime | None, dtype: str, role: str = TARGET) -> None:
    """A SpecdecError, in the option's words, where `entry` (the runtime `dtype` names) does not run a model in
    `role`: a draft-only runtime's dtype given for a target."""
    if entry is not None and role not in entry.roles:
        raise SpecdecError(f"{dtype} is a draft's dtype only (--draft-dtype {dtype}): a target's numbers are "
                           f"its output, and {dtype} weights would change them")


def of_dtype(dtype: str, backend: str = HF) -> Runtime | None:
    """The entry `--dtype dtype` names on `backend`, or None (a dtype no runtime takes: the loader reports it)."""
    return next((e for e in RUNNERS if e.backend == backend and dtype in e.dtypes), None)


def batchable(runner: ModelRunner | Any) -> bool:
    """Whether `runner`'s clones can be slots of one continuous batch (its runtime says so)."""
    entry = of(runner)
    return entry is not None and entry.batchable


def load(spec: str, backend: str, dtype: str, options: LoadOptions, role: str = TARGET) -> Loaded:
    """`spec` loaded on the runtime `backend` and `dtype` name (for_load)."""
    return for_load(backend, dtype, role).load(spec, dtype, options)


def of(runner: ModelRunner | Any) -> Runtime | None:
    """The entry whose runner `runner` is (None for one built elsewhere: a test's, a stairs view's)."""
    for entry in RUNNERS:
        if entry.owns(runner):
            return entry
    return None


def step_bytes(runner: ModelRunner | Any) -> int | None:
    """The weight bytes a one-token step of `runner` reads (every layer's linears and the output head; the
    embedding's one row aside), what bounds a memory-bound step; None where unknown."""
    entry = of(runner)
    return entry.step_bytes(runner) if entry is not None else None
