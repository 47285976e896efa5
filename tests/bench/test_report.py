"""Report: the JSON summary's shape, the markdown tables, the plots."""

import json

import pytest

from specdec.bench import report
from specdec.bench.methods import Measurement
from specdec.bench.results import Record, aggregate


def records():
    out = []
    for pid, cat in (("1", "code"), ("2", "chat")):
        out.append(Record(pid, cat, "plain", "plain", None, 0, 4, Measurement([1] * 8, wall_s=1.0, target_forwards=8)))
        for g in (1, 3):
            m = Measurement([1] * 8, wall_s=0.5 + 0.1 * g, target_forwards=4, drafted=2 * g, accepted=g, draft_steps=2,
                            proposed_at=[2] * g, accepted_at=[2] + [0] * (g - 1))
            out.append(Record(pid, cat, f"specdec-g{g}", "specdec", g, 0, 4, m))
        out.append(Record(pid, cat, "hf-plain", "hf-plain", None, 0, 4, Measurement([1] * 8, wall_s=1.2)))
    return out


META = {"target": "t", "draft": "d", "dtype": "fp32", "max_new_tokens": 8, "gammas": [1, 3], "repeats": 1,
        "prompts": "builtin", "num_prompts": 2, "prompts_per_category": {"code": 1, "chat": 1}}


def test_summary_json_shape():
    data = report.summary_json(aggregate(records()), META)
    json.dumps(data)  # serialisable
    names = [m["name"] for m in data["methods"]]
    assert names == ["plain", "specdec-g1", "specdec-g3", "hf-plain"]
    for m in data["methods"]:
        assert set(m) >= {"name", "speedup_vs_plain", "tokens_per_s", "acceptance_rate", "mean_accepted_per_step",
                          "identical_rate"}
    assert set(data["by_category"]) == {"code", "chat"}
    assert data["methods"][3]["acceptance_rate"] is None


def test_markdown_tables():
    md = report.summary_markdown(aggregate(records()), META)
    assert "## Overall" in md and "## Speedup vs plain by category" in md and "### code" in md
    assert "| `specdec-g3` | 3 |" in md
    assert "| method | code | chat | all |" in md
    assert "## Acceptance by draft position" in md
    assert "dtype fp32, greedy," in md


def test_decode_speedup_table_only_where_methods_report_the_first_token():
    assert "## Decode speedup" not in report.summary_markdown(aggregate(records()), META)
    rs = records()
    for r in rs:
        if r.method in ("plain", "specdec-g3"):
            r.measurement.first_token_s = 0.25
    md = report.summary_markdown(aggregate(rs), META)
    assert "## Decode speedup vs plain by category" in md
    assert "| method | code (25%) | chat (25%) | all (25%) |" in md  # the prefill's share of plain's wall time
    # specdec-g3: 7 tokens in 0.55 s against plain's 7 in 0.75 s
    assert f"| `specdec-g3` | {0.75 / 0.55:.2f}× | {0.75 / 0.55:.2f}× | {0.75 / 0.55:.2f}× |" in md
    assert "| `specdec-g1` |" not in md.split("## Decode speedup")[1].split("##")[0]


def test_acceptance_by_draft_source():
    rs = records()
    for r, counts in zip([r for r in rs if r.method == "specdec-g3"], ({"suffix": [2, 5, 4], "model": [1, 1, 0]},
                                                                      {"suffix": [1, 3, 3]})):
        r.measurement.by_source = counts
    rs = [Record.from_dict(json.loads(json.dumps(r.to_dict()))) for r in rs]  # through results.jsonl
    summary = aggregate(rs)
    by_source = summary.method("specdec-g3").overall.acceptance_by_source
    assert by_source == {"model": {"draft_steps": 1, "drafted": 1, "accepted": 0, "acceptance_rate": 0.0},
                         "suffix": {"draft_steps": 3, "drafted": 8, "accepted": 7, "acceptance_rate": 7 / 8}}
    assert summary.method("specdec-g3").by_category["chat"].acceptance_by_source["suffix"]["drafted"] == 3
    assert summary.method("specdec-g1").overall.acceptance_by_source is None  # not reported
    assert report.summary_json(summary, META)["methods"][2]["acceptance_by_source"] == by_source
    md = report.summary_markdown(summary, META)
    assert "## Acceptance by draft source" in md
    assert "| method | model | suffix |" in md and "| `specdec-g3` | 0% (1) | 88% (8) |" in md


def test_markdown_header_names_sampling_and_backends():
    meta = {**META, "backend": "llamacpp", "draft_backend": "hf",
            "sampling": {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 1}}
    md = report.summary_markdown(aggregate(records(), compare_outputs=False), meta)
    assert "target `t` (llama.cpp), draft `d`, dtype fp32, sampling (temperature 0.7, top-p 0.9, seed 1)" in md
    assert "greedy" not in md.split("\n")[2]
    bf16_draft = report.summary_markdown(aggregate(records()), {**META, "draft_dtype": "bf16"})
    assert "draft `d`, dtype fp32 (draft bf16), greedy" in bf16_draft


def test_a_sampled_run_with_repeats_names_its_seeds_and_each_repeats_speedup():
    rows = []
    for r, spec_wall in enumerate((0.5, 0.25, 1.0)):
        for pid in ("1", "2"):
            rows.append(Record(pid, "code", "plain", "plain", None, r, 4, Measurement([1] * 8, wall_s=1.0)))
            rows.append(Record(pid, "code", "specdec-auto", "specdec-auto", None, r, 4, Measurement([1] * 8, wall_s=spec_wall)))
    meta = {**META, "repeats": 3, "sampling": {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 4}}
    md = report.summary_markdown(aggregate(rows, compare_outputs=False), meta)
    assert "sampling (temperature 0.7, top-p 0.9, seeds 4–6, one per repeat)" in md
    assert "`specdec-auto` 2.00 / 4.00 / 1.00 (median 2.00×, spread 1.00–4.00)" in md
    greedy = report.summary_markdown(aggregate(rows), {**meta, "sampling": None})
    assert "seed by seed" not in greedy and "greedy" in greedy


def test_write_all_with_plots(tmp_path):
    pytest.importorskip("matplotlib")
    data = report.write_all(aggregate(records()), META, tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["acceptance_by_position.png", "speedup_by_category.png", "speedup_vs_gamma.png",
                     "summary.json", "summary.md"]
    assert json.loads((tmp_path / "summary.json").read_text()) == data
    assert "![speedup_vs_gamma](speedup_vs_gamma.png)" in (tmp_path / "summary.md").read_text()


def test_the_step_plot_follows_one_generation_of_the_controller(tmp_path):
    pytest.importorskip("matplotlib")
    rs = records()
    assert report.step_traces(rs) is None and report.plot_steps(rs, aggregate(rs), tmp_path) is None  # no auto run
    auto = [[0, 1, 0.1], [2, 3, 0.15], [1, 1, 0.12]]
    rs.append(Record("2", "chat", "specdec-auto", "specdec", None, 0, 4, Measurement([1] * 5, wall_s=0.4, steps=auto)))
    rs.append(Record("2", "chat", "specdec-auto", "specdec", None, 1, 4, Measurement([1] * 5, wall_s=0.4, steps=[])))
    rs[0].measurement.steps = [[0, 1, 0.1]] * 5  # plain on prompt 1: another prompt, not in the plot
    rs[4].measurement.steps = [[0, 1, 0.1]] * 5  # plain on prompt 2
    prompt, traces = report.step_traces(rs)
    assert prompt == "2" and set(traces) == {"plain", "specdec-auto"} and traces["specdec-auto"] == auto
    path = report.plot_steps(rs, aggregate(rs), tmp_path)
    assert path == tmp_path / "steps.png" and path.stat().st_size > 0


def test_inputs_note_says_whether_sessions_start_afresh():
    from specdec.bench.report import inputs_note

    meta = {"workload": ["agent"], "sessions_per_category": {"agent": 2}, "prompts_per_category": {"agent": 9},
            "num_prompts": 9, "chat": True, "repeats": 1}
    assert "every session starting afresh" in inputs_note(meta) and "agent 2/9" in inputs_note(meta)
    note = inputs_note({**meta, "across_sessions": True})
    assert "keeping the run's earlier sessions (--across-sessions" in note and "afresh" not in note
