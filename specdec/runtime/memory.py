"""What a request needs in memory, and a server's budget for it (`specdec serve --memory-budget`).

A request's need is known before it starts: the KV cache of its prompt and its max_tokens (and a draft's
worth more) in the target's cache and in the draft model's, plus the activations of its largest forward --
a chunk of its prompt's prefill where the runner prefills in chunks (specdec.backends.base.forward_chunked),
the whole prompt where it does not -- and the logits of a verification.  Each runner declares its own
numbers (ModelRunner.footprint: per cached token, per row).

:class:`MemoryBudget` admits requests while their needs fit: one that can never fit is refused at once
(the server's 413), one that cannot fit now waits until the running ones release theirs.  Memory outside
the requests (the weights, the tokenizer, Python) is not in it: the default budget is a share of what the
machine has available once the models are loaded (:func:`default_budget`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
from dataclasses import dataclass
from functools import cache

from specdec.backends.base import PREFILL_CHUNK, Footprint
from specdec.errors import SpecdecError

# A draft's worth of tokens beyond prompt + max_tokens: a verification's rows (a chain of k + 1, or a token tree's
# nodes) are cached before the rejected ones are rolled back, and their logits computed together.
DRAFT_ROWS = 64
# The default budget: this share of MemAvailable once the models are loaded.  The rest is headroom for what
# the budget does not count: the allocator's fragmentation and per-thread arenas, a cache's copy while it
# grows, tokenization and HTTP buffers, and the page cache the kernel may still reclaim (MemAvailable counts
# it, but a model mapped from its file runs slowly once it is evicted).
DEFAULT_SHARE = 0.75
# Between requests a runner keeps this many of its cached tokens (a conversation's earlier turns, a system
# prompt: prefix reuse) and frees the rest of its cache (ModelRunner.trim); a budget holds their memory aside.
RETAIN_TOKENS = 2048
# A request whose runners freed at least this much of their caches (a long one) then calls malloc_trim
# (return_freed_memory): a few milliseconds, worth it only after a large free.
TRIM_RETURN_BYTES = 16 << 20

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
          "ti": 2**40, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A size as a user writes it: bytes ("4000000000"), or a number with a unit, binary ("4GiB", "512MiB",
    "1.5Gi") or decimal ("4GB", "4G"); a one-line SpecdecError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise SpecdecError(f"not a size: {text!r} (give bytes, or a number with a unit: 4GiB, 512MiB, 8GB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise SpecdecError(f"a size must be > 0, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Bytes in binary units with one decimal: "4.0 GiB", "512.0 MiB", "900 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def available_bytes() -> int | None:
    """What the machine can still give without swapping: Linux's MemAvailable (free memory plus the page cache
    and slabs the kernel can reclaim), else free physical pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_budget() -> tuple[int, int] | None:
    """(the default budget, the available memory it is a share of), measured now -- once the models are
    loaded; None where the available memory cannot be read."""
    available = available_bytes()
    return None if available is None else (int(available * DEFAULT_SHARE), available)


@dataclass(frozen=True)
class Need:
    """One request's memory: its KV caches' and its largest forward's activations', for `prompt` + `max_tokens`."""

    prompt: int
    max_tokens: int
    cache_bytes: int
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.cache_bytes + self.activation_bytes

    def describe(self) -> str:
        return (f"{format_bytes(self.total)} of KV cache and activations for {self.prompt:,} + {self.max_tokens:,} "
                "tokens")


def request_need(target: Footprint, draft: Footprint | None, prompt: int, max_tokens: int) -> Need:
    """The memory a request of `prompt` tokens asking for `max_tokens` needs from runners of these footprints
    (`draft`: the draft model's, None without one).  Each cache holds prompt + max_tokens + DRAFT_ROWS tokens
    at most; the target's and the draft's forwards run one after another, so the larger activations count."""
    tokens = prompt + max_tokens + DRAFT_ROWS
    footprints = [target] if draft is None else [target, draft]
    cache_bytes = sum(f.cache_bytes_per_token for f in footprints) * tokens
    activations = 0
    for f in footprints:
        rows = max(min(prompt, PREFILL_CHUNK) if f.chunked else prompt, DRAFT_ROWS)
        activations = max(activations, rows * f.row_bytes + DRAFT_ROWS * f.logits_row_bytes)
    return Need(prompt, max_tokens, cache_bytes, activations)


class MemoryBudget:
    """Bytes shared by the running requests: `total`, of which `held` stays aside (the caches runners keep
    between requests, RETAIN_TOKENS each).  A request reserves its need before it starts and releases it when
    it ends; :meth:`reserve` waits while it does not fit."""

    def __init__(self, total: int, held: int = 0) -> None:
        self.total, self.held = int(total), int(held)
        self._reserved = 0  # by the running requests
        self._cond = threading.Condition()

    @property
    def room(self) -> int:
        """The most one request may need: the budget less what is held aside."""
        return self.total - self.held

    @property
    def reserved(self) -> int:
        """Bytes reserved now: the running requests' needs and what is held aside."""
        return self._reserved + self.held

    def reserve(self, need: int, cancelled: threading.Event | None = None, poll_s: float = 0.05) -> bool:
        """Reserve `need` bytes, waiting until the running requests leave room; False (nothing reserved)
        if `cancelled` is set meanwhile.  A need over `room` would wait for ever: a ValueError."""
        if need > self.room:
            raise ValueError(f"a need of {need} bytes never fits a room of {self.room}")
        with self._cond:
            while self._reserved + need > self.room:
                if cancelled is not None and cancelled.is_set():
                    return False
                self._cond.wait(poll_s)
            self._reserved += need
            return True

    def release(self, need: int) -> None:
        with self._cond:
            self._reserved = max(0, self._reserved - need)
            self._cond.notify_all()


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def return_freed_memory() -> bool:
    """Give the pages the allocator holds free back to the OS (glibc's malloc_trim(0): the top of every arena
    and the free pages inside them); False where the C library has no malloc_trim (musl, macOS).  A large
    tensor freed goes back on its own where it was mmapped, but glibc raises its mmap threshold as such
    blocks are freed (up to 32 MiB), so a long request's per-layer caches may come from an arena instead."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
