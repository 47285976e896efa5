"""Offline training material: manual pages as text, documented functions, chunks, prompts of every kind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.errors import SpecdecError
from specdec.training import data

TROFF = r""".\" a comment
.TH LS "1" "September 2022"
.SH NAME
ls \- list directory contents
.SH DESCRIPTION
.PP
List information about the \fBFILEs\fR (the current
directory by default).
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries
.TP
\f5\-\-color\fP, \fC\-\-width\fR
colorize the output
"""

SOURCE = '''
def documented(a, b):
    """Add two numbers."""
    total = a + b
    total += 0
    return total


def bare(x):
    return x
'''


def test_manual_pages_become_plain_text() -> None:
    text = data.strip_troff(TROFF)
    assert text.startswith("NAME\n\nls - list directory contents\n\nDESCRIPTION")
    assert "List information about the FILEs (the current directory by default)." in text
    assert "-a, --all do not ignore entries" in text and "comment" not in text and "\\f" not in text
    assert "--color, --width colorize the output" in text  # font escapes by number and C (constant width)


def test_documented_functions_are_found() -> None:
    found = data.functions(SOURCE)
    assert found == ['def documented(a, b):\n    """Add two numbers."""\n    total = a + b\n    total += 0\n    return total']
    assert data.functions("def broken(:") == []


def test_chunks_cut_at_paragraphs() -> None:
    paragraphs = ["word " * 60] * 10  # 300 characters each
    pieces = data.chunks("\n\n".join(paragraphs), size=1000)
    assert len(pieces) == 4 and all(len(p) <= 1300 for p in pieces)


def test_the_users_text_and_a_record_of_it(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text(("A paragraph of the user's own text. " * 10 + "\n\n") * 20)
    material = data.gather(extra=[tmp_path], builtin=False)
    assert material.texts and not material.prompts
    assert any(str(tmp_path / "notes.txt") in line for line in material.describe())


def test_builtin_prompts_cover_every_kind_and_repeat_with_the_seed() -> None:
    a, b = data.gather(seed=3, files=12), data.gather(seed=3, files=12)
    assert a.prompts == b.prompts and a.texts == b.texts
    kinds = {"code": "```python", "document": "text", "math": "?", "writing": "Write ", "question": "xplain"}
    for kind, mark in kinds.items():
        assert any(mark in p for p in a.prompts), kind
    assert data.gather(seed=4, files=12).prompts != a.prompts
    assert a.follow_ups == b.follow_ups


def test_some_prompts_are_followed_up_by_a_second_turn_or_a_translation_of_the_answer() -> None:
    material = data.gather(seed=3, files=12)
    turns = [(i, f) for i, f in material.follow_ups.items() if "{answer}" not in f.text]
    quotes = [(i, f) for i, f in material.follow_ups.items() if "{answer}" in f.text]
    assert turns and quotes and all(0 <= i < len(material.prompts) for i in material.follow_ups)
    assert all(any(f" {language}" in material.prompts[i] for language in data.LANGUAGES) for i, _ in quotes)
    i, turn = turns[0]
    assert turn.messages(material.prompts[i], "An answer.") == [
        ("user", material.prompts[i]), ("assistant", "An answer."), ("user", turn.text)]
    (role, text), = quotes[0][1].messages("In French, write a poem.", "Un poème {pas} formaté.")
    assert role == "user" and text.endswith("\n\nUn poème {pas} formaté.") and "English" in text
    assert f"{len(material.follow_ups)} of them followed up" in material.describe()[-1]


def test_the_users_prompts_in_every_format(tmp_path: Path) -> None:
    lines = tmp_path / "log.jsonl"
    lines.write_text('"Explain tides."\n\n{"prompt": "Fix my loop."}\n'
                     '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},'
                     ' {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Sum 2+2."}]}\n')
    assert data.read_prompts(lines) == [
        [("user", "Explain tides.")], [("user", "Fix my loop.")],
        [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Sum 2+2.")]]
    listed = tmp_path / "prompts.json"
    listed.write_text('["One?", {"prompt": "Two?"}]')
    assert data.read_prompts(listed) == [[("user", "One?")], [("user", "Two?")]]
    plain = tmp_path / "prompts.txt"
    plain.write_text("First question\n\nComplete:\\ndef f(x):\n")  # the bench's escapes: \n is a newline
    assert data.read_prompts(plain) == [[("user", "First question")], [("user", "Complete:\ndef f(x):")]]
    parts = tmp_path / "parts.jsonl"
    parts.write_text('{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hel"}, '
                     '{"type": "text", "text": "lo"}]}]}\n')
    assert data.read_prompts(parts) == [[("user", "Hello")]]
    served = tmp_path / "served.jsonl"  # what the server accepts: a developer turn, null and empty contents
    served.write_text('{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": []},'
                      ' {"role": "assistant", "content": null}, {"role": "user", "content": "Go on."}]}\n')
    assert data.read_prompts(served) == [[("developer", "Be brief."), ("user", ""), ("assistant", ""), ("user", "Go on.")]]
    bench = tmp_path / "bench.jsonl"  # a `specdec bench` prompt file, read as the bench reads it
    bench.write_text('{"turns": ["Only the first", "not this"]}\n'
                     '{"turns": ["Hi", "And now?"], "replies": ["Hello!"]}\n')
    assert data.read_prompts(bench) == [[("user", "Only the first")],
                                        [("user", "Hi"), ("assistant", "Hello!"), ("user", "And now?")]]
    material = data.gather(builtin=False, prompt_files=[lines, plain])
    assert len(material.chats) == 5 and not material.prompts
    assert f"--prompts {lines}: 3" in material.describe() and f"--prompts {plain}: 2" in material.describe()


@pytest.mark.parametrize("name, content, message", [
    ("a.jsonl", '{"prompt": "ok"}\n{"prompt": \n', "a.jsonl:2: not JSON"),
    ("a.jsonl", '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
     "the last message must be the user's"),
    ("a.jsonl", '{"messages": [{"role": "robot", "content": "q"}]}', "a message is {\"role\""),
    ("a.jsonl", '{"text": "q"}', "a prompt is a string"),
    ("a.jsonl", '"ok"\n""', "a.jsonl:2: an empty prompt"),
    ("a.jsonl", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "a message is"),
    ("a.jsonl", '{"messages": [{"role": "user", "content": null}]}', "a.jsonl:1: an empty prompt"),
    ("a.jsonl", '{"turns": ["ok"]}\n{"turns": []}', "line 2: expected a non-empty \"turns\" list"),
    ("a.json", '{"prompt": "q"}', "a .json file holds a list"),
    ("a.json", '["q",', "not JSON"),
    ("a.txt", "\n\n", "no prompts in it"),
])
def test_bad_prompt_files_are_named_in_one_line(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SpecdecError, match=re.escape(message)):
        data.read_prompts(path)
