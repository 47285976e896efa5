"""Tests for specdec.runtime.loading: spec resolution and load_hf on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec import zoo
from specdec.errors import SpecdecError
from specdec.runtime import loading


@pytest.fixture(autouse=True)
def tmp_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.delenv("SPECDEC_WHEELHOUSE", raising=False)
    return home


def make_tiny_model_dir(folder: Path) -> Path:
    """Save a tiny random llama model and a word-level tokenizer to `folder`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(29)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_resolve_kinds(tmp_path, monkeypatch):
    assert loading.resolve("qwen2.5-coder-1.5b") == ("zoo", "qwen2.5-coder-1.5b")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert loading.resolve(str(gguf)) == ("gguf", str(gguf))
    assert loading.resolve(str(tmp_path)) == ("dir", str(tmp_path))
    assert loading.resolve("Qwen/Qwen2.5-Coder-1.5B-Instruct") == ("hub", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").mkdir()
    assert loading.resolve("owner/name") == ("dir", "owner/name")  # an existing path wins over a hub id


@pytest.mark.parametrize("spec", ["nonexistent-model", "missing/model.gguf", "/no/such/file.gguf", "a/b/c", ""])
def test_resolve_unknown(spec):
    with pytest.raises(SpecdecError, match="unknown model") as info:
        loading.resolve(spec)
    assert "smollm2-135m" in str(info.value) and "hub id" in str(info.value)


def test_resolve_existing_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(SpecdecError, match="unknown model"):
        loading.resolve(str(f))


def test_load_hf_bad_dtype():
    with pytest.raises(SpecdecError, match="dtype"):
        loading.load_hf("smollm2-135m", dtype="fp16")


def test_load_hf_dir_without_config(tmp_path):
    with pytest.raises(SpecdecError, match="config.json"):
        loading.load_hf(str(tmp_path))


def test_load_hf_dir(tmp_path):
    import torch

    folder = make_tiny_model_dir(tmp_path / "tiny")
    model, tokenizer = loading.load_hf(str(folder))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    assert tokenizer("w1 w2")["input_ids"] == [4, 5]
    model16, _ = loading.load_hf(str(folder), dtype="bf16")
    assert model16.dtype == torch.bfloat16


def test_load_hf_gguf_converts_once(tmp_path, monkeypatch, tmp_home):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def fake_convert(gguf_file, out, source=None, progress=None):
        calls.append(gguf_file)
        return make_tiny_model_dir(out)

    monkeypatch.setattr(zoo, "convert_gguf", fake_convert)
    model, _ = loading.load_hf(str(gguf))
    model, _ = loading.load_hf(str(gguf))
    assert calls == [gguf.resolve()]
    cache = loading.gguf_cache_dir(gguf)
    assert cache.parent == tmp_home / "hf" and cache.name.startswith("gguf-")
    gguf.write_bytes(b"GGUF changed content")  # new size/mtime: a new cache entry
    assert loading.gguf_cache_dir(gguf) != cache


def test_load_hf_hub_unreachable(monkeypatch):
    def offline(location, torch_dtype):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(loading, "_from_pretrained", offline)
    with pytest.raises(SpecdecError, match="hub") as info:
        loading.load_hf("someone/some-model")
    assert "qwen2.5-coder-0.5b" in str(info.value)


@pytest.mark.real
def test_real_load_zoo_model(real_hf):
    """load_hf on a zoo name gives an eval-mode model whose greedy output is sane (uses the real cache)."""
    import torch

    model, tokenizer = real_hf("smollm2-135m", "bf16")
    assert model.dtype == torch.bfloat16 and not model.training
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.parametrize("isa,expected", [("avx512-vnni", "int4"), ("avx2", "int4"), ("c", None)])
def test_the_auto_draft_runs_on_specdecs_kernels_where_that_was_measured_faster(tmp_path, monkeypatch, isa, expected):
    from specdec.native import kernels
    from specdec.runtime.loading import fastest_spec_draft_dtype

    monkeypatch.setattr(kernels.int8, "isa", lambda: isa)
    assert fastest_spec_draft_dtype("qwen2.5-coder-0.5b", "hf", "cpu") == expected
    assert fastest_spec_draft_dtype("smollm2-135m", "hf", "cpu") == expected  # llama-family, like the 0.5B
    assert fastest_spec_draft_dtype("gemma3-270m", "hf", "cpu") == expected  # lean runs Gemma 3 in int4 too
    assert fastest_spec_draft_dtype(str(tmp_path), "hf", "cpu") is None  # a directory may hold an encoder-decoder
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert fastest_spec_draft_dtype(str(gguf), "hf", "cpu") is None  # a user's GGUF file stays on llama.cpp
    assert fastest_spec_draft_dtype("qwen2.5-coder-0.5b", "llamacpp", "cpu") is None  # a llama.cpp target
    assert fastest_spec_draft_dtype("qwen2.5-coder-0.5b", "hf", "cuda") is None
    assert fastest_spec_draft_dtype(None, "hf", "cpu") is None


@pytest.mark.parametrize("faster", ["int8", "int4", None])
def test_engine_auto_draft_backend_loads_an_int8_or_int4_draft_where_that_is_faster(tmp_path, monkeypatch, faster):
    from specdec.native.quant import is_int8
    from specdec.runtime import loading
    from specdec.runtime.engine import Engine

    model_dir = str(make_tiny_model_dir(tmp_path / "tiny"))
    asked = []
    monkeypatch.setattr(loading, "fastest_spec_draft_dtype",
                        lambda draft, backend, device: asked.append((draft, backend, device)) or faster)
    engine = Engine.load(model_dir, model_dir, dtype="fp32", draft_backend="auto")
    assert asked == [(model_dir, "hf", "cpu")]
    assert not is_int8(engine.target_runner.model)  # the target keeps the dtype it was given
    assert is_int8(engine.draft_runner.model) is (faster is not None)
    assert engine.draft_runner.describe().startswith("specdec int4") is (faster == "int4")
    explicit = Engine.load(model_dir, model_dir, dtype="fp32", draft_backend="hf")
    assert not is_int8(explicit.draft_runner.model)  # only "auto" asks
    given = Engine.load(model_dir, model_dir, dtype="fp32", draft_backend="auto", draft_dtype="fp32")
    assert not is_int8(given.draft_runner.model)  # a draft dtype the user gave wins
