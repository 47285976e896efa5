"""Default models: the zoo's same-tokenizer pair (see ``specdec models``), and the default drafter.

``specdec generate`` (and ``specdec.generate``) draft with DEFAULT_DRAFTER: prompt lookup where the
context repeats itself (free), the 0.5B draft elsewhere (on llama.cpp when it is installed), with the
cost-model controller choosing k each step (0 = a plain step), the fastest lossless configuration
measured on the project's CPUs (BENCHMARKS.md).  The benchmark compares explicit configurations and
keeps DEFAULT_DRAFT as its draft model.
"""

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_DRAFTER = f"lookup+{DEFAULT_DRAFT}"
