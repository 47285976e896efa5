"""auto's drafter choice (specdec.drafters.choice): a zoo draft model only with the target's tokenizer and at most a
third of its parameters, else prompt lookup alone; the reason printed where the drafter is reported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specdec import zoo
from specdec.cli import app
from specdec.defaults import DEFAULT_TARGET, MODEL_DRAFTER, MODEL_FREE_DRAFTER
from specdec.drafters import choice
from specdec.drafters.choice import auto_drafter, auto_model, auto_note, facts
from specdec.drafters.spec import parse_drafter, resolve_drafter
from specdec.native.gguf import GGUFFile

REAL_HOME = zoo.home()  # where the zoo's files are pulled (each test's own home is empty)
TOKENS_A = ["<s>", "a", "b", "ab", "Ġc"]
TOKENS_B = ["<s>", "a", "b", "ba", "Ġc"]  # one token differs: another vocabulary


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """An empty specdec home (no heads saved, no GGUF index) per test."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    choice._file_facts.cache_clear()
    return tmp_path / "home"


def write_gguf(path: Path, tokens: list[str], rows: int, columns: int = 10, tied_copy: bool = True) -> Path:
    """A GGUF file with `tokens` and an embedding of rows x columns, written out again as the output head when
    `tied_copy` (as converters write a tied head), and one layer tensor of 7 x 10: rows * columns + 70 parameters."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    embedding = np.zeros((rows, columns), np.float32)  # [rows, columns]
    writer.add_tensor("token_embd.weight", embedding)
    if tied_copy:
        writer.add_tensor("output.weight", embedding)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((7, 10), np.float32))  # [7, 10]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake(name: str, tokens: list[str], parameters: int) -> zoo.ZooModel:
    return zoo.ZooModel(name=name, description="", arch="llama", vocab_size=len(tokens), params="", packages=(),
                        members=(), sha256="", filename=f"{name}.gguf", parameters=parameters,
                        vocabulary=GGUFFile.vocabulary_digest(tokens))


def test_the_zoo_targets_get_a_draft_of_their_tokenizer_and_a_third_their_size_or_lookup_alone():
    assert auto_drafter(DEFAULT_TARGET).drafter == MODEL_DRAFTER == "lookup+qwen2.5-coder-0.5b"  # 0.49B of 1.54B
    assert "0.49B parameters to its 1.54B" in auto_drafter(DEFAULT_TARGET).reason
    for target in ("smollm2-135m", "gemma3-270m"):  # no other zoo model has their tokenizer
        assert auto_drafter(target) == auto_model(target)
        assert auto_drafter(target).drafter == MODEL_FREE_DRAFTER == "lookup"
        assert "no other zoo model has the target's tokenizer" in auto_drafter(target).reason
    small = auto_drafter("qwen2.5-coder-0.5b")  # the 1.5B shares its tokenizer, but is larger than it
    assert small.drafter == "lookup" and "too large" in small.reason
    for target in zoo.ZOO:  # never a draft larger than the target, never another tokenizer's
        draft = parse_drafter(auto_drafter(target).drafter).model
        if draft is not None:
            assert isinstance(draft, str)
            assert 3 * zoo.ZOO[draft].parameters <= zoo.ZOO[target].parameters
            assert zoo.ZOO[draft].vocabulary == zoo.ZOO[target].vocabulary
    assert resolve_drafter("auto", "smollm2-135m") == parse_drafter("lookup")
    assert resolve_drafter("qwen2.5-coder-1.5b", "smollm2-135m").model == "qwen2.5-coder-1.5b"  # named: as named


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_the_zoos_recorded_facts_are_its_files(name):
    """What the zoo records for auto's rule is what its file says (skipped where the model is not pulled)."""
    path = REAL_HOME / "models" / zoo.ZOO[name].filename
    if not path.is_file():
        pytest.skip(f"{name} is not pulled")
    file = GGUFFile(path)
    assert (file.vocabulary, file.parameters()) == (zoo.ZOO[name].vocabulary, zoo.ZOO[name].parameters)


def test_the_rule_on_files(tmp_path, monkeypatch):
    """A .gguf target: its vocabulary and size read from the file; the largest zoo model of a third its size
    with its tokenizer drafts; one a parameter over a third does not; another vocabulary never."""
    monkeypatch.setattr(zoo, "ZOO", {m.name: m for m in [fake("a-1000", TOKENS_A, 1000), fake("a-900", TOKENS_A, 900),
                                                         fake("a-1500", TOKENS_A, 1500), fake("b-100", TOKENS_B, 100)]})
    target = write_gguf(tmp_path / "t.gguf", TOKENS_A, rows=293)  # 2930 + 70 = 3000 parameters (the head once)
    assert facts(str(target)) == choice.ModelFacts(GGUFFile.vocabulary_digest(TOKENS_A), 3000)
    assert auto_drafter(str(target)).drafter == "lookup+a-1000"
    just_under = write_gguf(tmp_path / "u.gguf", TOKENS_A, rows=292, columns=10, tied_copy=False)  # 2990
    assert auto_drafter(str(just_under)).drafter == "lookup+a-900"  # a-1000 is over a third of 2990
    small = write_gguf(tmp_path / "s.gguf", TOKENS_A, rows=200)  # 2070: none fits
    assert auto_drafter(str(small)).drafter == "lookup"
    assert "too large" in auto_drafter(str(small)).reason and "a-900: 900 to its 2,070" in auto_drafter(str(small)).reason
    other = write_gguf(tmp_path / "o.gguf", TOKENS_B + ["x"], rows=10_000)  # large, but its own vocabulary
    assert auto_drafter(str(other)).drafter == "lookup"
    assert "no other zoo model has the target's tokenizer" in auto_drafter(str(other)).reason


def test_a_vocabulary_is_its_token_strings_by_id(tmp_path):
    """The digest of a file's token array is that of the token list; trailing [PAD<n>] fillers do not count, a
    changed token or order does; a transformers folder's tokenizer.json gives the file's digest."""
    digest = GGUFFile.vocabulary_digest
    assert GGUFFile(write_gguf(tmp_path / "a.gguf", TOKENS_A, rows=5)).vocabulary == digest(TOKENS_A)
    padded = GGUFFile(write_gguf(tmp_path / "p.gguf", [*TOKENS_A, "[PAD5]", "[PAD6]"], rows=7)).vocabulary
    assert padded == digest(TOKENS_A) == digest([t.encode() for t in TOKENS_A])
    assert digest(TOKENS_B) != digest(TOKENS_A) != digest(TOKENS_A[::-1])
    assert digest(["[PAD0]", *TOKENS_A]) != digest(TOKENS_A)  # only trailing fillers are dropped

    from tests.tiny import save_tiny
    from tests.tiny_gguf import save_tiny_gguf

    folder, file = save_tiny(tmp_path / "dir", "llama"), save_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    assert facts(folder).vocabulary == facts(file).vocabulary is not None  # the same tokenizer, two formats
    assert facts(folder).parameters and facts(folder).parameters > 0
    assert facts("owner/not-downloaded") == choice.ModelFacts(None, None)  # a hub id: nothing known yet
    assert auto_drafter("owner/not-downloaded").drafter == "lookup"
    assert "not known before it loads" in auto_drafter("owner/not-downloaded").reason


def test_the_reason_is_printed_where_the_drafter_is_reported(tmp_path):
    runner = CliRunner()
    listing = json.loads(runner.invoke(app, ["models", "--json"]).stdout)
    default = next(row for row in listing if row["name"] == DEFAULT_TARGET)
    assert default["auto_drafter"] == MODEL_DRAFTER and "at most a third" in default["auto_reason"]
    assert auto_note("auto", DEFAULT_TARGET) == f" (auto: {auto_drafter(DEFAULT_TARGET).reason})"
    assert auto_note("lookup", DEFAULT_TARGET) == auto_note(None, DEFAULT_TARGET) == ""

    from tests.tiny import save_tiny

    target = save_tiny(tmp_path / "target", "llama")  # its tokenizer is no zoo model's: lookup alone
    result = runner.invoke(app, ["generate", "def f(x):", "--target", target, "-n", "4"])
    assert result.exit_code == 0, result.output
    assert "draft lookup (auto: lookup alone: no other zoo model has the target's tokenizer)" in result.output
