"""The ModelRunner protocol (specdec.backends.base): every runner says what its callers need of it.

Each runner -- transformers fp32 and int8, the lean runner's layer sets,
encoder-decoder, llama.cpp (over a fake session), stairs, the tests' toy --
is a ModelRunner, names its backend as the CLI prints it, gives its model's
end-of-sequence ids, and clones itself over the same loaded model or refuses
with one line; what its capabilities do not offer (hidden states, taps, trees), it refuses in one line.
"""

from __future__ import annotations

import pytest
import torch

from specdec.algorithm.stairs import stairs_runner
from specdec.backends.base import ModelRunner
from specdec.backends.hf import HFRunner
from specdec.backends.llamacpp import LlamaCppRunner
from specdec.backends.seq2seq import Seq2SeqRunner
from specdec.errors import SpecdecError
from specdec.native.lean import Fp32Layers, Int8Layers, LeanRunner, NativeInt4Layers
from specdec.native.quant import quantize_model
from tests.backends.test_llamacpp import FakeSession
from tests.backends.test_seq2seq import tiny_t5
from tests.tiny import tiny_model
from tests.toy import ToyRunner, random_table

FP32, INT8 = tiny_model("qwen2", 0), quantize_model(tiny_model("qwen2", 0))


def runners() -> dict[str, tuple[ModelRunner, str]]:
    """A runner of every kind, with the backend it names."""
    return {
        "hf fp32": (HFRunner(FP32), "transformers"),
        "hf int8": (HFRunner(INT8), "transformers int8"),
        "lean int8": (LeanRunner(INT8), "transformers int8"),
        "lean fp32": (LeanRunner(FP32, fp32=True), "transformers"),
        "lean int4": (LeanRunner(INT8, int4=True, int8_catch_up=False), "specdec int4"),
        "seq2seq": (Seq2SeqRunner(tiny_t5()), "transformers"),
        "llama.cpp": (LlamaCppRunner(FakeSession(), eos_token_ids=frozenset({7})), "llama.cpp"),
        "stairs": (stairs_runner(HFRunner(FP32)), "stairs"),
        "toy": (ToyRunner(random_table(5, 0)), "toy"),
    }


def test_every_runner_is_a_model_runner_and_names_its_backend():
    for name, (runner, backend) in runners().items():
        assert isinstance(runner, ModelRunner), name
        assert runner.describe() == backend, name
        assert "backend" in runner.identity() and "threads" in runner.identity(), name


def test_runners_give_their_models_end_of_sequence_ids():
    found = {name: runner.eos_token_ids for name, (runner, _) in runners().items()}
    assert found["hf fp32"] == found["lean int8"] == found["lean int4"] == frozenset({2})  # the generation config's
    assert found["llama.cpp"] == frozenset({7})  # the GGUF's
    assert found["stairs"] == found["toy"] == frozenset()  # none of their own: the engine adds the tokenizer's


def test_runners_declare_their_capabilities_and_refuse_the_rest():
    found = {name: runner for name, (runner, _) in runners().items() if runner.capabilities.tree}
    assert set(found) == {"hf fp32", "hf int8", "lean int8", "lean fp32"}  # not int4 drafts, llama.cpp, ...
    taps = {name for name, (runner, _) in runners().items() if runner.capabilities.taps}
    assert taps == {"hf fp32", "hf int8", "lean int8", "lean fp32"}  # not the native int4 kernel's rows
    for name in ("llama.cpp", "stairs", "toy"):
        runner, _ = runners()[name]
        assert not runner.capabilities.hidden_states and not runner.capabilities.tree, name
        for method, args in ((runner.hidden, ()), (runner.forward_tree, ([1], [-1])), (runner.tap_layers, ([0],))):
            with pytest.raises(SpecdecError, match=f"a {type(runner).__name__} "):
                method(*args)


def test_the_lean_runner_chooses_its_layer_set_once():
    assert type(LeanRunner(INT8).layer_set) is Int8Layers
    assert type(LeanRunner(INT8, fp32=True).layer_set) is Int8Layers  # fp32=True allows fp32, an int8 model stays int8
    assert type(LeanRunner(FP32, fp32=True).layer_set) is Fp32Layers
    assert type(LeanRunner(INT8, int4=True, int8_catch_up=False).layer_set) is NativeInt4Layers
    assert LeanRunner(INT8).layer_set is LeanRunner(INT8).layer_set  # built once per model


def test_clones_share_the_model_not_the_cache():
    for runner in (HFRunner(FP32), LeanRunner(INT8), LeanRunner(FP32, fp32=True), LeanRunner(INT8, int4=True)):
        first = runner.forward([3, 4, 5])
        clone = runner.clone()
        assert type(clone) is type(runner) and clone.model is runner.model and clone.tokens == []
        assert clone.max_context == runner.max_context and clone.capabilities == runner.capabilities
        if isinstance(runner, LeanRunner):
            assert clone.layer_set is runner.layer_set
        assert torch.equal(clone.forward([3, 4, 5]), first) and runner.tokens == [3, 4, 5]


@pytest.mark.parametrize("name", ["seq2seq", "llama.cpp", "stairs", "toy"])
def test_runners_that_cannot_share_their_model_refuse_to_clone(name):
    runner, _ = runners()[name]
    with pytest.raises(SpecdecError, match=f"which a {type(runner).__name__} draft cannot share its model"):
        runner.clone()
