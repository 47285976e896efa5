"""The CLI: JSON output, streaming, and one-line errors with exit status 2 for user mistakes."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.errors import SpecdecError
from tests.tiny import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": save_tiny(root / "target", "llama", seed=0),
        "draft": save_tiny(root / "draft", "llama", seed=1),
        "other_vocab": save_tiny(root / "other", "qwen2", seed=2, variant=1),
        "root": root,
    }


def generate(*args):
    return runner.invoke(app, ["generate", *args])


def assert_user_error(result, fragment):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert fragment in result.output


def test_json_output(tiny_dirs):
    result = generate("def fibonacci(n):", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                      "--max-new-tokens", "20", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert len(out["token_ids"]) <= 20
    for key in ("new_tokens", "target_forwards", "drafted", "accepted", "acceptance_rate",
                "mean_accepted_per_step", "per_position_acceptance", "wall_s", "tokens_per_s"):
        assert key in out["stats"]


def test_timings_say_where_the_start_up_went(tiny_dirs):
    result = generate("def fibonacci(n):", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                      "-n", "4", "-k", "auto", "--timings")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("timings: "))
    phases = dict(part.rsplit(" ", 2)[:2] for part in line.removeprefix("timings: ").split(" · "))
    assert {"imports", "target", "draft", "step costs", "prefill", "decode"} <= set(phases), line
    assert all(float(value) >= 0 for value in phases.values())


def test_speculative_and_plain_print_the_same_text(tiny_dirs):
    common = ["Once upon a time", "--target", tiny_dirs["target"], "--max-new-tokens", "25", "--json"]
    spec = json.loads(generate(*common, "--draft", tiny_dirs["draft"], "-k", "3").stdout)
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["text"] == plain["text"]


def test_bf16_draft_for_an_fp32_target_keeps_the_output(tiny_dirs):
    # The draft's numerics never change the output: a bf16 copy of the target as its draft
    # is nearly perfect, and the text is the fp32 target's own greedy text.
    import torch

    from specdec.runtime.engine import Engine

    common = ["Once upon a time", "--target", tiny_dirs["target"], "--max-new-tokens", "25", "--json"]
    spec = json.loads(generate(*common, "--draft", tiny_dirs["target"], "--draft-dtype", "bf16", "-k", "4").stdout)
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["acceptance_rate"] > 0.5
    engine = Engine.load(tiny_dirs["target"], tiny_dirs["draft"], dtype="fp32", draft_dtype="bf16")
    assert engine.target_runner.model.dtype == torch.float32 and engine.draft_runner.model.dtype == torch.bfloat16


def test_int4_draft_keeps_the_int8_targets_output_and_is_refused_where_it_cannot_run(tiny_dirs):
    from specdec.native.lean import LeanRunner
    from specdec.runtime.engine import Engine

    common = ["Once upon a time", "--target", tiny_dirs["target"], "--dtype", "int8", "--max-new-tokens", "25", "--json"]
    spec = json.loads(generate(*common, "--draft", tiny_dirs["target"], "--draft-dtype", "int4", "-k", "4").stdout)
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted"] > 0
    summary = generate(*common[:-1], "--draft", tiny_dirs["target"], "--draft-dtype", "int4")
    assert summary.exit_code == 0 and "on specdec int4" in summary.output
    engine = Engine.load(tiny_dirs["target"], "lookup+" + tiny_dirs["draft"], dtype="int8", draft_dtype="int4",
                         draft_backend="auto")
    assert isinstance(engine.draft_runner, LeanRunner) and engine.draft_runner.describe().startswith("specdec int4")
    assert engine.target_runner.describe() != "specdec int4"
    assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                               "--draft-dtype", "int4", "--draft-backend", "llamacpp"), "--draft-backend hf")
    with pytest.raises(SpecdecError, match="draft's dtype only"):
        Engine.load(tiny_dirs["target"], dtype="int4")
    gemma = save_tiny(tiny_dirs["root"] / "gemma", "gemma3", seed=3)
    summary = generate("hi", "--target", tiny_dirs["target"], "--draft", gemma, "--draft-dtype", "int4", "-n", "4")
    assert summary.exit_code == 0 and "on specdec int4" in summary.output  # Gemma 3 runs as an int4 draft too
    config = Path(gemma) / "config.json"  # ... but not with soft-capped logits (Gemma 2's), which lean does not compute
    config.write_text(json.dumps({**json.loads(config.read_text()), "final_logit_softcapping": 30.0}))
    assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--draft", gemma, "--draft-dtype", "int4"),
                      "use --draft-dtype int8")
    assert_user_error(runner.invoke(app, ["bench", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                                          "--dtype", "int8", "--draft-dtype", "int4", "--methods", "plain,hf"]),
                      "no int4")


def test_streaming_prints_text_and_summary(tiny_dirs):
    result = generate("for i in range", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                      "--max-new-tokens", "10")
    assert result.exit_code == 0, result.output
    assert "tokens in" in result.output
    from specdec.runtime.runners import fastest_dtype

    # the summary line names the target's dtype: by default the fastest exact one (int8 on AVX2 CPUs)
    assert f"target {tiny_dirs['target']} {fastest_dtype(tiny_dirs['target'])}" in " ".join(result.output.split())


def test_empty_prompt(tiny_dirs):
    assert_user_error(generate("", "--target", tiny_dirs["target"]), "empty")


@pytest.mark.parametrize("n", ["0", "-5"])
def test_max_new_tokens_not_positive(tiny_dirs, n):
    assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--max-new-tokens", n), "max-new-tokens")


def test_unknown_model():
    assert_user_error(generate("hi", "--target", "no-such-model-anywhere"), "unknown model")


@pytest.mark.parametrize("name", ["no-such-[x]-model", "no-such-[/x]-model"])
def test_an_error_quoting_brackets_prints_them_as_given(name):
    """A user's input in an error is text, not markup: '[x]' stays, and '[/x]' is no traceback."""
    result = generate("hi", "--target", name)
    assert_user_error(result, "unknown model")
    assert name in result.output


def test_draft_with_other_vocabulary_forced_same(tiny_dirs):
    result = generate("hi", "--target", tiny_dirs["target"], "--draft", tiny_dirs["other_vocab"], "--draft-mode", "same")
    assert_user_error(result, "different vocabulary")


@pytest.mark.parametrize("mode", [[], ["--draft-mode", "text"], ["--draft-mode", "intersection"]])
def test_draft_with_other_vocabulary_needs_no_flag(tiny_dirs, mode):
    common = ["def fibonacci(n):", "--target", tiny_dirs["target"], "--max-new-tokens", "20", "--json"]
    universal = generate(*common, "--draft", tiny_dirs["other_vocab"], *mode)
    assert universal.exit_code == 0, universal.output
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    assert json.loads(universal.stdout)["token_ids"] == plain["token_ids"]


def test_prompt_longer_than_context_window(tiny_dirs):
    # The tiny models have a 256-token window.
    result = generate("fox " * 400, "--target", tiny_dirs["target"], "--draft", "none")
    assert_user_error(result, "context window")


def test_bad_sampling_option(tiny_dirs):
    assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--top-p", "1.5"), "top_p")


def test_models_json():
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {r["name"] for r in rows} >= {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for r in rows:
        assert set(r) == {"name", "installed", "path", "arch", "vocab_size", "params", "auto_drafter", "auto_reason"}


def test_models_pull_unknown():
    assert_user_error(runner.invoke(app, ["models", "pull", "nope"]), "nope")


def test_chat_without_template_is_a_user_error(tiny_dirs):
    assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--draft", "none", "--chat"), "chat template")


def test_chat_applies_the_template(tmp_path):
    from specdec.runtime.engine import Engine
    from tests.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(0)
    tok.chat_template = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    engine = Engine(tiny_model("llama", 0, vocab_size=len(tok)), tok)
    ids = engine.encode("def f", chat=True)
    assert tok.decode(ids) == "<bos>user: def f\nassistant:"


def test_int8_speculative_prints_int8_plain_output(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))  # the int8 copies are cached there
    common = ["def fibonacci(n):", "--target", tiny_dirs["target"], "--dtype", "int8", "--max-new-tokens", "24", "--json"]
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    # fixed γs: -k auto may rightly decline a random tiny draft that costs what the target costs
    for draft in (["--draft", tiny_dirs["draft"], "-k", "3"], ["--draft", tiny_dirs["target"], "-k", "6"],
                  ["--draft", tiny_dirs["draft"], "--draft-dtype", "fp32", "-k", "2"]):
        result = generate(*common, *draft)
        assert result.exit_code == 0, result.output
        spec = json.loads(result.stdout)
        assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted"] > 0
    fp32 = json.loads(generate(*common[:3], "--max-new-tokens", "24", "--json", "--draft", "none").stdout)
    assert len(fp32["token_ids"]) == len(plain["token_ids"])  # a different model's numbers, same length
    assert len(list((tmp_path / "home" / "int8").iterdir())) == 2  # target and draft, each quantized once


def test_profile_json(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    result = runner.invoke(app, ["profile", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                                 "--dtype", "int8", "--ks", "1-3,5", "--prefix", "8", "--repeats", "1",
                                 "--prefill", "100,200,4000", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out["target"]["ms"]) == {"1", "2", "3", "5"} and all(v > 0 for v in out["target"]["ms"].values())
    roof = out["target"]["roof"]  # the memory's bandwidth against the weights a step reads
    assert roof["read_gb_s"] > 0 and roof["weight_bytes"] > 0 and roof["step_ms"] > 0
    assert roof["roof_ms"] == pytest.approx(roof["weight_bytes"] / roof["read_gb_s"] / 1e6, rel=1e-2, abs=1e-3)
    assert set(out["target"]["prefill_tokens_per_s"]) == {"100", "200"}  # 4000 exceeds the window
    assert out["target"]["dtype"] == "int8" and out["target"]["batch_invariant"] is True
    assert out["draft"]["ms_per_token"] > 0 and out["draft"]["batch_invariant"] is True
    assert out["target"]["cpu"] and out["target"]["threads"] >= 1
    table = runner.invoke(app, ["profile", "--target", tiny_dirs["target"], "--ks", "1,2", "--prefix", "8",
                                "--repeats", "1", "--prefill", "none", "--no-roof"])
    assert table.exit_code == 0 and "t(k) / t(1)" in table.output and "roof" not in table.output


@pytest.mark.parametrize("args, fragment", [(["--ks", "0-3"], "--ks"), (["--ks", "x"], "--ks"),
                                            (["--prefix", "0"], "--prefix"), (["--prefix", "300"], "window"),
                                            (["--prefill", "512-1024"], "--prefill"), (["--prefill", "0"], "--prefill")])
def test_profile_user_errors(tiny_dirs, args, fragment):
    assert_user_error(runner.invoke(app, ["profile", "--target", tiny_dirs["target"], *args]), fragment)


def test_device_errors(tiny_dirs, monkeypatch):
    import torch

    from specdec.runtime.loading import resolve_device

    assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--device", "gpu"), "--device")
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--device", "cuda"), "no CUDA GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert_user_error(generate("hi", "--target", tiny_dirs["target"], "--device", "cuda", "--dtype", "int8"),
                      "CPU only")


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_speculative_equals_plain(tiny_dirs, dtype):
    # The loop keeps its bookkeeping on the CPU; models, caches and forwards run on the GPU.
    from specdec.runtime.engine import Engine

    engine = Engine.load(tiny_dirs["target"], tiny_dirs["draft"], dtype=dtype, device="cuda")
    assert engine.target_runner.model.device.type == "cuda"
    plain = engine.generate("def fibonacci(n):", max_new_tokens=24, use_draft=False)
    spec = engine.generate("def fibonacci(n):", max_new_tokens=24, num_speculative_tokens=4)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


def test_prompt_lookup_draft_prints_plain_output(tiny_dirs):
    common = ["def f(x): return x\ndef f(x): return", "--target", tiny_dirs["target"], "--max-new-tokens", "20", "--json"]
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    result = generate(*common, "--draft", "lookup", "-k", "4")
    assert result.exit_code == 0, result.output
    spec = json.loads(result.stdout)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted"] > 0


def test_k_auto_is_the_default_and_keeps_the_output(tiny_dirs):
    common = ["Once upon a time", "--target", tiny_dirs["target"], "--max-new-tokens", "25", "--json"]
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    for draft in (tiny_dirs["draft"], tiny_dirs["target"], "lookup"):
        result = generate(*common, "--draft", draft)
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["token_ids"] == plain["token_ids"], draft
        stats = out["stats"]
        assert 0 <= stats["plain_fraction"] <= 1 and 0 <= stats["mean_k"] <= 8
        assert stats["draft_s"] >= 0 and stats["target_s"] > 0 and stats["other_s"] >= 0
    summary = generate("Once upon a time", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "-n", "8")
    assert summary.exit_code == 0 and "k auto: mean" in summary.output and "plain steps" in summary.output


@pytest.mark.parametrize("k", ["0", "-3", "many", "2.5"])
def test_bad_num_speculative_tokens(tiny_dirs, k):
    result = generate("Hi", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "-k", k)
    assert_user_error(result, "--num-speculative-tokens")


def test_hybrid_lookup_and_draft_model_prints_plain_output(tiny_dirs):
    common = ["def f(x): return x\ndef f(x): return", "--target", tiny_dirs["target"], "--max-new-tokens", "20", "--json"]
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    for k in ("4", "auto"):
        result = generate(*common, "--draft", "lookup+" + tiny_dirs["draft"], "-k", k)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["token_ids"] == plain["token_ids"]
    assert_user_error(generate(*common, "--draft", "lookup+"), "needs a draft model")


def test_suffix_drafts_print_plain_output_and_acceptance_by_source(tiny_dirs):
    common = ["def f(x): return x\ndef f(x): return", "--target", tiny_dirs["target"], "--max-new-tokens", "20", "--json"]
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    for draft in ("suffix", "suffix+" + tiny_dirs["draft"]):
        result = generate(*common, "--draft", draft, "-k", "4", "--suffix-memory", "1000")
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["token_ids"] == plain["token_ids"], draft
        by_source = out["stats"]["by_source"]
        assert sum(s["drafted"] for s in by_source.values()) == out["stats"]["drafted"]
        assert set(by_source) <= {"suffix", "suffix-short", "model"}
    assert_user_error(generate(*common, "--draft", "suffix+"), "needs a draft model")
    assert_user_error(generate(*common, "--draft", "suffix+lookup"), "two model-free drafters")
    assert_user_error(generate(*common, "--draft", "suffix", "--suffix-memory", "-1"), "--suffix-memory")
    assert "--suffix-memory" in generate("--help").output and "1,048,576" in generate("--help").output


def test_a_seeded_request_under_k_auto_gets_a_frozen_controller_of_its_own(tiny_dirs, tmp_path, monkeypatch):
    # A seed's text depends on which tokens were drafted: k must not follow timings or earlier requests.
    from specdec.algorithm.control import AutoK
    from specdec.algorithm.sampling import SamplingParams
    from specdec.runtime.engine import Engine

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))  # the step costs are cached there
    engine = Engine.load(tiny_dirs["target"], tiny_dirs["draft"])
    seeded = SamplingParams(temperature=0.9, seed=7)
    first = engine.generate("Once upon a time", max_new_tokens=24, sampling=seeded)
    shared = engine.auto_controller()
    shared.costs.target_scale = 9.0  # a busy machine, as timings would say
    shared.costs.draft_overhead_ms = 1e6
    engine.generate("Once upon a time", max_new_tokens=24)  # a greedy request teaches the shared one more
    own = engine.speculation("auto", seeded)
    assert isinstance(own, AutoK) and own is not shared and own.cost_ewma == 0
    assert own.costs.target_scale == 1.0 and own.costs.draft_overhead_ms == 0.0
    assert own.costs.target_ms == engine._measured_costs.with_row_floor().target_ms  # rows at least at their average
    assert engine.speculation("auto", SamplingParams()) is shared  # greedy requests share what was learnt
    again = engine.generate("Once upon a time", max_new_tokens=24, sampling=seeded)
    assert again.token_ids == first.token_ids


def test_draft_confidence_keeps_the_output_and_refuses_a_bad_threshold(tiny_dirs):
    common = ["Once upon a time", "--target", tiny_dirs["target"], "--max-new-tokens", "20", "--json"]
    plain = json.loads(generate(*common, "--draft", "none").stdout)
    out = json.loads(generate(*common, "--draft", tiny_dirs["draft"], "-k", "4", "--draft-confidence", "0.5").stdout)
    assert out["token_ids"] == plain["token_ids"] and out["stats"]["drafted"] > 0
    assert_user_error(generate(*common, "--draft", tiny_dirs["draft"], "--draft-confidence", "1.5"), "between 0 and 1")


def test_stairs_verification_prints_plain_output(tiny_dirs):
    common = ["def fibonacci(n):", "--target", tiny_dirs["target"], "--max-new-tokens", "20"]
    plain = json.loads(generate(*common, "--draft", "none", "--json").stdout)
    stairs = json.loads(generate(*common, "--draft", tiny_dirs["draft"], "-k", "4", "--verify", "stairs",
                                 "--json").stdout)
    assert stairs["token_ids"] == plain["token_ids"] and stairs["stats"]["drafted"] > 0
    result = generate(*common, "--draft", tiny_dirs["draft"], "--verify", "stairs")
    assert result.exit_code == 0, result.output
    assert "stairs verification" in result.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--verify", "stairs", "--temperature", "0.7"], "greedy only"),
    (["--verify", "tree"], "--verify"),
])
def test_verify_user_errors(tiny_dirs, args, fragment):
    assert_user_error(generate("x = 1", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], *args), fragment)


def test_constrained_generation_flags(tiny_dirs, tmp_path):
    """--regex, --grammar (GBNF text or a file) and --json-schema (a file or its text): the output is the grammar's,
    with speculation as without; the target as its own draft, so that drafts are accepted."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"enum": ["yes", "no"]}', encoding="utf-8")
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "n=" [0-9] ";"\n', encoding="utf-8")
    cases = [(("--regex", "[ab]{3}"), r"[ab]{3}"), (("--grammar", str(grammar)), r"n=[0-9];"),
             (("--grammar", 'root ::= "x" [0-9]'), r"x[0-9]"), (("--json-schema", str(schema)), r'"(yes|no)"'),
             (("--json-schema", '{"const": 7}'), r"7")]
    for flags, pattern in cases:
        texts = []
        for draft in (tiny_dirs["target"], "none"):
            result = generate("Answer:", "--target", tiny_dirs["target"], "--draft", draft, "-n", "24", "--json", *flags)
            assert result.exit_code == 0, result.output
            out = json.loads(result.stdout)
            assert out["finish_reason"] == "stop" and re.fullmatch(pattern, out["text"]), (flags, out["text"])
            texts.append(out["token_ids"])
        assert texts[0] == texts[1], flags


@pytest.mark.parametrize("flags, fragment", [
    (("--regex", "a", "--grammar", 'root ::= "a"'), "give one of --grammar, --regex"),
    (("--json-schema", '{"type": "strnig"}'), "invalid JSON schema"),
    (("--json-schema", "missing.json"), "cannot read missing.json"),
    (("--grammar", "root ::= root"), "no output can satisfy it"),
    (("--regex", "(("), "invalid regex"),
])
def test_constrained_generation_errors_are_one_line(tiny_dirs, flags, fragment):
    assert_user_error(generate("Answer:", "--target", tiny_dirs["target"], "--draft", "none", *flags), fragment)
