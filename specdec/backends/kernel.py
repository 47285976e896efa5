"""specdec's own int8 matrix kernel for the CPU: built from C at first use, called through ctypes.

The int8 linear of :mod:`specdec.backends.quant` (weights int8 per output
channel, activations int8 per token: "W8A8", as in LLM.int8() -- Dettmers et
al. 2022 -- and ZeroQuant -- Yao et al. 2022) runs here.  A one-token decode
step is bound by memory bandwidth (each weight byte is read once), so the
kernel streams tiled int8 weights with prefetch, multiplying with AVX2
(``vpmaddubsw`` on |q| and sign(q)*w, two of them added in 16 bits, then
``vpmaddwd``: exact int32 sums, no 16-bit saturation since
2 * (2 * 63 * 127) < 2^15) or, where the CPU has AVX-512 VNNI, with
``vpdpbusd`` on w + 128 and q (minus 128 * sum(q): the same exact int32
sums, four times the multiplies per instruction), and does no per-call work
but the activation quantization.

Numerics, per output element (the same expression for every element of every
call, hence **batch-invariant**: a token's outputs do not depend on the other
rows, their number, the tiling or the threads):

    s_m   = max_k |x[m, k]|                  (a NaN or inf in the row: that row's outputs are NaN)
    q     = round_half_even(x[m, k] * (63 / s_m))       in [-63, 63]  (7 bits)
    acc   = sum_k q[k] * W[n, k]                        (int32, exact)
    y     = ((float) acc * wscale[n]) * (s_m / 63)   (+ bias[n])

The C source (``kernels/int8_linear.c``) is compiled once per source, compiler
and flags into ``~/.cache/specdec/kernels/`` with ``-O3 -ffp-contract=off``
and no ``-march`` flag: the AVX2 and AVX-512 VNNI functions carry target
attributes and are chosen at run time, with a portable C path (the same int32
sums, hence the same numbers) on CPUs without AVX2.  Every path gives the same
bits, so which CPU ran a model never changes its output.  A machine without a C compiler gets a
one-line error naming the missing compiler.

Threads: the kernel is built with OpenMP and links ``libgomp.so.1``, which
resolves to the OpenMP runtime torch has already loaded: its threads are
torch's own (``torch.get_num_threads()`` of them), so the kernel and torch's
operations never fight over cores (a private thread pool measured 20-40%
slower per step on 2 cores: the two pools' spinning threads took turns).
Output channels are claimed in chunks dynamically; which thread computes a
chunk changes no number.  Without OpenMP in the compiler the kernel runs on
one thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

from specdec.errors import SpecdecError

SOURCE = Path(__file__).with_name("kernels") / "int8_linear.c"
ATTENTION_SOURCE = SOURCE.with_name("attention.c")
INT4_SOURCE = SOURCE.with_name("int4_linear.c")  # group-wise 4-bit weights, for draft models (specdec.backends.int4)
INT4_LAYERS_SOURCE = SOURCE.with_name("int4_layers.c")  # an int4 draft's decoder layers in one call
SOURCES = (SOURCE, ATTENTION_SOURCE, INT4_SOURCE, INT4_LAYERS_SOURCE)  # compiled into one library
FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
OPENMP = ["-fopenmp"]  # threads: torch's own OpenMP runtime (see the module doc); built without when cc lacks it
ALIGN = 64  # weight rows are padded with zeros to a multiple of this many columns
TILE = 4  # output channels per tile of the packed layout (TILE_N in the C source)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise SpecdecError("--dtype int8 needs a C compiler to build its kernel once (install gcc, or set CC)")


def _build(cache: Path) -> Path:
    """Compile the kernel into `cache` (once per source, compiler and flags) and return the library."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(_source_bytes() + repr((version, FLAGS, OPENMP, sys.platform)).encode()).hexdigest()[:16]
    library = cache / f"specdec-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    errors = ""
    for extra in (OPENMP, []):  # without OpenMP the kernel runs on one thread, with the same numbers
        done = subprocess.run([compiler, *FLAGS, *extra, *map(str, SOURCES), "-o", str(partial), "-lm"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            partial.replace(library)  # atomic: a concurrent build writes the same file
            return library
        errors = done.stderr.strip()
    raise SpecdecError(f"building the int8 kernel with {compiler} failed: {errors.splitlines()[-1:] if errors else ''}")


def library() -> ctypes.CDLL:
    """The loaded kernel (built at first use; torch is imported first, so its OpenMP runtime is the one)."""
    global _lib
    if _lib is not None:  # the hot path: every linear asks
        return _lib
    with _lock:
        if _lib is None:
            from specdec.zoo import home

            lib = ctypes.CDLL(str(_build(home() / "kernels")))
            i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
            lib.sd_linear.argtypes = [ptr, ptr, ptr, i32, i32, i32, ptr, i64, i32, ptr, i64, i32, i32]
            lib.sd_linear.restype = i32
            lib.sd_pack.argtypes = [ptr, i32, i32, i32, ptr]
            lib.sd_pack.restype = None
            lib.sd_isa.restype = i32
            flt = ctypes.c_float
            lib.sd_attention.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i32, i32, i32, i32, i32, flt, i32,
                                         ptr, i64, i64, i32, i32]
            lib.sd_attention.restype = i32
            lib.sd_attention_isa.restype = i32
            lib.sd_openmp.restype = i32
            lib.sd_linear4.argtypes = [ptr, ptr, ptr, i32, i32, i32, ptr, i64, i32, ptr, i64, i32, i32]
            lib.sd_linear4.restype = i32
            lib.sd_pack4.argtypes = [ptr, ptr, ptr, i32, i32, i32, ptr, ptr]
            lib.sd_pack4.restype = None
            lib.sd_pack4_int8.argtypes = [ptr, ptr, i32, i32, i32, ptr, ptr, i32]
            lib.sd_pack4_int8.restype = None
            lib.sd_isa4.restype = i32
            lib.sd_int4_layers.argtypes = [ptr, i32, i32, i32, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr,
                                           i32, i32, i32, i32, i32, flt, i32]
            lib.sd_int4_layers.restype = i32
            _lib = lib
        return _lib


def _source_bytes() -> bytes:
    return b"".join(path.read_bytes() for path in SOURCES)


def version() -> str:
    """A short hash of the kernels' sources: what a cached timing of an int8 model depends on."""
    return hashlib.sha256(_source_bytes()).hexdigest()[:12]


PATHS = {"c": 1, "avx2": 2, "avx512-vnni": 3}  # the kernel's paths (ISA_* in the C source), slowest first


def isa() -> str:
    """The path the kernel takes on this CPU: "avx512-vnni", "avx2" or "c"."""
    code = library().sd_isa()
    return next(name for name, value in PATHS.items() if value == code)


def paths() -> list[str]:
    """Every path this CPU can run (tests compare their outputs bit for bit)."""
    best = library().sd_isa()
    return [name for name, value in PATHS.items() if value <= best]


def threaded() -> bool:
    """Whether the kernel was built with OpenMP (else it runs on one thread)."""
    return bool(library().sd_openmp())


def padded(k: int) -> int:
    return -(-k // ALIGN) * ALIGN


def pack(weight: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] -> the kernel's tiled layout, [ceil(N / TILE) * TILE, padded(K)] bytes (zero-padded)."""
    n, k = weight.shape
    out = torch.empty(-(-n // TILE) * TILE, padded(k), dtype=torch.int8)
    w = weight.contiguous()
    library().sd_pack(w.data_ptr(), n, k, out.shape[1], out.data_ptr())
    return out


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 weight [n, k] back from :func:`pack`'s layout (tile, 32-column chunk, row, byte)."""
    rows, kp = packed.shape
    tiled = packed.view(rows // TILE, kp // 32, TILE, 32).permute(0, 2, 1, 3)  # [tiles, TILE, chunks, 32]
    return tiled.reshape(rows, kp)[:n, :k].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, in_features: int, scale: torch.Tensor,
           bias: torch.Tensor | None, path: str | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> y [M, N] fp32 (see the module doc); packed [N, padded(K)] from :func:`pack`,
    scale [N] fp32, bias [N] fp32 or None.  path: one of :func:`paths` instead of the best (for tests)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected fp32 [M, {in_features}] input, got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], scale.shape[0]
    y = torch.empty(m, n)
    status = library().sd_linear(
        packed.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), n, in_features,
        packed.shape[1], x.data_ptr(), x.stride(0), m, y.data_ptr(), n, torch.get_num_threads(), PATHS[path] if path else 0,
    )
    if status != 0:
        raise MemoryError("int8 kernel: out of memory")
    return y


INT4_PATHS = {"c": 1, "avx2": 2}  # the int4 kernel's paths (ISA4_* in int4_linear.c), slowest first
GROUP = 32  # int4 weights: columns per scale and minimum


def int4_paths() -> list[str]:
    """Every path of the int4 kernel this CPU can run (tests compare their outputs bit for bit)."""
    best = library().sd_isa4()
    return [name for name, value in INT4_PATHS.items() if value <= best]


def _int4_buffers(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 layout's (bytes, fp16 scales and minimums) for an [n, k] layer, uninitialised (the packers
    fill them)."""
    rows, kp = -(-n // TILE) * TILE, padded(k)
    return torch.empty(rows, kp // 2, dtype=torch.uint8), torch.empty(rows * kp // GROUP * 2, dtype=torch.float16)


def pack4(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [N, K] in [0, 15] and fp16 scales and minimums [N, ceil(K / GROUP)] (w ~ value * scale + min of
    the column's group) -> the int4 kernel's layout: (bytes [ceil(N / TILE) * TILE, padded(K) / 2] uint8,
    scales and minimums [ceil(N / TILE) * TILE * padded(K) / GROUP * 2] fp16)."""
    n, k = values.shape
    for name, t in (("scales", scales), ("minimums", mins)):
        if t.shape != (n, -(-k // GROUP)):
            raise ValueError(f"int4 {name} must be [{n}, {-(-k // GROUP)}], got {list(t.shape)}")
    out, out_scales = _int4_buffers(n, k)
    v = values.to(torch.uint8).contiguous()
    sc, mn = scales.to(torch.float16).contiguous(), mins.to(torch.float16).contiguous()
    library().sd_pack4(v.data_ptr(), sc.data_ptr(), mn.data_ptr(), n, k, padded(k), out.data_ptr(),
                       out_scales.data_ptr())
    return out, out_scales


def pack4_int8(values: torch.Tensor, row_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 layer (values [N, K] int8, per-channel scales [N]) quantized to int4 and packed in one pass:
    the same as pack4(*int4.quantize_int4(values * row_scales[:, None])), without the fp32 copy."""
    n, k = values.shape
    out, out_scales = _int4_buffers(n, k)
    v, sc = values.to(torch.int8).contiguous(), row_scales.float().contiguous()
    library().sd_pack4_int8(v.data_ptr(), sc.data_ptr(), n, k, padded(k), out.data_ptr(), out_scales.data_ptr(),
                            torch.get_num_threads())
    return out, out_scales


def linear4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int,
            bias: torch.Tensor | None, path: str | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> y [M, N] fp32 through the int4 kernel (packed, scales from :func:`pack4`; bias
    [N] fp32 or None).  path: one of :func:`int4_paths` instead of the best (for tests)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected fp32 [M, {in_features}] input, got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, out_features)
    status = library().sd_linear4(
        packed.data_ptr(), scales.data_ptr(), None if bias is None else bias.data_ptr(), out_features, in_features,
        packed.shape[1] * 2, x.data_ptr(), x.stride(0), m, y.data_ptr(), out_features, torch.get_num_threads(),
        INT4_PATHS[path] if path else 0,
    )
    if status != 0:
        raise MemoryError("int4 kernel: out of memory")
    return y


ATTENTION_PATHS = {"c": 1, "avx2": 2, "avx512": 3}  # the attention's paths (ATT_* in attention.c), slowest first


def attention_paths() -> list[str]:
    """Every attention path this CPU can run (tests compare their outputs bit for bit)."""
    best = library().sd_attention_isa()
    return [name for name, value in ATTENTION_PATHS.items() if value <= best]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
              window: int | None = None, path: str | None = None) -> torch.Tensor:
    """Exact causal attention, each query row on its own (see kernels/attention.c for the numbers).

    q [H, n, D] fp32: the queries of positions start .. start + n - 1; keys, values [H_kv, >= start + n, D]
    fp32 (positions 0 .. start + n - 1 are read; query head h reads key/value head h // (H / H_kv)).
    window: a sliding window's size (None: the whole context).  Returns [n, H * D].  A row's result is
    bitwise the same whatever the other rows, their number and the threads, on every path.
    """
    heads, n, d = q.shape
    kv_heads = keys.shape[0]
    if (q.dtype, keys.dtype, values.dtype) != (torch.float32,) * 3 or keys.shape != values.shape:
        raise ValueError("attention wants fp32 q, keys and values, keys and values of one shape")
    if keys.shape[1] < start + n or keys.shape[2] != d or heads % kv_heads:
        raise ValueError(f"attention: q {list(q.shape)} at {start} does not fit keys {list(keys.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if keys.stride(2) != 1 or values.stride() != keys.stride():
        keys, values = keys.contiguous(), values.contiguous()
    out = torch.empty(n, heads * d)
    status = library().sd_attention(
        q.data_ptr(), q.stride(0), q.stride(1), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
        n, start, heads, kv_heads, d, scale, window or 0, out.data_ptr(), heads * d, d, torch.get_num_threads(),
        ATTENTION_PATHS[path] if path else 0,
    )
    if status != 0:
        raise MemoryError("attention kernel: out of memory")
    return out
