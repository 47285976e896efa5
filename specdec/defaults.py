"""Default models: the zoo's same-tokenizer pair (see ``specdec models``), and the default drafter.

``specdec generate``, ``specdec serve``, ``specdec bench`` and ``specdec.generate`` draft with
DEFAULT_DRAFTER, "auto" (specdec.drafters.spec.resolve_drafter): when a draft head was trained for the
target (``specdec train-drafter``; saved in ``$SPECDEC_HOME/drafters/<target>-head/``) and the target runs on
transformers (whose runners give the hidden states a head reads), ``lookup+head``: prompt lookup where the
context repeats itself, the head elsewhere; else prompt lookup before a zoo model that fits the target (its
tokenizer, at most a third of its parameters: specdec.drafters.choice), for the default target MODEL_DRAFTER:
prompt lookup where the context repeats itself (free), the 0.5B draft elsewhere (on specdec's int8 / int4
kernel or llama.cpp, whichever is faster on the CPU); where no zoo model fits (a gemma3 or SmolLM2 target),
MODEL_FREE_DRAFTER, prompt lookup alone.  Either way the cost-model controller chooses k each step (0 = a plain step), and
the target runs on its GGUF file's own blocks (a GGUF model) or in int8 (others) where specdec's exact
kernels run SIMD (dtype "auto"): the fastest lossless configuration measured on the project's CPUs
(BENCHMARKS.md; with the gguf target, lookup and suffix drafts measured as fast as this default on the
built-in set, and slower where the context has nothing to copy).
"""

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
MODEL_DRAFTER = f"lookup+{DEFAULT_DRAFT}"  # the default target's default without a trained head
MODEL_FREE_DRAFTER = "lookup"  # auto's drafter where no draft model fits the target (specdec.drafters.choice)
HEAD_DRAFTER = "lookup+head"  # the default with one
DEFAULT_DRAFTER = "auto"
# Suffix drafts (--draft suffix, suffix+<model>; specdec.drafters.suffix): the tokens of recent answers an
# engine keeps (--suffix-memory): 1,048,576, about 4,000 answers of 250 tokens (vLLM keeps 10,000
# requests), in ~20 MB of arrays (each token, its link to the previous occurrence, a hash bucket).
DEFAULT_SUFFIX_MEMORY = 1 << 20
