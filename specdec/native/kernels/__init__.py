"""specdec's own CPU kernels: C sources built into one library at first use, called through ctypes.

- ``specdec_kernels.h``: every exported C function's prototype and parameter struct;
  ``int8_linear.c``, ``int4_linear.c``, ``gguf_linear.c``, ``attention.c``, ``layers.c``: the kernels.
- :mod:`.build`: the compiler, its flags and the cached library (one per source, compiler and flags).
- :mod:`.bindings`: the library loaded, its functions typed from one signature table, the
  header's structs mirrored as ``ctypes.Structure`` classes.
- :mod:`.int8` (W8A8 linears), :mod:`.int4` (group-wise int4 linears), :mod:`.gguf` (linears on a
  GGUF file's own blocks), :mod:`.attention` (exact causal attention), :mod:`.layers` (a model's decoder
  layers in one call): the torch-facing functions, one module a kernel; :mod:`.bandwidth`, the memory's read
  bandwidth (``specdec profile``'s roof).

Every kernel computes each output row from its own input row in a fixed order of operations, on every
SIMD path (AVX-512, AVX2, portable C) alike: a token's numbers do not depend on the other rows of the
call, their number, the threads or the CPU.

``from specdec.native import kernels`` gives the kernel modules as ``kernels.int8``, ``kernels.int4``,
``kernels.gguf``, ``kernels.attention`` and ``kernels.layers``.
"""

from specdec.native.kernels import attention, gguf, int4, int8, layers

__all__ = ["attention", "gguf", "int4", "int8", "layers"]
