"""The default configuration every entry point shares: the fastest exact target dtype ("auto": int8
where specdec's int8 kernel runs), the lookup + draft-model drafter and `-k auto`."""

import inspect

import pytest

from specdec.bench.methods import default_methods
from specdec.bench.runner import BenchOptions
from specdec.cli.bench import bench
from specdec.cli.generate import generate
from specdec.cli.profile import profile
from specdec.cli.serve import serve
from specdec.defaults import DEFAULT_DRAFTER
from specdec.engine_config import EngineConfig
from specdec.native import kernels
from specdec.runtime.engine import Engine
from specdec.runtime.runners import fastest_dtype
from specdec.serve.replicas import EngineSpec
from tests.backends.test_seq2seq import TARGET, save_seq2seq
from tests.tiny import save_tiny, tiny_model, tiny_tokenizer

# What "auto" must stand for on the machine running the tests.
EXPECTED = "int8" if kernels.int8.isa() in ("avx512-vnni", "avx2") else "fp32"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    return {"llama": save_tiny(root / "llama", "llama"), "t5": save_seq2seq(root / "t5", TARGET)}


def test_auto_is_int8_where_the_kernel_runs_and_fp32_elsewhere(dirs):
    assert fastest_dtype(dirs["llama"]) == EXPECTED
    assert fastest_dtype(dirs["t5"]) == "fp32"  # int8 is for decoder-only models
    assert fastest_dtype(dirs["llama"], backend="llamacpp") == "fp32"  # llama.cpp reads its GGUF as it is
    assert fastest_dtype((tiny_model(), tiny_tokenizer())) == "fp32"  # a model passed in is used as it is


def test_engine_load_resolves_auto_and_says_what_it_took(dirs):
    engine = Engine.load(dirs["llama"], dirs["llama"])
    assert (engine.dtype, engine.draft_dtype) == (EXPECTED, EXPECTED)
    assert Engine.load(dirs["llama"], dtype="fp32").dtype == "fp32"  # the reference, on request
    assert Engine.load(dirs["t5"]).dtype == "fp32"


def test_every_entry_point_defaults_to_auto_and_the_same_drafter():
    import specdec

    api = inspect.signature(specdec.generate).parameters
    assert api["draft"].default == DEFAULT_DRAFTER and "dtype" not in api  # the models' options: EngineConfig's
    assert "dtype" not in inspect.signature(Engine.load).parameters and EngineConfig().dtype == "auto"
    for command in (generate, serve, bench, profile):
        options = inspect.signature(command).parameters
        assert options["dtype"].default.default == "auto", command.__name__  # typer.Option(...)
    for command in (generate, serve, bench):
        options = inspect.signature(command).parameters
        assert options["draft"].default.default == DEFAULT_DRAFTER, command.__name__
        assert options["draft_backend"].default.default == "auto", command.__name__
    assert EngineSpec("t").dtype == "auto"  # what serve's Ray replicas load
    options = BenchOptions(EngineConfig("t"))
    assert (options.engine.dtype, options.engine.draft, options.engine.draft_backend, options.methods) == (
        "auto", DEFAULT_DRAFTER, "auto", "default")


def test_bench_runs_what_generate_runs_beside_what_users_would_otherwise_run():
    assert default_methods(True, True, "hf", "hf", "int4", llamacpp=True) == [
        "plain", "specdec-auto", "specdec", "hf-pld", "llamacpp"]  # transformers cannot draft in int4
    assert default_methods(True, True, "hf", "hf", "int8", llamacpp=False) == [
        "plain", "specdec-auto", "specdec", "hf-pld", "hf"]
    assert default_methods(True, False, "hf", "hf", None, llamacpp=False) == [
        "plain", "specdec-auto", "specdec", "hf-pld"]  # prompt lookup alone: no draft model for hf
    assert default_methods(False, False, "llamacpp", "llamacpp", None, llamacpp=True) == ["plain", "llamacpp"]


def test_generate_hands_the_models_options_to_the_load_and_the_rest_to_the_request(dirs, monkeypatch):
    import specdec

    loaded: dict = {}
    real = Engine.load.__func__  # type: ignore[attr-defined]

    def spy(cls, target, draft=None, progress=None, config=None, **options):
        loaded.update(options)
        return real(cls, target, draft, progress, config, **options)

    monkeypatch.setattr(Engine, "load", classmethod(spy))
    out = specdec.generate("def f(x):", target=dirs["llama"], draft="lookup", dtype="fp32", suffix_memory=0,
                           max_new_tokens=4, temperature=0.0)
    assert loaded == {"dtype": "fp32", "suffix_memory": 0} and len(out.token_ids) == 4
    with pytest.raises(TypeError, match="unexpected request option .dtpye."):  # refused before anything loads
        specdec.generate("x", target=dirs["llama"], dtpye="fp32")
