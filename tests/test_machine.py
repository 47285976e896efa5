"""The machine facts and the one switch that runs the whole program on a lesser path (specdec.machine): SPECDEC_ISA
caps every kernel's path and torch's own, a bad value is one line, the CPU's description names the cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec import machine
from specdec.errors import SpecdecError
from tests.tiny import save_tiny

PROBE = """
import json, torch, specdec
from specdec.native import kernels
from specdec.native.kernels.bindings import library
print(json.dumps({"gguf": kernels.gguf.isa(), "int8": kernels.int8.isa(), "attention": kernels.attention.paths()[-1],
                  "limit": library().sd_isa_limit(), "torch": torch.backends.cpu.get_cpu_capability(),
                  "aten": __import__("os").environ.get("ATEN_CPU_CAPABILITY")}))
"""


def probe(value: str | None) -> dict:
    """The paths a fresh process takes with SPECDEC_ISA=value (the C side reads it once per process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_ISA", "ATEN_CPU_CAPABILITY",
                                                               "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    if value is not None:
        env["SPECDEC_ISA"] = value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_switch_parses_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, limit in (("", None), ("best", None), ("avx2", "avx2"), ("c", "c")):
        monkeypatch.setenv("SPECDEC_ISA", value)
        assert machine.isa_limit() == limit
    monkeypatch.delenv("SPECDEC_ISA")
    assert machine.isa_limit() is None
    monkeypatch.setenv("SPECDEC_ISA", "avx512")
    with pytest.raises(SpecdecError, match=r"SPECDEC_ISA='avx512': expected one of c, avx2 or best"):
        machine.isa_limit()


def test_torch_is_capped_only_where_the_user_left_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECDEC_ISA", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")  # the user's own choice stays
    machine.limit_torch_isa()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    monkeypatch.setenv("SPECDEC_ISA", "nonsense")
    machine.limit_torch_isa()  # a bad value is left for the kernels to report in one line


def test_the_description_names_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    cpuinfo = "model name : AMD EPYC 9R14\nflags : avx2 avx512f avx512_vnni\n"
    monkeypatch.delenv("SPECDEC_ISA", raising=False)
    assert machine.cpu_description(cpuinfo).endswith("AVX2, AVX-512, AVX512-VNNI")
    monkeypatch.setenv("SPECDEC_ISA", "avx2")
    assert machine.cpu_description(cpuinfo).endswith("; run as avx2 only (SPECDEC_ISA=avx2)")


def test_every_kernel_and_torch_take_the_capped_path() -> None:
    best = probe(None)
    assert best["limit"] == 3 and best["aten"] is None
    capped = probe("avx2")
    if best["gguf"] == "c":
        pytest.skip("this CPU has no AVX2: the cap changes nothing")
    assert capped["gguf"] == capped["int8"] == capped["attention"] == "avx2" and capped["limit"] == 2
    assert capped["aten"] == "avx2" and capped["torch"] in ("AVX2", "DEFAULT")
    portable = probe("c")
    assert portable["gguf"] == portable["int8"] == portable["attention"] == "c" and portable["limit"] == 1
    assert portable["torch"] == "DEFAULT"


def test_a_bad_value_is_one_line_from_the_cli(tmp_path) -> None:
    target = save_tiny(tmp_path / "target", "llama", seed=0)
    env = dict(os.environ, SPECDEC_ISA="sse", SPECDEC_HOME=str(tmp_path / "home"))
    command = [sys.executable, "-c", "from specdec.cli import main; main()", "generate", "hello", "--target", target,
               "--dtype", "int8", "--draft", "lookup", "-n", "2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "SPECDEC_ISA='sse': expected one of c, avx2 or best" in done.stderr
