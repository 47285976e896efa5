"""What machine a number was measured on: the CPU's name and the vector extensions that matter.

Kernels that fly on one x86 CPU crawl on another (AVX-512 / AMX on recent
Xeons, AVX2 only on many AMD EPYCs), so every measurement specdec reports
names the CPU beside it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TypedDict

# cpuinfo flag -> how we name it, in the order printed.
_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"),
             ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))


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
    return f"{info['name']}, {info['cpus']} CPUs, {extras}"
