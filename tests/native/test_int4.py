"""Group-wise int4 weights for draft models (specdec.native.int4, kernels/int4_linear.c).

- quantize_int4: values in [0, 15], an fp16 scale and minimum per 32 columns, each weight within half a
  step; the C quantizer from int8 weights gives the same bits.
- The kernel computes the module doc's numbers: against the same quantized math in float64 (its
  fp32 multiply-adds round differently, so to 1e-5), for shapes that are and are not multiples of
  its tiles and groups, with and without bias; every path this CPU runs gives the same bits.
- A row's outputs are the same alone and in any batch (batch-invariant).
- An int4 LeanRunner: its own logits are batch-invariant through forward / rollback, it shares its
  weights across runners, and as a draft it leaves speculative greedy output equal to plain greedy
  of the int8 target, for several γ and -k auto (the draft's numbers never change the output).
- Its layers in one C call (kernels/int4_layers.c) compute the torch path's numbers up to fp32
  rounding, and runners packed into one forward each get their own logits, bit for bit.
- Gemma 3 int4 drafts: the runner computes the transformers Gemma 3 model's own network (extra norms,
  scaled embedding, a rotary table per layer type, sliding windows) -- against that model with the same
  int4 linears swapped in -- and as a draft leaves greedy output equal to plain.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.algorithm.control import AutoK, Costs
from specdec.algorithm.loop import StopCondition, run
from specdec.drafters.model import ModelDrafter
from specdec.errors import SpecdecError
from specdec.native import kernels
from specdec.native.int4 import Int4Linear, quantize_int4
from specdec.native.lean import INT8_CATCH_UP_ROWS, CatchUpLayers, Int4Layers, Int8Layers, LeanRunner, forward_packed
from specdec.native.quant import Int8Linear, quantize_model
from tests.tiny import VOCAB, tiny_model

QMAX = 127.0


def dequantized(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The int4 weights as float64 [N, K]: value * scale + minimum of each column's group."""
    k = values.shape[1]
    expand = lambda t: torch.repeat_interleave(t.double(), kernels.int4.GROUP, dim=1)[:, :k]  # noqa: E731
    return values.double() * expand(scales) + expand(mins)


def reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's numbers in float64: per-row 8-bit activations times the dequantized weights."""
    s = x.abs().amax(dim=1, keepdim=True).double()  # [M, 1]
    q = torch.round(x.float() * (QMAX / x.abs().amax(dim=1, keepdim=True))).clamp(-QMAX, QMAX).double()  # [M, K]
    y = (q @ dequantized(values, scales, mins).T) * (s / QMAX)
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("n,k", [(8, 64), (13, 100), (37, 200), (96, 640)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_computes_the_quantized_math_on_every_path(n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    layer = Int4Linear.from_weight(weight, b)
    quantized = quantize_int4(weight)
    for m in (1, 2, 3, 4, 7, 16):
        x = torch.randn(m, k, generator=gen)
        outs = [kernels.int4.linear(x, layer.packed, layer.scales, k, n, layer.bias, path=p)
                for p in kernels.int4.paths()]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        ref = reference(x, *quantized, b)
        assert torch.allclose(outs[-1].double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert torch.equal(layer(x), outs[-1])  # the best path is the default


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_products_do_not_overflow_on_any_path(sign):
    """Nibbles at 15 and activations at +-127 everywhere: the AVX2 path's unsigned nibbles times q reach their
    largest 16-bit pair sums (2 * 15 * 127)."""
    n, k = 8, 192
    weight = torch.zeros(n, k)
    weight[:, 1::2] = 15.0  # every group spans [0, 15]: scale 1, minimum 0; the odd columns at u = 15
    weight[1::2] = -weight[1::2]  # odd rows: [-15, 0], minimum -15, so u = 15 on the even columns
    layer = Int4Linear.from_weight(weight)
    x = torch.full((5, k), sign)
    x[1] = -sign
    x[2, ::2] = -sign  # alternating signs
    outs = [kernels.int4.linear(x, layer.packed, layer.scales, k, n, None, path=p) for p in kernels.int4.paths()]
    quantized = quantize_int4(weight)
    assert int(quantized[0].max()) == 15 and torch.equal(dequantized(*quantized), weight.double())
    ref = reference(x, *quantized, None)
    for out in outs:
        assert torch.equal(out, outs[0])
        assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-4)
    assert float(outs[0].abs().max()) == pytest.approx(15.0 * k / 2)


def test_quantize_int4_keeps_each_weight_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(9, 150, generator=gen)
    weight[2, 32:64] = 0.25  # a constant group: scale 0, every weight its minimum
    values, scales, mins = quantize_int4(weight)
    assert values.dtype == torch.uint8 and values.max() <= 15 and scales.shape == mins.shape == (9, 5)
    assert scales.dtype == mins.dtype == torch.float16 and float(scales[2, 1]) == 0.0
    step = torch.repeat_interleave(scales.double(), kernels.int4.GROUP, dim=1)[:, :150]
    # half a step, plus the fp16 rounding of the minimum and of the scale times the value
    slack = 1e-3 * weight.abs().max().double()
    assert ((dequantized(values, scales, mins) - weight.double()).abs() <= step / 2 + slack).all()
    # the last group (columns 128..149) spans its own columns only
    assert float(mins[0, 4]) == pytest.approx(float(weight[0, 128:].min()), rel=1e-3)


def test_a_row_is_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(2)
    layer = Int4Linear.from_weight(torch.randn(300, 128, generator=gen) * 0.1)
    x = torch.randn(9, 128, generator=gen)
    full = layer(x)
    for i in range(9):
        assert torch.equal(layer(x[i : i + 1]), full[i : i + 1])
    perm = torch.randperm(9, generator=gen)
    assert torch.equal(layer(x[perm]), full[perm])


@pytest.mark.parametrize("n,k,bias", [(13, 100, True), (96, 640, False), (301, 150, True)])
def test_rows_are_bitwise_the_full_layers_outputs_at_those_ids_on_every_path(n, k, bias):
    # A trimmed draft head (FR-Spec): the kept channels' nibbles, scales and minimums gathered out of the tiles.
    gen = torch.Generator().manual_seed(n + k)
    layer = Int4Linear.from_weight(torch.randn(n, k, generator=gen) * 0.1, torch.randn(n, generator=gen) if bias else None)
    x = torch.randn(5, k, generator=gen)
    for ids in (torch.tensor([n - 1, 0, 7, 3]), torch.randperm(n, generator=gen)[: n // 2 + 1],
                torch.arange(n), torch.tensor([5]), torch.tensor([2, 2])):
        rows = layer.rows(ids)
        assert (rows.out_features, rows.in_features) == (len(ids), k)
        assert rows.nbytes() < layer.nbytes() or len(ids) >= n - 3
        for path in kernels.int4.paths():
            full = kernels.int4.linear(x, layer.packed, layer.scales, k, n, layer.bias, path=path)
            kept = kernels.int4.linear(x, rows.packed, rows.scales, k, len(ids), rows.bias, path=path)
            assert torch.equal(kept, full[:, ids]), path
    with pytest.raises(ValueError):
        layer.rows(torch.tensor([n]))


def test_from_int8_in_c_is_bitwise_the_torch_quantization_of_the_int8_weights():
    int8 = Int8Linear.from_linear(torch.nn.Linear(150, 41, bias=True))  # neither a multiple of 64 nor of 4
    a = Int4Linear.from_int8(int8)
    b = Int4Linear.from_weight(int8.int8_weight().float() * int8.scale[:, None], int8.bias)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales)


def test_int4_runner_is_batch_invariant_through_forward_and_rollback():
    model = quantize_model(tiny_model("qwen2", 0))
    batched, single = (LeanRunner(model, int4=True, int8_catch_up=False) for _ in range(2))
    assert batched.layer_set is single.layer_set and batched.head is single.head  # weights shared, caches not
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
    int4 = LeanRunner(model, int4=True, int8_catch_up=False)
    assert not torch.equal(LeanRunner(model).forward([1, 2, 3]), int4.forward([1, 2, 3]))


def tiny_gemma(seed: int = 0, layers: int = 3):
    """A tiny int8 Gemma 3 model whose norms are not all 1 (transformers initialises Gemma's norm weights to
    0, and the norm scales by 1 + w: a model with w = 0 would not tell w from 1 + w)."""
    model = tiny_model("gemma3", seed, layers=layers)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return quantize_model(model)


def assert_same_but_for_rare_roundings(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Logits [n, V] per forward computed in another fp32 order: every row within 10% of the largest logit, and
    at least 75% of them within 1e-5 of it.  A last-bit difference can move an activation across a rounding
    boundary of the int4 kernel's 8-bit quantization (rarely: none in 24 runs of the C-vs-torch test over
    seeds); such a step, amplified by these tiny high-gain models, moves its row and the rows that attend to it
    by up to a few percent (seen once: 6 rows of 40, the sliding window).  A wrong network (a missing norm, the
    wrong rotary table, ...) moves nearly every row by far more."""
    rows = torch.cat([(g - e).abs().amax(dim=1) / e.abs().max() for g, e in zip(got, expected)])  # [rows]
    assert float(rows.max()) <= 0.1, f"a row off by {float(rows.max()):.3g} of the largest logit"
    assert float((rows <= 1e-5).float().mean()) >= 0.75, f"rows within 1e-5: {float((rows <= 1e-5).float().mean()):.2f}"


class _Int4Module(torch.nn.Module):
    """An nn.Module calling an Int4Linear (to swap into a transformers model)."""

    def __init__(self, linear: Int4Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_an_int4_gemma3_runner_computes_the_transformers_models_network():
    """The lean int4 runner (its torch path and its C layers) against the transformers Gemma 3 model itself
    with each Int8Linear replaced by its int4 requantization: the torch path's numbers are the model's, the C
    layers' the same up to fp32 rounding, over 37 positions (past the sliding window of 6) and a rollback.  Checks
    Gemma's own pieces: 1 + w norms, q / k
    norms, the norms on the attention's and MLP's outputs, the embedding scale, the tanh-GELU, and the local
    and global rotary tables."""
    model = tiny_gemma()
    runner, torch_path = LeanRunner(model, int4=True, int8_catch_up=False), LeanRunner(model, layer_set=Int4Layers.of(model))
    assert runner.layer_set.native and len(runner._rope_kinds) == 2
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                setattr(parent, name, _Int4Module(Int4Linear.from_int8(child)))
    rng = random.Random(3)
    tokens: list[int] = []
    native, expected = [], []
    for chunk in (9, 1, 5, 1, 12, 1, 2, 1, 8):
        new = [rng.randrange(VOCAB) for _ in range(chunk)]
        tokens += new
        with torch.inference_mode():
            expected.append(model(torch.tensor([tokens])).logits[0, -chunk:])  # [chunk, V]
        native.append(runner.forward(new))
        assert torch.allclose(torch_path.forward(new), expected[-1], rtol=1e-5, atol=1e-5 * float(expected[-1].abs().max()))
        if chunk == 5:
            tokens = tokens[:-3]
            runner.rollback(len(tokens))
            torch_path.rollback(len(tokens))
    assert_same_but_for_rare_roundings(native, expected)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "gemma3"])
def test_int4_layers_in_c_compute_the_torch_path_numbers(arch):
    """kernels/int4_layers.c (runner.native) against the same int4 network op by op in torch: the same
    numbers up to fp32 rounding (sums in another order), through several forwards and a rollback."""
    got, expected = [], []
    model = tiny_gemma() if arch == "gemma3" else quantize_model(tiny_model(arch, 0))
    native, torch_path = LeanRunner(model, int4=True, int8_catch_up=False), LeanRunner(model, layer_set=Int4Layers.of(model))
    assert native.layer_set.native
    rng = random.Random(1)
    for chunk in (12, 3, 1, 1, 7):
        new = [rng.randrange(VOCAB) for _ in range(chunk)]
        got.append(native.forward(new))
        expected.append(torch_path.forward(new))
        if chunk == 3:
            native.rollback(len(native.tokens) - 2)
            torch_path.rollback(len(torch_path.tokens) - 2)
    assert_same_but_for_rare_roundings(got, expected)


def test_packed_int4_runners_get_each_runners_own_logits():
    """Several int4 runners in one forward_packed call (the batched engine's drafts): each gets, bit for bit,
    what it gets alone, though the runners sit at different positions with different capacities."""
    model = quantize_model(tiny_model("qwen2", 0))
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 150, 9)]
    windows = (None, None, 40)  # the last runner's cache holds 40 positions, the others 256
    packed = [LeanRunner(model, max_context=w, int4=True, int8_catch_up=False) for w in windows]
    alone = [LeanRunner(model, max_context=w, int4=True, int8_catch_up=False) for w in windows]
    for p, q, prompt in zip(packed, alone, prompts):
        p.forward(prompt)
        q.forward(prompt)
    chunks = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 4, 2)]
    together = forward_packed(packed, chunks, [None, 2, None])
    for runner, chunk, rows, last_n in zip(alone, chunks, together, [None, 2, None]):
        assert torch.equal(rows, runner.forward(chunk, last_n=last_n))


@pytest.mark.parametrize("int8_catch_up", [False, True])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_an_int4_draft_leaves_greedy_output_equal_to_plain(arch, int8_catch_up):
    target = quantize_model(tiny_model("qwen2", 0))
    # the target's own weights in int4: a close draft (or a Gemma 3 model with the same vocabulary)
    draft_model = tiny_gemma(1) if arch == "gemma3" else quantize_model(tiny_model("qwen2", 0))
    prompt = [5, 9, 13, 21, 34]
    plain = run(LeanRunner(target), prompt, StopCondition(40))
    for k in (1, 3, 5, AutoK(Costs({1: 10.0, 4: 11.0}, 1.0), max_k=6)):
        spec = run(LeanRunner(target), prompt, StopCondition(40),
                   drafter=ModelDrafter(LeanRunner(draft_model, int4=True, int8_catch_up=int8_catch_up)),
                   num_speculative_tokens=k)
        assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0
        if isinstance(k, int) and arch == "qwen2":  # the target's own weights in int4 agree with it often
            assert spec.stats.accepted > 0


def test_int4_needs_an_int8_model():
    with pytest.raises(SpecdecError, match="lean runner"):
        LeanRunner(tiny_model("qwen2", 0), int4=True, int8_catch_up=False)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_catch_ups_run_on_the_int8_weights_and_drafted_tokens_on_the_int4_ones(arch):
    """CatchUpLayers: a forward of INT8_CATCH_UP_ROWS rows or more is bitwise the int8 layers' (the same cache
    before it: the same final hidden states; the logits are the int4 head's), a shorter one bitwise the int4
    layers' over the same cache, whichever side wrote that cache."""
    model = tiny_gemma() if arch == "gemma3" else quantize_model(tiny_model(arch, 0))
    split = LeanRunner(model, int4=True, int8_catch_up=True)
    assert isinstance(split.layer_set, CatchUpLayers) and split.layer_set.rows == INT8_CATCH_UP_ROWS
    assert split.layer_set.dtype == "int4+int8" and split.describe().startswith("specdec int4")
    int8 = LeanRunner(model, layer_set=Int8Layers.of(model))
    int4 = LeanRunner(model, int4=True, int8_catch_up=False)
    rng = random.Random(4)
    prompt = [rng.randrange(VOCAB) for _ in range(INT8_CATCH_UP_ROWS + 7)]
    split.forward(prompt)
    int8.forward(prompt)
    assert torch.equal(split.hidden(), int8.hidden())
    for _ in range(3):  # drafted tokens, on the cache the int8 catch-up (then int4 steps) wrote
        int4.reset()
        int4._reserve(len(split.tokens) + 1)
        for mine, theirs in zip((*int4.keys, *int4.values), (*split.keys, *split.values)):
            mine[:, : len(split.tokens)] = theirs[:, : len(split.tokens)]
        int4.tokens = list(split.tokens)
        token = [rng.randrange(VOCAB)]
        assert torch.equal(split.forward(token), int4.forward(token))
    int8.rollback(0)
    int8.forward(split.tokens)  # the int8 cache over the same tokens
    more = [rng.randrange(VOCAB) for _ in range(INT8_CATCH_UP_ROWS)]
    split.forward(more, last_n=1)
    int8.forward(more, last_n=1)
    assert not torch.equal(split.hidden(), int8.hidden())  # three of its cached rows were written in int4
    split.rollback(len(prompt))
    int8.rollback(len(prompt))
    split.forward(more, last_n=1)
    int8.forward(more, last_n=1)
    assert torch.equal(split.hidden(), int8.hidden())  # after a rollback to the rows written in int8


@pytest.mark.parametrize("isa,split", [("avx512-vnni", True), ("avx2", False), ("c", False)])
def test_int4_drafts_catch_up_in_int8_where_the_int8_kernel_takes_its_vnni_path(monkeypatch, isa, split):
    from specdec.native import lean

    monkeypatch.setattr(kernels.int8, "isa", lambda: isa)
    model = quantize_model(tiny_model("qwen2", 0))
    assert lean.int8_catch_ups() is split
    assert isinstance(LeanRunner(model, int4=True).layer_set, CatchUpLayers) is split
