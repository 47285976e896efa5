"""The model options, declared once (specdec.engine_config.EngineConfig): every command's --target, --draft,
--dtype, ... are its fields' flags, and Engine, the Ray replicas' spec and the bench take the config."""

import dataclasses
import inspect
from pathlib import Path

import pytest
import typer

import specdec
from specdec import cli
from specdec.bench.runner import BenchOptions
from specdec.engine_config import EngineConfig, engine_fields, with_options
from specdec.serve.replicas import EngineSpec

# The model options each command takes (train-drafter: --target alone, required, without -t).
COMMANDS = {
    "generate": None, "serve": None, "bench": None,  # all of them
    "profile": {"target", "draft", "dtype", "draft_dtype", "backend", "device", "draft_backend", "n_ctx", "threads",
                "draft_vocab"},
    "quality": {"target", "dtype", "backend", "threads"},
    "train-drafter": {"target"},
}
# Options of a command's own that share a model option's name: train-drafter's --draft-vocab sizes the head it
# trains (the same idea, a draft's vocabulary, for a head), not a draft model's.
OWN = {"train-drafter": {"draft_vocab"}}


def test_target_is_declared_once_in_the_package():
    root = Path(specdec.__file__).parent
    found = {p.relative_to(root).as_posix(): p.read_text().count('"--target"') for p in root.rglob("*.py")}
    assert {name: n for name, n in found.items() if n} == {"engine_config.py": 1}


def test_every_commands_model_flags_come_from_engine_config():
    commands = typer.main.get_command(cli.app).commands
    fields = {f.name: o for f, o in engine_fields()}
    for name, wanted in COMMANDS.items():
        params = {p.name: p for p in commands[name].params}
        taken = {field for field in fields if field in params} - OWN.get(name, set())
        assert taken == (wanted or set(fields)), name
        assert "models" not in params, name
        for field in taken:
            flags = fields[field].flags
            if name == "train-drafter":
                flags = tuple(flag for flag in flags if flag.startswith("--"))
            assert sorted(params[field].opts) == sorted(flags), (name, field)
    assert commands["train-drafter"].params[0].required
    profile = {p.name: p for p in commands["profile"].params}
    assert profile["draft"].default == "none"  # profile times no drafter unless asked


def test_the_config_is_what_engine_replicas_and_bench_take():
    from specdec.runtime.engine import Engine

    assert EngineSpec is EngineConfig
    assert EngineConfig(draft="none").draft is None and EngineConfig(draft=" None ").draft is None
    load = inspect.signature(Engine.load).parameters  # Engine.load keeps no defaults of its own: the config's
    assert set(load) == {"target", "draft", "progress", "config", "options"}
    assert with_options(None, {}) == EngineConfig()
    assert with_options(EngineConfig(dtype="int8"), {"backend": "llamacpp"}) == EngineConfig(dtype="int8",
                                                                                           backend="llamacpp")
    with pytest.raises(TypeError, match="unexpected option.s. dtpye: expected some of backend"):
        with_options(None, {"dtpye": "int8"})
    with pytest.raises(TypeError, match="unexpected option.s. suffix_memroy"):
        Engine.load("smollm2-135m", suffix_memroy=0)  # refused before anything loads
    bench = BenchOptions(dataclasses.replace(EngineConfig(), target="t", threads=2))
    assert (bench.engine.target, bench.engine.threads, bench.methods) == ("t", 2, "default")


def test_engine_from_config_loads_as_load_does(tmp_path):
    from specdec.runtime.engine import Engine
    from tests.tiny import save_tiny

    target = save_tiny(tmp_path / "target", "llama", seed=0)
    engine = Engine.from_config(EngineConfig(target, "lookup", dtype="fp32"))
    assert (engine.dtype, engine.draft_name) == ("fp32", "lookup")
    assert engine.generate([1, 2, 3], max_new_tokens=4).token_ids == Engine.load(target, "lookup", dtype="fp32").generate(
        [1, 2, 3], max_new_tokens=4).token_ids


def test_a_config_written_as_options_parses_back_to_itself():
    from specdec.engine_config import command_line

    assert command_line(EngineConfig()) == []  # every default: no option
    config = EngineConfig(target="model.gguf", draft=None, dtype="int8", draft_dtype="int4", backend="llamacpp",
                          draft_backend="hf", n_ctx=512, threads=2, suffix_memory=0, draft_vocab="16384")
    args = command_line(config)
    assert args[:2] == ["--target", "model.gguf"] and "none" in args
    generate = typer.main.get_command(cli.app).commands["generate"]
    params = generate.make_context("generate", ["a prompt", *args]).params
    assert EngineConfig(**{f.name: params[f.name] for f, _ in engine_fields()}) == config
