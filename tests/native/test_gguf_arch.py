"""The gguf target's architectures (specdec.native.gguf's ARCHS): what it runs of a file, and that it runs it right.

- accounting: a file with a tensor, a metadata key or a key's value that its architecture's mapping does not
  account for is refused in one line naming it, before anything runs; the CLI exits 2 and generates nothing.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.native import gguf
from tests.native.gguf_files import edited_copy
from tests.tiny_gguf import save_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arch")
    return {arch: save_tiny_gguf(folder / f"{arch}.gguf", arch) for arch in ("llama", "qwen2")}


REFUSED = [  # (architecture, keys set, tensors added, what the message names)
    ("qwen2", {}, {"rope_freqs.weight": np.ones(32)}, "rope_freqs.weight"),
    ("qwen2", {}, {"blk.1.attn_output.bias": np.zeros(256)}, "blk.1.attn_output.bias"),
    ("llama", {}, {"blk.0.attn_q.bias": np.zeros(256)}, "blk.0.attn_q.bias"),
    ("llama", {}, {"blk.0.post_attention_norm.weight": np.ones(256)}, "blk.0.post_attention_norm.weight"),
    ("llama", {}, {"blk.2.attn_norm.weight": np.ones(256)}, "blk.2.attn_norm.weight"),  # a layer past block_count
    ("llama", {}, {"blk.1.ffn_norm.weight": np.ones(255)}, "blk.1.ffn_norm.weight has 255 values"),
    ("qwen2", {}, {"blk.0.attn_k.bias": np.ones(64)}, "blk.0.attn_k.bias has 64 values"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, {}, "'yarn' rotary scaling"),
    ("qwen2", {"qwen2.attn_logit_softcapping": 50.0}, {}, "qwen2.attn_logit_softcapping"),
    ("llama", {"llama.final_logit_softcapping": 30.0}, {}, "llama.final_logit_softcapping"),
    ("llama", {"llama.attention.sliding_window": 128}, {}, "llama.attention.sliding_window"),
    ("llama", {"llama.attention.sliding_window_pattern": 4}, {}, "llama.attention.sliding_window_pattern"),
    ("llama", {"llama.rope.dimension_count": 32}, {}, "partial rotary"),
    ("qwen2", {"qwen2.attention.scale": 0.1}, {}, "qwen2.attention.scale"),
    ("llama", {"llama.expert_count": 8}, {}, "mixture-of-experts"),
    ("llama", {"general.type": "adapter"}, {}, "is a 'adapter', not a model"),
    ("llama", {"clip.vision.block_count": 2}, {}, "clip.vision.block_count"),
]


@pytest.mark.parametrize("arch, keys, tensors, named", REFUSED)
def test_what_a_file_holds_beyond_its_architecture_is_refused_in_one_line(tiny, tmp_path, arch, keys, tensors, named):
    path = edited_copy(tiny[arch], tmp_path / "edited.gguf", keys=keys, tensors=tensors)
    with pytest.raises(SpecdecError) as e:
        gguf.GGUFModel(gguf.GGUFFile(path))
    message = str(e.value)
    assert named in message and "\n" not in message, message


def test_what_changes_nothing_passes(tiny, tmp_path):
    keys = {"general.author": "someone", "general.type": "model", "tokenizer.chat_template": "{{ x }}",
            "quantize.imatrix.file": "x.dat", "llama.rope.scaling.type": "none", "llama.rope.dimension_count": 64,
            "llama.attention.value_length": 64, "llama.vocab_size": 300, "llama.expert_count": 0}
    path = edited_copy(tiny["llama"], tmp_path / "harmless.gguf", keys=keys)
    assert gguf.GGUFModel(gguf.GGUFFile(path)).config.num_hidden_layers == 2


def test_the_cli_exits_2_in_one_line_and_generates_nothing(tiny, tmp_path):
    path = edited_copy(tiny["llama"], tmp_path / "extra.gguf", tensors={"blk.0.ffn_norm.bias": np.zeros(256)})
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "def f(x):", "--target", path,
                          "--dtype", "gguf", "--draft", "none", "--max-new-tokens", "4", "--json"],
                         capture_output=True, text=True, env={**__import__("os").environ,
                                                                "SPECDEC_HOME": str(tmp_path / "home")})
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "blk.0.ffn_norm.bias" in lines[0], out.stderr
