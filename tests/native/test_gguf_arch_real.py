"""The gguf target's architectures on the zoo's real files, against llama.cpp (llama-cpp-python) on the same file.

- smollm2-135m (llama) and gemma3-270m (gemma3: q / k norms, norms on the attention's and the MLP's outputs,
  sliding-window layers with their own rotary base, a scaled embedding, a tanh-GELU gate): logits of 150 tokens
  of text within the real files' tolerances of tests.native.gguf_files (rms distance 6%, argmax the same on 95% of
  the positions: every token's flips of a quantised activation in 18-30 layers, and real near-ties; llama.cpp's own
  one-batch and one-token-at-a-time logits of gemma3-270m are that far apart);
- Llama 3's rotary scaling (rope_freqs.weight, the per-frequency divisors llama.cpp's converter writes): smollm2
  with factors added greedily continues otherwise, and is still llama.cpp's model of that file;
- `--dtype auto` takes the gguf target for a gemma3 file, as for the llama-family ones;
- gemma3-270m is batch-invariant bitwise (forwards of 1..16 tokens between rollbacks against one token at a time)
  in a context of 640 tokens, past its sliding window of 512.
Marked `real`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.native import gguf
from tests.conftest import real_model_threads, user_home
from tests.native.gguf_files import assert_close_to_llama_cpp, edited_copy, llama_cpp_logits, text_tokens

pytestmark = pytest.mark.real


def zoo_file(name: str) -> str:
    from specdec.runtime.loading import gguf_file

    with user_home():
        return str(gguf_file(name))


def logits(path: str, tokens: list[int]) -> np.ndarray:
    with real_model_threads():
        return gguf.load(path).forward(tokens).numpy()


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_zoos_logits_are_llama_cpps(name):
    path = zoo_file(name)
    tokens = text_tokens(path)
    assert_close_to_llama_cpp(logits(path, tokens), llama_cpp_logits(path, tokens), real=True)


def greedy(path: str, tokens: list[int], n: int) -> list[int]:
    runner = gguf.load(path)
    out: list[int] = []
    with real_model_threads():
        row = runner.forward(tokens, last_n=1)
        for _ in range(n):
            out.append(int(torch.argmax(row[-1])))
            row = runner.forward(out[-1:])
    return out


def test_llama3_rotary_factors_are_llama_cpps(tmp_path):
    path = zoo_file("smollm2-135m")
    d = gguf.GGUFModel(gguf.GGUFFile(path)).head_dim
    factors = np.geomspace(1.0, 32.0, d // 2)  # the high frequencies kept, the low ones slowed down to 32 times
    scaled = edited_copy(path, tmp_path / "llama3.gguf", tensors={"rope_freqs.weight": factors})
    tokens = text_tokens(path)
    assert greedy(scaled, tokens, 16) != greedy(path, tokens, 16)
    assert_close_to_llama_cpp(logits(scaled, tokens), llama_cpp_logits(scaled, tokens), real=True)


def test_auto_takes_the_gguf_target_for_gemma3():
    from specdec.runtime.loading import gguf_runs

    with user_home():
        assert gguf_runs("gemma3-270m") and gguf_runs(zoo_file("gemma3-270m"))


def test_gemma3_is_bitwise_one_token_at_a_time_past_its_window(real_gguf):
    from tests.real_checks import assert_bitwise_one_token_at_a_time

    runner, tok = real_gguf("gemma3-270m")
    mirror, _ = real_gguf("gemma3-270m")
    assert runner.layer_set.layers[0].sliding_window == 512  # a context of 640: its sliding layers' windows slide
    assert_bitwise_one_token_at_a_time(runner, mirror, tok, "gemma3-270m", 640)
