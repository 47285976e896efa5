"""A trained head in use: `--draft head[:<dir>]` and `lookup+head[:<dir>]` through the Engine (alone and in a
batch), the CLI and the server give plain greedy's output; the default drafter picks lookup+head when a head is
saved for the target; missing heads, other targets' heads and targets without hidden states are one-line errors;
`specdec models` lists the heads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from specdec import zoo
from specdec.cli import app
from specdec.defaults import HEAD_DRAFTER, MODEL_FREE_DRAFTER
from specdec.drafters.spec import resolve_drafter
from specdec.errors import SpecdecError
from specdec.head import manifest, store
from specdec.head.manifest import heads_table
from specdec.runtime.engine import Engine
from specdec.runtime.head_cost import measure_head
from specdec.training.train import train
from tests.head.conftest import QUICK, own_text
from tests.tiny import save_tiny

PROMPTS = ["def fibonacci(n):", "Once upon a time", "for i in range(10):"]
KS = [1, 3, "auto"]
cli = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """A tiny target saved as a model directory, another one, and a head trained for the first (fp32) saved
    in a directory of its own."""
    root = tmp_path_factory.mktemp("head-use")
    target = save_tiny(root / "target", "llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    trained = train(model, own_text(model), QUICK, heldout=own_text(model)[0])
    head = store.save(trained.head, root / "head", store.target_identity(model, target), trained, ["own text"])
    return {"target": target, "other": save_tiny(root / "other", "llama", seed=1), "head": str(head)}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(zoo.HOME_ENV, str(tmp_path / "home"))
    return tmp_path / "home"


def install(saved: dict[str, str]) -> Path:
    """Copy the saved head to the target's default directory in $SPECDEC_HOME."""
    import shutil

    directory = manifest.default_directory(saved["target"])
    shutil.copytree(saved["head"], directory)
    return directory


def test_a_bench_method_drafts_with_a_head_beside_the_runs_draft_model(saved) -> None:
    """`specdec bench --draft lookup+<model> --methods ...,specdec-auto@lookup+head:<dir>`: the head is
    loaded once for the run's target; every method's output is plain greedy's."""
    from specdec.bench.methods import build_methods

    engine = Engine.load(saved["target"], f"lookup+{saved['other']}", dtype="fp32")
    spec = f"lookup+head:{saved['head']}"
    entries = ["plain", "specdec-auto", f"specdec-auto@{spec}", f"specdec-tree@head:{saved['head']}"]
    methods = build_methods(engine, entries, [3], max_new_tokens=24)
    by_name = {m.name: m.engine for m in methods}
    with_head, tree = by_name[entries[2]], by_name[entries[3]]
    assert (with_head.head, with_head.draft_runner, with_head.copier, with_head.draft_name) == (
        tree.head, None, "lookup", spec) and with_head.head is not None
    assert (tree.copier, tree.draft_name) == (None, f"head:{saved['head']}")
    assert by_name["specdec-auto"].head is None and by_name["specdec-auto"].draft_runner is not None
    assert engine.head is None and engine.draft_name == f"lookup+{saved['other']}"  # the run's engine as it was
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        runs = {m.name: m.run(ids) for m in methods}
        assert all(r.token_ids == runs["plain"].token_ids for r in runs.values()), prompt
        tree = runs[entries[3]]  # its trees are counted in the record (results.jsonl)
        assert tree.tree_steps is not None and tree.tree_nodes >= tree.tree_steps and runs["plain"].tree_steps is None
    with pytest.raises(ValueError, match="not both"):
        engine.fork_drafting("lookup", True, with_head.head)


def plain(engine: Engine, prompt: str) -> list[int]:
    return engine.generate(prompt, max_new_tokens=30, use_draft=False).token_ids


@pytest.mark.parametrize("dtype", ["int8", "fp32"])
@pytest.mark.parametrize("lookup", [False, True], ids=["head", "lookup+head"])
def test_engine_greedy_is_plain_greedy(saved, dtype: str, lookup: bool) -> None:
    spec = ("lookup+" if lookup else "") + f"head:{saved['head']}"
    engine = Engine.load(saved["target"], spec, dtype=dtype)
    assert engine.head is not None and engine.draft_runner is None and engine.draft_name == spec
    drafted = 0
    for prompt in PROMPTS:
        reference = plain(engine, prompt)
        for k in KS:
            out = engine.generate(prompt, max_new_tokens=30, k=k)
            assert out.token_ids == reference, (prompt, k)
            drafted += out.stats.drafted
    assert drafted > 0


def test_a_batch_gives_each_request_a_head_drafter_of_its_own(saved) -> None:
    engine = Engine.load(saved["target"], f"lookup+head:{saved['head']}", dtype="int8")
    references = {p: plain(engine, p) for p in PROMPTS}
    engine.enable_batching(2)
    for k in KS:
        results: dict[str, list[int]] = {}

        def run(prompt: str, results: dict[str, list[int]] = results, k: int = k) -> None:
            results[prompt] = engine.generate(prompt, max_new_tokens=30, k=k).token_ids

        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:2]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {p: references[p] for p in PROMPTS[:2]}, k


@pytest.mark.parametrize("draft", ["head", "lookup+head"])
@pytest.mark.parametrize("k", ["1", "3", "auto"])
def test_cli_greedy_is_plain_greedy(saved, draft: str, k: str) -> None:
    common = ["generate", PROMPTS[0], "--target", saved["target"], "-n", "25", "--json"]
    spec = json.loads(cli.invoke(app, [*common, "--draft", f"{draft}:{saved['head']}", "-k", k]).stdout)
    reference = json.loads(cli.invoke(app, [*common, "--draft", "none"]).stdout)
    assert spec["token_ids"] == reference["token_ids"] and spec["text"] == reference["text"]


def test_the_default_drafts_with_the_head_when_one_is_saved(saved, home: Path) -> None:
    # no head yet: auto's model rule, which finds no zoo draft for a tiny target (specdec.drafters.choice)
    assert resolve_drafter("auto", saved["target"]).name == MODEL_FREE_DRAFTER
    install(saved)
    assert resolve_drafter("auto", saved["target"]).name == HEAD_DRAFTER == "lookup+head"
    assert resolve_drafter("auto", saved["target"], hidden_states=False).name == MODEL_FREE_DRAFTER  # llama.cpp: none
    assert resolve_drafter("auto", saved["other"]).name == MODEL_FREE_DRAFTER  # another target's head is not its default
    assert resolve_drafter("lookup", saved["target"]).name == "lookup"  # what is given stays as it is
    result = cli.invoke(app, ["generate", PROMPTS[1], "--target", saved["target"], "-n", "20"])
    assert result.exit_code == 0, result.output
    assert "draft lookup+head" in result.output
    engine = Engine.load(saved["target"], "head")
    assert engine.generate(PROMPTS[1], max_new_tokens=20, k=3).token_ids == plain(engine, PROMPTS[1])[:20]
    import specdec

    out = specdec.generate(PROMPTS[1], target=saved["target"], max_new_tokens=20, k=3)  # the API's default: auto
    assert out.token_ids == plain(engine, PROMPTS[1])[:20] and out.stats.drafted > 0


def assert_one_line_error(args: list[str], fragment: str) -> None:
    result = cli.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]  # after any progress bar of a load (a quantization)
    assert last.startswith("error: ") and fragment in last, result.output


def test_missing_head_other_target_and_no_hidden_states_are_one_line_errors(saved, home: Path) -> None:
    target = saved["target"]
    assert_one_line_error(["generate", "hi", "--target", target, "--draft", "head"],
                          f"no draft head for {target}: train one with specdec train-drafter --target {target}")
    assert_one_line_error(["generate", "hi", "--target", target, "--draft", f"head:{home / 'nothing'}"],
                          "no draft head in")
    assert_one_line_error(["generate", "hi", "--target", saved["other"], "--draft", f"lookup+head:{saved['head']}"],
                          "was trained for another target")
    assert_one_line_error(["generate", "hi", "--target", target, "--backend", "llamacpp", "--draft", "head"],
                          "a draft head reads the target's hidden states, which a llamacpp target does not give")
    engine = Engine.load(target, f"head:{saved['head']}", dtype="int8")
    with pytest.raises(SpecdecError, match="which stairs verification does not give"):
        engine.generate("hi", max_new_tokens=4, verify="stairs")


def test_models_lists_the_heads(saved, home: Path) -> None:
    result = cli.invoke(app, ["models"])
    assert result.exit_code == 0 and "no trained draft heads" in result.output
    directory = install(saved)
    [row] = heads_table()
    manifest = store.read_manifest(directory)
    assert row["directory"] == str(directory) and row["target"] == saved["target"]
    assert row["tokens_seen"] == manifest["tokens_seen"] > 0 and len(row["agreement_by_position"]) > 0
    result = cli.invoke(app, ["models"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "trained draft heads" in result.output and str(directory) in result.output
    assert f"{manifest['tokens_seen']:,}" in result.output
    broken = home / "drafters" / "broken-head"
    broken.mkdir()
    (broken / "manifest.json").write_text(json.dumps({**manifest, "agreement_by_position": ["x"]}))
    assert "error" in heads_table()[0] and heads_table()[1]["directory"] == str(directory)
    result = cli.invoke(app, ["models"], env={"COLUMNS": "400"})
    assert result.exit_code == 0 and "Traceback" not in result.output and "broken manifest" in result.output


def test_the_controller_prices_the_head_by_its_measured_cost(saved) -> None:
    engine = Engine.load(saved["target"], f"lookup+head:{saved['head']}", dtype="int8")
    costs = engine.auto_controller().costs
    assert costs.draft_ms > 0 and costs.draft_ms == pytest.approx(measure_head(engine.head.head), rel=10)


def test_a_server_request_with_the_head_gets_plain_greedys_text(saved) -> None:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from tests.serve.conftest import MODEL, serve

    engine = Engine.load(saved["target"], f"lookup+head:{saved['head']}", dtype="int8")
    expected = engine.generate(PROMPTS[0], max_new_tokens=24, use_draft=False).text
    for max_batch in (1, 2):
        with serve(engine, k=3, max_batch=max_batch) as server:
            out = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=24)
        assert out.choices[0].text == expected
        assert out.speculative_decoding["drafted"] > 0


def test_bench_runs_the_head_and_names_it(saved, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = cli.invoke(app, ["bench", "--target", saved["target"], "--draft", f"lookup+head:{saved['head']}",
                              "--prompts", str(prompts), "--max-new-tokens", "12", "--gammas", "3", "--out", str(out),
                              "--json"])
    assert result.exit_code == 0, result.output
    methods = {m["name"]: m for m in json.loads(result.stdout)["methods"]}
    assert list(methods) == ["plain", "specdec-auto", "specdec", "hf-pld"]  # no draft model for transformers' hf
    assert all(m["identical_rate"] == 1.0 for m in methods.values())
    assert f"draft `lookup+head:{saved['head']}`" in (out / "summary.md").read_text()


def test_one_identity_for_the_fp32_bf16_and_int8_forms_of_a_target(saved) -> None:
    """The checksum is the embedding's, rounded to bf16: an int8 target (its LM head quantized) and a bf16 one
    are the fp32 one's target, and the head loads for each with the weights it was saved with."""
    import copy

    from specdec.native.quant import quantize_model

    fp32 = AutoModelForCausalLM.from_pretrained(saved["target"], dtype=torch.float32).eval()
    forms = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16), "int8": quantize_model(copy.deepcopy(fp32))}
    assert len({store.target_identity(m, "t")["checksum"] for m in forms.values()}) == 1
    heads = {name: store.load(saved["head"], m)[0].state_dict() for name, m in forms.items() if name != "bf16"}
    assert all(torch.equal(heads["fp32"][k], heads["int8"][k]) for k in heads["fp32"])
