"""Workloads: the shipped session files load, have the shape the issue asks for, and bad input is refused."""

import json
import re

import pytest

from specdec.bench.workloads import (
    SOURCE,
    WORKLOADS,
    Session,
    load_workload,
    load_workloads,
    parse_workloads,
    workload_path,
)
from specdec.errors import SpecdecError
from specdec.prompt_files import ASSISTANT, USER


@pytest.mark.parametrize("name", WORKLOADS)
def test_shipped_workloads_have_eight_sessions_of_three_to_six_turns(name):
    assert workload_path(name).is_file()
    sessions = load_workload(name)
    assert len(sessions) >= 8
    assert all(3 <= len(s.turns) <= 6 for s in sessions), [(s.id, len(s.turns)) for s in sessions]
    assert {s.category for s in sessions} == {name}
    assert {s.source for s in sessions} == {SOURCE}
    assert len({s.id for s in sessions}) == len(sessions)
    # Short enough for a 1.5B model on CPU: under 1,500 tokens with 128-token answers, at about
    # 3 characters a token (measured with Qwen2.5's tokenizer: at most 1,378 tokens).
    for s in sessions:
        assert sum(len(t) for t in s.turns) / 3 + 128 * (len(s.turns) - 1) < 1500, s.id


def test_agent_turns_are_tools_then_json_observations():
    for s in load_workload("agent"):
        tools = re.search(r"The tools:\n(\[.*?\n\])\n", s.turns[0], re.S)
        assert tools is not None, s.id
        assert all({"name", "description", "parameters"} <= set(t) for t in json.loads(tools.group(1)))
        for turn in s.turns[1:]:
            head, _, rest = turn.partition("Observation: ")
            assert head == "", (s.id, turn[:40])
            observation = json.loads(rest.splitlines()[0])
            assert observation["tool"] in tools.group(1), (s.id, observation["tool"])


def test_later_turns_change_or_repeat_the_first():
    """Edit turns ask to change the previous answer; template turns are short requests in the first's format."""
    for s in load_workload("edit"):
        assert all(len(t) < 300 for t in s.turns[1:]), s.id
    for s in load_workload("template"):
        assert all(len(t) < len(s.turns[0]) for t in s.turns[1:]), s.id


def test_a_turn_prompt_holds_the_conversation_so_far():
    s = Session("x", "edit", ("write f", "rename it", "add tests"))
    first = s.prompt(1, [])
    assert (first.id, first.category, first.text, first.history) == ("x/1", "edit", "write f", ())
    third = s.prompt(3, ["def f(): ...", "def g(): ..."])
    assert third.id == "x/3" and third.text == "add tests"
    assert third.messages == ((USER, "write f"), (ASSISTANT, "def f(): ..."), (USER, "rename it"),
                              (ASSISTANT, "def g(): ..."), (USER, "add tests"))
    with pytest.raises(ValueError):
        s.prompt(2, [])
    with pytest.raises(ValueError):
        s.prompt(4, ["a", "b", "c"])


def test_load_workloads_limits_dedupes_and_reads_files(tmp_path):
    assert [s.category for s in load_workloads("edit, agent,edit", 1)] == ["edit", "agent"]
    assert parse_workloads("template,template") == ["template"]
    own = tmp_path / "mine.jsonl"
    own.write_text('{"turns": ["a", "b"]}\n\n{"session_id": "s2", "category": "sql", "turns": ["c"]}\n')
    sessions = load_workloads(f"{own},edit")
    assert sessions[:2] == [Session("1", "mine", ("a", "b")), Session("s2", "sql", ("c",))]
    assert len(sessions) == 2 + len(load_workload("edit"))


@pytest.mark.parametrize("text, fragment", [
    ("", "--workload is empty"),
    (" , ", "--workload is empty"),
    ("edit,chat", "unknown workload 'chat': expected a comma-separated list of edit, agent, template"),
    ("/no/such/sessions.jsonl", "unknown workload '/no/such/sessions.jsonl'"),
])
def test_bad_workload_names(text, fragment):
    with pytest.raises(SpecdecError, match=re.escape(fragment)) as e:
        load_workloads(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("body, fragment", [
    ('{"turns": []}', "non-empty \"turns\" list"),
    ('{"turns": ["a", " "]}', "non-empty \"turns\" list"),
    ('{"turns": ["a", "b"], "replies": ["x"]}', "a session has no \"replies\""),
    ('{"session_id": 1, "turns": ["a"]}\n{"session_id": "1", "turns": ["b"]}', "session_id 1 appears twice"),
    ('{"turns": ["a"], "category": ""}', "\"category\" must be a non-empty string"),
    ('{"turns": ["a"], "source": 3}', "\"source\" must be a string"),
    ('["a"]', "expected a JSON object"),
    ("{nope", "not valid JSON"),
    ("\n", "has no sessions"),
])
def test_bad_session_files(tmp_path, body, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(body + "\n", encoding="utf-8")
    with pytest.raises(SpecdecError, match=re.escape(fragment)):
        load_workloads(str(path))


def test_session_ids_must_be_unique_across_workloads(tmp_path):
    path = tmp_path / "copy.jsonl"
    path.write_text('{"session_id": "edit-01", "turns": ["a"]}\n', encoding="utf-8")
    with pytest.raises(SpecdecError, match="share the id 'edit-01'"):
        load_workloads(f"edit,{path}")
