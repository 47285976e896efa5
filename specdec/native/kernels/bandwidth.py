"""The memory's read bandwidth (bandwidth.c): what a one-token step that streams every weight once can reach.

specdec.runtime.profile.measure_roof sets a runner's one-token step against it (its roof).
"""

from __future__ import annotations

import torch

from specdec.errors import SpecdecError
from specdec.native.kernels.bindings import library


def read_bandwidth(threads: int | None = None, size: int = 1 << 30, passes: int = 3) -> float | None:
    """The memory's read bandwidth in GB/s: the best of `passes` streaming reads of a `size`-byte buffer (far
    larger than the caches; huge pages where the kernel allows, as the gguf target's weights) on `threads`
    threads (default: torch's), by specdec's kernel library (bandwidth.c).  None where the library
    cannot be built (no C compiler) or the buffer cannot be had."""
    try:
        rate = library().sd_read_bandwidth(int(size), int(threads or torch.get_num_threads()), int(passes), None)
    except SpecdecError:
        return None
    return float(rate) if rate > 0 else None
