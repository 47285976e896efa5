"""A GGUF file with a block type the gguf target does not multiply is refused in one line that names the type
and what to run the file with instead: from GGUFModel for a few such types, and from the CLI (exit 2, no
traceback, before any generation) in a process of its own, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.native import gguf
from specdec.native.kernels.gguf import NAMES


def save_one_tensor_gguf(path: Path, type_name: str) -> Path:
    """A qwen2 GGUF whose embedding (4 rows of 256 values) is of ggml type `type_name`, its blocks raw zero bytes
    of that type's size: enough for the gguf target to read the file's tensors and refuse the type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    kind = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[kind]  # (values, bytes) of one block
    writer = GGUFWriter(str(path), "qwen2")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 512),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("context_length", 64)):
        writer.add_uint32(f"qwen2.{key}", value)
    # [4, 256 / block * size] bytes: the writer reads a byte tensor of a quantised type as its rows' blocks
    writer.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "IQ3_S", "TQ1_0"])
def test_a_type_the_kernel_lacks_is_one_line_naming_it_and_what_to_use(tmp_path, type_name):
    path = save_one_tensor_gguf(tmp_path / f"{type_name}.gguf", type_name)
    with pytest.raises(SpecdecError) as e:
        gguf.GGUFModel(gguf.GGUFFile(path))
    message = str(e.value)
    assert "\n" not in message
    assert f"{path.name}'s token_embd.weight is {type_name}, which the gguf target does not multiply" in message
    assert all(name in message for name in NAMES.values())  # what it does multiply
    assert "--backend llamacpp" in message and "--dtype int8" in message


def test_the_cli_refuses_it_with_exit_2_and_that_line(tmp_path):
    path = save_one_tensor_gguf(tmp_path / "iq2xxs.gguf", "IQ2_XXS")
    from specdec.native import kernels

    kernels.gguf.supported(0)  # the kernels built in this session's $SPECDEC_HOME, which the CLI's process shares
    command = [sys.executable, "-c", "from specdec.cli import main; main()", "generate", "hello", "--target",
               str(path), "--dtype", "gguf", "--draft", "none", "-n", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == ""  # nothing generated
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "token_embd.weight is IQ2_XXS, which the gguf target does not multiply" in lines[0]
    assert "--backend llamacpp" in lines[0]
