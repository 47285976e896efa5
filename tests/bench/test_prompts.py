"""Prompt files (specdec.prompt_files) and the bench's sets (specdec.bench.prompts): Spec-Bench JSONL, conversations,
plain text with escapes, the named sets, and one-line errors."""

import json

import pytest

from specdec.bench.prompts import BUILTIN, SHORT, builtin_path, limit_per_category, load_prompts
from specdec.errors import SpecdecError
from specdec.prompt_files import Prompt, unescape_line

BUILTIN_CATEGORIES = {"code", "qa", "math", "translation", "writing", "chat", "summarization", "rag"}


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


def counts_of(prompts):
    counts = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    return counts


def test_short_set_has_six_categories_of_at_least_ten():
    assert builtin_path(SHORT).is_file()
    prompts = load_prompts(SHORT)
    counts = counts_of(prompts)
    assert set(counts) == {"code", "summarization", "qa", "translation", "math", "chat"}
    assert min(counts.values()) >= 10
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(not p.history for p in prompts)


def test_builtin_set_has_at_least_eight_per_category_and_real_conversations():
    assert builtin_path().is_file() and builtin_path(BUILTIN) == builtin_path()
    prompts = load_prompts(BUILTIN)
    counts = counts_of(prompts)
    assert BUILTIN_CATEGORIES == set(counts)
    assert min(counts.values()) >= 8, counts
    assert len({p.id for p in prompts}) == len(prompts)
    chats = [p for p in prompts if p.category == "chat"]
    assert all(len(p.history) >= 2 for p in chats)  # every chat prompt answers a conversation of 2+ user turns
    assert all(not p.history for p in prompts if p.category != "chat")


def test_every_builtin_record_names_its_source():
    for line in builtin_path(BUILTIN).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        assert isinstance(record.get("source"), str) and record["source"].strip(), record["question_id"]


def test_conversation_record(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl(
        {"question_id": "chat-1", "category": "chat", "turns": ["Hi.", "And then?"], "replies": ["Hello!"],
         "source": "written for specdec"},
        {"question_id": "one", "category": "chat", "turns": ["Only one."], "replies": []},
    ))
    convo, single = load_prompts(path)
    assert convo == Prompt("chat-1", "chat", "And then?", (("user", "Hi."), ("assistant", "Hello!")))
    assert convo.messages == (("user", "Hi."), ("assistant", "Hello!"), ("user", "And then?"))
    assert convo.plain_text == "User: Hi.\n\nAssistant: Hello!\n\nUser: And then?\n\nAssistant:"
    assert single == Prompt("one", "chat", "Only one.")  # no replies to give: a one-turn prompt
    assert single.messages == (("user", "Only one."),) and single.plain_text == "Only one."


def test_turns_without_replies_keep_the_first_turn_only(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"question_id": 1, "turns": ["first", 2]}))
    assert load_prompts(path) == [Prompt("1", "default", "first")]  # Spec-Bench records: later turns unread


def test_limit_per_category_keeps_file_order():
    ps = [Prompt(str(i), c, c + str(i)) for i, c in enumerate("aabbba")]
    assert [p.id for p in limit_per_category(ps, 2)] == ["0", "1", "2", "3"]
    assert limit_per_category(ps, None) == ps
    with pytest.raises(SpecdecError, match="limit-per-category"):
        limit_per_category(ps, 0)


def test_named_set_limit():
    assert len(load_prompts(SHORT, limit=1)) == 6
    assert [p.category for p in load_prompts(BUILTIN, limit=1)] == list(counts_of(load_prompts(BUILTIN)))


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
        (jsonl({"turns": ["a", "b"], "replies": "x"}), "\"replies\" must be a list of strings"),
        (jsonl({"turns": ["a", "b"], "replies": [3]}), "\"replies\" must be a list of strings"),
        (jsonl({"turns": ["a", "b"], "replies": []}), r"one entry fewer than \"turns\" \(2 turns, 0 replies\)"),
        (jsonl({"turns": ["a"], "replies": ["x"]}), r"\(1 turns, 1 replies\)"),
        (jsonl({"turns": ["a", 7], "replies": ["x"]}), "\"turns\" list of strings"),
        (jsonl({"turns": ["a", " "], "replies": ["x"]}), "line 1: turn 2 is empty"),
        (jsonl({"turns": ["a", "b"], "replies": [""]}), "line 1: reply 1 is empty"),
        (jsonl({"turns": ["a"], "source": 5}), "\"source\" must be a string"),
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


def tiny_engine(template: str | None):
    """An Engine over a tiny model whose tokenizer has the given chat template (None: none)."""
    from specdec.runtime.engine import Engine
    from tests.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(0)
    if template is not None:
        tok.chat_template = template
    return tok, Engine(tiny_model("llama", 0, vocab_size=len(tok)), tok)


CONVERSATION = Prompt("c", "chat", "def g", (("user", "def f"), ("assistant", "ok")))


def test_bench_encodes_a_conversation_through_the_chat_template():
    from specdec.bench.runner import _encode_all

    tok, engine = tiny_engine("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    [(_, ids)] = _encode_all(engine, [CONVERSATION], chat=True, max_new_tokens=4)
    assert tok.decode(ids) == "<bos>user: def f\n<bos>assistant: ok\n<bos>user: def g\nassistant:"
    # a one-turn prompt encodes as Engine.encode(text, chat=True) always did
    [(_, one)] = _encode_all(engine, [Prompt("1", "code", "def f")], chat=True, max_new_tokens=4)
    assert one == engine.encode("def f", chat=True) and tok.decode(one) == "<bos>user: def f\nassistant:"


def test_bench_renders_a_conversation_as_text_without_chat():
    from specdec.bench.runner import _encode_all

    tok, engine = tiny_engine(None)
    [(_, ids)] = _encode_all(engine, [CONVERSATION], chat=False, max_new_tokens=4)
    assert ids == engine.encode("User: def f\n\nAssistant: ok\n\nUser: def g\n\nAssistant:")


def test_chat_needs_a_template():
    from specdec.bench.runner import _encode_all

    _, engine = tiny_engine(None)
    with pytest.raises(SpecdecError, match="has no chat template; drop --chat"):
        _encode_all(engine, [CONVERSATION], chat=True, max_new_tokens=4)
