"""The weight-major fp32 Linear forward (specdec.native.fastlinear): same numbers, one row bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specdec.backends.hf import HFRunner
from specdec.native import fastlinear
from tests.tiny import tiny_model


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 9, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_major_linear_computes_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 72, bias=bias)
    x = torch.randn(1, rows, 96)  # [batch, rows, K], as transformers passes it
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    got = fastlinear.weight_major_linear(x, layer.weight, layer.bias)
    fastlinear.install(layer)
    assert torch.equal(layer(x), expected)  # installed but not enabled: nn.Linear itself
    with fastlinear.enabled():
        assert torch.equal(layer(x), got)
    assert got.shape == expected.shape == (1, rows, 72)
    if rows == 1:
        assert torch.equal(got, expected)  # one row: the very same kernel
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_install_touches_fp32_cpu_linears_only_once():
    model = tiny_model("llama", 0)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert fastlinear.install(model) == linears > 0
    assert fastlinear.install(model) == 0  # already installed
    half = tiny_model("llama", 0).to(torch.bfloat16)
    assert fastlinear.install(half) == 0  # bf16 keeps its own kernel
    assert type(model.lm_head).forward is nn.Linear.forward  # the class is untouched


def test_runner_prefill_and_one_token_bitwise_several_close():
    plain_model = tiny_model("qwen2", 3)
    reference = copy.deepcopy(plain_model)  # never given the fast forward
    runner = HFRunner(plain_model)  # installs it
    assert getattr(plain_model.lm_head, fastlinear.MARK, False)
    prompt, step = [5, 9, 13, 21, 8, 40], [30]
    with torch.inference_mode():
        ref_prompt = reference(torch.tensor([prompt])).logits[0]  # [6, V]
        ref_step = reference(torch.tensor([prompt + step])).logits[0, -1]  # [V]
    assert torch.equal(runner.forward(prompt), ref_prompt)  # the prefill: the model's own kernel
    # a one-token forward over the cache (what plain decoding runs: each Linear on one row) is
    # bitwise what a runner without the fast forward computes
    one = HFRunner.__new__(HFRunner)  # a runner over the reference model, installing nothing
    one.model, one.device, one.tokens = reference, torch.device("cpu"), []
    from transformers import DynamicCache

    one.cache, one.max_context, one.hidden_rows = DynamicCache(), 256, 0
    one.forward(prompt)
    got = runner.forward(step)[-1]
    assert torch.equal(got, one.forward(step)[-1])
    torch.testing.assert_close(got, ref_step, rtol=1e-5, atol=1e-5)
    # several tokens: the same logits up to fp32 rounding
    torch.testing.assert_close(runner.forward([31, 32]), one.forward([31, 32]), rtol=1e-5, atol=1e-5)
    assert not getattr(reference.lm_head, fastlinear.MARK, False)
