"""Running a workload's sessions turn by turn, every method with its own conversation.

A session (:mod:`specdec.bench.workloads`) is answered in order: turn t's
prompt is the conversation so far — the user's turns 1..t and the answers to
turns 1..t-1 — and those answers are the ones **the method itself** generated,
as a chat client would send them back.  Greedy speculative decoding is
lossless, so every method should see the very prompts plain sees; each record
says whether it did (``history_identical_to_plain``: the method's earlier
answers in the session equal plain's, token for token).

Schedule.  Optionally one warm-up generation per method on the first turn of
the first session (not recorded).  Then per session, per repeat (a repeat is
the whole session again, from its first turn), every method's
``before_session()`` (its engine forgets what drafters learned from earlier
requests: :meth:`specdec.runtime.engine.Engine.forget`; with ``across_sessions`` only before the first
session, so that a method's suffix store keeps the run's earlier sessions as a server's does), then per
turn every method once,
in an order rotated by one place per turn (:func:`rotated`, as
:func:`specdec.bench.runner.run_interleaved` rotates per prompt).  Each method runs on an engine of its own (a fork:
:meth:`specdec.runtime.engine.Engine.fork`), so a drafter that learns across requests
learns from this method's earlier turns of the session and from nothing else —
never from another method's answer to the turn it is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specdec.bench.methods import REFERENCE, Method
from specdec.bench.results import Record
from specdec.bench.workloads import Session
from specdec.errors import SpecdecError
from specdec.prompt_files import Prompt

Encoder = Callable[[Prompt], list[int]]  # a turn's prompt -> token ids (chat template or plain text)
Decoder = Callable[[list[int]], str]  # an answer's token ids -> the text that goes into the history


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """`items` rotated left by k places: rotated([a, b, c], 1) == [b, c, a].  Both schedules run the
    methods in an order rotated by one place per prompt or turn, so that slow drift of the machine
    (thermal state, other load) falls on all methods alike instead of on whichever ran last."""
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def check_across_sessions(across_sessions: bool, repeats: int) -> None:
    """--across-sessions needs --repeats 1: a method keeps what its drafters learned, so a repeat would
    draft from its own earlier answer to the same turn (a one-line SpecdecError)."""
    if across_sessions and repeats > 1:
        raise SpecdecError("--across-sessions keeps what drafters learned, so a repeat would draft from its own "
                           "earlier answers: use --repeats 1")


def run_sessions(
    methods: Sequence[Method],
    sessions: Sequence[Session],
    encode: Encoder,
    decode: Decoder,
    repeats: int = 1,
    warmup: bool = True,
    advance: Callable[[str], None] | None = None,
    on_turn_done: Callable[[list[Record]], None] | None = None,
    compare_outputs: bool = True,
    reference: str = REFERENCE,
    across_sessions: bool = False,
) -> list[Record]:
    """Run every session turn by turn, every method on its own history, `repeats` times; returns the records.

    advance(description) is called after each generation (warm-ups included);
    on_turn_done(records) after each turn of a session repeat with that turn's records, marked
    identical or not to the reference's repeat-0 output of the turn (left None with
    compare_outputs=False: sampled outputs are not expected to match).
    """
    if repeats < 1:
        raise SpecdecError(f"--repeats must be >= 1, got {repeats}")
    check_across_sessions(across_sessions, repeats)
    advance = advance or (lambda _: None)
    if warmup and sessions:
        first = encode(sessions[0].prompt(1, ()))
        for m in methods:
            m.before_session()
            m.run(first)
            advance(f"warm-up {m.name}")
    records: list[Record] = []
    reference_ids: dict[str, list[int]] = {}  # turn prompt id -> the reference's repeat-0 answer
    slot = 0  # the rotation: one place per turn run
    for index, session in enumerate(sessions):
        for r in range(repeats):
            for m in methods:
                m.start_repeat(r)
            if index == 0 or not across_sessions:  # (across sessions: repeats == 1)
                for m in methods:
                    m.before_session()
            answers: dict[str, list[list[int]]] = {m.name: [] for m in methods}  # token ids, turn by turn
            replies: dict[str, list[str]] = {m.name: [] for m in methods}  # the same as text
            for turn in range(1, len(session.turns) + 1):
                done: list[Record] = []
                for m in rotated(methods, slot):
                    done.append(run_turn(m, session, turn, r, replies[m.name], encode))
                    advance(f"{session.category} {done[-1].prompt_id} {m.name}")
                slot += 1
                for record in done:
                    answers[record.method].append(record.measurement.token_ids)
                    replies[record.method].append(decode(record.measurement.token_ids))
                mark_turn(done, answers, reference, reference_ids if compare_outputs else None)
                records.extend(done)
                if on_turn_done is not None:
                    on_turn_done(done)
    return records


def run_turn(method: Method, session: Session, turn: int, repeat: int, replies: Sequence[str],
             encode: Encoder) -> Record:
    """One method's generation for one turn, its prompt built from its own earlier `replies`."""
    prompt = session.prompt(turn, replies)
    ids = encode(prompt)
    measurement = method.run(ids)
    return Record(prompt.id, session.category, method.name, method.family, method.gamma, repeat, len(ids),
                  measurement, session=session.id, turn=turn)


def mark_turn(done: Sequence[Record], answers: dict[str, list[list[int]]], reference: str,
              reference_ids: dict[str, list[int]] | None) -> None:
    """Set the records of one turn (all methods, one repeat) against the reference method:
    history_identical_to_plain (its answers to the earlier turns equal the reference's; None when the
    reference did not run) and, with `reference_ids` (greedy), identical_to_plain (this turn's answer
    equals the reference's answer in repeat 0, kept in `reference_ids`)."""
    for record in done:
        earlier = record.turn - 1 if record.turn is not None else 0
        ref = answers.get(reference)
        record.history_identical_to_plain = None if ref is None else answers[record.method][:earlier] == ref[:earlier]
        if reference_ids is None:
            continue
        if record.method == reference and record.repeat == 0:
            reference_ids[record.prompt_id] = record.measurement.token_ids
    if reference_ids is None:
        return
    for record in done:
        ids = reference_ids.get(record.prompt_id)
        record.identical_to_plain = None if ids is None else record.measurement.token_ids == ids
