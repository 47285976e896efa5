"""`specdec train-drafter` on a tiny target: trains, saves a head the target loads, refuses bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.head import store
from specdec.training import data
from specdec.training.command import HELDOUT_PROMPTS, encode_messages, follow_up, load_target, split_heldout
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny(tmp_path_factory.mktemp("target") / "tiny", "llama", seed=0)


def test_trains_and_saves_a_head_its_target_loads(tiny_target: str, tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 8 + "\n\n") * 30)
    out = tmp_path / "head"
    result = CliRunner().invoke(app, ["train-drafter", "--target", tiny_target, "--text", str(text), "--no-builtin",
                                      "--minutes", "0.15", "--out", str(out), "--draft-vocab", "64"])
    assert result.exit_code == 0, result.output
    assert "held-out agreement by position 1:" in result.output and "step" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokens_seen"] > 0 and manifest["agreement_by_position"][0] is not None
    assert any(str(text) in line for line in manifest["data"]) and len(manifest["draft_vocab"]) == 64
    model, _ = load_target(tiny_target)
    head, _ = store.load(out, model, tiny_target)
    assert len(head.vocab) == 64 and head.taps == () and manifest["tapped_layers"] == []


def test_a_fused_head_records_its_layers(tiny_target: str, tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 8 + "\n\n") * 30)
    out = tmp_path / "head"
    result = CliRunner().invoke(app, ["train-drafter", "--target", tiny_target, "--text", str(text), "--no-builtin",
                                      "--minutes", "0.1", "--out", str(out), "--draft-vocab", "64", "--fuse-layers", "0"])
    assert result.exit_code == 0, result.output
    model, _ = load_target(tiny_target)
    head, manifest = store.load(out, model, tiny_target)
    assert head.taps == (0,) and manifest["tapped_layers"] == [0]


def test_fuse_layers_values() -> None:
    from specdec.training.features import parse_taps

    assert parse_taps("none", 28) == () and parse_taps("auto", 28) == (2, 14) and parse_taps("auto", 4) == ()
    assert parse_taps(" 3,9 ", 28) == (3, 9)
    for bad in ("27", "9,3", "2,2", "x"):
        with pytest.raises(ValueError):
            parse_taps(bad, 28)


@pytest.mark.parametrize("args, message", [
    (["--text", "/no/such/file", "--no-builtin"], "--text /no/such/file: no such file or directory"),
    (["--no-builtin"], "no training material"),
    (["--fuse-layers", "1"], "tapped layers must ascend within [0, 1)"),
    (["--fuse-layers", "low"], "--fuse-layers takes auto, none or layer indices"),
])
def test_bad_input_is_one_line(tiny_target: str, tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["train-drafter", "--target", tiny_target, "--out", str(tmp_path), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_an_unknown_target_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train-drafter", "--target", str(tmp_path / "nothing"), "--minutes", "0.1"])
    assert result.exit_code == 2 and "unknown model" in result.output


def test_a_follow_up_is_the_conversation_or_the_quote_through_the_template(tiny_target: str) -> None:
    _, tokenizer = load_target(tiny_target)
    material = data.Material(prompts=["Tell me about tides.", "In French, write a poem.", "Hi."],
                             follow_ups={0: data.FollowUp("Shorter, please."),
                                         1: data.FollowUp("Translate into English:\n\n{answer}")})
    answer = tokenizer("the moon pulls the sea")["input_ids"]
    text = tokenizer.decode(answer, skip_special_tokens=True).strip()
    assert follow_up(tokenizer, material, 0, answer) == encode_messages(
        tokenizer, [("user", "Tell me about tides."), ("assistant", text), ("user", "Shorter, please.")])
    assert follow_up(tokenizer, material, 1, answer) == encode_messages(
        tokenizer, [("user", "Translate into English:\n\n" + text)])
    assert follow_up(tokenizer, material, 2, answer) is None and follow_up(tokenizer, material, 0, []) is None
    assert not getattr(tokenizer, "chat_template", None)  # the tiny tokenizer has none: plain turns
    assert tokenizer.decode(follow_up(tokenizer, material, 0, answer)).endswith("Shorter, please.\n\nAssistant:")


def test_the_users_prompts_are_answered_first_and_a_tenth_held_out() -> None:
    mine = [[i] for i in range(25)]
    builtin = [[100 + i] for i in range(20)]
    split = split_heldout(mine, builtin)
    assert split.heldout == mine[:2] and split.train == mine[2:] + builtin and split.builtin_from == 23
    assert split.builtin_held == 0 and split.described == "2 of your prompts"
    few = split_heldout(mine[:5], builtin)  # too few of the user's: the built-in ones measure
    assert few.heldout == builtin[:HELDOUT_PROMPTS] and few.train == mine[:5] + builtin[HELDOUT_PROMPTS:]
    assert (few.builtin_from, few.builtin_held) == (5, HELDOUT_PROMPTS)
    alone = split_heldout(mine[:5], [])  # no built-in prompts: one of the user's
    assert alone.heldout == mine[:1] and alone.train == mine[1:5]
    assert split_heldout(mine[:1], []).heldout == [] and split_heldout([], builtin[:3]).train == builtin[:3]
    many = split_heldout([[i] for i in range(500)], builtin)
    assert len(many.heldout) == HELDOUT_PROMPTS


def test_trains_on_the_users_prompts(tiny_target: str, tmp_path: Path) -> None:
    prompts = tmp_path / "asked.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": f"Question {i} about tides?"}]}) + "\n"
                               for i in range(12)))
    out = tmp_path / "head"
    result = CliRunner().invoke(app, ["train-drafter", "--target", tiny_target, "--prompts", str(prompts), "--no-builtin",
                                      "--minutes", "0.15", "--out", str(out), "--draft-vocab", "64"])
    assert result.exit_code == 0, result.output
    assert "held-out answers: 1 (1 of your prompts)" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert f"--prompts {prompts}: 12" in manifest["data"] and manifest["agreement_by_position"][0] is not None


def test_a_missing_or_bad_prompt_file_is_one_line(tiny_target: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "no end"\n')
    for args, message in ((["--prompts", "/no/such.jsonl"], "--prompts /no/such.jsonl: no such file or directory"),
                          (["--prompts", str(bad)], f"--prompts {bad}:2: not JSON"),
                          (["--prompts", str(tmp_path)], "a directory; give the prompt files")):
        result = CliRunner().invoke(app, ["train-drafter", "--target", tiny_target, "--out", str(tmp_path / "h"), *args])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def short_run(tiny_target: str, tmp_path: Path) -> tuple[Path, list[str]]:
    """(the head's directory, train-drafter's arguments for a short run on a text file there)."""
    text = tmp_path / "text.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 8 + "\n\n") * 30)
    out = tmp_path / "head"
    return out, ["train-drafter", "--target", tiny_target, "--text", str(text), "--no-builtin", "--minutes", "0.1",
                 "--out", str(out)]


def test_resume_goes_on_training_the_saved_head(tiny_target: str, tmp_path: Path) -> None:
    out, args = short_run(tiny_target, tmp_path)
    assert CliRunner().invoke(app, [*args, "--draft-vocab", "64"]).exit_code == 0
    first = json.loads((out / "manifest.json").read_text())
    assert first["runs"] == 1 and len(first["cursor"]) == 1  # the text's source
    result = CliRunner().invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert f"going on from {out}: {first['tokens_seen']:,} training tokens" in result.output
    assert "over 2 runs" in result.output
    second = json.loads((out / "manifest.json").read_text())
    assert second["runs"] == 2 and second["draft_vocab"] == first["draft_vocab"]  # its shape kept
    for key in ("tokens_seen", "steps", "training_seconds"):  # counted over both runs
        assert second[key] > first[key], key


def test_resume_refuses_in_one_line(tiny_target: str, tmp_path: Path) -> None:
    out, args = short_run(tiny_target, tmp_path)
    missing = CliRunner().invoke(app, [*args, "--resume"])
    assert missing.exit_code == 2 and f"--resume: no draft head in {out}" in missing.output
    assert CliRunner().invoke(app, [*args, "--draft-vocab", "64"]).exit_code == 0
    for extra, message in ((["--draft-vocab", "32"], "its --draft-vocab is 64; drop --draft-vocab"),
                           (["--fuse-layers", "0"], "its --fuse-layers is none; drop --fuse-layers")):
        result = CliRunner().invoke(app, [*args, "--resume", *extra])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    other = save_tiny(tmp_path / "other", "llama", seed=1)
    result = CliRunner().invoke(app, [*args[:2], other, *args[3:], "--resume"])
    assert result.exit_code == 2 and "was trained for another target" in result.output
