"""specdec's native engine: its own C kernels and the runners over them, one of specdec's three runtimes
(specdec.runtime.runners names them: native-gguf, native-int8, native-int4; beside transformers and llama.cpp,
whose thin adapters are specdec.backends').

- ``kernels/``: the C sources (one library, built once per source and compiler: kernels/build.py), their ctypes
  bindings, and the Python side of each kernel: int8, int4 and GGUF-block linears, exact attention, whole layer
  stacks, a draft's greedy chain; ``SPECDEC_ISA`` caps their paths (specdec.machine).
- ``gguf``: a GGUF file's own blocks as a model (the gguf target; a draft requantised to Q4_1).
- ``lean``: the lean runner, the decode loop's runner over packed layers (int8, int4, fp32 batch slots, GGUF).
- ``quant`` (int8 weights and activations inside a transformers model), ``int4`` (a draft's 4-bit weights),
  ``fastlinear`` (fp32 products for a few rows), ``packcache`` (packed weights cached on disk), ``skeleton``
  (a cached int8 model without transformers' modelling code), ``modelconfig`` (what a model's config says).

Every format here is exact for a target: a token's logits are bitwise the same alone and inside a forward of
several (docs/guarantees.md), on every kernel path.
"""
