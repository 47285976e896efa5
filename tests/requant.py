"""Requantised zoo files for tests: the zoo's few models as the types a user may bring, made once.

``requantized_zoo("smollm2-135m", "Q4_0")`` is the zoo file requantised by llama.cpp's quantiser
(specdec.native.requantize), kept in the real cache's models/derived (not a test's temporary
$SPECDEC_HOME: made once for every test and run after); the test is skipped where the zoo model is not
pulled or neither llama-quantize nor llama-cpp-python is installed.  TEST_TYPES lists the files the tests
use.  Making each once here (llama-cpp-python's quantiser on every core of a 2-core Zen 4 shared with other
work, so upper figures) took, in seconds: smollm2-135m Q4_0 0.6, Q5_1 1.2, Q8_0 1.6, Q2_K 1.1, Q3_K_M 4.9,
Q5_K_M 3.2, F16 1.3, BF16 1.3, IQ4_NL 49, IQ4_XS 74 (its IQ4_NL tensors too); qwen2.5-coder-1.5b Q4_0 19, Q8_0 37,
Q3_K_M 108, Q5_K_M 152, IQ4_XS 550 (the IQ and K types search each block's scales).  The smollm2-135m files
(about 90 s in all) are made by the first test that asks, in CI too (tests/test_real_gguf_types.py, in a
real-model group that overlaps the other); the 1.5B's (about 15 minutes) by none of the tests: they are for
measuring (issue 74's must-holds), where the real cache keeps them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from specdec import zoo
from specdec.native.requantize import QUANTIZE_TOOL, requantized

REAL_HOME = zoo.home()  # read at import, before a test's fixture points SPECDEC_HOME at a temporary folder
# the types the tests may ask of each zoo model: what the gguf target's kernels are being taught
TEST_TYPES = {"smollm2-135m": ("Q5_1", "Q2_K", "Q3_K_M", "Q5_K_M", "IQ4_XS", "F16", "BF16"),
              "qwen2.5-coder-1.5b": ("Q3_K_M", "Q5_K_M", "IQ4_XS", "Q4_0", "Q8_0")}


def can_requantize() -> bool:
    """Whether a quantiser is installed: llama-quantize in the real cache's bin, or llama-cpp-python."""
    return os.access(REAL_HOME / "bin" / QUANTIZE_TOOL, os.X_OK) or importlib.util.find_spec("llama_cpp") is not None


def requantized_zoo(name: str, ftype: str) -> Path:
    """Zoo model `name`'s file requantised to llama.cpp file type `ftype` (made the first time it is asked for);
    the calling test skipped where that cannot be done here."""
    source = REAL_HOME / "models" / zoo.get(name).filename
    if not source.is_file():
        pytest.skip(f"zoo model {name} is not pulled (specdec models pull {name})")
    if not can_requantize():
        pytest.skip("neither llama-quantize nor llama-cpp-python is installed (scripts/install-llamacpp.sh)")
    return requantized(source, ftype, cache=REAL_HOME / "models" / "derived", tools=REAL_HOME / "bin")
