"""llama.cpp backend: a ModelRunner over a GGUF model through llama-cpp-python's C API.

One ``forward`` is one ``llama_decode`` call (split into chunks of ``n_batch``
tokens for long prompts) that asks for logits only at the positions the
caller wants, so llama.cpp's output buffer holds at most ``last_n`` rows and
no n_ctx × vocab score matrix is ever filled.  Rollback removes the rejected
cells from the KV cache (``llama_memory_seq_rm``) and truncates ``tokens``.

Exactness.  Speculative greedy decoding equals plain greedy decoding only if
the target's logits for a token do not depend on how many tokens were
evaluated with it.  Stock llama.cpp (0.3.36's ggml) breaks that on CPUs: for
a batch it switches to other kernels, which sum in another order; the
rounding grows through the layers (measured up to 0.6-0.75 in the logits of
the Qwen models) and flips near-ties.  Measured on Qwen2.5-Coder-1.5B
(Q4_K_M) and 0.5B (Q5_0/Q8_0), batched vs one-token logits after a prompt:

- repacked Q4_0/Q4_K/IQ4_NL weights: a GEMM for n >= 4 (a GEMV below);
- the tiled K-quant GEMM (Q4_K/Q5_K/Q6_K...): n >= 8;
- llamafile's tinyBLAS, the attention products (F16 K/V): n >= 2;
- flash attention: a split-KV path for n == 1 once the cache holds >= 512
  tokens (with more than one thread), a tiled path for n >= 64.

With all four out of the way every row goes through the same vec_dot
kernels at any batch size, and batched logits are bitwise equal to one-token
logits (checked for k = 2..16 up to 640 tokens of context; smollm2's Q4_1
has none of these paths).  ``exact=True`` (the default) therefore:

- loads weights without repacking (``use_extra_bufts = false``),
- turns the tiled K-quant GEMM off (``GGML_CPU_TILED_MM=0``, read once per
  process, so it is set when this module is imported unless already set),
- disables flash attention and op offload, and keeps all layers on the CPU,
- and, when the library was built with llamafile's tinyBLAS (``LLAMAFILE = 1``
  in ``llama_print_system_info()``: stock builds) or with ARM int8 matmul
  kernels, which cannot be switched off at run time, evaluates every forward
  on a non-empty cache one token at a time ("sequential"): the output is
  still exact, only verification is no longer batched.
  ``scripts/install-llamacpp.sh`` builds without llamafile, so verification
  stays batched and exact.

The price: no repacking and no tiled GEMM make single-token decoding and
prompt processing slower (BENCHMARKS.md, component timings).

``exact=False`` keeps llama.cpp's fastest kernels (repacking on); use it for
draft models, whose numerics never affect the output.

Token trees (issue 39, ModelRunner.forward_tree): not offered (``capabilities.tree`` False).
llama.cpp could mask a tree through sequence ids (one per leaf, the shared
ancestors' cells in several sequences) and positions by depth, but whether its
attention then sums a node's keys in the order a chain over its path does --
which the exactness above needs -- is not something it promises or that could
be checked here, so the decode loop verifies chains on this backend.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from specdec.backends.base import Capabilities, Footprint, Refusals, cannot_clone
from specdec.errors import SpecdecError

if TYPE_CHECKING:  # torch only wraps the logits (LlamaCppRunner.forward): checking a spec needs none of it
    import torch

# 4096 tokens: prompt + generation of the CLI and the benchmark with room to
# spare.  Memory is the f16 KV cache (Qwen2.5-Coder-1.5B: 28 KiB per token ->
# 112 MiB; 0.5B: 48 MiB; SmolLM2-135M: 90 MiB) plus compute buffers that grow
# with n_ctx × n_ubatch; logits are only ever kept for the rows asked for.
DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512  # tokens per llama_decode call (longer prompts are chunked)

TILED_MM_ENV = "GGML_CPU_TILED_MM"
# Read by ggml once per process at the first matrix multiplication: set it before any.
os.environ.setdefault(TILED_MM_ENV, "0")

EVAL_MODES = ("auto", "batched", "sequential")


class Session(Protocol):
    """What the runner needs from llama.cpp (a fake stands in for it in unit tests)."""

    n_vocab: int
    n_ctx: int
    n_batch: int
    path: str  # the .gguf file ("" for a fake)
    exact: bool  # loaded with the batch-invariant settings

    @property
    def n_threads(self) -> int | None:
        """The threads it computes on (None: llama.cpp's default)."""
        ...

    def decode(self, tokens: Sequence[int], start: int, outputs: int) -> np.ndarray:
        """Evaluate `tokens` at positions start, start+1, ...; return fp32 logits
        [outputs, n_vocab] for the last `outputs` of them (0 <= outputs <= len(tokens) <= n_batch)."""
        ...

    def remove(self, start: int) -> None:
        """Drop the cached cells at positions >= start."""
        ...

    def close(self) -> None:
        """Free the model and its context now (a fake has nothing to free)."""
        ...


def default_threads() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def import_llama_cpp() -> Any:
    """The llama_cpp module, or a SpecdecError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SpecdecError(
            "the llama.cpp backend needs llama-cpp-python: run scripts/install-llamacpp.sh "
            f"(or pip install 'specdec[llamacpp]') ({e})"
        ) from None
    # llama-cpp-python prints all of llama.cpp's logging unless its logger says otherwise, and its
    # level table predates ggml's DEBUG level (it prints warnings as errors and drops errors): unless
    # the user configured that logger, llama.cpp's errors alone reach stderr, through our callback.
    logger = logging.getLogger("llama-cpp-python")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)
        global _log_callback
        if _log_callback is None:
            _log_callback = llama_cpp.llama_log_callback(
                lambda level, text, user_data: print_llama_log(level, text))
            llama_cpp.llama_log_set(_log_callback, None)
    return llama_cpp


GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5  # ggml.h's enum ggml_log_level
_log_callback: Any = None  # the ctypes callback llama.cpp holds (kept alive here)
_last_log_level = 0


def print_llama_log(level: int, text: bytes) -> None:
    """llama.cpp's log messages -> stderr, errors only (a CONT piece continues the previous message)."""
    global _last_log_level
    if level != GGML_LOG_LEVEL_CONT:
        _last_log_level = level
    if _last_log_level == GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode("utf-8", errors="replace"))
        sys.stderr.flush()


def build_features() -> dict[str, str]:
    """The CPU backend's compile-time features, e.g. {"AVX2": "1", "LLAMAFILE": "1", "REPACK": "1"}."""
    llama_cpp = import_llama_cpp()
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    features: dict[str, str] = {}
    for part in info.replace("\n", "|").split("|"):
        if "=" in part:
            key, _, value = part.partition("=")
            features[key.strip().split(":")[-1].strip()] = value.strip()
    return features


def batch_invariant_build(features: dict[str, str] | None = None) -> bool:
    """Whether this llama.cpp build can evaluate a batch with the same numbers as one token at a time
    (given exact=True's run-time settings).  llamafile's tinyBLAS (x86, non-int8 ARM) and ARM's
    int8 matmul (two rows at once) kernels are compiled in and used for any batch of 2 or more."""
    features = build_features() if features is None else features
    if features.get("LLAMAFILE") == "1" or features.get("MATMUL_INT8") == "1" or features.get("KLEIDIAI") == "1":
        return False
    return os.environ.get(TILED_MM_ENV) == "0"


class LlamaCppSession:
    """A llama.cpp model + context + batch, driven through the C API of llama-cpp-python."""

    def __init__(
        self,
        path: str | Path,
        n_ctx: int = DEFAULT_N_CTX,
        n_batch: int = DEFAULT_N_BATCH,
        n_threads: int | None = None,
        exact: bool = True,
        n_gpu_layers: int = 0,
    ) -> None:
        llama_cpp = import_llama_cpp()
        self._lib = llama_cpp
        self.path = str(path)
        if not Path(path).is_file():
            raise SpecdecError(f"no such GGUF file: {path}")
        if n_ctx < 1:
            raise SpecdecError(f"n_ctx must be >= 1, got {n_ctx}")
        llama_cpp.llama_backend_init()

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        if exact:
            mparams.use_extra_bufts = False  # no weight repacking (its GEMM differs from its GEMV)
        model = llama_cpp.llama_model_load_from_file(self.path.encode("utf-8"), mparams)
        if not model:
            raise SpecdecError(f"llama.cpp cannot load {path} (not a GGUF model it supports?)")

        threads = n_threads or default_threads()
        self.n_batch = max(1, min(n_batch, n_ctx))
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch  # one physical batch per call: the kernels see the whole batch
        cparams.n_seq_max = 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.swa_full = True  # sliding-window models (Gemma 3) keep every cell, so any rollback works
        cparams.no_perf = True
        if exact:
            cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            cparams.op_offload = False
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise SpecdecError(f"llama.cpp cannot create a context of {n_ctx} tokens for {path} (out of memory?)")

        self.model, self.ctx = model, ctx
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(model))
        self.n_threads = threads
        self.exact = exact
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.memory = llama_cpp.llama_get_memory(ctx)
        self._finalizer = weakref.finalize(self, _free, llama_cpp, model, ctx, self.batch)

    # --- the Session protocol ---------------------------------------------

    def decode(self, tokens: Sequence[int], start: int, outputs: int) -> np.ndarray:
        n = len(tokens)
        if not 0 < n <= self.n_batch or not 0 <= outputs <= n:
            raise ValueError(f"decode of {n} tokens with {outputs} outputs (n_batch {self.n_batch})")
        batch = self.batch
        batch.n_tokens = n
        first_output = n - outputs
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i >= first_output
        status = self._lib.llama_decode(self.ctx, batch)
        if status != 0:
            self.remove(start)  # a failed call may leave some of its ubatches in the cache
            raise SpecdecError(f"llama_decode failed with status {status} at position {start} ({n} tokens)")
        if outputs == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = self._lib.llama_get_logits(self.ctx)  # the output rows, in batch order
        return np.ctypeslib.as_array(ptr, shape=(outputs * self.n_vocab,)).reshape(outputs, self.n_vocab).copy()

    def remove(self, start: int) -> None:
        if not self._lib.llama_memory_seq_rm(self.memory, 0, start, -1):
            raise SpecdecError(f"llama.cpp could not remove the cache from position {start}")

    # --- extras --------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """llama.cpp's own tokenization (the runner uses a transformers tokenizer; this checks it)."""
        data = text.encode("utf-8")
        size = len(data) + 8
        buf = (self._lib.llama_token * size)()
        n = self._lib.llama_tokenize(self.vocab, data, len(data), buf, size, add_special, parse_special)
        if n < 0:
            size = -n
            buf = (self._lib.llama_token * size)()
            n = self._lib.llama_tokenize(self.vocab, data, len(data), buf, size, add_special, parse_special)
        return list(buf[:n])

    def eos_token_ids(self) -> frozenset[int]:
        eos = int(self._lib.llama_vocab_eos(self.vocab))
        return frozenset({eos} if eos >= 0 else set())

    def close(self) -> None:
        self._finalizer()


def _free(llama_cpp: Any, model: Any, ctx: Any, batch: Any) -> None:
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


class LlamaCppRunner(Refusals):  # no hidden states, no taps, no trees
    """A GGUF model evaluated by llama.cpp, with a KV cache that can be rolled back.

    eval_mode: "batched" evaluates all new tokens in one call; "sequential"
    evaluates the new tokens one at a time whenever the cache is not empty (the
    prompt of a request is still one batch); "auto" = batched unless exact
    evaluation needs sequential on this build (see the module docstring).
    """

    capabilities = Capabilities()
    model = None  # llama.cpp's model lives in the session

    def __init__(self, session: Session, eval_mode: str = "batched", eos_token_ids: frozenset[int] = frozenset(),
                 exact: bool = False) -> None:
        if eval_mode not in ("batched", "sequential"):
            raise ValueError(f"eval_mode must be 'batched' or 'sequential', got {eval_mode!r}")
        self.session = session
        self.eval_mode = eval_mode
        # exact: loaded with the batch-invariant settings (from_gguf(exact=True)); one token at a
        # time ("sequential") is trivially invariant too.
        # No hidden_states: llama-cpp-python gives a context's embeddings only in embedding mode, not with logits.
        self.capabilities = Capabilities(batch_invariant=exact or eval_mode == "sequential")
        self.vocab_size = int(session.n_vocab)
        self.max_context = int(session.n_ctx)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokens: list[int] = []

    @classmethod
    def from_gguf(
        cls,
        path: str | Path,
        n_ctx: int = DEFAULT_N_CTX,
        exact: bool = True,
        eval_mode: str = "auto",
        n_threads: int | None = None,
        n_batch: int = DEFAULT_N_BATCH,
    ) -> LlamaCppRunner:
        """Load a .gguf file.  exact: settings for batch-invariant logits (see the module docstring)."""
        if eval_mode not in EVAL_MODES:
            raise SpecdecError(f"unknown eval mode '{eval_mode}': expected one of {', '.join(EVAL_MODES)}")
        session = LlamaCppSession(path, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, exact=exact)
        if eval_mode == "auto":
            eval_mode = "sequential" if exact and not batch_invariant_build() else "batched"
        return cls(session, eval_mode, session.eos_token_ids(), exact=exact)

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        new_tokens = [int(t) for t in new_tokens]
        n = len(new_tokens)
        if not n:
            raise ValueError("forward needs at least one token")
        if len(self.tokens) + n > self.max_context:
            raise SpecdecError(
                f"context of {len(self.tokens) + n} tokens exceeds the llama.cpp context of "
                f"{self.max_context} (raise n_ctx)"
            )
        bad = [t for t in new_tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {self.vocab_size}")
        want = n if not last_n else min(last_n, n)
        step = 1 if self.eval_mode == "sequential" and self.tokens else self.session.n_batch
        rows: list[np.ndarray] = []
        for i in range(0, n, step):
            chunk = new_tokens[i : i + step]
            outputs = max(0, min(len(chunk), i + len(chunk) - (n - want)))
            rows.append(self.session.decode(chunk, len(self.tokens), outputs))
            self.tokens.extend(chunk)  # only what is in the cache, should a later chunk fail
        logits = rows[0] if len(rows) == 1 else np.concatenate(rows)
        import torch

        return torch.from_numpy(logits)  # [want, V] fp32

    def rollback(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"rollback to a negative length {n}")
        if n >= len(self.tokens):
            return
        self.session.remove(n)
        del self.tokens[n:]

    def reset(self) -> None:
        self.session.remove(0)
        self.tokens = []

    def footprint(self) -> Footprint:
        """Nothing per request: llama.cpp allocates its context's KV cache (n_ctx tokens) and its compute
        buffers when the model is loaded (ModelRunner.footprint), so they are in what the machine has left then."""
        return Footprint()

    def expect(self, tokens: int) -> None:
        """Nothing to make room for: the context of n_ctx tokens is allocated already."""

    def trim(self, tokens: int) -> int:
        """Keep the first `tokens` cached tokens; the context's memory stays allocated (ModelRunner.trim): 0."""
        self.rollback(min(len(self.tokens), max(0, int(tokens))))
        return 0

    def clone(self) -> LlamaCppRunner:
        raise cannot_clone(self)

    def describe(self) -> str:
        return "llama.cpp"

    def identity(self) -> dict[str, Any]:
        session = self.session
        return {"backend": "llama.cpp", "model": str(session.path), "exact": bool(session.exact),
                "mode": self.eval_mode, "threads": int(session.n_threads or 0)}

    def close(self) -> None:
        """Free the model and its context now (they are also freed when the runner is collected)."""
        self.session.close()
