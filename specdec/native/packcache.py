"""Weights in the kernels' own layout, prepared once into the cache and memory-mapped at every later load.

The gguf target repacks its file's blocks 16 output channels a lane (:mod:`specdec.native.kernels.gguf`), an
int4 draft requantises its int8 weights (:mod:`specdec.native.int4`): seconds of work at every start that
give the same bytes every time.  Like llama.cpp, which maps its model file and reads the weights where they lie,
a load here maps a file that holds those bytes as the kernels read them: nothing is unpacked, repacked or
quantised, the pages come from the OS's page cache (two processes over one model share them), and on a
kernel that maps file pages in 2 MiB pieces (Linux with large folios, e.g. ext4 on 6.x: ``FilePmdMapped`` in
``/proc/PID/smaps``) a step streams through them with as few TLB misses as from the anonymous huge-page arena.

**One file per model and kind** (``$SPECDEC_HOME/packed/<kind>-<hash of the source's path>.bin``): a header
(JSON: the key, every tensor's name, dtype, shape and place, CRC-32s of sampled pages) and then the tensors,
the first 2 MiB aligned, each 4 KiB aligned.  The key names everything the bytes depend on: the source file
(its path, size and modification time), the kernels' sources (their hash), the format, and the CPU (its name
and vector extensions); a file whose key differs (another CPU or build, a changed model) is never used but
rebuilt in place, which also evicts it: a model has one file, not one per build it ever ran with.

**Written once, atomically.**  A load that built its tensors hands them to :meth:`PackCache.save`, which writes
them from memory in a background thread (the process goes on to prefill and decode meanwhile; a process that ends
first hands what is left to a child process, so that it ends at once) into a temporary file renamed into place
when complete, so a file at the cache's path is always whole; the writing thread runs at the lowest CPU priority.
A file that is truncated or damaged (size, magic, header or a sampled page's CRC) is rebuilt with one line on
stderr saying so.  A cache that cannot be written (read-only, full) costs the packing next time, nothing else.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import mmap
import os
import sys
import threading
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MAGIC = b"SDPACK01"
FORMAT = 1
DATA_ALIGN = 2 << 20  # the tensors start on a huge-page boundary of the file
ALIGN = 4096  # each tensor starts on a page
SAMPLES = 64  # pages whose CRC-32 the header keeps (a cheap check of the data at every load)
CHUNK = 64 << 20  # bytes per write call (the GIL is released during each)

# the writes under way: (thread, cache, its tensors, set once the thread is done with torch: see _write)
_writers: list[tuple[threading.Thread, PackCache, dict[str, torch.Tensor], threading.Event]] = []


def wait_for_writes() -> None:
    """Let the cache files being written finish."""
    while _writers:
        _writers.pop()[0].join()


def _finish_at_exit() -> None:
    """At exit: the writes still under way are finished by a child process (os.fork: the tensors are the parent's
    memory, copied on write), so that the process ends at once -- a first run would otherwise wait seconds for
    its 1-2 GB of cache to reach the disk.  The child writes each file afresh to a temporary file of its own
    and renames it when whole (the parent's half-written one is cleaned up by a later write).  Where fork is
    not available the process waits for them."""
    pending = [(cache, tensors) for thread, cache, tensors, _ in _writers if thread.is_alive()]
    for thread, _, _, past_torch in _writers:  # this process ends with the writers still running, and a thread
        # stopped inside a torch call as the interpreter finalises aborts it ("terminate called without an active
        # exception"): each is let past its torch calls first (its tensors' bytes as memoryviews: at once)
        if thread.is_alive():
            past_torch.wait(timeout=10)
    _writers.clear()
    if not pending:
        return
    try:
        pid = os.fork() if hasattr(os, "fork") else -1
    except OSError:
        pid = -1
    if pid > 0:  # the parent: the child writes
        return
    try:  # the child, or this process where there is none
        for cache, tensors in pending:
            cache._write(tensors)
    finally:
        if pid == 0:
            os._exit(0)  # without the parent's exit handlers


atexit.register(_finish_at_exit)


def enabled() -> bool:
    """Whether loads use the cache ($SPECDEC_PACK_CACHE=0 turns it off: every load packs afresh)."""
    return os.environ.get("SPECDEC_PACK_CACHE", "1") != "0"


def cache_for(kind: str, source: str | Path, extra: dict[str, Any] | None = None) -> PackCache | None:
    """The PackCache of `source`'s packed weights of `kind` (extra: what else they depend on, as PackCache's), or
    None where loads do not use one ($SPECDEC_PACK_CACHE=0) or it cannot be had (a source that vanished)."""
    if not enabled():
        return None
    try:
        return PackCache(kind, source, extra)
    except OSError:
        return None


def file_identity(path: str | Path) -> dict[str, Any]:
    """What a source file's packed bytes depend on: its real path, size and modification time."""
    real = Path(path).resolve()
    stat = real.stat()
    return {"path": str(real), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def build_identity() -> dict[str, Any]:
    """The kernels' sources (their hash) and the CPU's name and extensions: a cache from another CPU or build
    is never used."""
    from specdec.machine import cpu_info
    from specdec.native.kernels.build import version

    info = cpu_info()
    return {"kernels": version(), "cpu": info["name"], "features": info["features"], "format": FORMAT}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sample_offsets(size: int) -> list[int]:
    """The page offsets (from the data's start) whose CRC-32 the header keeps: SAMPLES spread over the data."""
    pages = max(1, size // ALIGN)
    return sorted({i * (pages - 1) // max(1, SAMPLES - 1) * ALIGN for i in range(min(SAMPLES, pages))})


def _crc(data: memoryview, offset: int) -> int:
    return zlib.crc32(data[offset : offset + ALIGN])


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's memory as uint8 [nbytes] (a view: no copy)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class PackCache:
    """The packed tensors of one model of one kind (see the module doc): get() the mapped ones, save() new ones.

    kind: what the bytes are ("gguf": a gguf target's blocks; "lean": an int4 draft's int4 and int8 weights);
    source: the model file they are made from (its path keys the cache file, its size and time the key); extra:
    anything else the bytes depend on (e.g. the packing's parameters); directory: where the files live (default
    $SPECDEC_HOME/packed)."""

    def __init__(self, kind: str, source: str | Path, extra: dict[str, Any] | None = None,
                 directory: Path | None = None) -> None:
        if directory is None:
            from specdec.zoo import home

            directory = home() / "packed"
        identity = file_identity(source)
        self.key = json.dumps({"kind": kind, "source": identity, **build_identity(), **(extra or {})}, sort_keys=True)
        slot = hashlib.sha256(f"{kind}\0{identity['path']}".encode()).hexdigest()[:16]
        self.path = Path(directory) / f"{kind}-{slot}.bin"
        self._map: mmap.mmap | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._open()

    @property
    def hit(self) -> bool:
        """Whether a whole, current file was mapped."""
        return self._map is not None

    def get(self, name: str) -> torch.Tensor | None:
        """Tensor `name` from the mapped file (read-only memory: the kernels only read it), or None."""
        return self._tensors.get(name)

    def prefault(self) -> threading.Thread | None:
        """Map the file's pages into this process now, on a thread of their own, while the caller goes on (a
        gguf target's load parses its tokenizer next, 0.35 s holding the GIL): a page's first read faults, and
        1 GB of them took 0.05 s of the first prefill otherwise (2-core Zen 4).  The thread reads one byte per
        page by numpy's strided sum, which runs without the GIL; its view of the mapping keeps it mapped until
        the thread is done.  Returns the thread; None where no file was mapped (nothing to read) or the process
        has one CPU (the thread would only take the caller's time)."""
        if self._map is None or _cpus() < 2:
            return None
        import numpy as np

        pages = np.frombuffer(self._map, dtype=np.uint8)[:: mmap.PAGESIZE]  # [pages], one byte of each
        thread = threading.Thread(target=pages.sum, name="specdec-prefault", daemon=True)
        thread.start()
        return thread

    def tensor(self, name: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Tensor `name` from the file, else build() (kept to be saved)."""
        found = self._tensors.get(name)
        if found is not None:
            return found
        self._tensors[name] = built = build()
        self._stale = True
        return built

    def _open(self) -> None:
        self._stale = False
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # not built yet (or unreadable: built again)
        try:
            self._clean()
        except OSError:
            pass
        try:
            with os.fdopen(fd, "rb") as f:
                reason = self._map_file(f)
        except (OSError, ValueError) as e:
            reason = f"{type(e).__name__}: {e}"
        if reason == "stale":  # another build or CPU, a changed model: rebuilt quietly, as a first run is
            self._drop()
        elif reason:
            self._drop()
            print(f"specdec: the packed weights {self.path} are damaged ({reason}); rebuilding them", file=sys.stderr)

    def _clean(self) -> None:
        """Delete the temporary files of this cache file that a killed process left (a whole model's size each:
        a current file is never written again, so a load looks too)."""
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            if not _alive(stale):
                stale.unlink(missing_ok=True)

    def _drop(self) -> None:
        self._tensors = {}
        self._map = None  # the tensors' views went with _tensors; the mapping closes when unreferenced

    def _map_file(self, f: Any) -> str:
        """Map the open file and check it: "" when whole and current, "stale" for another key, else the damage."""
        size = os.fstat(f.fileno()).st_size
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            return "not a packed weights file" if len(head) == 16 else "truncated"
        length = int.from_bytes(head[8:], "little")
        if length > DATA_ALIGN - 16:
            return "bad header length"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "bad header"
        if header.get("key") != self.key:
            return "stale"
        if size != header.get("size"):
            return f"{size} bytes, {header.get('size')} expected: truncated"
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapped.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        view = memoryview(mapped)
        data = view[DATA_ALIGN:]
        for offset, crc in header["samples"]:
            if _crc(data, offset) != crc:
                return f"the page at {DATA_ALIGN + offset} changed"
        with warnings.catch_warnings():  # a read-only buffer: the tensors are never written
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(mapped, dtype=torch.uint8)  # [size], shares the mapping
        for name, (dtype, shape, offset, nbytes) in header["tensors"].items():
            raw = whole[DATA_ALIGN + offset : DATA_ALIGN + offset + nbytes]
            self._tensors[name] = raw.view(getattr(torch, dtype)).view(shape)
        self._map = mapped
        return ""

    def save(self) -> None:
        """Write the tensors (mapped and built) to the cache file in a background thread, if any was built."""
        if not self._stale:
            return
        self._stale = False
        tensors = dict(self._tensors)
        past_torch = threading.Event()
        thread = threading.Thread(target=self._write, args=(tensors, past_torch), name=f"specdec-pack {self.path.name}",
                                  daemon=True)
        _writers.append((thread, self, tensors, past_torch))
        thread.start()

    def _write(self, tensors: dict[str, torch.Tensor], past_torch: threading.Event | None = None) -> None:
        """Write `tensors` to the cache file (a temporary file, renamed when whole); `past_torch` is set once the
        tensors' bytes are memoryviews, after which this thread calls nothing of torch's (_finish_at_exit)."""
        try:  # the lowest CPU priority for this thread (Linux: per thread): the run's own work goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        entries, offset = {}, 0
        try:
            raws = {name: _as_bytes(t).numpy().data for name, t in tensors.items()}  # memoryviews of their bytes
            for name, t in tensors.items():
                nbytes = t.numel() * t.element_size()
                entries[name] = (_dtype_name(t.dtype), list(t.shape), offset, nbytes)
                offset += -(-nbytes // ALIGN) * ALIGN
        finally:
            if past_torch is not None:
                past_torch.set()
        data_size = offset
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._clean()
            samples: list[tuple[int, int]] = []
            wanted = _sample_offsets(data_size)
            with open(tmp, "wb") as f:
                f.truncate(DATA_ALIGN + data_size)  # the padding between tensors reads as zeros
                for name, raw in raws.items():
                    start = entries[name][2]
                    f.seek(DATA_ALIGN + start)
                    for at in range(0, len(raw), CHUNK):
                        f.write(raw[at : at + CHUNK])
                    padded = -(-len(raw) // ALIGN) * ALIGN
                    samples += [(page, zlib.crc32(bytes(raw[page - start : page - start + ALIGN]).ljust(ALIGN, b"\0")))
                                for page in wanted if start <= page < start + padded]
                header = json.dumps({"key": self.key, "size": DATA_ALIGN + data_size, "tensors": entries,
                                     "samples": sorted(samples)}).encode()
                if len(header) > DATA_ALIGN - 16:
                    raise ValueError("packed weights header too long")
                f.seek(0)
                f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            os.replace(tmp, self.path)
        except (OSError, ValueError):  # an unwritable or full cache: packed again next time
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def _cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _alive(tmp: Path) -> bool:
    """Whether the process that writes temporary file `tmp` (its name holds the pid) still runs."""
    try:
        pid = int(tmp.name.split(".")[-3])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
