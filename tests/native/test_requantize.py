"""specdec.native.requantize and tests/requant.py: a zoo file requantised once by llama.cpp's quantiser, the types
asked for, reused after; the llama-quantize binary preferred where built; one-line errors.

The seconds each of the tests' files took to make here are in tests/requant.py's module doc.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from specdec.errors import SpecdecError
from specdec.native import requantize
from specdec.native.requantize import derived_path, requantized
from tests.requant import REAL_HOME, can_requantize, requantized_zoo

SMOLLM = REAL_HOME / "models" / "smollm2-135m-instruct-q4_1.gguf"
needs_source = pytest.mark.skipif(not SMOLLM.is_file() or not can_requantize(),
                                  reason="smollm2-135m is not pulled, or no quantiser is installed")


def layer_types(path: Path) -> set[str]:
    """The types of the file's layer matrices (blk.*: the embedding and head are the quantiser's own choice)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) > 1}


@needs_source
def test_made_once_of_the_type_asked_then_reused(tmp_path, monkeypatch):
    out = requantized(SMOLLM, "q4_0", cache=tmp_path / "derived", tools=tmp_path / "no-bin")  # the library's quantiser
    assert out == derived_path(SMOLLM, "Q4_0", tmp_path / "derived")
    assert out == tmp_path / "derived" / "smollm2-135m-instruct-q4_1-Q4_0.gguf"
    assert layer_types(out) == {"Q4_0"}  # the source's Q4_1 layers requantised
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary file left

    def never(*args):
        raise AssertionError("made again")

    monkeypatch.setattr(requantize, "_with_library", never)
    made = out.stat().st_mtime_ns
    assert requantized(SMOLLM, "Q4_0", cache=tmp_path / "derived", tools=tmp_path / "no-bin") == out
    assert out.stat().st_mtime_ns == made


@needs_source
def test_the_helper_gives_the_types_the_tests_use():
    assert layer_types(requantized_zoo("smollm2-135m", "Q5_1")) == {"Q5_1"}


def test_llama_quantize_is_preferred_and_told_to_allow_requantizing(tmp_path):
    """A fake llama-quantize in the tools folder: called as llama.cpp's is, its output renamed into place."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF source")
    tools = tmp_path / "bin"
    tools.mkdir()
    tool = tools / "llama-quantize"
    tool.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\ncp \"$2\" \"$3\"\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    out = requantized(source, "IQ4_XS", cache=tmp_path / "derived", tools=tools)
    assert out.read_bytes() == b"GGUF source"
    words = (tmp_path / "args").read_text().split()
    assert words[:2] == ["--allow-requantize", str(source)] and words[3] == "IQ4_XS" and int(words[4]) >= 1
    assert words[2] != str(out) and Path(words[2]).parent == out.parent  # a temporary name, renamed after
    tool.write_text("#!/bin/sh\necho 'main: invalid ftype' >&2\nexit 1\n")
    with pytest.raises(SpecdecError, match="could not requantise model.gguf to Q8_0 .*invalid ftype") as error:
        requantized(source, "Q8_0", cache=tmp_path / "derived", tools=tools)
    assert "\n" not in str(error.value) and not derived_path(source, "Q8_0", tmp_path / "derived").exists()


def test_one_line_errors(tmp_path, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    with pytest.raises(SpecdecError, match="unknown GGUF file type 'Q9_9': expected one of Q4_0"):
        requantized(source, "Q9_9", cache=tmp_path)
    with pytest.raises(SpecdecError, match="no such file"):
        requantized(tmp_path / "missing.gguf", "Q4_0", cache=tmp_path)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # llama-cpp-python not installed: its import fails
    with pytest.raises(SpecdecError, match="neither .*llama-quantize .* nor llama-cpp-python") as error:
        requantized(source, "Q4_0", cache=tmp_path / "derived", tools=tmp_path / "no-bin")
    assert "\n" not in str(error.value) and os.listdir(tmp_path / "derived") == []
