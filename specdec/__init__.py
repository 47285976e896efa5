"""specdec: lossless speculative decoding (assisted generation).

A cheap drafter proposes several tokens; the target model checks them all in
one forward pass; every accepted token is a decode step saved, and the output
is the target's own (Leviathan et al. 2023; Chen et al. 2023).

    >>> import specdec
    >>> out = specdec.generate("def fibonacci(n):", max_new_tokens=64)
    >>> out.text, out.stats.acceptance_rate
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET
from specdec.errors import SpecdecError
from specdec.machine import limit_torch_isa

limit_torch_isa()  # SPECDEC_ISA=avx2|c: torch's own kernels capped too, before anything imports torch

if TYPE_CHECKING:
    from specdec.algorithm.sampling import SamplingParams
    from specdec.constrain.spec import Constraint
    from specdec.request import RequestConfig
    from specdec.runtime.engine import Engine, ModelSpec, Result

__all__ = ["Constraint", "Engine", "RequestConfig", "Result", "SamplingParams", "SpecdecError", "generate"]
__version__ = "0.1.0"

# Imported on first use (PEP 562): `import specdec`, `specdec --help` and the CLI's error paths need no
# torch or transformers, which take seconds to import.
_LAZY = {"Engine": "specdec.runtime.engine", "Result": "specdec.runtime.engine", "RequestConfig": "specdec.request",
         "SamplingParams": "specdec.algorithm.sampling", "Constraint": "specdec.constrain.spec"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdec' has no attribute '{name}'")



def generate(
    prompt: str,
    target: ModelSpec = DEFAULT_TARGET,
    draft: ModelSpec | None = DEFAULT_DRAFTER,
    **options: Any,
) -> Result:
    """Generate a continuation of `prompt` with speculative decoding.

    target / draft: a zoo name (``specdec models``), a .gguf path, a model
    directory, a Hugging Face hub id, or an already-loaded ``(model, tokenizer)``
    pair, "lookup" (prompt lookup), "lookup+<model>" (lookup where it matches, the draft model
    elsewhere), "suffix" / "suffix+<model>" (suffix drafts: the context and the engine's recent answers,
    specdec.drafters.suffix), "recycle" / "recycle+<model>" (Token Recycling: the target's own top candidates
    from earlier forwards, specdec.drafters.recycling), "head" / "head:<dir>" / "lookup+head[:<dir>]" (a draft
    head trained for the target: specdec train-drafter), or "auto" (the default: "lookup+head" when a head was trained for the
    target and it runs on transformers, else "lookup+qwen2.5-coder-0.5b", the draft's backend chosen
    by draft_backend "auto").  draft=None (or "none") decodes plainly with the target alone.
    options: the models' (specdec.engine_config.EngineConfig's fields, with its defaults, as Engine.load takes
    them): dtype, the target's: "auto" (gguf for a GGUF model and int8 for others on CPUs where specdec's exact
    kernels run SIMD, fp32 elsewhere), "gguf" (a GGUF model's own blocks), "int8", "fp32" (the reference) or
    "bf16"; draft_dtype, backend, draft_backend, device, threads, draft_vocab...; and the request's
    (specdec.request.RequestConfig): max_new_tokens, num_speculative_tokens
    (default "auto": the cost-model controller), temperature, top_k, top_p, seed, stop, chat,
    draft_mode, draft_confidence, verify ("causal"; "block": sampled drafts verified as blocks; "stairs":
    next-token queries only, greedy), tree ("off", "auto", "WxD": token trees); see Engine.stream.
    Returns a Result with text, token_ids, finish_reason and stats.
    """
    from specdec.engine_config import load_options
    from specdec.request import RequestConfig
    from specdec.runtime.engine import Engine

    models = load_options()
    loading = {name: options.pop(name) for name in list(options) if name in models}
    config = RequestConfig.from_options(**options)  # a bad option is refused before anything loads
    engine = Engine.load(target, draft, **loading)
    return engine.generate(prompt, config)
