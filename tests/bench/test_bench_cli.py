"""`specdec bench` end to end on tiny fp32 models, and its one-line errors (exit status 2)."""

import json

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from tests.tiny import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-bench")
    prompts = root / "prompts.txt"
    prompts.write_text("def fibonacci(n):\\n    if n < 2:\nOnce upon a time\n", encoding="utf-8")
    return {
        "target": save_tiny(root / "target", "llama", seed=0),
        "draft": save_tiny(root / "draft", "llama", seed=1),
        "prompts": str(prompts),
    }


def bench(*args):
    return runner.invoke(app, ["bench", *args])


def test_bench_smoke(tiny_dirs, tmp_path):
    out = tmp_path / "out"
    result = bench("--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--prompts", tiny_dirs["prompts"],
                   "--max-new-tokens", "12", "--methods", "plain,specdec,hf", "--gammas", "3", "--out", str(out),
                   "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    methods = {m["name"]: m for m in data["methods"]}
    assert list(methods) == ["plain", "specdec", "hf"]
    assert methods["plain"]["identical_rate"] == 1.0
    assert methods["specdec"]["identical_rate"] == 1.0  # greedy is lossless (fp32)
    assert methods["hf"]["identical_rate"] == 1.0
    assert methods["plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert methods["specdec"]["acceptance_rate"] is not None and methods["plain"]["acceptance_rate"] is None
    for m in methods.values():
        assert m["tokens_per_s"] > 0 and m["speedup_vs_plain"] > 0

    for name in ("results.jsonl", "summary.md", "summary.json"):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3  # prompts x methods x repeats
    assert all(0 < len(r["token_ids"]) <= 12 and r["new_tokens"] == len(r["token_ids"]) for r in rows)
    assert "| `specdec` | 3 |" in (out / "summary.md").read_text()
    assert (out / "speedup_by_category.png").stat().st_size > 0
    assert (out / "acceptance_by_position.png").stat().st_size > 0
    assert not (out / "speedup_vs_gamma.png").exists()  # no sweep


def assert_user_error(result, fragment):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "error:" in result.output and fragment in result.output


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--methods", "plain,turbo"], "unknown method 'turbo'"),
        (["--gammas", "3,zero"], "is not an integer"),
        (["--gammas", "0"], ">= 1"),
        (["--repeats", "0"], "--repeats"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--limit-per-category", "0"], "--limit-per-category"),
        (["--prompts", "/no/such/prompts.jsonl"], "not found"),
        (["--draft", "none", "--methods", "plain,specdec"], "need a draft model"),
        (["--backend", "llamacpp", "--methods", "plain,hf-plain"], "needs the target on transformers"),
        (["--draft-backend", "llamacpp", "--methods", "plain,specdec,hf"], "needs the draft on transformers"),
        (["--n-ctx", "0", "--methods", "plain"], "--n-ctx"),
        (["--methods", "plain,llamacpp"], "llama"),  # the peer needs a GGUF target (and llama-cpp-python)
        (["--draft", "lookup", "--methods", "plain,specdec,hf"], "not prompt lookup"),
        (["--concurrency", "0,2"], "client counts >= 1"),
        (["--concurrency", "1,2", "--methods", "plain,hf"], "drop hf"),
        (["--methods", "plain,specdec@lookup+/no/other/model"], "drafts with /no/other/model, but this run loads"),
        (["--methods", "plain,hf@lookup"], "only our loop's methods"),
        (["--methods", "plain,specdec@lookup+head:/no/head"], "no draft head in /no/head"),
        (["--concurrency", "1", "--methods", "plain,specdec-auto@lookup"], "drop specdec-auto@lookup"),
    ],
)
def test_user_errors(tiny_dirs, tmp_path, args, fragment):
    base = ["--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--prompts", tiny_dirs["prompts"],
            "--out", str(tmp_path / "out")]
    assert_user_error(bench(*base, *args), fragment)


def test_methods_with_their_own_drafters_in_one_run(tiny_dirs, tmp_path):
    result = bench("--target", tiny_dirs["target"], "--draft", f"suffix+{tiny_dirs['draft']}", "--prompts",
                   tiny_dirs["prompts"], "--max-new-tokens", "12", "--methods", "plain,specdec,specdec@lookup",
                   "--gammas", "3", "--out", str(tmp_path / "out"), "--json")
    assert result.exit_code == 0, result.output
    methods = {m["name"]: m for m in json.loads(result.stdout)["methods"]}
    assert list(methods) == ["plain", "specdec", "specdec@lookup"]
    assert all(m["identical_rate"] == 1.0 for m in methods.values())
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    lookup = [r for r in rows if r["method"] == "specdec@lookup"]
    assert lookup and all(r["family"] == "specdec" and set(r["by_source"] or {}) <= {"lookup"} for r in lookup)
    # no draft model loaded: a model-free drafter still makes a method
    result = bench("--target", tiny_dirs["target"], "--draft", "none", "--prompts", tiny_dirs["prompts"],
                   "--max-new-tokens", "8", "--methods", "plain,specdec@suffix", "--gammas", "2",
                   "--out", str(tmp_path / "out2"), "--json")
    assert result.exit_code == 0, result.output
    assert [m["name"] for m in json.loads(result.stdout)["methods"]] == ["plain", "specdec@suffix"]


def test_empty_prompt_file(tiny_dirs, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    assert_user_error(bench("--target", tiny_dirs["target"], "--prompts", str(empty)), "no prompts")


def test_prompt_that_does_not_fit_the_window(tiny_dirs, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("fox " * 200 + "\n", encoding="utf-8")  # tiny models: 256-token window
    result = bench("--target", tiny_dirs["target"], "--draft", "none", "--methods", "plain", "--prompts", str(long),
                   "--max-new-tokens", "100", "--out", str(tmp_path / "out"))
    assert_user_error(result, "context window")


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory):
    """Tiny models with a 4,096-token window: a session's last turn holds the whole conversation."""
    root = tmp_path_factory.mktemp("tiny-workload")
    return {"target": save_tiny(root / "target", "llama", seed=0, positions=4096),
            "draft": save_tiny(root / "draft", "llama", seed=1, positions=4096)}


def test_bench_workloads(wide_dirs, tmp_path):
    from specdec.bench.workloads import WORKLOADS, load_workloads

    out = tmp_path / "out"
    result = bench("--target", wide_dirs["target"], "--draft", wide_dirs["draft"], "--workload", ",".join(WORKLOADS),
                   "--limit-per-category", "1", "--methods", "plain,specdec", "--gammas", "3", "-n", "6",
                   "--dtype", "fp32", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    sessions = load_workloads(",".join(WORKLOADS), 1)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # Turn by turn, in order, both methods on every turn (the order within a turn rotates).
    expected = [(s.id, t) for s in sessions for t in range(1, len(s.turns) + 1)]
    assert [(r["session"], r["turn"]) for r in rows[::2]] == expected
    assert [(r["session"], r["turn"]) for r in rows[1::2]] == expected
    assert {r["method"] for r in rows[0::2]} == {"plain", "specdec"}  # the turn-to-turn rotation
    assert all({rows[i]["method"], rows[i + 1]["method"]} == {"plain", "specdec"} for i in range(0, len(rows), 2))
    # Lossless: the same answers, so the same histories and prompts; every later prompt is longer.
    assert all(r["identical_to_plain"] and r["history_identical_to_plain"] for r in rows)
    for a, b in zip(rows[::2], rows[1::2]):
        assert a["prompt_tokens"] == b["prompt_tokens"]
        assert a["prompt_id"] == b["prompt_id"] == f"{a['session']}/{a['turn']}"
    for earlier, later in zip(rows[::2], rows[2::2]):
        if later["session"] == earlier["session"]:
            assert later["prompt_tokens"] > earlier["prompt_tokens"] + earlier["new_tokens"]
    assert list(data["by_category"]) == list(WORKLOADS)
    assert list(data["by_turn"])[:2] == ["1", "2+"]
    assert data["config"]["workload"] == list(WORKLOADS) and data["config"]["prompts"] is None
    assert data["config"]["sessions_per_category"] == {w: 1 for w in WORKLOADS}
    assert data["config"]["across_sessions"] is False
    assert data["config"]["num_prompts"] == len(expected)
    spec = {m["name"]: m for m in data["methods"]}["specdec"]
    assert spec["identical_rate"] == 1.0 and spec["history_identical_rate"] == 1.0
    md = (out / "summary.md").read_text()
    assert "## Speedup vs plain by turn" in md and "sessions, " in md and "`specdec` 100%." in md
    assert "every session starting afresh" in md


@pytest.mark.parametrize("args, fragment", [
    (["--workload", "chat"], "unknown workload 'chat'"),
    (["--workload", ","], "--workload is empty"),
    (["--workload", "edit", "--prompts", "short"], "give --prompts or --workload, not both"),
    (["--workload", "edit", "--concurrency", "1,2"], "drop --concurrency"),
    (["--across-sessions"], "--across-sessions is for --workload"),
    (["--workload", "edit", "--across-sessions", "--repeats", "2"], "use --repeats 1"),
])
def test_workload_errors(tiny_dirs, tmp_path, args, fragment):
    result = bench("--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--out", str(tmp_path / "out"),
                   *args)
    assert_user_error(result, fragment)
    assert len(result.output.strip().splitlines()) == 1
