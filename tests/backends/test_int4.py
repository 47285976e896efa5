"""Group-wise int4 weights for draft models (specdec.backends.int4, kernels/int4_linear.c).

- quantize_int4: values in [-7, 7], one scale per 64 columns, each weight within half a step.
- The kernel computes the module doc's numbers: against the same quantized math in float64 (its
  fp32 multiply-adds round differently, so to 1e-5), for shapes that are and are not multiples of
  its tiles and groups, with and without bias; every path this CPU runs gives the same bits.
- A row's outputs are the same alone and in any batch (batch-invariant).
- An int4 LeanRunner: its own logits are batch-invariant through forward / rollback, it shares its
  weights across runners, and as a draft it leaves speculative greedy output equal to plain greedy
  of the int8 target, for several γ and -k auto (the draft's numbers never change the output).
- Its layers in one C call (kernels/int4_layers.c) compute the torch path's numbers up to fp32
  rounding, and runners packed into one forward each get their own logits, bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.backends import kernel
from specdec.backends.int4 import Int4Linear, quantize_int4
from specdec.backends.lean import LeanRunner, forward_packed
from specdec.backends.quant import Int8Linear, quantize_model
from specdec.control import AutoK, Costs
from specdec.drafters.model import ModelDrafter
from specdec.errors import SpecdecError
from specdec.loop import StopCondition, run
from tests.tiny import VOCAB, tiny_model

QMAX = 63.0


def reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's numbers in float64: per-row 7-bit activations, group sums times group scales."""
    n, k = values.shape
    s = x.abs().amax(dim=1, keepdim=True).double()  # [M, 1]
    q = torch.round(x.double() * (QMAX / s)).clamp(-QMAX, QMAX)  # [M, K]
    w = values.double() * torch.repeat_interleave(scales.double(), kernel.GROUP, dim=1)[:, :k]  # [N, K]
    y = (q @ w.T) * (s / QMAX)
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("n,k", [(8, 64), (13, 100), (37, 200), (96, 640)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_computes_the_quantized_math_on_every_path(n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    layer = Int4Linear.from_weight(weight, b)
    values, scales = quantize_int4(weight)
    for m in (1, 2, 3, 4, 7, 16):
        x = torch.randn(m, k, generator=gen)
        outs = [kernel.linear4(x, layer.packed, layer.scales, k, n, layer.bias, path=p) for p in kernel.int4_paths()]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        ref = reference(x, values, scales, b)
        assert torch.allclose(outs[-1].double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert torch.equal(layer(x), outs[-1])  # the best path is the default


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_products_do_not_overflow_on_any_path(sign):
    """Weights at +-7 and activations at +-63 everywhere: the AVX2 path's unsigned nibbles (u = v + 8) times q
    reach their largest 16-bit sums, and its lane offsets their largest values."""
    n, k = 8, 192
    weight = torch.full((n, k), 7.0)
    weight[1::2] = -7.0  # odd rows at -7, even at +7
    layer = Int4Linear.from_weight(weight)
    x = torch.full((5, k), sign)
    x[1] = -sign
    x[2, ::2] = -sign  # alternating signs
    outs = [kernel.linear4(x, layer.packed, layer.scales, k, n, None, path=p) for p in kernel.int4_paths()]
    values, scales = quantize_int4(weight)
    ref = reference(x, values, scales, None)
    for out in outs:
        assert torch.equal(out, outs[0])
        assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-4)
    assert float(outs[0].abs().max()) == pytest.approx(7.0 * k)


def test_quantize_int4_keeps_each_weight_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(9, 150, generator=gen)
    values, scales = quantize_int4(weight)
    assert values.dtype == torch.int8 and values.abs().max() <= 7 and scales.shape == (9, 3)
    step = torch.repeat_interleave(scales, kernel.GROUP, dim=1)[:, :150]
    assert ((values.float() * step - weight).abs() <= step / 2 + 1e-6).all()


def test_a_row_is_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(2)
    layer = Int4Linear.from_weight(torch.randn(300, 128, generator=gen) * 0.1)
    x = torch.randn(9, 128, generator=gen)
    full = layer(x)
    for i in range(9):
        assert torch.equal(layer(x[i : i + 1]), full[i : i + 1])
    perm = torch.randperm(9, generator=gen)
    assert torch.equal(layer(x[perm]), full[perm])


def test_from_int8_in_c_is_bitwise_the_torch_quantization_of_the_int8_weights():
    int8 = Int8Linear.from_linear(torch.nn.Linear(150, 41, bias=True))  # neither a multiple of 64 nor of 4
    a = Int4Linear.from_int8(int8)
    b = Int4Linear.from_weight(int8.int8_weight().float() * int8.scale[:, None], int8.bias)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales)


def test_int4_runner_is_batch_invariant_through_forward_and_rollback():
    model = quantize_model(tiny_model("qwen2", 0))
    batched, single = LeanRunner(model, int4=True), LeanRunner(model, int4=True)
    assert batched.layers is single.layers and batched.head is single.head  # weights shared, caches not
    rng = random.Random(0)
    for _ in range(30):
        if batched.tokens and rng.random() < 0.3:
            keep = rng.randrange(len(batched.tokens) + 1)
            batched.rollback(keep)
            single.rollback(keep)
            continue
        if len(batched.tokens) > 100:
            batched.reset()
            single.reset()
        new = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        rows = batched.forward(new)
        one = torch.cat([single.forward([t]) for t in new])
        assert torch.equal(rows, one)
    assert not torch.equal(LeanRunner(model).forward([1, 2, 3]), LeanRunner(model, int4=True).forward([1, 2, 3]))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_int4_layers_in_c_compute_the_torch_path_numbers(arch):
    """kernels/int4_layers.c (runner.native) against the same int4 network op by op in torch: the same
    numbers up to fp32 rounding (sums in another order), through several forwards and a rollback."""
    model = quantize_model(tiny_model(arch, 0))
    native, torch_path = LeanRunner(model, int4=True), LeanRunner(model, int4=True)
    assert native.native
    torch_path.native = False
    rng = random.Random(1)
    for chunk in (12, 3, 1, 1, 7):
        new = [rng.randrange(VOCAB) for _ in range(chunk)]
        a, b = native.forward(new), torch_path.forward(new)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        if chunk == 3:
            native.rollback(len(native.tokens) - 2)
            torch_path.rollback(len(torch_path.tokens) - 2)


def test_packed_int4_runners_get_each_runners_own_logits():
    """Several int4 runners in one forward_packed call (the batched engine's drafts): each gets, bit for bit,
    what it gets alone, though the runners sit at different positions with different capacities."""
    model = quantize_model(tiny_model("qwen2", 0))
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 150, 9)]
    windows = (None, None, 40)  # the last runner's cache holds 40 positions, the others 256
    packed = [LeanRunner(model, max_context=w, int4=True) for w in windows]
    alone = [LeanRunner(model, max_context=w, int4=True) for w in windows]
    for p, q, prompt in zip(packed, alone, prompts):
        p.forward(prompt)
        q.forward(prompt)
    chunks = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 4, 2)]
    together = forward_packed(packed, chunks, [None, 2, None])
    for runner, chunk, rows, last_n in zip(alone, chunks, together, [None, 2, None]):
        assert torch.equal(rows, runner.forward(chunk, last_n=last_n))


def test_an_int4_draft_leaves_greedy_output_equal_to_plain():
    target = quantize_model(tiny_model("qwen2", 0))
    draft_model = quantize_model(tiny_model("qwen2", 0))  # the target's own weights, in int4: a close draft
    prompt = [5, 9, 13, 21, 34]
    plain = run(LeanRunner(target), prompt, StopCondition(40))
    for k in (1, 3, 5, AutoK(Costs({1: 10.0, 4: 11.0}, 1.0), max_k=6)):
        spec = run(LeanRunner(target), prompt, StopCondition(40),
                   drafter=ModelDrafter(LeanRunner(draft_model, int4=True)), num_speculative_tokens=k)
        assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0
        if isinstance(k, int):  # the target's own weights in int4 agree with it often
            assert spec.stats.accepted > 0


def test_int4_needs_an_int8_model():
    with pytest.raises(SpecdecError, match="lean runner"):
        LeanRunner(tiny_model("qwen2", 0), int4=True)
