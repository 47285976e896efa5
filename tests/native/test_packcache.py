"""The packed weights' cache (specdec.native.packcache): made once, memory-mapped after, never stale or damaged.

- tensors of every dtype come back from the file as they went in, mapped (no copy), and a model has one file;
- a file from another build, CPU or version of the model is not used (rebuilt quietly, in place);
- a truncated file, a damaged header or a changed page is rebuilt with one line on stderr, never a traceback;
- the gguf target and an int4 draft (its int4 rows and its int8 catch-ups) loaded from the cache compute
  bitwise the logits of a load that packed afresh.
"""

from __future__ import annotations

import os

import pytest
import torch

from specdec.native import gguf, packcache
from specdec.native.lean import LeanRunner, use_pack_cache
from specdec.native.packcache import DATA_ALIGN, PackCache, wait_for_writes
from specdec.native.quant import quantize_model
from tests.tiny import tiny_model
from tests.tiny_gguf import save_tiny_gguf


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"weights")
    return path


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"bytes": torch.randint(0, 255, (5000,), dtype=torch.uint8, generator=g),
            "int8": torch.randint(-128, 127, (3, 70), dtype=torch.int8, generator=g),
            "half": torch.randn(4, 9, generator=g).half(), "float": torch.randn(2, 3, 4, generator=g)}


def saved(source, directory, **extra) -> PackCache:
    cache = PackCache("test", source, extra, directory)
    for name, t in tensors().items():
        cache.tensor(name, lambda t=t: t)
    cache.save()
    wait_for_writes()
    return cache


def test_tensors_come_back_mapped_as_they_went_in(source, tmp_path):
    first = saved(source, tmp_path / "packed")
    assert not first.hit
    again = PackCache("test", source, None, tmp_path / "packed")
    assert again.hit
    for name, t in tensors().items():
        got = again.get(name)
        assert got is not None and got.dtype == t.dtype and torch.equal(got, t)
        assert got.data_ptr() % 4096 == 0  # in the mapping, page-aligned
    assert again.tensor("bytes", lambda: pytest.fail("rebuilt")) is again.get("bytes")
    assert len(list((tmp_path / "packed").iterdir())) == 1


def test_another_build_cpu_or_model_version_is_rebuilt_in_place(source, tmp_path, monkeypatch, capsys):
    directory = tmp_path / "packed"
    saved(source, directory)
    assert not PackCache("test", source, {"parameter": 2}, directory).hit
    real = packcache.build_identity
    monkeypatch.setattr(packcache, "build_identity", lambda: {**real(), "cpu": "another CPU"})
    assert not PackCache("test", source, None, directory).hit
    monkeypatch.setattr(packcache, "build_identity", real)
    os.utime(source, ns=(1, 1))  # the model file changed
    stale = PackCache("test", source, None, directory)
    assert not stale.hit
    assert capsys.readouterr().err == ""  # a first run's quiet, not an error
    saved(source, directory)
    assert PackCache("test", source, None, directory).hit and len(list(directory.iterdir())) == 1


@pytest.mark.parametrize("damage", ["truncated", "header", "page", "empty"])
def test_a_damaged_file_is_rebuilt_with_one_line(source, tmp_path, capsys, damage):
    directory = tmp_path / "packed"
    path = saved(source, directory).path
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 4096]
    elif damage == "header":
        data[20:30] = b"#" * 10
    elif damage == "page":
        data[DATA_ALIGN + 10] ^= 0xFF  # the first tensor's first page is always sampled
    else:
        data = data[:3]
    path.write_bytes(bytes(data))
    cache = PackCache("test", source, None, directory)
    assert not cache.hit and cache.get("bytes") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged" in err[0] and "rebuilding" in err[0] and "Traceback" not in err[0]
    saved(source, directory)
    assert PackCache("test", source, None, directory).hit


def test_an_unwritable_cache_costs_only_the_packing(source, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = saved(source, blocker / "packed")  # cannot be made: nothing written, nothing raised
    assert not cache.hit and not (blocker / "packed").exists()


def test_the_gguf_target_from_the_cache_is_bitwise_a_fresh_pack(tmp_path, monkeypatch):
    path = save_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    tokens = [3, 17, 42, 99, 5, 8]
    fresh = gguf.GGUFModel(gguf.GGUFFile(path))
    wait_for_writes()
    mapped = gguf.GGUFModel(gguf.GGUFFile(path))
    assert not fresh._arena.filled and mapped._arena.filled
    monkeypatch.setenv("SPECDEC_PACK_CACHE", "0")
    unpacked = gguf.GGUFModel(gguf.GGUFFile(path))
    assert not unpacked._arena.filled
    logits = [gguf.GGUFRunner(m).forward(tokens) for m in (fresh, mapped, unpacked)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


@pytest.mark.parametrize("catch_up", [False, True])
def test_an_int4_draft_from_the_cache_is_bitwise_a_fresh_one(source, tmp_path, catch_up):
    tokens = [5, 9, 13, 21, 34, 55, 89]

    def logits(cache: PackCache | None) -> list[torch.Tensor]:
        model = quantize_model(tiny_model("qwen2", 0))
        if cache is not None:
            use_pack_cache(model, cache)
        runner = LeanRunner(model, int4=True, int8_catch_up=catch_up)
        return [runner.forward(tokens), runner.forward([7]), runner.forward([11, 12])]  # catch-up rows, then a step

    fresh = logits(None)
    first = PackCache("int4", source, {"catch_up": catch_up}, tmp_path / "packed")
    assert [torch.equal(a, b) for a, b in zip(logits(first), fresh)] == [True] * 3
    first.save()
    wait_for_writes()
    again = PackCache("int4", source, {"catch_up": catch_up}, tmp_path / "packed")
    assert again.hit and any(name.startswith("int4.") for name in again._tensors)
    assert any(name.startswith("int8.") for name in again._tensors) == catch_up
    assert [torch.equal(a, b) for a, b in zip(logits(again), fresh)] == [True] * 3
    assert not again._stale  # every packed tensor came from the file: nothing made afresh


def test_a_process_that_ends_first_leaves_the_write_to_a_child(source, tmp_path):
    import subprocess
    import sys
    import time

    directory = tmp_path / "packed"
    code = ("import sys, torch; from pathlib import Path; from specdec.native.packcache import PackCache; "
            "c = PackCache('test', sys.argv[1], None, Path(sys.argv[2])); "
            "c.tensor('big', lambda: torch.ones(64 << 20, dtype=torch.uint8)); c.save()")  # then exits at once
    subprocess.run([sys.executable, "-c", code, str(source), str(directory)], check=True, timeout=120)
    deadline = time.monotonic() + 120
    while not list(directory.glob("test-*.bin")) and time.monotonic() < deadline:
        time.sleep(0.1)
    cache = PackCache("test", source, None, directory)
    assert cache.hit and torch.equal(cache.get("big")[:: 1 << 20], torch.ones(64, dtype=torch.uint8))


def _resident_bytes(address: int) -> int | None:
    """The bytes of this process's mapping at `address` that are mapped in (/proc/self/smaps' Rss), None where
    there is no such file (not Linux)."""
    try:
        with open("/proc/self/smaps", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    return None


def test_prefault_maps_every_page_in_on_its_own_thread(source, tmp_path, monkeypatch):
    monkeypatch.setattr(packcache, "SAMPLES", 1)  # the load's CRC check reads one page (a kernel may map its folio)
    big = torch.arange(32 << 20, dtype=torch.int64).to(torch.uint8)  # 32 MiB
    first = PackCache("test", source, None, tmp_path / "packed")
    assert first.prefault() is None  # nothing mapped: nothing to read
    first.tensor("big", lambda: big)
    first.save()
    wait_for_writes()
    cache = PackCache("test", source, None, tmp_path / "packed")
    mapped = cache.get("big")
    assert cache.hit and mapped is not None
    before = _resident_bytes(mapped.data_ptr())
    if before is None:
        pytest.skip("no /proc/self/smaps here")
    assert before < 8 << 20
    monkeypatch.setattr(packcache, "_cpus", lambda: 1)
    assert cache.prefault() is None  # one CPU: the thread would only take the caller's time
    monkeypatch.setattr(packcache, "_cpus", lambda: 2)
    thread = cache.prefault()
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _resident_bytes(mapped.data_ptr()) >= 32 << 20
    assert torch.equal(mapped, big)  # read, not written


def test_a_cache_dropped_while_its_pages_map_in_stays_mapped_until_done(source, tmp_path, monkeypatch):
    first = PackCache("test", source, None, tmp_path / "packed")
    first.tensor("big", lambda: torch.ones(64 << 20, dtype=torch.uint8))
    first.save()
    wait_for_writes()
    monkeypatch.setattr(packcache, "_cpus", lambda: 2)
    cache = PackCache("test", source, None, tmp_path / "packed")
    thread = cache.prefault()
    del cache  # the thread's view keeps the mapping: no read of unmapped memory (that would kill the process)
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_a_killed_writers_temporary_file_goes_at_the_next_load(source, tmp_path):
    import subprocess
    import sys

    saved(source, tmp_path / "packed")
    cache_file = next((tmp_path / "packed").glob("test-*.bin"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a pid that has ended
    left = cache_file.with_name(f".{cache_file.name}.{dead}.1.tmp")
    writing = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.1.tmp")  # this process's: still writing
    left.write_bytes(b"half a model")
    writing.write_bytes(b"being written")
    assert PackCache("test", source, None, tmp_path / "packed").hit  # a current file: never written again
    assert not left.exists() and writing.exists()
