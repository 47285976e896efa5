"""The runtimes' registry (specdec.runtime.runners): `auto` takes the first entry in RUNNERS' order that runs a model
fast and exactly here, --backend / --dtype name one entry, every runner built is its entry's, and what the batch
and the profile ask of a runner (slots, weight bytes a step) its entry answers."""

from __future__ import annotations

import pytest

from specdec.backends.hf import HFRunner
from specdec.errors import SpecdecError
from specdec.native import kernels
from specdec.native.gguf import Q4_1
from specdec.native.gguf import load as load_gguf
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from specdec.runtime import runners
from specdec.runtime.runners import DRAFT, RUNNERS, TARGET
from tests.backends.test_seq2seq import TARGET as T5
from tests.backends.test_seq2seq import save_seq2seq
from tests.tiny import save_tiny, tiny_model, tiny_tokenizer
from tests.tiny_gguf import save_tiny_gguf

SIMD = kernels.int8.isa() in ("avx512-vnni", "avx2")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("runtimes")
    return {"gguf": save_tiny_gguf(root / "tiny.gguf"), "llama": save_tiny(root / "llama", "llama"),
            "t5": save_seq2seq(root / "t5", T5)}


def test_the_registry_names_each_runtime_once_in_autos_order() -> None:
    names = [entry.name for entry in RUNNERS]
    assert names == ["native-gguf", "native-int8", "transformers", "llamacpp", "native-int4"]
    assert {entry.backend for entry in RUNNERS} == {"hf", "llamacpp"}
    hf_dtypes = [d for entry in RUNNERS if entry.backend == "hf" for d in entry.dtypes]
    assert len(hf_dtypes) == len(set(hf_dtypes)), "a --dtype names one runtime"
    assert runners.named("native-int4").roles == (DRAFT,)
    with pytest.raises(SpecdecError, match="unknown runtime 'onnx': expected one of native-gguf"):
        runners.named("onnx")


def test_auto_takes_the_first_runtime_that_runs_the_model_fast_here(files: dict[str, str]) -> None:
    gguf_fast = kernels.gguf.isa() != "c"
    assert runners.auto(files["gguf"]).name == ("native-gguf" if gguf_fast else "native-int8" if SIMD else "transformers")
    assert runners.auto(files["llama"]).name == ("native-int8" if SIMD else "transformers")
    assert runners.auto(files["t5"]).name == "transformers"  # the int8 kernel is for decoder-only models
    assert runners.auto((tiny_model(), tiny_tokenizer())).name == "transformers"  # a loaded model as it is
    assert runners.auto(files["gguf"], backend="llamacpp").name == "llamacpp"
    assert runners.auto("not a model").name == "transformers"  # the load reports the name in one line


def test_backend_and_dtype_name_one_runtime_and_a_draft_only_one_is_refused_for_a_target() -> None:
    assert runners.for_load("hf", "gguf").name == "native-gguf"
    assert runners.for_load("hf", "bf16").name == "transformers"
    assert runners.for_load("llamacpp", "fp32").name == "llamacpp"
    assert runners.for_load("hf", "int4", DRAFT).name == "native-int4"
    with pytest.raises(SpecdecError, match=r"int4 is a draft's dtype only \(--draft-dtype int4\)"):
        runners.for_load("hf", "int4", TARGET)
    with pytest.raises(SpecdecError, match="no runtime runs --backend hf --dtype fp8"):
        runners.for_load("hf", "fp8")


def test_every_runner_built_is_its_runtimes_and_answers_for_the_batch_and_the_profile(files: dict[str, str]) -> None:
    gguf = load_gguf(files["gguf"])
    four_bits = load_gguf(files["gguf"], requantize=Q4_1)
    int8 = LeanRunner(quantize_model(tiny_model("llama", seed=0)))
    hf = HFRunner(tiny_model("llama", seed=0))
    owners = {id(r): runners.of(r) for r in (gguf, four_bits, int8, hf)}
    assert [owners[id(r)].name for r in (gguf, four_bits, int8, hf)] == [  # type: ignore[union-attr]
        "native-gguf", "native-int4", "native-int8", "transformers"]
    assert runners.of(object()) is None  # built elsewhere: no runtime claims it
    assert runners.batchable(gguf) and runners.batchable(int8) and not runners.batchable(hf)
    assert runners.step_bytes(gguf) == gguf.layer_set.step_bytes(gguf.head) > 0
    assert runners.step_bytes(four_bits) < runners.step_bytes(gguf)  # type: ignore[operator]
    params = sum(p.numel() * p.element_size() for p in hf.model.parameters())
    embedding = hf.model.get_input_embeddings().weight
    tied = hf.model.get_output_embeddings().weight is embedding  # a tied head is read every step
    assert runners.step_bytes(hf) == params - (0 if tied else embedding.numel() * embedding.element_size())


def test_as_runner_wraps_a_loaded_model_on_its_runtime(files: dict[str, str]) -> None:
    from transformers import AutoModelForSeq2SeqLM

    assert isinstance(runners.as_runner(tiny_model("llama")), HFRunner)
    assert isinstance(runners.as_runner(quantize_model(tiny_model("llama"))), LeanRunner)
    seq2seq = runners.as_runner(AutoModelForSeq2SeqLM.from_pretrained(files["t5"]))
    assert runners.is_seq2seq_runner(seq2seq) and not runners.is_seq2seq_runner(object())
    with pytest.raises(TypeError, match="expected a transformers model or a ModelRunner"):
        runners.as_runner("a name")  # type: ignore[arg-type]


def test_a_new_runtime_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch, files: dict[str, str],
                                             tmp_path) -> None:
    """docs/extending.md's example: a draft in fp16, one entry registered ahead of transformers; Engine.load loads
    the draft through it, the registry names its runner, a target in fp16 is refused, greedy output is plain's."""
    import torch

    from specdec.runtime.engine import Engine
    from specdec.runtime.loading import load_hf

    def load_fp16(spec: str, dtype: str, options: runners.LoadOptions) -> runners.Loaded:
        model, tokenizer = load_hf(spec, dtype="fp32", progress=options.progress, device=options.device)
        return model.half(), tokenizer

    def is_fp16(runner) -> bool:
        model = getattr(runner, "model", None)
        return model is not None and getattr(model, "dtype", None) == torch.float16

    monkeypatch.setattr(runners, "RUNNERS", RUNNERS)  # the registry as it was, after the test
    entry = runners.Runtime("transformers-fp16", "hf", ("fp16",), (DRAFT,), "transformers in fp16",
                            fast=lambda spec, device: False, load=load_fp16, owns=is_fp16,
                            step_bytes=runners.named("transformers").step_bytes)
    runners.register(entry, before="transformers")
    assert [e.name for e in runners.RUNNERS].index("transformers-fp16") == 2
    with pytest.raises(SpecdecError, match="another entry has"):
        runners.register(entry)
    draft = save_tiny(tmp_path / "draft", "llama", seed=1)
    engine = Engine.load(files["llama"], draft, dtype="fp32", draft_dtype="fp16")
    assert runners.of(engine.draft_runner).name == "transformers-fp16"  # type: ignore[union-attr]
    assert runners.of(engine.target_runner).name == "transformers"  # type: ignore[union-attr]
    assert runners.step_bytes(engine.draft_runner) * 2 == runners.step_bytes(  # type: ignore[operator]
        runners.as_runner(load_hf(draft)[0]))
    with pytest.raises(SpecdecError, match=r"fp16 is a draft's dtype only"):
        Engine.load(files["llama"], draft, dtype="fp16")
    plain = Engine.load(files["llama"], "none", dtype="fp32")
    for prompt in ("Once upon a time", "def f(x):"):
        speculative = engine.generate(prompt, max_new_tokens=24, num_speculative_tokens=3)
        assert speculative.token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
        assert speculative.stats.drafted > 0  # the fp16 draft drafted
