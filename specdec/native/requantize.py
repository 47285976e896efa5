"""A GGUF model requantised to another type by llama.cpp's own quantiser, made once into the model cache.

``requantized(source, "Q4_0")`` is ``$SPECDEC_HOME/models/derived/<source's stem>-Q4_0.gguf``: made the first
time by ``llama-quantize --allow-requantize`` when ``scripts/install-llamacpp.sh --server`` built it into
``$SPECDEC_HOME/bin``, else by llama-cpp-python's ``llama_model_quantize`` (the same llama.cpp code, in the
library specdec's llama.cpp backend loads), written to a temporary name and renamed into place (a reader sees
no file or the whole one), and reused after (made again only when the source is newer).  The tests get files
of the types a user may bring (Q4_0, Q5_1, IQ4_NL, Q3_K_M, IQ4_XS...) from the zoo's few without a download
(tests/requant.py).  Requantising from an already quantised file compounds two roundings: the result is a
file of the asked types, not the one llama.cpp would make from the fp16 model.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.zoo import home

# llama.cpp's file types (llama-quantize's names, llama_cpp's LLAMA_FTYPE_MOSTLY_<name>) made without an
# importance matrix, which the 1- to 3-bit IQ types need
FTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S",
          "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16")
QUANTIZE_TOOL = "llama-quantize"  # in home()/bin, built by scripts/install-llamacpp.sh --server
DERIVED = "derived"  # the folder of home()/models that holds the requantised files


def derived_path(source: Path, ftype: str, cache: Path | None = None) -> Path:
    """Where `source` requantised to `ftype` lives: `cache` (default $SPECDEC_HOME/models/derived)/<stem>-<TYPE>.gguf."""
    return (cache or home() / "models" / DERIVED) / f"{source.stem}-{ftype}.gguf"


def requantized(source: str | Path, ftype: str, cache: Path | None = None, tools: Path | None = None) -> Path:
    """`source` (a .gguf file) requantised to llama.cpp file type `ftype` (one of FTYPES, any case): the file in
    `cache` (default $SPECDEC_HOME/models/derived), made once (see the module doc) with `tools`/llama-quantize
    (default $SPECDEC_HOME/bin) or llama-cpp-python.  A one-line SpecdecError for a missing source, an unknown
    type, neither quantiser installed, or a quantiser that fails."""
    source = Path(source).expanduser()
    name = ftype.strip().upper()
    if name not in FTYPES:
        raise SpecdecError(f"unknown GGUF file type '{ftype}': expected one of {', '.join(FTYPES)}")
    if not source.is_file():
        raise SpecdecError(f"cannot requantise {source}: no such file")
    out = derived_path(source, name, cache)
    if out.is_file() and out.stat().st_mtime_ns >= source.stat().st_mtime_ns:
        return out  # made before, from this source
    tool = (tools or home() / "bin") / QUANTIZE_TOOL
    quantise = _with_tool if os.access(tool, os.X_OK) else _with_library
    out.parent.mkdir(parents=True, exist_ok=True)
    # a temporary name in the same folder (the rename is atomic), ending in .gguf as llama-quantize wants it
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}-", suffix=".gguf")
    os.close(fd)
    try:
        quantise(tool, source, Path(tmp), name)
        os.chmod(tmp, 0o644)  # a cache file as any other (mkstemp made it the owner's alone)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def _with_tool(tool: Path, source: Path, out: Path, ftype: str) -> None:
    """`tool` (llama-quantize) run on `source` into `out`, allowing a quantised source, with every core."""
    threads = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    done = subprocess.run([str(tool), "--allow-requantize", str(source), str(out), ftype, threads],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise SpecdecError(f"{tool} could not requantise {source.name} to {ftype} (exit {done.returncode}): "
                           f"{lines[-1] if lines else 'no message'}")


def _with_library(tool: Path, source: Path, out: Path, ftype: str) -> None:
    """llama-cpp-python's llama_model_quantize on `source` into `out` (allow_requantize set); `tool` is where
    llama-quantize was looked for, named in the error when llama-cpp-python is missing too."""
    try:
        import llama_cpp
    except ImportError:
        raise SpecdecError(f"cannot requantise {source.name} to {ftype}: neither {tool} "
                           "(scripts/install-llamacpp.sh --server builds it) nor llama-cpp-python "
                           "(scripts/install-llamacpp.sh) is installed") from None
    import ctypes

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = 0  # llama.cpp's default: every core
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise SpecdecError(f"llama.cpp could not requantise {source.name} to {ftype} (status {status})")
