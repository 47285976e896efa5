"""Hidden states (specdec.backends.base.ModelRunner.hidden): after a forward, a runner hands out the final
hidden states of the positions whose logits it returned.

On tiny models, for the transformers runner (fp32, int8), the lean runner's layer sets (int8, fp32, int4
in C and in torch), batch slots and the encoder-decoder runner: ``hidden()`` is the transformers model's
own final-norm output at those positions (its base model's ``last_hidden_state``, which its final norm
ends; in transformers 5 ``output_hidden_states=True`` gives the same as its last entry), the output layer
applied to it gives the returned logits, it follows forwards after a rollback, and each runner of a
packed forward gets its own rows.  Runners that cannot give them say so in their capabilities.  Asked to
keep a forward's last rows (``keep_hidden_rows``), a runner's logits and hidden() are bitwise unchanged, its
output layer runs on the logits' rows only, and ``hidden_tail()`` is bitwise what a full-logits forward's
hidden() gives at those rows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from specdec.algorithm.stairs import stairs_runner
from specdec.backends.base import ModelRunner
from specdec.backends.hf import HFRunner
from specdec.backends.llamacpp import LlamaCppRunner
from specdec.backends.seq2seq import Seq2SeqRunner
from specdec.native.lean import Int4Layers, LeanRunner, forward_packed
from specdec.native.quant import quantize_model
from specdec.runtime.batching import BatchedTarget
from tests.backends.test_llamacpp import FakeSession
from tests.backends.test_seq2seq import SOURCES, tiny_bart, tiny_t5
from tests.tiny import tiny_model

FP32 = {arch: tiny_model(arch, 0) for arch in ("llama", "qwen2", "gemma3")}
INT8 = {arch: quantize_model(tiny_model(arch, 0)) for arch in ("llama", "qwen2", "gemma3")}
PROMPT = [5, 17, 3, 40, 22, 9, 61, 8]
# (new tokens, last_n) after the prompt: a verification of 4, one token, a verification keeping 2
STEPS = [([11, 12, 13, 14], None), ([30], None), ([7, 70, 2], 2)]


def reference_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The transformers model's own final hidden states over `tokens`, no cache: [len(tokens), H]."""
    with torch.inference_mode():
        return model.model(torch.tensor([tokens])).last_hidden_state[0].float()


def head(runner, hidden: torch.Tensor) -> torch.Tensor:
    """The runner's output layer over hidden states [n, H] -> [n, V]."""
    with torch.inference_mode():
        return runner.head(hidden) if isinstance(runner, LeanRunner) else runner.model.get_output_embeddings()(hidden)


def check_steps(runner: ModelRunner, model, exact: bool) -> None:
    """Prompt, STEPS, a rollback and a forward after it: hidden() has the returned logits' rows, is the
    model's own final hidden states there (bitwise where `exact`), and the head over it gives the logits."""
    assert runner.capabilities.hidden_states and isinstance(runner, ModelRunner)
    tokens: list[int] = []
    for new, last_n in [(PROMPT, None), *STEPS, ("rollback", 3), ([44, 45, 46], None)]:
        if new == "rollback":
            tokens = tokens[:-last_n]
            runner.rollback(len(tokens))
            continue
        logits = runner.forward(new, last_n)  # [n, V]
        tokens += new
        hidden = runner.hidden()  # [n, H]
        assert hidden.dtype == torch.float32 and hidden.shape[0] == logits.shape[0]
        expected = reference_hidden(model, tokens)[-logits.shape[0]:]
        again = head(runner, hidden)
        if exact:
            assert torch.equal(hidden, expected)
            assert torch.equal(again, logits)
        else:
            assert torch.allclose(hidden, expected, rtol=1e-4, atol=1e-4)
            assert torch.allclose(again, logits, rtol=1e-4, atol=1e-4 * float(logits.abs().max()))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_transformers_runner_fp32(arch):
    check_steps(HFRunner(FP32[arch]), FP32[arch], exact=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_transformers_runner_int8_is_bitwise(arch):
    check_steps(HFRunner(INT8[arch]), INT8[arch], exact=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_int8_is_bitwise_the_models_own(arch):
    check_steps(LeanRunner(INT8[arch]), INT8[arch], exact=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_fp32(arch):
    check_steps(LeanRunner(FP32[arch], fp32=True), FP32[arch], exact=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_int4_native_and_torch_path(arch):
    """An int4 draft computes its own network, not the model's: its hidden states are its head's input (the
    head over them gives its logits bitwise), and the C layers' are the torch path's up to fp32 rounding."""
    model = INT8[arch]
    native, torch_path = LeanRunner(model, int4=True, int8_catch_up=False), LeanRunner(model, layer_set=Int4Layers.of(model))
    assert native.layer_set.native and native.capabilities.hidden_states
    for new, last_n in [(PROMPT, None), *STEPS]:
        logits = [r.forward(new, last_n) for r in (native, torch_path)]
        hidden = [r.hidden() for r in (native, torch_path)]
        for r, h, lg in zip((native, torch_path), hidden, logits):
            assert h.shape == (lg.shape[0], model.config.hidden_size)
            assert torch.equal(head(r, h), lg)
        assert torch.allclose(hidden[0], hidden[1], rtol=1e-3, atol=1e-3)


def test_runners_in_one_packed_forward_get_their_own_rows():
    """Three int8 runners at different positions in one forward_packed call: each gets, bit for bit, the
    hidden states it gets alone."""
    model = INT8["qwen2"]
    packed, alone = [LeanRunner(model) for _ in range(3)], [LeanRunner(model) for _ in range(3)]
    prompts = [PROMPT, PROMPT[:3], [9, 9, 1, 4, 5]]
    forward_packed(packed, prompts, [1, None, 2])
    for r, p, last_n in zip(alone, prompts, [1, None, 2]):
        r.forward(p, last_n)
    chunks, last_ns = [[4, 5, 6], [7], [8, 9]], [None, None, 1]
    forward_packed(packed, chunks, last_ns)
    for p, a, c, last_n in zip(packed, alone, chunks, last_ns):
        a.forward(c, last_n)
        assert torch.equal(p.hidden(), a.hidden()) and p.hidden().shape[0] == (last_n or len(c))


def test_batch_slots_pass_their_own():
    """Two slots of a BatchedTarget forwarding together: each slot's hidden() is its own runner's, as alone."""
    model = INT8["llama"]
    target = BatchedTarget(model, 2)
    slots = [target.acquire(), target.acquire()]
    assert all(s.capabilities.hidden_states for s in slots)
    chunks = [PROMPT, PROMPT[2:]]
    got: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        slots[i].forward(chunks[i])
        got[i] = slots[i].hidden()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, chunk in enumerate(chunks):
        alone = LeanRunner(model)
        alone.forward(chunk)
        assert torch.equal(got[i], alone.hidden()) and torch.equal(slots[i].hidden(), alone.hidden())
    for s in slots:
        s.release()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_runner_gives_the_decoders_final_hidden_states(name):
    """The decoder's output layer input: the decoder's final hidden states (T5 scales them by d_model ** -0.5
    before its head, BART adds a bias after it), so the head over them gives the logits."""
    model = tiny_t5() if name == "t5" else tiny_bart()
    runner = Seq2SeqRunner(model)
    runner.set_source(SOURCES[0])
    assert runner.capabilities.hidden_states
    bias = getattr(model, "final_logits_bias", None)
    decoder: list[int] = []
    for new, last_n in [(runner.decoder_prompt(), None), ([5, 9, 30], None), ([12, 40], 1)]:
        logits = runner.forward(new, last_n)
        decoder += new
        hidden = runner.hidden()
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([SOURCES[0]]), decoder_input_ids=torch.tensor([decoder]),
                        use_cache=False, output_hidden_states=True)
        expected = out.decoder_hidden_states[-1][0]  # [len(decoder), d_model]: after the final norm
        if getattr(model.config, "scale_decoder_outputs", False):
            expected = expected * model.config.d_model ** -0.5
        assert torch.allclose(hidden, expected[-logits.shape[0]:], rtol=1e-4, atol=1e-4)
        again = head(runner, hidden) + (0 if bias is None else bias[0])
        assert torch.allclose(again, logits, rtol=1e-4, atol=1e-4 * float(logits.abs().max()))


def test_runners_without_hidden_states_say_so():
    assert not LlamaCppRunner(FakeSession()).capabilities.hidden_states
    assert not stairs_runner(HFRunner(FP32["llama"])).capabilities.hidden_states


def test_no_hidden_states_before_a_forward_or_after_reset():
    for runner in (HFRunner(FP32["llama"]), LeanRunner(INT8["llama"])):
        with pytest.raises(RuntimeError, match="no hidden states"):
            runner.hidden()
        runner.forward([1, 2, 3])
        assert runner.hidden().shape[0] == 3
        runner.reset()
        with pytest.raises(RuntimeError, match="no hidden states"):
            runner.hidden()


def test_the_model_run_by_others_keeps_nothing():
    """The output layer's hook collects only inside a runner's forward: the model run directly (transformers'
    generate, a benchmark) keeps no reference, and its logits are unchanged."""
    model = FP32["qwen2"]
    runner = HFRunner(model)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        logits = model(ids).logits
    runner.forward(PROMPT)
    kept = runner.hidden()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, logits)
    assert torch.equal(runner.hidden(), kept)


def test_a_prompts_kept_row_does_not_keep_the_whole_prompt():
    """A prefill that returns the last position's logits keeps that row's hidden state only (a copy where the
    output layer got a view of the prompt's), not the prompt's [n, H]."""
    runner = HFRunner(FP32["llama"])
    runner.forward(PROMPT, last_n=1)
    kept = runner._hidden
    assert kept is not None and kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
    assert torch.allclose(runner.hidden(), reference_hidden(FP32["llama"], PROMPT)[-1:], rtol=1e-4, atol=1e-4)


# Runners asked to keep a forward's last rows (keep_hidden_rows / hidden_tail), and how they are built
KEEPING = {
    "lean int8 llama": lambda: LeanRunner(INT8["llama"]),
    "lean int8 qwen2": lambda: LeanRunner(INT8["qwen2"]),
    "lean fp32 llama": lambda: LeanRunner(FP32["llama"], fp32=True),
    "hf fp32 llama": lambda: HFRunner(FP32["llama"]),
    "hf fp32 gemma3": lambda: HFRunner(FP32["gemma3"]),
    "hf int8 qwen2": lambda: HFRunner(INT8["qwen2"]),
}
LONG = [(7 * i + 3) % 90 for i in range(40)]


@contextmanager
def output_layer_rows(runner) -> Iterator[list[int]]:
    """Records the rows each forward of `runner` runs its output layer on (a wrapper / a hook) in the block."""
    rows: list[int] = []
    if isinstance(runner, LeanRunner):
        head = runner.head
        runner.head = lambda x: rows.append(x.shape[0]) or head(x)
        yield rows
        runner.head = head
        return
    hook = runner.model.get_output_embeddings().register_forward_pre_hook(lambda _m, a: rows.append(a[0].shape[1]))
    try:
        yield rows
    finally:
        hook.remove()


@pytest.mark.parametrize("name", list(KEEPING))
def test_kept_tail_rows_change_no_logits_and_are_a_full_forwards_rows(name):
    """A prefill keeping 16 rows (logits of the last one), then steps: logits and hidden() bitwise those of a
    runner keeping none, the output layer run on the logits' rows only, the tail's rows bitwise those a
    full-logits forward's hidden() gives (the prompt's) and its end hidden()'s."""
    keeping, plain, full = (KEEPING[name]() for _ in range(3))
    keeping.keep_hidden_rows(16)
    full.forward(LONG)
    tails = []
    for new, last_n in [(LONG, 1), *STEPS, ([44], None)]:
        with output_layer_rows(keeping) as heads:
            logits = keeping.forward(new, last_n)
        assert torch.equal(logits, plain.forward(new, last_n))
        hidden, tail = keeping.hidden(), keeping.hidden_tail()
        assert torch.equal(hidden, plain.hidden()) and heads[-1] == logits.shape[0]
        assert tail.dtype == torch.float32 and tail.shape[0] == max(logits.shape[0], min(16, len(new)))
        assert torch.equal(tail[tail.shape[0] - hidden.shape[0]:], hidden)
        tails.append(tail)
    assert torch.equal(tails[0], full.hidden()[-16:])  # the prompt's last 16 positions
    keeping.reset()
    keeping.forward(LONG[:5], 1)
    full.reset()
    full.forward(LONG[:5])
    assert torch.equal(keeping.hidden_tail(), full.hidden())  # a prompt shorter than the rows kept: all of it
    keeping.keep_hidden_rows(0)
    keeping.forward([9, 10, 11], 1)
    assert torch.equal(keeping.hidden_tail(), keeping.hidden()) and keeping.hidden().shape[0] == 1


def test_packed_runners_keep_their_own_tails():
    """int8 runners keeping different rows in one forward_packed call: each gets, bit for bit, the logits,
    hidden() and tail it gets alone, and the logits of runners keeping nothing."""
    model = INT8["llama"]
    prompts, last_ns, keeps = [LONG, PROMPT, LONG[:3]], [1, 2, None], [16, 0, 2]
    packed, alone, plain = ([LeanRunner(model) for _ in prompts] for _ in range(3))
    for r, a, keep in zip(packed, alone, keeps):
        r.keep_hidden_rows(keep)
        a.keep_hidden_rows(keep)
    logits = forward_packed(packed, prompts, last_ns)
    reference = forward_packed(plain, prompts, last_ns)
    for r, a, p, last_n, lg, ref, keep in zip(packed, alone, prompts, last_ns, logits, reference, keeps):
        assert torch.equal(lg, ref) and torch.equal(a.forward(p, last_n), lg)
        assert torch.equal(r.hidden(), a.hidden()) and torch.equal(r.hidden_tail(), a.hidden_tail())
        assert r.hidden_tail().shape[0] == max(last_n or len(p), min(keep, len(p)))


def test_batch_slots_and_encoder_decoder_runners_keep_tails():
    """A batch slot passes keep_hidden_rows to its runner; the encoder-decoder runner's tail is hidden()'s."""
    target = BatchedTarget(INT8["llama"], 1)
    slot = target.acquire()
    slot.keep_hidden_rows(6)
    slot.forward(PROMPT, 1)
    alone = LeanRunner(INT8["llama"])
    alone.forward(PROMPT)
    assert torch.equal(slot.hidden_tail(), alone.hidden()[-6:]) and slot.hidden().shape[0] == 1
    slot.release()
    runner = Seq2SeqRunner(tiny_bart())
    runner.set_source(SOURCES[0])
    runner.keep_hidden_rows(6)
    runner.forward([*runner.decoder_prompt(), 5, 9], 1)
    assert torch.equal(runner.hidden_tail(), runner.hidden())


def layer_outputs(model, tokens: list[int], taps: tuple[int, ...]) -> torch.Tensor:
    """The transformers model's outputs of decoder layers `taps` over `tokens`, no cache: [len(tokens), H x taps]."""
    with torch.inference_mode():
        states = model.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # [0]: embeddings
    return torch.cat([states[i + 1][0].float() for i in taps], dim=1)


@pytest.mark.parametrize("name", ["lean-int8", "transformers-fp32"])
def test_tapped_rows_follow_the_final_hidden_states(name):
    """With tap_layers, hidden() and hidden_tail() rows are the final hidden states (as untapped, bitwise) then
    the tapped layers' outputs (the model's own: bitwise for int8), through steps, a rollback and a tree; the
    logits do not change; () turns it off."""
    int8 = name == "lean-int8"
    model = quantize_model(tiny_model("llama", 0, layers=3)) if int8 else tiny_model("llama", 0, layers=3)
    make = (lambda: LeanRunner(model)) if int8 else (lambda: HFRunner(model))
    tapped, plain = make(), make()
    tapped.tap_layers((0, 1))
    tapped.keep_hidden_rows(4)
    h = model.config.hidden_size
    tokens: list[int] = []
    for new, last_n in [(PROMPT, 1), *STEPS, ("rollback", 3), ([44, 45, 46], None)]:
        if new == "rollback":
            tokens = tokens[:-last_n]
            tapped.rollback(len(tokens))
            plain.rollback(len(tokens))
            continue
        assert torch.equal(tapped.forward(new, last_n), plain.forward(new, last_n))
        tokens += new
        hidden, tail = tapped.hidden(), tapped.hidden_tail()  # [n, 3H], [m, 3H]
        assert hidden.shape[1] == tail.shape[1] == 3 * h and torch.equal(hidden[:, :h], plain.hidden())
        expected = layer_outputs(model, tokens, (0, 1))[-tail.shape[0]:]
        assert torch.equal(tail[:, h:], expected) if int8 else torch.allclose(tail[:, h:], expected, atol=1e-4)
        assert torch.equal(tail[tail.shape[0] - hidden.shape[0]:], hidden)
    cached = len(tokens)
    tapped.forward_tree([5, 6, 7], [-1, -1, 1])
    tapped.keep_rows(cached, [1, 2])
    expected = layer_outputs(model, tokens + [6, 7], (0, 1))[-2:]
    assert torch.allclose(tapped.hidden()[:, h:], expected, atol=1e-4)
    tapped.tap_layers(())
    tapped.forward([8], None)
    assert tapped.hidden().shape == (1, h)
    with pytest.raises(ValueError, match="tapped layers"):
        tapped.tap_layers((3,))


def test_packed_runners_tap_their_own_layers():
    """int8 runners tapping different layers (or none) in one forward_packed call: each gets, bit for bit, what
    it gets alone, and the same logits."""
    model = quantize_model(tiny_model("qwen2", 0, layers=3))
    taps, prompts, last_ns = [(0, 1), (), (1,)], [PROMPT, PROMPT[:3], [9, 9, 1, 4, 5]], [1, None, 2]
    packed, alone = [LeanRunner(model) for _ in taps], [LeanRunner(model) for _ in taps]
    for r, a, t in zip(packed, alone, taps):
        r.tap_layers(t)
        a.tap_layers(t)
        r.keep_hidden_rows(3)
        a.keep_hidden_rows(3)
    logits = forward_packed(packed, prompts, last_ns)
    for r, a, p, last_n, lg, t in zip(packed, alone, prompts, last_ns, logits, taps):
        assert torch.equal(a.forward(p, last_n), lg)
        assert torch.equal(r.hidden(), a.hidden()) and torch.equal(r.hidden_tail(), a.hidden_tail())
        assert r.hidden().shape[1] == model.config.hidden_size * (1 + len(t))
    target = BatchedTarget(model, 1)
    slot = target.acquire()
    slot.tap_layers((1,))
    slot.forward(PROMPT, 1)
    fresh = LeanRunner(model)
    fresh.tap_layers((1,))
    fresh.forward(PROMPT, 1)
    assert torch.equal(slot.hidden(), fresh.hidden()) and slot.hidden().shape[1] == 2 * model.config.hidden_size
    slot.release()
