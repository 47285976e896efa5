"""llama-bench beside specdec's timings (specdec.bench.llamabench): its JSON read, its runs refused beside a live
server, the rounds alternated, the summaries -- against stubs and tests/bench/fake_llama_bench.py; nothing timed."""

import json
import os
import sys
from pathlib import Path

import pytest

from specdec.bench import llamabench, llamaserver
from specdec.bench.llamabench import Row
from specdec.errors import SpecdecError

FAKE_BENCH = Path(__file__).with_name("fake_llama_bench.py")
FAKE_SERVER = Path(__file__).with_name("fake_llama_server.py")

# llama-bench -m qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 -p 1 -n 64 -d 128 -r 2 -o json, its keys trimmed
REAL_JSON = """[
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_filename": "/root/.cache/specdec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
   "model_type": "qwen2 1.5B Q4_K - Medium", "model_size": 1111370240, "n_batch": 2048, "n_ubatch": 512,
   "n_threads": 2, "type_k": "f16", "n_prompt": 1, "n_gen": 0, "n_depth": 128, "test_time": "2026-12-06T22:29:22Z",
   "avg_ns": 37166807, "stddev_ns": 1952318, "avg_ts": 26.942899, "stddev_ts": 1.415272,
   "samples_ns": [ 38547305, 35786309 ], "samples_ts": [ 25.9422, 27.9436 ]},
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_type": "qwen2 1.5B Q4_K - Medium", "n_threads": 2, "n_prompt": 0, "n_gen": 64, "n_depth": 128,
   "avg_ns": 2450000000, "stddev_ns": 0, "avg_ts": 26.12, "stddev_ts": 0.1,
   "samples_ns": [ 2432000000, 2468000000 ], "samples_ts": [ 26.3, 25.9 ]}
]"""


def install(folder: Path, name: str, script: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / name
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    wrapper.chmod(0o755)


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """The fake llama-bench and llama-server first on PATH ($SPECDEC_HOME, the session's, has no bin/); the fake
    llama-bench's runs are logged to the returned file, with the fake servers still running then."""
    install(tmp_path / "bin", "llama-bench", FAKE_BENCH)
    install(tmp_path / "bin", "llama-server", FAKE_SERVER)
    (tmp_path / "pids").mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LLAMA_BENCH_LOG", str(tmp_path / "bench-runs.jsonl"))
    monkeypatch.setenv("FAKE_LLAMA_SERVER_PIDS", str(tmp_path / "pids"))
    return tmp_path / "bench-runs.jsonl"


def runs(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def row(n_prompt: int = 0, n_gen: int = 0, samples_ms: tuple[float, ...] = (10.0,), depth: int = 0) -> Row:
    return Row(n_prompt, n_gen, depth, 2, tuple(int(ms * 1e6) for ms in samples_ms), 1.0, "abc", "m")


def test_llama_bench_s_json_is_read_per_test_and_per_repetition():
    pp, tg = llamabench.parse_rows(REAL_JSON)
    assert (pp.test, tg.test) == ("pp1 @ d128", "tg64 @ d128")
    assert (pp.threads, pp.build, pp.model_type) == (2, "0c1e570", "qwen2 1.5B Q4_K - Medium")
    assert pp.ms_per_forward() == pytest.approx([38.547305, 35.786309])  # a pp test's sample: one forward of k
    assert tg.ms_per_forward() == pytest.approx([38.0, 38.5625])  # a tg test's: 64 one-token forwards
    # k / (tokens/s): its avg_ts is the mean of each sample's rate
    assert [1000 / ms for ms in pp.ms_per_forward()] == pytest.approx([25.9422, 27.9436], rel=1e-5)
    assert row(n_prompt=512).test == "pp512" and row(n_gen=64).test == "tg64"


@pytest.mark.parametrize("text, fragment", [("main: error", "printed no JSON"), ('{"a": 1}', "not a list of tests"),
                                            ('[{"n_prompt": 1}]', "lacks a test's 'n_gen'")])
def test_what_is_not_llama_bench_s_json_is_one_line(text, fragment):
    with pytest.raises(SpecdecError, match=fragment) as caught:
        llamabench.parse_rows(text)
    assert "\n" not in str(caught.value)


def test_run_passes_its_arguments_and_a_failure_or_a_missing_binary_is_one_line(fakes, tmp_path, monkeypatch):
    rows = llamabench.run(Path("/models/t.gguf"), ["-t", "2", "-p", "1,2", "-n", "0", "-d", "16", "-r", "3"])
    assert [(r.test, r.ms_per_forward()) for r in rows] == [("pp1 @ d16", [12.0] * 3), ("pp2 @ d16", [14.0] * 3)]
    assert runs(fakes)[0]["args"] == ["-m", "/models/t.gguf", "-t", "2", "-p", "1,2", "-n", "0", "-d", "16", "-r", "3",
                                      "-o", "json"]
    assert llamabench.shown(Path("/models/t.gguf"), ["-t", "2"]) == "llama-bench -m t.gguf -t 2 -o json"
    monkeypatch.setenv("FAKE_LLAMA_BENCH_MODE", "fail")
    with pytest.raises(SpecdecError, match=r"^llama-bench failed \(1\): main: error: failed to load model 'x.gguf'$"):
        llamabench.run(Path("t.gguf"), [])
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SpecdecError, match="llama-bench not found: build it with scripts/install-llamacpp.sh"):
        llamabench.run(Path("t.gguf"), [])


def test_llama_bench_never_runs_beside_a_server_the_bench_started(fakes):
    server = llamaserver.LlamaServer(llamaserver.require_tool("llama-server"), ["-m", "t.gguf"])
    try:
        assert llamaserver.running() == ["llama-server"]
        with pytest.raises(SpecdecError, match="llama-bench not run: llama-server started by this bench still runs"):
            llamabench.run(Path("t.gguf"), ["-p", "1", "-n", "0"])
    finally:
        server.close()
    assert llamaserver.running() == []
    assert [r.test for r in llamabench.run(Path("t.gguf"), ["-p", "1", "-n", "0"])] == ["pp1"]
    assert [r["alive_servers"] for r in runs(fakes)] == [[]]  # the refused run never started


def test_the_machine_block_keeps_llama_bench_s_tokens_per_s_by_test():
    block = llamabench.run_llama_bench(Path("/m/t.gguf"), 2, run_tool=lambda model, args: [
        Row(512, 0, 0, 2, (1,), 108.6, "abc", "m"), Row(0, 64, 0, 2, (1,), 30.25, "abc", "m")])
    assert block == {"command": "llama-bench -m t.gguf -t 2 -p 512 -n 64 -r 3 -o json", "pp512": 108.6,
                     "tg64": 30.25, "build": "abc"}


class StubRunner:
    """A runner that computes nothing and logs what it is asked: ("forward", n tokens), ("rollback", n)..."""

    max_context, vocab_size = 4096, 1000

    def __init__(self, events: list) -> None:
        self.events, self.tokens = events, []

    def reset(self) -> None:
        self.tokens = []

    def forward(self, tokens, last_n=None):
        self.events.append(("forward", len(tokens)))
        self.tokens += list(tokens)

    def rollback(self, n: int) -> None:
        del self.tokens[n:]


def test_profile_rounds_alternate_our_forwards_with_one_llama_bench_run_each():
    events: list = []
    peer_times = iter([(12.0, 14.0, 18.0), (13.0, 15.0, 19.0), (11.0, 16.0, 17.0)])

    def fake_run(model, args):
        events.append(("llama-bench", tuple(args)))
        times = next(peer_times)
        return [row(k, 0, (ms,), depth=8) for k, ms in zip((1, 2, 4), times, strict=True)]

    found = llamabench.forwards_beside(StubRunner(events), Path("t.gguf"), [1, 2, 3, 4], prefix=8, rounds=3, threads=2,
                                       run_tool=fake_run)
    bench_calls = [i for i, e in enumerate(events) if e[0] == "llama-bench"]
    assert len(bench_calls) == 3
    # each round: the prefix, a warm-up, then k = 1, 2, 3, 4 once each, then llama-bench
    first_round = [e for e in events[: bench_calls[0]] if e[0] == "forward"]
    assert first_round == [("forward", 8), ("forward", 1), ("forward", 1), ("forward", 2), ("forward", 3), ("forward", 4)]
    assert events[bench_calls[0]][1] == ("-t", "2", "-p", "1,2,4", "-n", "0", "-d", "8", "-r", "1")
    assert found.peer_ms() == {1: 12.0, 2: 15.0, 4: 18.0}  # medians over the rounds
    assert found.peer_ratio() == {1: 1.0, 2: 1.25, 4: 1.5}
    table = found.table()
    assert sorted(table.ms) == [1, 2, 3, 4] and table.repeats == 3 and all(len(v) == 3 for v in found.ours.values())
    out = found.to_dict()
    assert out["ms"] == {"1": 12.0, "2": 15.0, "4": 18.0} and out["ms_by_round"]["1"] == [12.0, 13.0, 11.0]
    assert out["command"] == "llama-bench -m t.gguf -t 2 -p 1,2,4 -n 0 -d 8 -r 1 -o json" and out["depth"] == 8


def test_a_failing_llama_bench_is_noted_once_and_our_rounds_go_on():
    calls = []

    def failing(model, args):
        calls.append(args)
        raise SpecdecError("llama-bench failed (1): no model")

    found = llamabench.forwards_beside(StubRunner([]), Path("t.gguf"), [1, 2], prefix=4, rounds=3, threads=1,
                                       run_tool=failing)
    assert len(calls) == 1 and found.error == "llama-bench failed (1): no model"
    assert all(len(v) == 3 for v in found.ours.values()) and found.peer_ms() == {}


def test_llama_bench_s_ks_are_those_of_1_2_4_8_profile_times_and_its_smallest():
    assert llamabench.peer_ks(range(1, 17)) == [1, 2, 4, 8]
    assert llamabench.peer_ks([3, 4, 6]) == [3, 4]


def test_decode_rounds_alternate_our_steps_with_llama_bench_s_tg64():
    events: list = []

    def fake_run(model, args):
        events.append(("llama-bench", tuple(args)))
        return [row(0, 64, (64 * 40.0, 64 * 42.0))]

    records = llamabench.decode_rounds(StubRunner(events), Path("t.gguf"), rounds=2, repeats=2, threads=2,
                                       run_tool=fake_run)
    # each round: a warm-up step, then 2 runs of 64 one-token forwards from an empty cache, then llama-bench
    per_round = 1 + 2 * 64 + 1
    assert len(events) == 2 * per_round and events[per_round - 1][0] == "llama-bench"
    assert all(e == ("forward", 1) for e in events[: per_round - 1])
    assert events[per_round - 1][1] == ("-t", "2", "-p", "0", "-n", "64", "-r", "2")
    assert [r["round"] for r in records] == [1, 2]
    assert records[0]["llama_bench_ms_per_token"] == [40.0, 42.0] and len(records[0]["specdec_ms_per_token"]) == 2
    with pytest.raises(SpecdecError, match="gave no tg64 test"):
        llamabench.decode_rounds(StubRunner([]), Path("t.gguf"), 1, 1, 2, run_tool=lambda model, args: [row(1)])


RECORDS = [{"round": 1, "specdec_ms_per_token": [30.0, 34.0], "llama_bench_ms_per_token": [40.0, 36.0]},
           {"round": 2, "specdec_ms_per_token": [35.0, 33.0], "llama_bench_ms_per_token": [38.0, 42.0]}]
META = {"target": "qwen2.5-coder-1.5b", "file": "/m/q.gguf", "types": "Q4_K 68%, Q6_K 32% of the weight bytes",
        "specdec": "GGUFRunner, gguf", "cpu": "AMD EPYC, 2 CPUs, AVX2, AVX-512", "threads": 2, "rounds": 2, "repeats": 2,
        "command": "llama-bench -m q.gguf -t 2 -p 0 -n 64 -r 2 -o json", "build": "0c1e570", "date_utc": "2026-12-06 22:00"}


def test_the_decode_summary_gives_medians_their_ratio_and_each_round_s():
    summary = llamabench.decode_summary(RECORDS, META)
    assert summary["specdec"]["ms_per_token"] == 33.5 and summary["llama_bench"]["ms_per_token"] == 39.0
    assert summary["ratio"] == pytest.approx(39.0 / 33.5)
    assert summary["ratio_by_round"] == pytest.approx([38.0 / 32.0, 40.0 / 34.0])
    assert summary["specdec"]["tokens_per_s"] == pytest.approx(1000 / 33.5) and summary["llama_bench"]["runs"] == 4
    md = llamabench.decode_markdown(summary, RECORDS)
    assert "(AMD EPYC, 2 CPUs, AVX2, AVX-512)" in md and "GGUFRunner, gguf on 2 threads" in md
    assert "llama-bench build 0c1e570 on 2 threads: `llama-bench -m q.gguf -t 2 -p 0 -n 64 -r 2 -o json`" in md
    assert "**1.16×**" in md and "per round 1.18–1.19" in md
    assert "| specdec | 33.50 | 29.9 | 30.00 | 35.00 | 4 |" in md and "| 2 | 34.00 | 40.00 | 1.18× |" in md


def test_the_decode_bench_writes_its_records_and_summaries(tmp_path):
    setup = llamabench.DecodeBench(StubRunner([]), Path("/m/q.gguf"), 2, rounds=3, repeats=1, meta=dict(META))
    summary = llamabench.write_decode_bench(setup, tmp_path / "out", run_tool=lambda model, args: [row(0, 64, (64 * 40.0,))])
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["llama_bench"]["ms_per_token"] == 40.0
    assert summary["meta"]["command"] == "llama-bench -m q.gguf -t 2 -p 0 -n 64 -r 1 -o json"
    assert (tmp_path / "out" / "summary.md").read_text().startswith("# One-token decode: specdec beside llama-bench tg64")
    for rounds, repeats, fragment in ((0, 1, "--decode-vs-llama-bench takes the number of rounds"), (1, 0, "--repeats")):
        with pytest.raises(SpecdecError, match=fragment):
            llamabench.write_decode_bench(llamabench.DecodeBench(StubRunner([]), Path("q.gguf"), 2, rounds, repeats),
                                          tmp_path / "no")


# --- the commands, end to end on tiny GGUF files (tests/tiny_gguf.py) and the fakes ----------------------------


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from tests.tiny import save_tiny
    from tests.tiny_gguf import save_tiny_gguf

    root = tmp_path_factory.mktemp("tiny-peers")
    (root / "prompts.txt").write_text("def fibonacci(n):\n", encoding="utf-8")
    return {"target": save_tiny_gguf(root / "target.gguf", "qwen2", seed=0),
            "draft": save_tiny_gguf(root / "draft.gguf", "qwen2", seed=1),
            "dir": save_tiny(root / "hf", "llama", seed=0), "prompts": str(root / "prompts.txt")}


def cli(*args):
    from typer.testing import CliRunner

    from specdec.cli import app

    return CliRunner().invoke(app, list(args))


def test_profile_prints_llama_bench_s_pp_k_beside_t_k_in_the_same_rounds(fakes, tiny_files):
    result = cli("profile", "--target", tiny_files["target"], "--ks", "1-3", "--prefix", "8", "--repeats", "2",
                 "--prefill", "none", "--no-roof", "--json")
    assert result.exit_code == 0, result.output
    target = json.loads(result.stdout)["target"]
    peer = target["llama_bench"]
    assert peer["ms"] == {"1": 12.0, "2": 14.0} and peer["ratio"] == {"1": 1.0, "2": 1.167}  # the fake's times
    assert peer["rounds"] == 2 == target["repeats"] and peer["depth"] == 8 and peer["threads"] == target["threads"]
    assert set(target["ms"]) == {"1", "2", "3"} and all(len(v) == 2 for v in peer["ours_ms_by_round"].values())
    assert [r["args"][2:] for r in runs(fakes)] == [["-t", str(target["threads"]), "-p", "1,2", "-n", "0", "-d", "8",
                                                     "-r", "1", "-o", "json"]] * 2
    table = cli("profile", "--target", tiny_files["target"], "--ks", "1,2", "--prefix", "8", "--repeats", "1",
                "--prefill", "none", "--no-roof")
    assert table.exit_code == 0, table.output
    assert "llama-bench t(k) / t(1)" in table.output and "llama-bench (build fake123, the same file" in table.output


def test_profile_leaves_llama_bench_out_where_asked_or_where_it_cannot_run(fakes, tiny_files, monkeypatch):
    common = ["--ks", "1", "--prefix", "4", "--repeats", "1", "--prefill", "none", "--no-roof", "--json"]
    off = cli("profile", "--target", tiny_files["target"], "--no-llama-bench", *common)
    assert off.exit_code == 0 and "llama_bench" not in json.loads(off.stdout)["target"] and not runs(fakes)
    not_gguf = cli("profile", "--target", tiny_files["dir"], *common)  # by default: only where it can
    assert not_gguf.exit_code == 0 and "llama_bench" not in json.loads(not_gguf.stdout)["target"]
    asked = cli("profile", "--target", tiny_files["dir"], "--llama-bench", *common)
    assert_one_line_error(asked, "llama-bench reads GGUF files: give the target as a zoo name or a .gguf file")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert_one_line_error(cli("profile", "--target", tiny_files["target"], "--llama-bench", *common),
                          "llama-bench not found")


def assert_one_line_error(result, fragment):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and fragment in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output


def test_bench_decode_vs_llama_bench_writes_rounds_and_a_summary(fakes, tiny_files, tmp_path):
    out = tmp_path / "decode"
    result = cli("bench", "--target", tiny_files["target"], "--decode-vs-llama-bench", "2", "--repeats", "2",
                 "--threads", "1", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["llama_bench"]["ms_per_token"] == 12.0 and summary["specdec"]["runs"] == 4
    assert summary["meta"]["threads"] == 1 and summary["meta"]["cpu"] and "output head" in summary["meta"]["types"]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [len(r["specdec_ms_per_token"]) for r in records] == [2, 2]
    assert [r["args"][2:] for r in runs(fakes)] == [["-t", "1", "-p", "0", "-n", "64", "-r", "2", "-o", "json"]] * 2
    assert "llama-bench build fake123 on 1 threads" in (out / "summary.md").read_text()


@pytest.mark.parametrize("args, fragment", [
    (["--decode-vs-llama-bench", "0"], "takes the number of rounds, at least 1"),
    (["--decode-vs-llama-bench", "1", "--repeats", "0"], "--repeats must be >= 1"),
    (["--decode-vs-llama-bench", "1", "--startup", "1"], "give no --prompts, --workload, --concurrency or --startup"),
])
def test_bench_decode_vs_llama_bench_user_errors(fakes, tiny_files, args, fragment):
    assert_one_line_error(cli("bench", "--target", tiny_files["target"], *args), fragment)
    assert_one_line_error(cli("bench", "--target", tiny_files["dir"], "--decode-vs-llama-bench", "1"),
                          "llama-bench reads GGUF files")


def test_the_bench_runs_llama_bench_after_its_servers_stopped_and_names_each_side_s_draft(fakes, tiny_files, tmp_path):
    out = tmp_path / "bench"
    result = cli("bench", "--target", tiny_files["target"], "--draft", tiny_files["draft"], "--prompts",
                 tiny_files["prompts"], "--methods", "plain,specdec,llama-server,llama-server-draft", "--gammas", "2",
                 "-n", "4", "--threads", "1", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    [machine_run] = runs(fakes)
    assert machine_run["alive_servers"] == []  # both servers had stopped
    assert len(list((tmp_path / "pids").iterdir())) == 2  # and both had run
    config = json.loads(result.stdout)["config"]
    assert config["machine_bench"]["llama_bench"]["tg64"] == pytest.approx(1000 / 12)
    files = config["draft_files"]
    assert files["specdec"].startswith(f"{tiny_files['draft']} (") and "output head Q6_K" in files["specdec"]
    assert files["llama-server"].endswith("loaded as is (-md)") and tiny_files["draft"] in files["llama-server"]
    md = (out / "summary.md").read_text()
    assert f"- specdec's draft model: {tiny_files['draft']} (" in md
    assert f"- llama-server-draft's draft model: {tiny_files['draft']} (" in md and "its servers stopped" in md
