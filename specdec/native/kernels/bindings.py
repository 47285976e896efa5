"""The kernels' library through ctypes: the header's structs and one signature table, nothing written twice.

``specdec_kernels.h`` is the C side; here each of its structs is one ``ctypes.Structure`` with the
same fields in the same order, and :data:`SIGNATURES` gives every exported function's result and
argument types, from which :func:`library` types the loaded functions.  A test compares both with
the header (names, argument counts) and the structs' layouts with the C compiler's.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p

from specdec.native.kernels import build


class LinearParams(ctypes.Structure):
    """sd_linear_params: y [m, n] = x [m, k] W^T (+ bias), for sd_linear (int8) and sd_linear4 (int4)."""

    _fields_ = [("w", c_void_p), ("scales", c_void_p), ("bias", c_void_p), ("n", c_int), ("k", c_int),
                ("kp", c_int), ("x", c_void_p), ("ldx", c_int64), ("m", c_int), ("y", c_void_p),
                ("ldy", c_int64), ("threads", c_int), ("isa", c_int)]


class AttentionParams(ctypes.Structure):
    """sd_attention_params: exact causal attention of n query rows at positions start.., or of a token tree's
    rows (tree_at, tree_rows; attention.c)."""

    _fields_ = [("q", c_void_p), ("q_head", c_int64), ("q_row", c_int64), ("k", c_void_p), ("v", c_void_p),
                ("kv_head", c_int64), ("kv_row", c_int64), ("out", c_void_p), ("out_row", c_int64),
                ("out_head", c_int64), ("n", c_int), ("start", c_int), ("heads", c_int), ("kv_heads", c_int),
                ("d", c_int), ("scale", c_float), ("window", c_int), ("threads", c_int), ("isa", c_int),
                ("tree_at", c_void_p), ("tree_rows", c_void_p), ("softcap", c_float)]


class LayersModel(ctypes.Structure):
    """sd_layers_model: a model's decoder layers, the same in every call (layers.c): an int4 draft's or the gguf
    target's."""

    _fields_ = [("tensors", c_void_p), ("scaling", c_void_p), ("window", c_void_p), ("layers", c_int),
                ("hidden", c_int), ("heads", c_int), ("kv_heads", c_int), ("d", c_int), ("intermediate", c_int),
                ("act", c_int), ("eps", c_float), ("linear", c_int), ("isa", c_int), ("softcap", c_float)]


class LayersRows(ctypes.Structure):
    """sd_layers_rows: the new rows of one call of sd_layers, of one or more sequences (chains or token trees)."""

    _fields_ = [("x", c_void_p), ("total", c_int), ("runners", c_int), ("starts", c_void_p), ("sizes", c_void_p),
                ("caches", c_void_p), ("kv_head", c_void_p), ("cos", c_void_p), ("sin", c_void_p),
                ("threads", c_int), ("trees", c_void_p), ("taps", c_void_p)]


class GGUFPart(ctypes.Structure):
    """sd_gguf_part: one block of output columns of a linear on a GGUF file's blocks (gguf_linear.c)."""

    _fields_ = [("w", c_void_p), ("bias", c_void_p), ("type", c_int), ("n", c_int), ("col", c_int64)]


class GGUFParams(ctypes.Structure):
    """sd_gguf_params: y = x [W_0 | W_1 | ...]^T on a GGUF file's blocks (gguf_linear.c)."""

    _fields_ = [("parts", c_void_p), ("nparts", c_int), ("k", c_int), ("x", c_void_p), ("ldx", c_int64),
                ("m", c_int), ("y", c_void_p), ("ldy", c_int64), ("threads", c_int), ("isa", c_int)]


class DraftParams(ctypes.Structure):
    """sd_draft_params: a draft model's greedy chain of k tokens in one call (draft.c)."""

    _fields_ = [("model", c_void_p), ("caches", c_void_p), ("kv_head", c_int64), ("cos", c_void_p),
                ("sin", c_void_p), ("final_norm", c_void_p), ("head", c_void_p), ("head_parts", c_int),
                ("head_rows", c_int), ("head_ids", c_void_p), ("embed_type", c_int), ("embed", c_void_p),
                ("embed_rows", c_int64), ("threads", c_int), ("feed", c_void_p), ("nfeed", c_int), ("start", c_int),
                ("k", c_int), ("out", c_void_p)]


STRUCTS = {"sd_linear_params": LinearParams, "sd_attention_params": AttentionParams, "sd_layers_model": LayersModel,
           "sd_layers_rows": LayersRows, "sd_gguf_part": GGUFPart, "sd_gguf_params": GGUFParams,
           "sd_draft_params": DraftParams}  # the header's name of each

_ptr, _i32 = c_void_p, c_int
# Every function the header exports: name -> (result type, argument types).
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "sd_linear": (c_int, [POINTER(LinearParams)]),
    "sd_pack": (None, [_ptr, _i32, _i32, _i32, _ptr]),
    "sd_isa": (c_int, []),
    "sd_openmp": (c_int, []),
    "sd_linear4": (c_int, [POINTER(LinearParams)]),
    "sd_pack4": (None, [_ptr, _ptr, _ptr, _i32, _i32, _i32, _ptr, _ptr]),
    "sd_pack4_int8": (None, [_ptr, _ptr, _i32, _i32, _i32, _ptr, _ptr, _i32]),
    "sd_isa4": (c_int, []),
    "sd_attention": (c_int, [POINTER(AttentionParams)]),
    "sd_attention_isa": (c_int, []),
    "sd_isa_limit": (c_int, []),
    "sd_layers": (c_int, [POINTER(LayersModel), POINTER(LayersRows)]),
    "sd_rms_norm": (None, [_ptr, _i32, _i32, _ptr, c_float, _ptr]),
    "sd_rope_table": (None, [_ptr, _i32, _i32, c_float, c_float, _ptr, _ptr, _ptr]),
    "sd_gguf_linear": (c_int, [POINTER(GGUFParams)]),
    "sd_gguf_pack": (c_int, [_i32, _ptr, _i32, _i32, _ptr, _ptr, _i32]),
    "sd_gguf_packed_bytes": (c_int64, [_i32, _i32, _i32]),
    "sd_gguf_supported": (c_int, [_i32]),
    "sd_gguf_rows": (c_int, [_i32, _ptr, _i32, _ptr, _i32, _ptr]),
    "sd_gguf_isa": (c_int, []),
    "sd_read_bandwidth": (ctypes.c_double, [c_int64, _i32, _i32, _ptr]),
    "sd_draft_greedy": (c_int, [POINTER(DraftParams)]),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded library, its functions typed from SIGNATURES (built at first use; torch is imported
    first, so its OpenMP runtime is the one the kernels' threads run on)."""
    global _lib
    if _lib is not None:  # the hot path: every linear asks
        return _lib
    with _lock:
        if _lib is None:
            import torch  # noqa: F401  (its OpenMP runtime loaded before the library's)

            from specdec.machine import isa_limit
            from specdec.zoo import home

            isa_limit()  # a bad SPECDEC_ISA: one line, before the C side would ignore it

            lib = ctypes.CDLL(str(build.build(home() / "kernels")))
            for name, (restype, argtypes) in SIGNATURES.items():
                function = getattr(lib, name)
                function.restype, function.argtypes = restype, argtypes
            _lib = lib
        return _lib

