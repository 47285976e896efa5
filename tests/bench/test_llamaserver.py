"""llama-server as a bench peer: finding the tools, the process, the request, the methods, the summary
(against tests/bench/fake_llama_server.py, a stand-in that speaks llama-server's command line and API)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.algorithm.sampling import SamplingParams
from specdec.bench import llamaserver, report
from specdec.bench.methods import (
    LlamaServerDraft,
    LlamaServerNgram,
    LlamaServerPlain,
    build_methods,
    default_methods,
    parse_methods,
)
from specdec.bench.results import aggregate
from specdec.bench.runner import run_interleaved
from specdec.errors import SpecdecError
from specdec.prompt_files import Prompt

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """$SPECDEC_HOME/bin/llama-server is the fake; requests are logged to the returned file."""
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    script = home / "bin" / "llama-server"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    script.chmod(0o755)
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(log))
    monkeypatch.setenv("PATH", "/nonexistent")  # nothing found on PATH but what the test puts there
    return log


def engine(draft=True):
    from specdec.drafters.spec import parse_drafter

    name = "lookup+qwen2.5-coder-0.5b" if draft else None
    e = SimpleNamespace(can_draft=draft, draft_runner=object() if draft else None, head=None,
                        draft_name=name, drafter_spec=parse_drafter(name),
                        tokenizer=SimpleNamespace(eos_token_id=99), forget=lambda: None)
    e.fork = lambda: e
    return e


def requests(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_find_tool_prefers_the_built_one_then_path(tools, tmp_path, monkeypatch):
    assert llamaserver.find_tool("llama-server") == llamaserver.zoo.home() / "bin" / "llama-server"
    assert llamaserver.find_tool("llama-bench") is None
    with pytest.raises(SpecdecError, match=r"llama-bench not found: build it with scripts/install-llamacpp.sh --server"):
        llamaserver.require_tool("llama-bench")
    elsewhere = tmp_path / "path"
    elsewhere.mkdir()
    (elsewhere / "llama-bench").write_text("#!/bin/sh\n")
    (elsewhere / "llama-bench").chmod(0o755)
    monkeypatch.setenv("PATH", str(elsewhere))
    assert llamaserver.find_tool("llama-bench") == elsewhere / "llama-bench"


def test_sampling_fields_turn_llama_cpp_s_other_samplers_off():
    assert llamaserver.sampling_fields(SamplingParams()) == {"temperature": 0.0}
    fields = llamaserver.sampling_fields(SamplingParams(temperature=0.7, top_p=0.9, seed=3))
    assert fields["temperature"] == 0.7 and fields["top_p"] == 0.9 and fields["seed"] == 3
    assert fields["top_k"] == 0 and fields["min_p"] == 0.0 and fields["repeat_penalty"] == 1.0  # its defaults: 40, 0.05


def test_a_plain_server_answers_with_the_prompt_ids_and_its_timings(tools):
    method = LlamaServerPlain(engine(), 5, target_gguf="/models/t.gguf", threads=2)
    try:
        assert method.command.startswith("llama-server -m /models/t.gguf -t 2 -c 8192 -np 1 --host 127.0.0.1 --port ")
        m = method.run([7, 8, 9])
        assert m.token_ids == [9, 10, 11, 12, 13] and m.first_token_s == pytest.approx(0.001)
        assert m.drafted is None and m.accepted is None and m.wall_s > 0
        ended = method.run([0, 3])  # the fake ends at the end of sequence, that token in its answer as llama-server's
        assert ended.token_ids == [3, 4, 99]
    finally:
        method.close()
    [first, _] = requests(tools)
    assert first["body"]["prompt"] == [7, 8, 9] and first["body"]["n_predict"] == 5
    assert first["body"]["cache_prompt"] is False and first["body"]["temperature"] == 0.0
    assert method.server.process is None  # closed: the process is gone


def test_draft_and_ngram_servers_take_their_options_and_report_acceptance(tools):
    draft = LlamaServerDraft(engine(), 4, target_gguf="t.gguf", draft_gguf="d.gguf", option="8", threads=1)
    ngram = LlamaServerNgram(engine(), 4, target_gguf="t.gguf", threads=1)
    try:
        assert "--spec-type draft-simple -md d.gguf --spec-draft-n-max 8" in draft.command
        assert "--spec-type ngram-mod" in ngram.command
        m = draft.run([1, 2])
        assert (m.drafted, m.accepted, m.acceptance_rate) == (10, 4, 0.4)
        undrafted = ngram.run([2, 5])  # the fake drafts nothing after a prompt that starts with 2: no draft_n
        assert (undrafted.drafted, undrafted.accepted) == (0, 0)
    finally:
        draft.close()
        ngram.close()
    with pytest.raises(SpecdecError, match="needs the draft model as a GGUF"):
        LlamaServerDraft(engine(), 4, target_gguf="t.gguf", draft_gguf=None)
    with pytest.raises(SpecdecError, match="needs a draft model"):
        LlamaServerDraft(engine(draft=False), 4, target_gguf="t.gguf", draft_gguf="d.gguf")


def test_a_server_that_cannot_start_is_one_line_and_the_run_goes_on(tools, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "fail")
    with pytest.raises(SpecdecError, match=r"llama-server exited \(1\) before it was ready: .*error loading model"):
        LlamaServerPlain(engine(), 4, target_gguf="t.gguf")
    skipped = {}
    methods = build_methods(engine(), ["llama-server", "llama-server-ngram"], [5], 4, target_gguf="t.gguf",
                            skipped=skipped)
    assert methods == [] and set(skipped) == {"llama-server", "llama-server-ngram"}
    assert all("error loading model" in why and "\n" not in why for why in skipped.values())


def test_a_missing_binary_leaves_its_methods_out_with_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")
    skipped = {}
    assert build_methods(engine(), ["llama-server"], [5], 4, target_gguf="t.gguf", skipped=skipped) == []
    assert skipped == {"llama-server": "llama-server not found: " + llamaserver.BUILD_HINT}
    with pytest.raises(SpecdecError, match="llama-server not found"):
        build_methods(engine(), ["llama-server"], [5], 4, target_gguf="t.gguf")


def test_methods_parse_their_options():
    assert parse_methods("llama-server,llama-server-draft@6,llama-server-ngram@ngram-simple") == [
        "plain", "llama-server", "llama-server-draft@6", "llama-server-ngram@ngram-simple"]
    for bad, why in (("llama-server@3", "takes no option"), ("llama-server-draft@x", "integer >= 1"),
                     ("llama-server-ngram@ngram-bogus", "expected one of ngram-mod")):
        with pytest.raises(SpecdecError, match=why):
            parse_methods(bad)


def test_default_methods_add_the_servers_when_llama_server_is_there():
    assert default_methods(True, True, "hf", "hf", "int4", True, llama_server=True)[-3:] == [
        "llama-server", "llama-server-draft", "llama-server-ngram"]
    chosen = default_methods(True, False, "hf", "hf", None, True, llama_server=True)
    assert chosen[-2:] == ["llamacpp", "llama-server", "llama-server-ngram"][-2:]
    assert "llama-server" not in default_methods(True, True, "hf", "hf", "int4", True)


def test_the_summary_names_each_server_command_what_was_left_out_and_the_machine(tools):
    server = LlamaServerPlain(engine(), 3, target_gguf="t.gguf", threads=2)
    plain = LlamaServerPlain.__new__(LlamaServerPlain)  # a stand-in "plain": the reference, same answers
    try:
        plain.__dict__.update(server.__dict__, name="plain", family="plain")
        records = run_interleaved([plain, server], [(Prompt("p", "code", "t"), [5, 6])], warmup=False)
    finally:
        server.close()
    meta = {"target": "t", "draft": None, "dtype": "gguf", "max_new_tokens": 3, "gammas": [5], "repeats": 1,
            "prompts": "builtin", "num_prompts": 1, "prompts_per_category": {"code": 1},
            "servers": {"llama-server": server.command}, "skipped": {"llama-server-draft": "llama-server-draft: no draft"},
            "machine_bench": {"threads": 2, "llama_bench": {"pp512": 108.6, "tg64": 30.25, "command": "llama-bench -m t.gguf"},
                              "specdec": {"dtype": "gguf", "t1_ms": 24.6, "tg_tokens_per_s": 40.65, "pp512_tokens_per_s": 190.0}}}
    md = report.summary_markdown(aggregate(records), meta)
    assert f"- `llama-server`: `{server.command}`" in md
    assert "- `llama-server-draft`: not run: llama-server-draft: no draft" in md
    assert "pp512 108.6 tok/s, tg64 30.2 tok/s" in md and "t(1) 24.6 ms (40.6 tok/s), prefill at 512 tokens 190.0" in md
    assert "| `llama-server` |" in md  # a row of its own in the tables


def test_llama_cpp_s_speculation_is_checked_against_its_own_plain_server():
    from specdec.bench.methods import Measurement
    from specdec.bench.results import Record, identical_share

    def rec(pid, method, tokens, repeat=0):
        return Record(pid, "c", method, method.split("@")[0], None, repeat, 3, Measurement(tokens, wall_s=1.0))

    records = [rec("a", "llama-server", [1, 2]), rec("b", "llama-server", [3]),
               rec("a", "llama-server-draft", [1, 2]), rec("b", "llama-server-draft", [4]),
               rec("a", "llama-server-ngram@ngram-simple", [1, 2]), rec("b", "llama-server-ngram@ngram-simple", [3]),
               rec("a", "plain", [9])]
    server = llamaserver.SERVER
    assert identical_share(records, reference=server, family=server) == {"llama-server-draft": 0.5,
                                                                         "llama-server-ngram@ngram-simple": 1.0}
    assert identical_share(records[2:], reference=server, family=server) == {}  # no plain server in the run
    meta = {"servers": {"llama-server-draft": "llama-server -md d.gguf"}, "servers_identical": {"llama-server-draft": 0.5}}
    assert report.peers_note(meta)[-1] == ("- `llama-server-draft`: `llama-server -md d.gguf` (output identical to "
                                           "`llama-server`'s on 50% of the prompts)")
