"""What machine a number was measured on: the CPU's name and the vector extensions that matter.

Kernels that fly on one x86 CPU crawl on another (AVX-512 / AMX on recent
Xeons, AVX2 only on many AMD EPYCs), so every measurement specdec reports
names the CPU beside it.

One switch runs the whole program as a lesser CPU would: ``SPECDEC_ISA=avx2`` (or ``c``) caps every specdec
kernel's path (the C side reads it: kernels/isa.c) and torch's own (ATen, MKL and oneDNN dispatch) at that
instruction set where the CPU has more, so a developer on an AVX-512 machine finds what fails or crawls on an
AVX2-only one.  The measurements name the cap beside the CPU.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TypedDict

# cpuinfo flag -> how we name it, in the order printed.
_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"),
             ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))


ISA_SWITCH = "SPECDEC_ISA"
ISA_LIMITS = ("c", "avx2")  # the caps, lowest first; "best" (or unset) is none
# torch's own switches for each cap, set before torch is imported unless the user set them
_TORCH_SWITCHES = {
    "c": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def isa_limit() -> str | None:
    """The cap SPECDEC_ISA sets ("c" or "avx2"), or None (unset, empty or "best": the CPU's best paths).  Any other
    value is a SpecdecError naming the choices."""
    value = os.environ.get(ISA_SWITCH, "")
    if value in ("", "best"):
        return None
    if value not in ISA_LIMITS:
        from specdec.errors import SpecdecError

        raise SpecdecError(f"{ISA_SWITCH}={os.environ[ISA_SWITCH]!r}: expected one of {', '.join(ISA_LIMITS)} or "
                           "best (unset: the CPU's best paths)")
    return value


def limit_torch_isa() -> None:
    """Keep torch's own kernels to SPECDEC_ISA's cap too: sets ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS and
    ONEDNN_MAX_CPU_ISA (each unless already set).  Takes effect only before torch is imported: specdec's
    package import calls it.  A bad value is left for the kernels' first use to report."""
    try:
        limit = isa_limit()
    except Exception:
        return
    for name, value in _TORCH_SWITCHES.get(limit or "", {}).items():
        os.environ.setdefault(name, value)


class CPUInfo(TypedDict):
    name: str
    features: list[str]
    cpus: int


def cpu_info(cpuinfo: str | None = None) -> CPUInfo:
    """{"name": "AMD EPYC", "features": ["AVX2"], "cpus": 2} from /proc/cpuinfo (or the platform elsewhere)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    name, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not name:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return {
        "name": name or platform.processor() or platform.machine(),
        "features": [label for flag, label in _FEATURES if flag in flags],
        "cpus": cpus,
    }


def cpu_description(cpuinfo: str | None = None) -> str:
    """One line, e.g. "AMD EPYC, 2 CPUs, AVX2 (no AVX-512)"."""
    info = cpu_info(cpuinfo)
    features = list(info["features"])
    extras = ", ".join(features) if features else "no AVX2"
    if "AVX2" in features and "AVX-512" not in features:
        extras += " (no AVX-512)"
    try:
        limit = isa_limit()
    except Exception:
        limit = None
    if limit:
        extras += f"; run as {limit} only ({ISA_SWITCH}={limit})"
    return f"{info['name']}, {info['cpus']} CPUs, {extras}"
