"""Turn a model "spec" string into a loaded transformers model and tokenizer.

A spec is one of: a zoo name (see ``specdec.zoo.ZOO``), a path to a ``.gguf``
file, a path to a transformers model directory, or a Hugging Face hub id
("owner/name").  GGUF files (zoo or not) are converted once into an fp32
transformers directory under ``home()/hf/`` so later loads are fast.  An int8
model (``dtype="int8"``, see specdec.native.quant) is quantized once from the
fp32 one and cached under ``home()/int8/``.

Also which backend and dtype a draft model runs in when they are left to "auto" (resolve_draft):
Engine.load, the bench and serve's replicas all choose here.  What a drafter spec means ("lookup",
"lookup+<model>", "head", "auto"...) is specdec.drafters.spec's.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec import zoo
from specdec.engine_config import AUTO_BACKEND, BACKENDS, HF, LLAMACPP, feeds_heads

# drafter specs are specdec.drafters.spec's; these two names stay importable from here for specdec.bench.runner
from specdec.errors import SpecdecError
from specdec.vocab import fast_tokenizer, saved_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdec.backends.base import ModelRunner
    from specdec.engine_config import EngineConfig
    from specdec.native.packcache import PackCache

# A name, or a loaded (transformers model or ModelRunner, tokenizer) pair.
ModelSpec = str | tuple[Any, "PreTrainedTokenizerBase"]
DTYPES = ("fp32", "bf16", "int8")  # a transformers model's
GGUF = "gguf"  # a GGUF file's own blocks on specdec's kernels (specdec.native.gguf): targets and drafts
AUTO_DTYPE = "auto"  # a target's dtype: the fastest exact one on this machine (fastest_dtype)
INT4 = "int4"  # a draft model's dtype only (specdec.native.int4): its numbers never reach the output
DRAFT_DTYPES = (*DTYPES, GGUF, INT4)
# "owner/name" with the characters the hub allows in each part.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _unknown(spec: str, why: str = "") -> SpecdecError:
    return SpecdecError(
        f"unknown model '{spec}'{why}: expected one of {', '.join(zoo.ZOO)}, "
        "a .gguf file, a model directory or a Hugging Face hub id"
    )


def resolve(spec: str) -> tuple[str, str]:
    """Classify `spec`: ("zoo", name), ("gguf", path), ("dir", path) or ("hub", id)."""
    if spec in zoo.ZOO:
        return "zoo", spec
    if not spec.strip():  # Path("") would mean the current directory
        raise _unknown(spec)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if path.is_file():
            return "gguf", str(path)
        raise _unknown(spec, " (no such .gguf file)")
    if path.is_dir():
        return "dir", str(path)
    if _HUB_ID.match(spec) and not path.exists():
        return "hub", spec
    raise _unknown(spec)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        extra = f" ({GGUF} is not a transformers model's: Engine.load takes it)" if dtype == GGUF else ""
        raise SpecdecError(f"unknown dtype '{dtype}': expected one of {', '.join(DTYPES)}{extra}")


def gguf_runs(spec: str) -> bool:
    """Whether the gguf target runs `spec` (a zoo name or .gguf path): an architecture it computes, judged
    without reading the file where the zoo says (a .gguf file's header is read: a few milliseconds)."""
    from specdec.native.gguf import ARCHITECTURES, GGUFFile

    kind, location = resolve(spec)
    if kind == "zoo":
        return zoo.get(location).arch in ARCHITECTURES
    if kind != "gguf":
        return False
    try:
        return GGUFFile(location).architecture in ARCHITECTURES
    except GGUFFile.PartError:
        raise  # a split model's later or missing part: transformers cannot read it either, and would say less
    except SpecdecError:
        return False


def load_gguf(spec: str, progress: zoo.Progress | None = None, max_context: int | None = None,
              requantize: int | None = None):
    """`spec` (a zoo name, pulled on first use, or a .gguf path) as a GGUFRunner over the file's own blocks
    (specdec.native.gguf; requantize: Q4_1 for a draft's weights in 4 bits) plus its transformers tokenizer."""
    from specdec.native.gguf import load

    kind, _ = resolve(spec)
    if kind not in ("zoo", "gguf"):
        raise SpecdecError(f"--dtype gguf runs a GGUF model (a zoo name or a .gguf file), not '{spec}': "
                           "use --dtype int8")
    path = gguf_file(spec, progress=progress)
    runner = load(path, name=spec, max_context=max_context, requantize=requantize)  # first: its pages map in while
    # the tokenizer parses
    return runner, load_tokenizer(spec, progress=progress)


def _torch_dtype(dtype: str):
    import torch

    _check_dtype(dtype)
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def _not_gguf(spec: str) -> SpecdecError:
    return SpecdecError(f"the llama.cpp backend needs a GGUF model (a zoo name or a .gguf file), not '{spec}'")


def gguf_cache_dir(path: str | Path) -> Path:
    """Where the converted directory of an arbitrary GGUF file is cached (keyed by path, size and mtime)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return zoo.home() / zoo.CONVERTED / f"gguf-{key}"


def _gguf_dir(path: str, progress: zoo.Progress | None) -> Path:
    out = gguf_cache_dir(path)
    if (out / "config.json").is_file():
        return out
    return zoo.convert_gguf(Path(path).resolve(), out, progress=progress)


def gguf_file(spec: str, progress: zoo.Progress | None = None) -> Path:
    """The GGUF file behind `spec` (a zoo name, pulled on first use, or a .gguf path), for llama.cpp."""
    kind, location = resolve(spec)
    if kind == "zoo":
        return zoo.pull(location, progress=progress)
    if kind == "gguf":
        return Path(location)
    raise _not_gguf(spec)


def _tokenizer_dir(gguf: Path, out: Path) -> Path:
    """A saved transformers tokenizer built from a GGUF's tokenizer metadata (cached at `out`)."""
    if (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoTokenizer

    try:
        with zoo.shared_gguf_reader():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, OSError, KeyError) as e:
        raise SpecdecError(f"cannot build a tokenizer from {gguf}: {str(e).strip().splitlines()[0]}") from e
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as scratch:
        tmp = Path(scratch) / "out"
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "tokenizer_config.json").is_file():  # not a concurrent save that finished first
                raise
    return out


def load_tokenizer(spec: str, progress: zoo.Progress | None = None) -> PreTrainedTokenizerBase:
    """The transformers tokenizer of `spec`, without loading (or converting) any weights.

    For a GGUF (zoo or file) it is transformers' tokenizer built from the GGUF's
    metadata -- the one load_hf uses -- taken from the converted directory when
    there is one, else built once and cached under home()/tokenizers/.
    """
    kind, location = resolve(spec)
    folder: Path | str
    if kind == "zoo":
        converted = zoo.home() / zoo.CONVERTED / location
        if (zoo._converted_from(converted) or {}).get("sha256") == zoo.get(location).sha256:
            folder = converted
        else:
            folder = _tokenizer_dir(zoo.pull(location, progress=progress), zoo.home() / "tokenizers" / location)
    elif kind == "gguf":
        converted = gguf_cache_dir(location)
        if (converted / "config.json").is_file():
            folder = converted
        else:
            folder = _tokenizer_dir(Path(location).resolve(), zoo.home() / "tokenizers" / converted.name)
    else:
        folder = Path(location) if kind == "dir" else location
    try:
        return fast_tokenizer(folder)
    except Exception as e:  # offline hub id, broken directory: fixable by the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecdecError(f"cannot load the tokenizer of '{spec}' ({first})") from e


def check_spec(spec: str, backend: str = HF) -> None:
    """Raise the SpecdecError that loading `spec` on `backend` would raise for a bad name or
    a backend that cannot take it, without loading (or downloading) anything.

    Engine.load checks target and draft first, so a mistake in the draft's name costs no
    target load.
    """
    kind, _ = resolve(spec)
    if backend == LLAMACPP:
        from specdec.backends.llamacpp import import_llama_cpp

        import_llama_cpp()
        if kind not in ("zoo", "gguf"):
            raise _not_gguf(spec)


def check_config(config: EngineConfig) -> None:
    """Raise the SpecdecError that loading `config`'s models would raise for a bad name (check_spec on the
    target and on a named draft), without loading anything: a server checks its models before it listens."""
    from specdec.drafters.spec import resolve_drafter

    # the model of "lookup+<model>", if any; a head's spec is checked where it loads, beside its target
    draft = resolve_drafter(config.draft, config.target, feeds_heads(config.backend)).model
    backend, draft_backend = resolve_backends(config.backend, config.draft_backend, draft)
    check_spec(config.target, backend)
    if isinstance(draft, str):  # a name: a config's drafts are all named
        check_spec(draft, draft_backend)


def llamacpp_can_run(spec: Any) -> bool:
    """Whether llama.cpp can run `spec` here: llama-cpp-python is installed and `spec` names a GGUF (a zoo
    name or a .gguf file) -- check_spec(spec, "llamacpp") would pass."""
    if not isinstance(spec, str):
        return False
    try:
        check_spec(spec, LLAMACPP)
    except SpecdecError:
        return False
    return True


def load_llamacpp(
    spec: str,
    n_ctx: int | None = None,
    exact: bool = True,
    progress: zoo.Progress | None = None,
    n_threads: int | None = None,
):
    """Load `spec` (zoo name or .gguf path) as a LlamaCppRunner plus its transformers tokenizer.

    exact: batch-invariant kernels, for a target (see specdec.backends.llamacpp);
    n_threads: llama.cpp's CPU threads (default: every CPU this process may use).
    """
    from specdec.backends.llamacpp import DEFAULT_N_CTX, LlamaCppRunner, import_llama_cpp

    import_llama_cpp()  # fail early, before a download, if llama-cpp-python is missing
    path = gguf_file(spec, progress=progress)
    tokenizer = load_tokenizer(spec, progress=progress)
    runner = LlamaCppRunner.from_gguf(path, n_ctx=n_ctx or DEFAULT_N_CTX, exact=exact, n_threads=n_threads)
    return runner, tokenizer


def _from_pretrained(location: str | Path, torch_dtype):
    """A causal LM, or a seq2seq LM when the config says is_encoder_decoder (T5, BART), and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.from_pretrained(location)
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(location, config=config, dtype=torch_dtype)
    return model, saved_tokenizer(location)


def refuse_int8_seq2seq(spec: str, kind: str, location: str) -> None:
    """A SpecdecError when `spec` is an encoder-decoder model: int8 (specdec.native.quant) is for
    decoder-only models.  Zoo models and GGUF files are all decoder-only; an unreadable config
    (offline hub id, broken directory) is left to the loader's own error."""
    if kind not in ("dir", "hub"):
        return
    from transformers import AutoConfig

    try:
        seq2seq = bool(getattr(AutoConfig.from_pretrained(location), "is_encoder_decoder", False))
    except Exception:  # reported where the model itself is loaded
        return
    if seq2seq:
        raise SpecdecError(f"'{spec}' is an encoder-decoder model: --dtype int8 is for decoder-only models; "
                           "use --dtype fp32 or bf16")


def _fp32_folder(kind: str, location: str, progress: zoo.Progress | None) -> Path | None:
    """The local fp32 transformers folder behind a resolved spec (None for a hub id)."""
    if kind == "zoo":
        return zoo.hf_dir(location, progress=progress)
    if kind == "gguf":
        return _gguf_dir(location, progress)
    if kind == "dir":
        folder = Path(location)
        if not (folder / "config.json").is_file():
            raise SpecdecError(f"{folder} is not a transformers model directory (no config.json)")
        return folder
    return None


def _load_float(kind: str, location: str, torch_dtype, progress: zoo.Progress | None):
    folder = _fp32_folder(kind, location, progress)
    if folder is not None:
        try:
            return _from_pretrained(folder, torch_dtype)
        except (OSError, ValueError, KeyError) as e:
            raise SpecdecError(f"cannot load model from {folder}: {str(e).strip().splitlines()[0]}") from e
    try:
        return _from_pretrained(location, torch_dtype)
    except Exception as e:  # offline, unknown repo, gated repo, ...: all fixable by the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecdecError(
            f"could not load '{location}' from the Hugging Face hub ({first}); "
            f"if offline, use an offline zoo model: {', '.join(zoo.ZOO)}"
        ) from e


def int8_cache(kind: str, location: str) -> tuple[Path, dict]:
    """Where the int8 copy of a resolved spec is cached, and the source record that must match."""
    if kind == "zoo":
        return zoo.home() / "int8" / location, {"zoo": location, "sha256": zoo.get(location).sha256}
    if kind == "gguf":
        folder = gguf_cache_dir(location)
        return zoo.home() / "int8" / folder.name, {"gguf": str(Path(location).resolve())}
    if kind == "dir":
        config = Path(location).resolve() / "config.json"
        stamp = f"{config.parent}|{config.stat().st_mtime_ns if config.exists() else 0}"
        key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
        return zoo.home() / "int8" / f"dir-{key}", {"dir": stamp}
    return zoo.home() / "int8" / ("hub-" + location.replace("/", "--")), {"hub": location}


def _current_int8(kind: str, location: str) -> Path | None:
    """The cached int8 folder of a resolved spec when it is complete and made from the same source, else None."""
    from specdec.native import quant

    folder, source = int8_cache(kind, location)
    index = quant.saved_index(folder)
    return folder if index is not None and all(index.get(k) == v for k, v in source.items()) else None


def _load_int8(kind: str, location: str, progress: zoo.Progress | None):
    """The int8 model of a resolved spec: from its cache, else quantized from fp32 and cached."""
    from specdec.native import quant

    folder, source = int8_cache(kind, location)
    if _current_int8(kind, location) is not None:
        try:
            return quant.load_int8(folder)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache: quantize again
    model, tokenizer = _load_float(kind, location, _torch_dtype("fp32"), progress)
    if progress:
        progress("quantize", 0, 1)
    quant.quantize_model(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}-", dir=folder.parent) as scratch:
        tmp = Path(scratch) / "out"
        quant.save_int8(model, tokenizer, tmp, source)
        shutil.rmtree(folder, ignore_errors=True)  # a stale copy (other source or format)
        try:
            os.replace(tmp, folder)
        except OSError:
            if quant.saved_index(folder) is None:  # not a concurrent save that finished first
                raise
    if progress:
        progress("quantize", 1, 1)
    return model, tokenizer


DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device: str, dtype: str = "fp32") -> str:
    """"cpu" or "cuda" for a --device value ("auto": cuda when available); a SpecdecError for what cannot run."""
    import torch

    if device not in DEVICES:
        raise SpecdecError(f"unknown device '{device}': expected one of {', '.join(DEVICES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("--device cuda: no CUDA GPU is available to this torch build; use --device cpu")
    if device == "cuda" and dtype in ("int8", INT4, GGUF):
        raise SpecdecError(f"{dtype} models run on the CPU only (specdec's own kernel); on CUDA use --dtype bf16")
    return device


def load_int4_draft(spec: str, progress: zoo.Progress | None = None) -> tuple[ModelRunner, PreTrainedTokenizerBase]:
    """A draft model in int4 (specdec.native.int4): the int8 model (quantized once and cached, as for
    dtype="int8") with its weights requantized to group-wise int4 at load, on a LeanRunner; llama,
    qwen2, mistral and Gemma 3 text models only (lean.INT4_ARCHITECTURES)."""
    from specdec.native import lean

    saved = _saved_int8_skeleton(spec)  # the cached int8 model without transformers' modeling code, if it can
    model, tokenizer = saved if saved is not None else load_hf(spec, dtype="int8", progress=progress)
    if not lean.supports(model, int4=True):
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise SpecdecError(f"--draft-dtype int4 runs {'/'.join(lean.INT4_ARCHITECTURES)} drafts, and '{spec}' is a {kind} "
                           "model: use --draft-dtype int8")
    cache = _pack_cache(spec)
    if cache is not None:
        lean.use_pack_cache(model, cache)  # the int4 requantisation and the int8 packing, made once
    runner = lean.LeanRunner(model, int4=True)
    if cache is not None:
        cache.save()  # what was made afresh, written in the background
    return runner, tokenizer


def _saved_int8_skeleton(spec: str) -> tuple[Any, PreTrainedTokenizerBase] | None:
    """(the cached int8 model of `spec` as specdec.native.skeleton builds it, its tokenizer), or None where it is
    not cached yet, not current, or not covered (load_hf then loads, or quantizes, transformers' model)."""
    from specdec.native import skeleton

    try:
        folder = _current_int8(*resolve(spec))
        if folder is None:
            return None
        model = skeleton.load(folder)
        return None if model is None else (model, fast_tokenizer(folder))
    except (OSError, ValueError, KeyError, SpecdecError):
        return None  # load_hf says what is wrong, or rebuilds a damaged cache


def _pack_cache(spec: str) -> PackCache | None:
    """The cache of the packed weights of `spec`'s int8 model (specdec.native.packcache, keyed by its cached
    int8 file), or None ($SPECDEC_PACK_CACHE=0, no int8 file)."""
    from specdec.native.packcache import cache_for
    from specdec.native.quant import WEIGHTS_FILE

    folder, _ = int8_cache(*resolve(spec))
    return cache_for("lean", folder / WEIGHTS_FILE)


def load_hf(
    spec: str, dtype: str = "fp32", progress: zoo.Progress | None = None, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `spec` as an eval-mode transformers causal LM (no grads) plus its tokenizer; a model
    whose config says is_encoder_decoder (T5, BART) as a seq2seq LM (fp32 or bf16, not int8).

    `dtype` is "fp32", "bf16" or "int8" (int8 weights and per-token int8 activations,
    batch-invariant: specdec.native.quant).  Zoo models are pulled and converted on
    first use; an int8 model is quantized once and cached.  `device`: "cpu", "cuda" or
    "auto" (cuda when available); int8 runs on the CPU only.
    """
    _check_dtype(dtype)
    device = resolve_device(device, dtype)
    kind, location = resolve(spec)
    if dtype == "int8":
        refuse_int8_seq2seq(spec, kind, location)
        model, tokenizer = _load_int8(kind, location, progress)
    else:
        model, tokenizer = _load_float(kind, location, _torch_dtype(dtype), progress)
    if device != "cpu":
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


# --- the backend and dtype chosen for a draft (Engine.load, the bench, serve's replicas) ---


def fastest_draft_backend(draft: ModelSpec | None, backend: str) -> str:
    """The draft backend "auto" stands for: llama.cpp when llama-cpp-python is installed and the draft is
    a GGUF (a zoo name or a .gguf file): it drafts faster there than in transformers int8 or fp32
    (BENCHMARKS.md, component timings), and a draft's numerics never change the output.  Otherwise the
    target's backend."""
    return LLAMACPP if backend != LLAMACPP and llamacpp_can_run(draft) else backend


INT4_ZOO_ARCHS = ("llama", "qwen2", "mistral", "gemma3")  # zoo (GGUF) architectures lean runs as int4 drafts


def fastest_spec_draft_dtype(draft: ModelSpec | None, backend: str, device: str) -> str | None:
    """The draft dtype the draft backend "auto" means on specdec's own kernels, or None for llama.cpp.

    Only for a transformers target on the CPU and a zoo draft (decoder-only models that int8 runs; a
    directory or hub model may be an encoder-decoder one, so those keep llama.cpp), as measured with
    `specdec profile` (a draft's numerics never change the output):
    - "int4" on CPUs with AVX2 or AVX-512 VNNI, for the drafts lean runs in int4 (llama family, Gemma
      3): in the Q4_1-like format (kernels/int4_linear.c), with the layers in one C call, both a
      drafted token and a prompt catch-up cost about half of llama.cpp's (BENCHMARKS.md, Zen 3
      component timings); where the int8 kernel takes its VNNI path the draft's catch-ups run on its
      int8 weights (specdec.native.lean.CatchUpLayers): on a Zen 4 a drafted token of the 0.5B took
      13 ms this way against 27 ms in int8, and a catch-up 2.0 ms a token against 4.4 in int4 alone
      (BENCHMARKS.md, Zen 4 component timings);
    - "int8" for the other drafts where the int8 kernel takes its VNNI path (faster than llama.cpp
      there: BENCHMARKS.md, Xeon component timings)."""
    if backend != HF or device != "cpu" or not isinstance(draft, str):
        return None
    try:
        kind, location = resolve(draft)
        if kind != "zoo":
            return None
        from specdec.native import kernels

        isa = kernels.int8.isa()
    except SpecdecError:  # no C compiler for the kernel, or a name that loading will report
        return None
    if isa not in ("avx512-vnni", "avx2"):
        return None
    if zoo.get(location).arch in INT4_ZOO_ARCHS:
        return "int4"
    return "int8" if isa == "avx512-vnni" else None


def int4_draft_backend(draft_backend: str | None, draft_dtype: str | None) -> str | None:
    """The draft's backend given its dtype: an int4 draft runs on specdec's int4 kernel, on the
    transformers side ("hf"; a SpecdecError for llama.cpp); other dtypes leave it as it is."""
    if draft_dtype != "int4":
        return draft_backend
    if draft_backend not in (None, AUTO_BACKEND, HF):
        raise SpecdecError("--draft-dtype int4 runs the draft on specdec's int4 kernel: use --draft-backend hf")
    return HF


def resolve_draft(draft: ModelSpec | None, backend: str, draft_backend: str | None, draft_dtype: str | None,
                  device: str = "cpu") -> tuple[str, str, str | None]:
    """(target's backend, draft's backend, draft's dtype) as Engine.load will load them: an int4 draft on
    specdec's kernel; the draft backend "auto" with a draft dtype given: transformers (a dtype is a
    transformers model's); with none: the draft on specdec's int8 / int4 kernel where that is fastest
    (fastest_spec_draft_dtype), else llama.cpp where it can run the draft, else the target's backend.
    `draft` is the draft model alone (specdec.drafters.spec.DrafterSpec.model)."""
    draft_backend = int4_draft_backend(draft_backend, draft_dtype)
    if draft_backend == AUTO_BACKEND and draft_dtype is not None and backend == HF:
        draft_backend = HF  # a dtype is a transformers model's: the user asked for the draft there
    if draft_backend == AUTO_BACKEND and draft_dtype is None:
        draft_dtype = fastest_spec_draft_dtype(draft, backend, device)
        if draft_dtype is not None:
            draft_backend = HF
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
