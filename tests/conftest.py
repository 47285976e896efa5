"""Test configuration.

Tiny models run far faster on one thread (no thread hand-off per tiny matmul),
so the suite uses one; tests of real models raise it for their own duration
with :func:`real_model_threads`.
"""

from contextlib import contextmanager
from typing import Iterator

import torch

torch.set_num_threads(1)


@contextmanager
def real_model_threads() -> Iterator[None]:
    """Both cores while real models run, then back to one."""
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(1)
