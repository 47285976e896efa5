"""`specdec bench --structured` (specdec.bench.structured): the shipped schema set, a run end to end on tiny fp32
models (constrained speculative output identical to plain constrained output, the files written), and its
one-line errors."""

import json

import jsonschema
import pytest
from typer.testing import CliRunner

from specdec.bench.structured import load_schema_prompts, validates
from specdec.cli import app
from specdec.errors import SpecdecError
from tests.tiny import save_tiny

runner = CliRunner()


def test_the_shipped_set_has_24_valid_schemas_with_prompts():
    records = load_schema_prompts("builtin")
    assert len(records) == 24 and len({r.id for r in records}) == 24
    assert len({r.category for r in records}) >= 6
    for r in records:
        jsonschema.Draft202012Validator.check_schema(r.schema)
        assert r.prompt.strip() and "JSON" in r.prompt


def test_validates():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert validates('{"a": 1}', schema) is True
    assert validates('{"a": "x"}', schema) is False
    assert validates('{"a": 1', schema) is False


@pytest.mark.parametrize("text, fragment", [
    ('{"id": "x"}\n', "needs id, category, prompt, schema"),
    ("not json\n", "not JSON"),
    ('{"id": 1, "category": "c", "prompt": "p", "schema": []}\n', "must be an object"),
    ("", "no records"),
])
def test_bad_files_are_one_line_errors(tmp_path, text, fragment):
    path = tmp_path / "set.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecdecError, match=fragment):
        load_schema_prompts(str(path))


def test_bench_structured_on_tiny_models(tmp_path):
    target = save_tiny(tmp_path / "target", "llama", seed=0)
    records = [{"id": f"r{i}", "category": "c", "prompt": f"Answer {i} in JSON:", "schema": schema}
               for i, schema in enumerate([{"enum": ["yes", "no", "maybe"]},
                                           {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                            "required": ["ok"], "additionalProperties": False}])]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "out"
    # the target as its own draft: drafts accepted, forced tokens verified as drafts
    result = runner.invoke(app, ["bench", "--target", target, "--draft", target, "--structured", str(path),
                                 "-n", "16", "--repeats", "2", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["records"] == 2 and data["identical"] == 2
    assert data["valid"] == sum(r["finish"] == "stop" for r in data["rows"])
    assert all(r["forced"] > 0 for r in data["rows"])  # '{"ok": ' and the enum's quotes are forced
    assert 0 <= data["mask_share"] < 10
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2  # records x methods x repeats
    assert "| r1 | c |" in (out / "summary.md").read_text()


def test_structured_refuses_other_modes_and_bad_files(tmp_path):
    result = runner.invoke(app, ["bench", "--structured", "builtin", "--prompts", "builtin"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    result = runner.invoke(app, ["bench", "--structured", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "cannot read" in result.output
