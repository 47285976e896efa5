"""Sessions: turns in order, every method on its own history, before_session, repeats, per-turn summaries."""

import pytest

from specdec.algorithm.sampling import SamplingParams
from specdec.bench.methods import Measurement, Method
from specdec.bench.report import summary_json, summary_markdown
from specdec.bench.results import LATER, Record, aggregate, turn_keys
from specdec.bench.sessions import run_sessions
from specdec.bench.workloads import Session

SESSIONS = [Session("s1", "edit", ("write", "rename", "test")), Session("s2", "agent", ("tools", "obs"))]


class Echo(Method):
    """Answers with token ids derived from the prompt (so a different history gives a different answer)."""

    def __init__(self, name, log, shift=0, sampling=SamplingParams()):
        self.name, self.family, self.gamma = name, name, None
        self.log, self.shift, self.sessions = log, shift, 0
        self.sampling, self.base_seed = sampling, sampling.seed
        self.seeds = []

    def before_session(self):
        self.sessions += 1
        self.log.append((self.name, "session"))

    def generate(self, prompt_ids):
        self.log.append((self.name, tuple(prompt_ids)))
        self.seeds.append(self.sampling.seed)
        return Measurement([len(prompt_ids) % 50 + self.shift, 7])


def encode(prompt):
    """A prompt as "ids": one per character of the whole conversation (roles included)."""
    return [ord(c) for role, text in prompt.messages for c in role[0] + text]


def decode(token_ids):
    return "-".join(map(str, token_ids))


def run(methods, **kwargs):
    seen = []
    records = run_sessions(methods, SESSIONS, encode, decode, advance=seen.append, **kwargs)
    return records, seen


def test_turns_run_in_order_each_method_on_its_own_answers():
    log = []
    plain, same, other = Echo("plain", log), Echo("same", log), Echo("other", log, shift=1)
    records, seen = run([plain, same, other], warmup=False)
    assert [(r.session, r.turn) for r in records] == [(s.id, t) for s in SESSIONS
                                                      for t in range(1, len(s.turns) + 1) for _ in range(3)]
    assert [r.prompt_id for r in records[:3]] == ["s1/1"] * 3 and records[-1].prompt_id == "s2/2"
    assert len(seen) == 5 * 3 and seen[0] == "edit s1/1 plain"
    # One place of rotation per turn: s1/1 plain first, s1/2 same first, s1/3 other first.
    assert [r.method for r in records[:9]] == ["plain", "same", "other", "same", "other", "plain",
                                               "other", "plain", "same"]
    # Each method's turn-2 prompt holds its own turn-1 answer: other's differs from plain's.
    by = {(r.method, r.prompt_id): r for r in records}
    for name in ("plain", "other"):
        answer = decode(by[(name, "s1/1")].measurement.token_ids)
        turn2 = [ids for who, ids in log if who == name and ids != "session"][1]
        assert turn2 == tuple(encode(SESSIONS[0].prompt(2, [answer])))
    assert by[("plain", "s1/1")].measurement.token_ids != by[("other", "s1/1")].measurement.token_ids
    # Recorded: same answers and same history as plain for `same`; `other` parts at turn 1 and its
    # history differs from turn 2 on (turn 1 has none: vacuously plain's).
    assert all(r.identical_to_plain and r.history_identical_to_plain for r in records if r.method != "other")
    assert [(r.turn, r.identical_to_plain, r.history_identical_to_plain) for r in records
            if r.method == "other" and r.session == "s1"] == [(1, False, True), (2, False, False), (3, False, False)]
    # before_session once per session (no warm-up here), before its first turn.
    assert [m.sessions for m in (plain, same, other)] == [2, 2, 2]
    assert log[:3] == [("plain", "session"), ("same", "session"), ("other", "session")]


def test_warmup_and_repeats_run_whole_sessions_again():
    log = []
    methods = [Echo("plain", log), Echo("b", log)]
    records, seen = run(methods, repeats=2)
    assert seen[:2] == ["warm-up plain", "warm-up b"]
    assert log[1] == ("plain", tuple(encode(SESSIONS[0].prompt(1, []))))  # the first turn of the first session
    assert len(records) == 2 * 5 * 2
    # s1 repeat 0 (3 turns), then s1 repeat 1 from turn 1 again, then s2.
    assert [(r.session, r.repeat, r.turn) for r in records[::2]] == [
        ("s1", 0, 1), ("s1", 0, 2), ("s1", 0, 3), ("s1", 1, 1), ("s1", 1, 2), ("s1", 1, 3),
        ("s2", 0, 1), ("s2", 0, 2), ("s2", 1, 1), ("s2", 1, 2)]
    assert [m.sessions for m in methods] == [1 + 2 * 2] * 2  # the warm-up, then every session repeat
    assert all(r.identical_to_plain and r.history_identical_to_plain for r in records)


def test_across_sessions_methods_start_afresh_once_after_the_warmup():
    log = []
    methods = [Echo("plain", log), Echo("b", log)]
    records, seen = run(methods, across_sessions=True)
    assert seen[:2] == ["warm-up plain", "warm-up b"] and len(records) == 2 * 5
    # the warm-up's session, then one for the whole run: s2 keeps what s1 left (a server's store)
    assert [m.sessions for m in methods] == [2, 2]
    assert [i for i, (who, what) in enumerate(log) if what == "session"] == [0, 2, 4, 5]  # none after s1
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="--repeats 1"):
        run(methods, across_sessions=True, repeats=2)


def test_sampled_sessions_leave_identity_unmarked_but_record_histories():
    log = []
    records, _ = run([Echo("plain", log), Echo("b", log, shift=2)], warmup=False, compare_outputs=False)
    assert {r.identical_to_plain for r in records} == {None}
    assert [r.history_identical_to_plain for r in records if r.method == "b" and r.session == "s1"] == [True, False, False]


def test_a_sampled_session_repeat_draws_every_turn_with_seed_plus_repeat():
    log = []
    methods = [Echo(n, log, sampling=SamplingParams(temperature=1.0, seed=10)) for n in ("plain", "b")]
    run(methods, warmup=False, repeats=2, compare_outputs=False)
    for m in methods:  # s1's 3 turns, twice; s2's 2 turns, twice
        assert m.seeds == [10, 10, 10, 11, 11, 11, 10, 10, 11, 11]


def test_without_plain_no_history_is_compared():
    records, _ = run([Echo("b", [])], warmup=False, reference="plain")
    assert {(r.identical_to_plain, r.history_identical_to_plain) for r in records} == {(None, None)}


def test_repeats_must_be_positive():
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="--repeats"):
        run([Echo("plain", [])], repeats=0)


def rec(session, turn, method, tokens, wall, history=True, repeat=0):
    m = Measurement(list(tokens), wall_s=wall)
    return Record(f"{session}/{turn}", "edit", method, method, None, repeat, 5, m, session=session, turn=turn,
                  history_identical_to_plain=history)


def test_turn_keys():
    assert turn_keys([3, 1, None, 2, 1]) == ["1", LATER, "2", "3"]
    assert turn_keys([1, 1]) == ["1"]
    assert turn_keys([None]) == []


def test_summary_by_turn():
    records = [
        rec("a", 1, "plain", [1] * 10, 1.0), rec("a", 1, "spec", [1] * 10, 1.0),
        rec("a", 2, "plain", [1] * 10, 1.0), rec("a", 2, "spec", [1] * 10, 0.5),
        rec("a", 3, "plain", [1] * 10, 1.0), rec("a", 3, "spec", [1] * 10, 0.125, history=False),
    ]
    s = aggregate(records)
    assert s.turns == ["1", LATER, "2", "3"]
    spec = s.method("spec")
    assert spec.by_turn["1"].speedup_vs_plain == pytest.approx(1.0)
    assert spec.by_turn["2"].speedup_vs_plain == pytest.approx(2.0)
    assert spec.by_turn[LATER].speedup_vs_plain == pytest.approx(4.0)  # geometric mean of 2 and 8
    assert spec.by_turn[LATER].prompts == 2
    assert spec.overall.history_identical_rate == pytest.approx(2 / 3)
    assert s.method("plain").overall.history_identical_rate == 1.0
    data = summary_json(s, {})
    assert list(data["by_turn"]) == ["1", LATER, "2", "3"]
    assert [row["name"] for row in data["by_turn"]["3"]] == ["plain", "spec"]
    meta = {"workload": ["edit"], "sessions_per_category": {"edit": 1}, "prompts_per_category": {"edit": 3},
            "num_prompts": 3, "repeats": 1}
    md = summary_markdown(s, meta)
    assert "## Speedup vs plain by turn" in md and "| `spec` | 1.00× | 4.00× | 2.00× | 8.00× | 2.52× |" in md
    assert "workload `edit`: 1 sessions, 3 turns" in md and "`spec` 67%" in md
    # A prompt set has no turns: no by_turn key, no turn tables.
    plain_set = aggregate([Record("p", "c", "plain", "plain", None, 0, 5, Measurement([1], wall_s=1.0))])
    assert plain_set.turns == [] and "by_turn" not in summary_json(plain_set)
    assert "by turn" not in summary_markdown(plain_set, {"prompts": "builtin"})


def test_session_record_round_trip():
    r = rec("a", 2, "spec", [1, 2], 0.5, history=False)
    r.identical_to_plain = True
    d = r.to_dict()
    assert (d["session"], d["turn"], d["history_identical_to_plain"]) == ("a", 2, False)
    assert list(d)[-1] == "token_ids"
    assert Record.from_dict(d) == r
