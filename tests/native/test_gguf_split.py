"""Split GGUF models (llama.cpp's gguf-split: <name>-00001-of-0000N.gguf ...) read by specdec.native.gguf.GGUFFile.

The parts are written here with gguf's GGUFWriter as gguf-split lays them out: every part a GGUF file of its own
header and tensor table, the model's metadata in the first only, split.no / split.count / split.tensors.count in
each, the tensors spread over the parts in order.  Checked: the split model is read from its first part as the
whole file is (metadata, vocabulary, the bytes of every tensor), the gguf target's logits from it are bitwise
the whole file's (a tiny random model) and its greedy tokens too (the zoo's SmolLM2, where pulled); another part,
or a set missing a part, is one line naming it; the parsed-header index follows every part's version.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.native import gguf
from tests.tiny_gguf import save_tiny_gguf

REAL_MODELS = gguf.home() / "models"  # where the zoo's files are pulled (read before a test's own home is set)
SPLIT = gguf.GGUFFile.SPLIT_NO, gguf.GGUFFile.SPLIT_COUNT, gguf.GGUFFile.SPLIT_TENSORS


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))  # its own GGUF index


def split_gguf(source: str | Path, folder: Path, parts: int, padding: str = "") -> list[Path]:
    """`source` split into `parts` files in `folder` as gguf-split writes them (see the module doc); `padding`: a
    string key more in the later parts (their tensors' data then starts further on)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    tensors = list(reader.tensors)
    stem = Path(source).stem
    paths = [folder / f"{stem}-{n:05d}-of-{parts:05d}.gguf" for n in range(1, parts + 1)]
    bounds = np.linspace(0, len(tensors), parts + 1).astype(int)  # the tensors in order, about as many in each part
    for number, path in enumerate(paths):
        writer = GGUFWriter(str(path), "unused")
        writer.kv_data[0].clear()  # no general.architecture of the writer's own: the first part copies the source's
        if number == 0:
            copy_metadata(reader, writer)
        writer.add_key_value(SPLIT[0], number, GGUFValueType.UINT16)
        writer.add_key_value(SPLIT[1], parts, GGUFValueType.UINT16)
        writer.add_key_value(SPLIT[2], len(tensors), GGUFValueType.INT32)
        if number and padding:
            writer.add_key_value("test.padding", padding, GGUFValueType.STRING)
        for tensor in tensors[bounds[number] : bounds[number + 1]]:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths


def copy_metadata(reader, writer) -> None:
    """The metadata of `reader`'s file (a gguf.GGUFReader) added to `writer` (a gguf.GGUFWriter's first part)."""
    from gguf import GGUFValueType

    for field in reader.fields.values():
        if field.name.startswith("GGUF."):  # the header's own fields, not metadata
            continue
        kind = GGUFValueType(field.types[0])
        inner = GGUFValueType(field.types[-1]) if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, inner)


def split_by_gguf_py(source: str | Path, folder: Path, max_tensors: int) -> list[Path]:
    """`source` split by the gguf package's own writer (split_max_tensors: its gguf-split layout), another
    producer of the layout split_gguf writes by hand."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(source))
    writer = GGUFWriter(None, "unused", split_max_tensors=max_tensors)
    writer.kv_data[0].clear()
    copy_metadata(reader, writer)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file(folder / Path(source).name)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(folder.glob(f"{Path(source).stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("split")
    whole = save_tiny_gguf(folder / "tiny.gguf", "qwen2")
    return {"whole": whole, "parts": split_gguf(whole, folder, 3)}


def test_a_split_model_reads_as_the_whole_file(tiny):
    whole, split = gguf.GGUFFile(tiny["whole"]), gguf.GGUFFile(tiny["parts"][0])
    assert split.paths == tiny["parts"] and {t.shard for t in split.tensors.values()} == {0, 1, 2}
    assert {k: v for k, v in split.metadata.items() if k not in SPLIT} == whole.metadata
    assert split.vocabulary == whole.vocabulary is not None and split.parameters() == whole.parameters()
    assert list(split.tensors) == list(whole.tensors)
    for name, tensor in whole.tensors.items():
        assert (split.tensors[name].type_id, split.tensors[name].shape) == (tensor.type_id, tensor.shape)
        assert np.array_equal(split.blocks(name), whole.blocks(name)), name  # each from its own part's mapping
    again = gguf.GGUFFile(tiny["parts"][0])  # from the index now
    assert again.tensors == split.tensors and again.paths == split.paths and again.metadata == split.metadata


def test_the_gguf_packages_own_split_reads_as_the_whole_file(tiny, tmp_path):
    parts = split_by_gguf_py(tiny["whole"], tmp_path, max_tensors=8)
    whole, split = gguf.GGUFFile(tiny["whole"]), gguf.GGUFFile(parts[0])
    assert len(parts) > 2 and split.paths == parts and len({t.shard for t in split.tensors.values()}) == len(parts)
    assert all(np.array_equal(split.blocks(name), whole.blocks(name)) for name in whole.tensors)


def test_the_gguf_targets_logits_are_the_whole_files(tiny):
    tokens = [5, 17, 99, 3, 42, 42, 7, 200, 11, 64]
    logits = []
    for path in (tiny["whole"], tiny["parts"][0]):
        runner = gguf.load(path)
        prefill = runner.forward(tokens[:6])  # [6, vocab]: a prefill, then a verification of 4
        logits.append(torch.cat([prefill, runner.forward(tokens[6:])]))
    assert torch.equal(logits[0], logits[1])


def test_another_part_or_a_missing_part_is_one_line(tiny, tmp_path):
    parts: list[Path] = tiny["parts"]  # type: ignore[assignment]
    with pytest.raises(SpecdecError, match=re.escape(f"{parts[1].name} is part 2 of 3 of a split GGUF model: "
                                                     f"give its first part, {parts[0].name}")) as error:
        gguf.GGUFFile(parts[1])
    assert "\n" not in str(error.value)
    for part in parts:
        os.link(part, tmp_path / part.name)
    (tmp_path / parts[2].name).unlink()
    with pytest.raises(SpecdecError, match=re.escape(f"part {parts[2].name} of 3 missing from {tmp_path}")) as error:
        gguf.GGUFFile(tmp_path / parts[0].name)
    assert "\n" not in str(error.value)
    renamed = tmp_path / "model.gguf"
    os.link(parts[0], renamed)
    with pytest.raises(SpecdecError, match="its name is not gguf-split's"):
        gguf.GGUFFile(renamed)


def test_the_index_follows_every_part(tiny, tmp_path, capsys):
    """The parsed header's index is current only while every part is: a later part written again (its tensors
    further on) is parsed again, and one gone since is said to be missing."""
    whole = gguf.GGUFFile(tiny["whole"])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    parts = split_gguf(tiny["whole"], tmp_path / "a", 3)
    padded = split_gguf(tiny["whole"], tmp_path / "b", 3, padding="x" * 100)
    before = gguf.GGUFFile(parts[0])  # parsed, indexed
    assert gguf.GGUFFile(parts[0]).tensors == before.tensors  # from the index
    index = before._index_path()
    index.write_text(json.dumps({"format": 1, "file": {}}))  # an earlier specdec's index, keyed on one file
    assert gguf.GGUFFile(parts[0]).tensors == before.tensors and capsys.readouterr().err == ""  # parsed again, quietly
    os.replace(padded[2], parts[2])  # the last part again, its tensors 128 bytes further on
    stat = os.stat(parts[0])
    os.utime(parts[2], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))  # (a later time than the first part's)
    after = gguf.GGUFFile(parts[0])
    last = [name for name, t in after.tensors.items() if t.shard == 2]
    assert last and all(after.tensors[name].offset != before.tensors[name].offset for name in last)
    assert all(np.array_equal(after.blocks(name), whole.blocks(name)) for name in last)
    parts[1].unlink()
    with pytest.raises(SpecdecError, match=re.escape(f"part {parts[1].name} of 3 missing")):
        gguf.GGUFFile(parts[0])


@pytest.mark.skipif(not (REAL_MODELS / "smollm2-135m-instruct-q4_1.gguf").is_file(), reason="smollm2-135m is not pulled")
def test_a_split_zoo_model_gives_the_whole_files_greedy_tokens(tmp_path):
    whole = REAL_MODELS / "smollm2-135m-instruct-q4_1.gguf"
    parts = split_gguf(whole, tmp_path, 2)
    prompt = [1, 504, 3287, 28, 253, 5248, 314, 253, 1345, 30]
    outputs = []
    for path in (whole, parts[0]):
        runner = gguf.load(path)
        logits, tokens = runner.forward(prompt), []  # [len(prompt), vocab]
        for _ in range(12):
            tokens.append(int(logits[-1].argmax()))
            logits = runner.forward(tokens[-1:])
        outputs.append((tokens, logits))
    assert outputs[0][0] == outputs[1][0] and torch.equal(outputs[0][1], outputs[1][1])


def test_the_cli_says_which_part_to_give(tiny):
    from typer.testing import CliRunner

    from specdec.cli import app

    parts: list[Path] = tiny["parts"]  # type: ignore[assignment]
    result = CliRunner().invoke(app, ["generate", "hi", "--target", str(parts[2]), "--draft", "none", "-n", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"is part 3 of 3 of a split GGUF model: give its first part, {parts[0].name}" in " ".join(result.output.split())
