"""Building the kernels' library: the C compiler, its flags, and the cached shared library.

The C sources of this folder (and their header) are compiled once per source, compiler and flags into
``~/.cache/specdec/kernels/`` with ``-O3 -ffp-contract=off`` and no ``-march`` flag: the AVX2 and
AVX-512 functions carry target attributes and are chosen at run time, with a portable C path (the same
numbers) on CPUs without them, so which CPU ran a model never changes its output.  A machine without a
C compiler gets a one-line error naming the missing compiler.

Threads: the library is built with OpenMP and links ``libgomp.so.1``, which resolves to the OpenMP
runtime torch has already loaded: its threads are torch's own (``torch.get_num_threads()`` of them), so
the kernels and torch's operations never fight over cores (a private thread pool was measured slower per
step on 2 cores, BENCHMARKS.md: the two pools' spinning threads took turns).  Which thread computes a chunk of
outputs changes no number.  Without OpenMP in the compiler the kernels run on one thread.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from specdec.errors import SpecdecError

FOLDER = Path(__file__).parent
HEADER = FOLDER / "specdec_kernels.h"  # every exported prototype and parameter struct
SOURCES = tuple(FOLDER / name for name in ("int8_linear.c", "attention.c", "int4_linear.c", "gguf_linear.c", "layers.c",
                                           "bandwidth.c", "draft.c", "isa.c"))
FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
OPENMP = ["-fopenmp"]  # threads: torch's own OpenMP runtime (see the module doc); built without when cc lacks it


def compiler() -> str:
    """The C compiler: $CC, else cc, gcc or clang, the first one found."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise SpecdecError("--dtype int8 needs a C compiler to build its kernel once (install gcc, or set CC)")


def _source_bytes() -> bytes:
    """The header and the sources, what the library is built from."""
    return b"".join(path.read_bytes() for path in (HEADER, *SOURCES))


def version() -> str:
    """A short hash of the kernels' sources: what a cached timing of an int8 model depends on."""
    return hashlib.sha256(_source_bytes()).hexdigest()[:12]


def build(cache: Path) -> Path:
    """Compile the kernels into `cache` (once per source, compiler and flags) and return the library."""
    cc = compiler()
    cc_version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(_source_bytes() + repr((cc_version, FLAGS, OPENMP, sys.platform)).encode()).hexdigest()[:16]
    library = cache / f"specdec-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    errors = ""
    for extra in (OPENMP, []):  # without OpenMP the kernels run on one thread, with the same numbers
        done = subprocess.run([cc, *FLAGS, *extra, *map(str, SOURCES), "-o", str(partial), "-lm"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            partial.replace(library)  # atomic: a concurrent build writes the same file
            return library
        errors = done.stderr.strip()
    raise SpecdecError(f"building the int8 kernel with {cc} failed: {errors.splitlines()[-1:] if errors else ''}")
