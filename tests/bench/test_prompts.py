"""Prompt files: Spec-Bench JSONL, plain text with escapes, the builtin set, and one-line errors."""

import json

import pytest

from specdec.bench.prompts import BUILTIN, Prompt, builtin_path, limit_per_category, load_prompts, unescape_line
from specdec.errors import SpecdecError


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(*rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_spec_bench_jsonl_uses_the_first_turn(tmp_path):
    path = write(tmp_path / "q.jsonl", jsonl(
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "math", "turns": ["2+2?"]},
    ))
    assert load_prompts(path) == [Prompt("81", "writing", "Write a poem."), Prompt("82", "math", "2+2?")]


def test_jsonl_defaults_and_blank_lines(tmp_path):
    path = write(tmp_path / "q.jsonl", "\n" + json.dumps({"turns": ["hello"]}) + "\n\n")
    assert load_prompts(path) == [Prompt("2", "default", "hello")]  # id: the line number


def test_jsonl_detected_without_the_suffix(tmp_path):
    path = write(tmp_path / "questions.txt", jsonl({"question_id": 1, "category": "qa", "turns": ["Why?"]}))
    assert load_prompts(path) == [Prompt("1", "qa", "Why?")]


def test_plain_text_one_prompt_per_line_with_escapes(tmp_path):
    path = write(tmp_path / "p.txt", "def f(x):\\n    return x\n\n  \nsay \\\"hi\\\" \\\\n\ttab\n")
    prompts = load_prompts(path)
    assert [p.text for p in prompts] == ["def f(x):\n    return x", 'say \\"hi\\" \\n\ttab']
    assert [p.id for p in prompts] == ["1", "4"]
    assert {p.category for p in prompts} == {"default"}


def test_unescape_line():
    assert unescape_line(r"a\nb\tc\\d\qe") == "a\nb\tc\\d\\qe"
    assert unescape_line("ends with \\") == "ends with \\"


def test_builtin_set_has_six_categories_of_at_least_ten():
    assert builtin_path().is_file()
    prompts = load_prompts(BUILTIN)
    counts = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    assert set(counts) == {"code", "summarization", "qa", "translation", "math", "chat"}
    assert min(counts.values()) >= 10
    assert len({p.id for p in prompts}) == len(prompts)


def test_limit_per_category_keeps_file_order():
    ps = [Prompt(str(i), c, c + str(i)) for i, c in enumerate("aabbba")]
    assert [p.id for p in limit_per_category(ps, 2)] == ["0", "1", "2", "3"]
    assert limit_per_category(ps, None) == ps
    with pytest.raises(SpecdecError, match="limit-per-category"):
        limit_per_category(ps, 0)


def test_builtin_limit():
    assert len(load_prompts(BUILTIN, limit=1)) == 6


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "no prompts"),
        ("\n  \n", "no prompts"),
        ("{not json\n", "line 1: not valid JSON"),
        (json.dumps({"turns": []}) + "\n", "non-empty \"turns\""),
        (json.dumps({"question": "x"}) + "\n", "\"turns\""),
        (json.dumps([1, 2]) + "\n", "JSON object"),
        (json.dumps({"turns": ["  "]}) + "\n", "first turn is empty"),
        (json.dumps({"turns": ["a"], "category": 3}) + "\n", "category"),
        (jsonl({"question_id": 1, "turns": ["a"]}, {"question_id": 1, "turns": ["b"]}), "twice"),
    ],
)
def test_bad_jsonl(tmp_path, text, fragment):
    path = write(tmp_path / "bad.jsonl", text)
    with pytest.raises(SpecdecError, match=fragment):
        load_prompts(path)


def test_empty_text_file(tmp_path):
    with pytest.raises(SpecdecError, match="no prompts"):
        load_prompts(write(tmp_path / "empty.txt", "\n\n"))


def test_missing_file(tmp_path):
    with pytest.raises(SpecdecError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
