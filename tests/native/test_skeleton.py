"""The saved int8 model without transformers' modeling code (specdec.native.skeleton).

A lean runner over it -- int4 steps, int8 catch-ups, int8 alone -- computes bitwise the logits of one over
transformers' model of the same folder (quant.load_int8), with the same identity (the cached timings' key)
and end-of-sequence ids; a folder it does not cover gives None (transformers then loads it).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MistralConfig

from specdec.native import skeleton
from specdec.native.lean import LeanRunner
from specdec.native.quant import load_int8, quantize_model, save_int8
from tests.native.test_int4 import tiny_gemma
from tests.tiny import tiny_model, tiny_tokenizer


def saved(tmp_path, model, name: str, eos=None):
    folder = tmp_path / name
    save_int8(quantize_model(model), tiny_tokenizer(0), folder)
    if eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def tiny_mistral():
    from transformers import AutoModelForCausalLM

    config = MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=5, tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(2)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_a_lean_runner_over_it_is_bitwise_one_over_transformers_model(tmp_path, arch):
    model = tiny_mistral() if arch == "mistral" else tiny_model(arch, 1, vocab_size=300)
    folder = saved(tmp_path, model, arch, eos=[2, 7] if arch == "qwen2" else None)
    light, (heavy, _) = skeleton.load(folder), load_int8(folder)
    assert light is not None
    tokens = [5, 9, 13, 21, 34, 55, 89, 144, 3, 4, 6]  # past mistral's window of 5
    for kind in (dict(int4=True, int8_catch_up=True), dict(int4=True, int8_catch_up=False), {}):
        a, b = LeanRunner(light, **kind), LeanRunner(heavy, **kind)
        assert a.identity() == b.identity() and a.eos_token_ids == b.eos_token_ids
        for chunk in (tokens, [7], [8, 9]):
            assert torch.equal(a.forward(chunk), b.forward(chunk)), kind


def test_what_it_does_not_cover_is_left_to_transformers(tmp_path):
    assert skeleton.load(saved(tmp_path, tiny_gemma(0), "gemma")) is None  # another architecture
    assert skeleton.load(tmp_path) is None  # no int8 model saved there
