"""Default models: the zoo's same-tokenizer pair (see ``specdec models``)."""

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
