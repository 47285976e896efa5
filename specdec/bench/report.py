"""Reporting a benchmark run: summary.md, summary.json, the ``--json`` object, PNG plots, a terminal table.

Files written in the output directory (results.jsonl is written by the runner):

* ``summary.md`` — markdown tables: per method overall, speedup per method ×
  category, full numbers per category, acceptance by draft position and by draft source; for a
  workload (``--workload``) also speedup and acceptance per turn index;
* ``summary.json`` — the same object ``--json`` prints;
* ``speedup_by_category.png`` — grouped bars, one group per category (and all);
* ``acceptance_by_position.png`` — one line per specdec method (solid) and per hf method (dashed);
* ``speedup_vs_gamma.png`` — only when several γ were swept.
* ``steps.png`` — one generation of `specdec-auto`: the k chosen at each step, and every method's tokens/s so far.

Plots need matplotlib (the `bench` extra; Agg backend, no display); without it they are skipped
and the summary says so.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specdec.bench.plotting import MISSING, pyplot
from specdec.bench.results import ALL, Aggregate, MethodSummary, Record, Summary
from specdec.engine_config import HF, LLAMACPP

SUMMARY_KEYS = (
    "speedup_vs_plain", "tokens_per_s", "acceptance_rate", "mean_accepted_per_step", "identical_rate",
)


def _method_row(m: MethodSummary, agg: Aggregate) -> dict[str, Any]:
    d = agg.to_dict()
    head = {"name": m.name, "family": m.family, "gamma": m.gamma}
    return {**head, **{k: d[k] for k in SUMMARY_KEYS}, **{k: v for k, v in d.items() if k not in SUMMARY_KEYS}}


def summary_json(summary: Summary, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` object: {"methods": [...], "by_category": {category: [...]}, "config": {...}},
    and for a workload "by_turn": {"1": [...], "2+": [...], "2": [...], ...}."""
    data: dict[str, Any] = {
        "methods": [_method_row(m, m.overall) for m in summary.methods],
        "by_category": {
            c: [_method_row(m, m.by_category[c]) for m in summary.methods if c in m.by_category]
            for c in summary.categories
        },
    }
    if summary.turns:
        data["by_turn"] = {
            t: [_method_row(m, m.by_turn[t]) for m in summary.methods if t in m.by_turn] for t in summary.turns
        }
    return {**data, "reference": summary.reference, "config": meta or {}}


# --- markdown ---------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table; the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join(":---" if i == 0 else "---:" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


METRIC_HEADER = ("method", "γ", "prompts", "tokens", "wall s", "tok/s", "speedup vs plain", "range",
                 "decode speedup", "first token", "acceptance", "accepted/step", "tokens/target fwd", "mean k",
                 "plain steps", "draft time", "identical")


def _metric_row(m: MethodSummary, a: Aggregate) -> list[str]:
    span = "–" if a.speedup_min is None else f"{a.speedup_min:.2f}–{a.speedup_max:.2f}"
    return [
        f"`{m.name}`", fmt(m.gamma, "d"), str(a.prompts), fmt(a.new_tokens, ".0f"), fmt(a.wall_s, ".2f"),
        fmt(a.tokens_per_s, ".1f"), fmt(a.speedup_vs_plain, ".2f", "×"), span,
        fmt(a.decode_speedup_vs_plain, ".2f", "×"), pct(a.first_token_share), pct(a.acceptance_rate),
        fmt(a.mean_accepted_per_step), fmt(a.tokens_per_target_forward), fmt(a.mean_k),
        pct(a.plain_fraction), pct(a.draft_time_share), pct(a.identical_rate),
    ]


def _group_tables(summary: Summary, what: str, groups: Sequence[str],
                  by: Callable[[MethodSummary], dict[str, Aggregate]]) -> list[str]:
    """The "Speedup vs plain by <what>" and "Acceptance rate by <what>" tables: a column per group, then all."""
    lines = ["", f"## Speedup vs plain by {what}", ""]
    rows = [
        [f"`{s.name}`"] + [fmt(by(s)[g].speedup_vs_plain if g in by(s) else None, ".2f", "×") for g in groups]
        + [fmt(s.overall.speedup_vs_plain, ".2f", "×")]
        for s in summary.methods
    ]
    lines += _table(["method", *groups, ALL], rows)
    decoding = [s for s in summary.methods if s.overall.decode_speedup_vs_plain is not None]
    if decoding:
        lines += ["", f"## Decode speedup vs plain by {what}", "",
                  "The same from the first output on: the prompt's prefill, which no drafter speeds up, left out "
                  "(its share of plain's wall time in brackets).", ""]
        ref = next((s for s in summary.methods if s.name == summary.reference), None)

        def share(g: str) -> str:  # the prefill's share of plain's wall time in group g
            a = None if ref is None else ref.overall if g == ALL else by(ref).get(g)
            return f" ({pct(a.first_token_share)})" if a is not None and a.first_token_share is not None else ""

        rows = [
            [f"`{s.name}`"] + [fmt(by(s)[g].decode_speedup_vs_plain if g in by(s) else None, ".2f", "×") for g in groups]
            + [fmt(s.overall.decode_speedup_vs_plain, ".2f", "×")]
            for s in decoding
        ]
        lines += _table(["method", *(g + share(g) for g in groups), ALL + share(ALL)], rows)
    lines += ["", f"## Acceptance rate by {what}", ""]
    rows = [
        [f"`{s.name}`"] + [pct(by(s)[g].acceptance_rate if g in by(s) else None) for g in groups]
        + [pct(s.overall.acceptance_rate)]
        for s in summary.methods if s.overall.acceptance_rate is not None
    ]
    return lines + (_table(["method", *groups, ALL], rows) if rows else ["(no method reported draft statistics)"])


def source_cell(counts: dict[str, float | None] | None) -> str:
    """A source's acceptance and drafted tokens, "82% (1,234)"; – where the method never drafted from it."""
    return "–" if not counts else f"{pct(counts['acceptance_rate'])} ({counts['drafted']:,})"


def backend_note(backend: str | None) -> str:
    """" (llama.cpp)" for a model run through llama.cpp; nothing for transformers (the default)."""
    return " (llama.cpp)" if backend == LLAMACPP else ""


def draft_dtype_note(meta: dict[str, Any]) -> str:
    """" (draft bf16)" when a transformers draft ran in another dtype than the target."""
    dd = meta.get("draft_dtype")
    if not dd or dd == meta.get("dtype") or meta.get("draft_backend") == LLAMACPP:
        return ""
    return f" (draft {dd})"


def decoding_note(sampling: dict[str, Any] | None, repeats: int = 1) -> str:
    """"greedy", or the sampling parameters that every method used (several repeats: a seed each)."""
    if not sampling or not sampling.get("temperature"):
        return "greedy"
    parts = [f"temperature {sampling['temperature']}"]
    if sampling.get("top_k"):
        parts.append(f"top-k {sampling['top_k']}")
    if sampling.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {sampling['top_p']}")
    seed = sampling.get("seed")
    seeds = (f"seeds {seed}–{seed + repeats - 1}, one per repeat" if repeats > 1 and seed is not None
             else f"seed {seed}")
    return "sampling (" + ", ".join(parts) + f", {seeds})"


def repeats_note(summary: Summary, meta: dict[str, Any]) -> list[str]:
    """Under sampling with several repeats: each method's overall speedup per repeat (per seed), their median
    and spread, and why a sampled run is read that way."""
    sampled = bool((meta.get("sampling") or {}).get("temperature"))
    rows = [s for s in summary.methods if s.name != summary.reference and s.overall.speedup_by_repeat]
    if not sampled or not rows:
        return []
    cells = []
    for s in rows:
        per = s.overall.speedup_by_repeat or []
        cells.append(f"`{s.name}` " + " / ".join(f"{v:.2f}" for v in per)
                     + f" (median {statistics.median(per):.2f}×, spread {min(per):.2f}–{max(per):.2f})")
    return ["", "Sampled: the methods' texts differ (one sample each), so a prompt's ratio compares two samples "
            "of the same distribution; repeat r draws with seed + r, the same seed for every method, and the "
            "tables take per prompt the median over the repeats. The overall speedup in each repeat "
            "(geometric mean over the prompts), seed by seed: " + "; ".join(cells) + "."]


DRAFT_SIDES = {"specdec": "specdec's draft model", "llama-server": "llama-server-draft's draft model"}


def draft_files_note(meta: dict[str, Any]) -> list[str]:
    """A line per side that drafted with a model: its file, the file's types, and how that side ran it
    (runner.draft_files); nothing where no side did."""
    files = meta.get("draft_files") or {}
    return [f"- {DRAFT_SIDES.get(side, side)}: {what}" for side, what in files.items()]


def inputs_note(m: dict[str, Any]) -> str:
    """The summary's line on what ran: the prompt set, or the workload's sessions and turns."""
    how = (f"{'chat template' if m.get('chat') else 'raw text'}, {m.get('repeats')} repeat(s) (median), "
           f"{'one warm-up generation per method' if m.get('warmup', True) else 'no warm-up'}")
    if not m.get("workload"):
        per = ", ".join(f"{c} {n}" for c, n in m.get("prompts_per_category", {}).items())
        return f"- prompts `{m.get('prompts')}`: {m.get('num_prompts')} ({per}), {how}, methods interleaved per prompt"
    sessions, turns = m.get("sessions_per_category", {}), m.get("prompts_per_category", {})
    per = ", ".join(f"{c} {n}/{turns.get(c)}" for c, n in sessions.items())
    return (f"- workload `{', '.join(m['workload'])}`: {sum(sessions.values())} sessions, {m.get('num_prompts')} turns "
            f"(sessions/turns: {per}), {how}; a session's turns in order, each method's prompt built from its "
            "own earlier answers, methods interleaved per turn, "
            + ("each method's drafters and caches keeping the run's earlier sessions (--across-sessions, as a "
               "server's do)" if m.get("across_sessions") else "every session starting afresh (its drafters "
               "learn from its own turns only), a repeat runs the whole session again"))


def peers_note(meta: dict[str, Any]) -> list[str]:
    """The llama-server methods' command lines, the methods left out and why, and the machine block
    (llama-bench's pp512 / tg64 beside our target's t(1) and prefill); nothing without llama-server."""
    servers, skipped, machine = meta.get("servers") or {}, meta.get("skipped") or {}, meta.get("machine_bench")
    if not servers and not skipped:
        return []
    lines = ["", "## llama.cpp's own server", "",
             "Each llama-server method is one server started for the run on 127.0.0.1 and sent the same token ids "
             "through its /completion API, one request at a time, `cache_prompt` off (every prompt prefilled "
             "whole, as ours); its prefill time from the server's `timings`, its acceptance from `draft_n` / "
             "`draft_n_accepted`. Commands:", ""]
    same = meta.get("servers_identical") or {}
    lines += [f"- `{name}`: `{command}`" + (f" (output identical to `llama-server`'s on {pct(same[name])} of the prompts)"
                                            if name in same else "") for name, command in servers.items()]
    lines += [f"- `{name}`: not run: {why}" for name, why in skipped.items()]
    if machine:
        bench, ours = machine.get("llama_bench") or {}, machine.get("specdec") or {}
        peer = (f"llama-bench on the target's file, {machine.get('threads')} threads: pp512 {fmt(bench.get('pp512'), '.1f')} "
                f"tok/s, tg64 {fmt(bench.get('tg64'), '.1f')} tok/s (`{bench.get('command')}`)"
                if "error" not in bench else f"llama-bench: {bench['error']}")
        lines += ["", f"Machine: {peer}; specdec's target ({ours.get('dtype')}): t(1) {fmt(ours.get('t1_ms'), '.1f')} ms "
                  f"({fmt(ours.get('tg_tokens_per_s'), '.1f')} tok/s), prefill at 512 tokens "
                  f"{fmt(ours.get('pp512_tokens_per_s'), '.1f')} tok/s (specdec.runtime.profile); both after the run, "
                  "its servers stopped."]
    return lines


def summary_markdown(summary: Summary, meta: dict[str, Any], plots: Sequence[str] = (), plot_note: str = "") -> str:
    """summary.md: configuration, then the tables."""
    m = meta
    lines = ["# specdec benchmark", ""]
    lines += [
        f"- target `{m.get('target')}`{backend_note(m.get('backend'))}, draft `{m.get('draft')}`{m.get('draft_choice') or ''}"
        f"{backend_note(m.get('draft_backend'))}, dtype {m.get('dtype')}{draft_dtype_note(m)}, "
        f"{decoding_note(m.get('sampling'), m.get('repeats') or 1)}, "
        f"max {m.get('max_new_tokens')} new tokens, γ {', '.join(map(str, m.get('gammas', [])))}",
        *draft_files_note(m),
        inputs_note(m),
        f"- {m.get('device', 'cpu')} ({m.get('cpu') or m.get('processor')}, {m.get('torch_threads')} torch threads), "
        f"torch {m.get('torch')}, transformers {m.get('transformers')}, {m.get('date_utc')} UTC",
        "",
        "Speedup: per prompt tokens/s ÷ plain's tokens/s, geometric mean over prompts (range: min–max). "
        "tok/s: all new tokens ÷ all wall time. Decode speedup: the same from the first output on (the "
        "prompt's prefill left out; a draft model reads the prompt in its first proposal, so its prefill "
        "counts there); first token: the share of the wall time before the first output. Acceptance: "
        "accepted ÷ drafted draft tokens; accepted/step: accepted draft tokens per verification; "
        "mean k: draft tokens proposed per step (a plain step "
        "counts 0); plain steps: share of steps that drafted nothing (`-k auto` chooses them); draft time: "
        "share of the wall time in the drafter; identical: share of prompts whose token ids equal `plain`'s. "
        "– : not applicable or not reported.",
        "",
        "## Overall",
        "",
    ]
    lines += _table(METRIC_HEADER, [_metric_row(s, s.overall) for s in summary.methods])
    lines += repeats_note(summary, m)
    lines += peers_note(m)
    reusing = [s for s in summary.methods if s.overall.prompt_reused_share]
    if reusing:
        lines += ["", "Prompt tokens taken from the target's cache (prefix reuse: a turn's prompt starts with "
                  "the earlier turns): " + ", ".join(f"`{s.name}` {pct(s.overall.prompt_reused_share)}"
                                                     for s in reusing) + "."]

    cats = summary.categories
    lines += _group_tables(summary, "category", cats, lambda s: s.by_category)
    if summary.turns:
        lines += _group_tables(summary, "turn", summary.turns, lambda s: s.by_turn)
        lines += ["", "Turn 2+: every turn after a session's first. Same history as plain (each method's "
                  "earlier answers in the session equal plain's, so its prompts were plain's): "
                  + ", ".join(f"`{s.name}` {pct(s.overall.history_identical_rate)}" for s in summary.methods) + "."]

    drafting = [s for s in summary.methods if s.overall.per_position_acceptance]
    if drafting:
        width = max(len(s.overall.per_position_acceptance or []) for s in drafting)
        lines += ["", "## Acceptance by draft position", "",
                  "Share of steps whose i-th draft token was accepted, given it was proposed.", ""]
        rows = [
            [f"`{s.name}`"] + [pct(v) for v in s.overall.per_position_acceptance or []]
            + ["–"] * (width - len(s.overall.per_position_acceptance or []))
            for s in drafting
        ]
        lines += _table(["method", *(str(i + 1) for i in range(width))], rows)

    by_source = [s for s in summary.methods if s.overall.acceptance_by_source]
    if by_source:
        sources = sorted({source for s in by_source for source in s.overall.acceptance_by_source or {}})
        lines += ["", "## Acceptance by draft source", "",
                  "Accepted ÷ drafted draft tokens of the drafts from each source (drafted tokens in brackets).", ""]
        rows = [[f"`{s.name}`"] + [source_cell((s.overall.acceptance_by_source or {}).get(source)) for source in sources]
                for s in by_source]
        lines += _table(["method", *sources], rows)

    lines += ["", "## Per category", ""]
    for c in cats:
        lines += [f"### {c}", ""]
        lines += _table(METRIC_HEADER, [_metric_row(s, s.by_category[c]) for s in summary.methods if c in s.by_category])
        lines.append("")

    if plots or plot_note:
        lines += ["## Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        if plot_note:
            lines.append(plot_note)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --- plots ------------------------------------------------------------------------------------------


# One colour of its own per method family (matplotlib's tab10 palette), in every plot of every run.
FAMILY_COLORS = {"plain": "tab:gray", "specdec": "tab:blue", "specdec-auto": "tab:red", "specdec-stairs": "tab:cyan",
                 "specdec-tree": "black", "specdec-intersection": "tab:pink", HF: "tab:orange", "hf-auto": "tab:purple",
                 "hf-plain": "tab:olive", "hf-pld": "tab:green", LLAMACPP: "tab:brown"}


def method_colors(methods: Sequence[MethodSummary]) -> dict[str, Any]:
    """A colour per method: its family's own, lighter for smaller γ within a sweep (the largest γ full)."""
    from matplotlib.colors import to_rgb

    by_family: dict[str, list[str]] = {}
    for m in methods:
        by_family.setdefault(m.family, []).append(m.name)
    colors: dict[str, Any] = {}
    for family, names in by_family.items():
        base = to_rgb(FAMILY_COLORS.get(family, "black"))
        for i, name in enumerate(names):
            light = 0.0 if len(names) == 1 else 0.6 * (len(names) - 1 - i) / (len(names) - 1)  # share of white
            colors[name] = tuple(c + (1.0 - c) * light for c in base)
    return colors


def plot_all(summary: Summary, out: Path) -> list[Path]:
    """Write the PNG plots into `out`; returns their paths.  Raises ImportError without matplotlib."""
    plt = pyplot()

    colors = method_colors(summary.methods)
    paths = [plot_speedup_by_category(plt, summary, colors, out), plot_acceptance_by_position(plt, summary, colors, out),
             plot_speedup_vs_gamma(plt, summary, colors, out)]
    return [p for p in paths if p is not None]


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """`fig` laid out, written to `path` (a PNG) and closed; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_speedup_by_category(plt: Any, summary: Summary, colors: dict[str, Any], out: Path) -> Path | None:
    """speedup_by_category.png: speedup by method and category, grouped bars, one group per category (and
    all); None when no method but the reference ran."""
    others = [s for s in summary.methods if s.name != summary.reference]
    if not others:
        return None
    groups = [*summary.categories, ALL]
    width = 0.8 / len(others)
    # Room per group for its bars and its (rotated) category name; the legend sits outside.
    fig_width = min(18.0, max(7.0, 3.0 + len(groups) * max(0.9, 0.2 * len(others))))
    fig, ax = plt.subplots(figsize=(fig_width, 4.8))
    for j, s in enumerate(others):
        values = [s.overall if g == ALL else s.by_category.get(g) for g in groups]
        ys = [v.speedup_vs_plain if v is not None and v.speedup_vs_plain is not None else 0.0 for v in values]
        xs = [i + (j - (len(others) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, ys, width * 0.95, label=s.name, color=colors[s.name], edgecolor="white", linewidth=0.3)
        if len(others) * len(groups) <= 60:
            ax.bar_label(bars, labels=[f"{y:.2f}" if y else "" for y in ys], fontsize=6, padding=1, rotation=90)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{summary.reference} = 1")
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", rotation_mode="anchor")
    ax.set_ylabel("speedup vs plain (geometric mean, ×)")
    ax.set_title("Speedup vs plain decoding, by method and category")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return save_figure(plt, fig, out / "speedup_by_category.png")


def plot_acceptance_by_position(plt: Any, summary: Summary, colors: dict[str, Any], out: Path) -> Path | None:
    """acceptance_by_position.png: acceptance by draft position, our loop (solid) and transformers' assisted
    generation with the same draft and γ (dashed); prompt lookup and hf-auto are in summary.md.  None when
    no such method drafted."""
    drafting = [s for s in summary.methods
                if s.overall.per_position_acceptance and s.family in ("specdec", "specdec-intersection", HF)]
    if not drafting:
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for s in drafting:
        ys = s.overall.per_position_acceptance or []
        style = "-" if s.family.startswith("specdec") else "--"
        marker = "o" if s.family.startswith("specdec") else "x"
        ax.plot(range(1, len(ys) + 1), ys, style, marker=marker, label=s.name, color=colors[s.name])
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(draft token i accepted | proposed)")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Acceptance by draft position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, out / "acceptance_by_position.png")


def plot_speedup_vs_gamma(plt: Any, summary: Summary, colors: dict[str, Any], out: Path) -> Path | None:
    """speedup_vs_gamma.png, when a sweep ran: one line per family that takes γ; methods without γ as
    levels.  None without a sweep."""
    swept: dict[str, list[MethodSummary]] = {}
    for s in summary.methods:
        if s.gamma is not None:
            swept.setdefault(s.family, []).append(s)
    if not any(len(v) > 1 for v in swept.values()):
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for family, ms in swept.items():
        ms = sorted(ms, key=lambda s: s.gamma or 0)
        ax.plot([s.gamma for s in ms], [s.overall.speedup_vs_plain or 0.0 for s in ms], marker="o",
                label=family, color=colors[ms[-1].name])
    for s in summary.methods:
        if s.name != summary.reference and s.gamma is None and s.overall.speedup_vs_plain is not None:
            ax.axhline(s.overall.speedup_vs_plain, linestyle=":", linewidth=1.2, color=colors[s.name],
                       label=f"{s.name} (no γ)")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{summary.reference} = 1")
    ax.set_xlabel("γ (draft tokens per step)")
    ax.set_ylabel("speedup vs plain (geometric mean, ×)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Speedup vs γ")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save_figure(plt, fig, out / "speedup_vs_gamma.png")


STEP_METHOD = "specdec-auto"  # whose chosen k the per-step plot shows


def step_traces(records: Sequence[Record]) -> tuple[str, dict[str, list[list[float]]]] | None:
    """(prompt id, {method: per-step records}) of the first prompt on which `specdec-auto` ran, the
    first repeat of every method of our loop on it; None when there is no such prompt."""
    first = next((r for r in records if r.method == STEP_METHOD and r.repeat == 0 and r.measurement.steps), None)
    if first is None:
        return None
    traces = {r.method: r.measurement.steps for r in records
              if r.prompt_id == first.prompt_id and r.repeat == 0 and r.measurement.steps}
    return first.prompt_id, traces


def plot_steps(records: Sequence[Record], summary: Summary, out: Path) -> Path | None:
    """steps.png: over one generation, the k the controller chose at each step and each method's
    decode tokens/s so far.  Raises ImportError without matplotlib."""
    found = step_traces(records)
    if found is None:
        return None
    plt = pyplot()

    prompt_id, traces = found
    colors = method_colors(summary.methods)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.0, 6.0), sharex=True)
    auto = traces[STEP_METHOD]
    xs = range(1, len(auto) + 1)
    top.bar(xs, [k for k, _, _ in auto], color=colors.get(STEP_METHOD), label="k chosen (0 = plain step)")
    top.plot(xs, [n for _, n, _ in auto], "k.", markersize=4, label="tokens emitted")
    top.set_ylabel("tokens")
    top.yaxis.get_major_locator().set_params(integer=True)
    top.legend(fontsize=8, loc="upper right")
    top.set_title(f"One generation (prompt {prompt_id}): the controller's k and tokens/s so far")
    for method, steps in traces.items():
        tokens = seconds = 0.0
        rate = []
        for _, n, sec in steps:
            tokens, seconds = tokens + n, seconds + sec
            rate.append(tokens / seconds if seconds > 0 else 0.0)
        bottom.plot(range(1, len(steps) + 1), rate, label=method, color=colors.get(method))
    bottom.set_xlabel("decode step (after the prefill)")
    bottom.set_ylabel("tokens/s so far (prefill excluded)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    return save_figure(plt, fig, out / "steps.png")


def write_all(summary: Summary, meta: dict[str, Any], out: Path, records: Sequence[Record] = ()) -> dict[str, Any]:
    """Write summary.md, summary.json and the plots into `out` (steps.png from `records`); returns
    the JSON summary (with file paths)."""
    note = ""
    try:
        plots = plot_all(summary, out)
        step_plot = plot_steps(records, summary, out)
        plots += [step_plot] if step_plot is not None else []
    except ImportError:
        plots, note = [], f"({MISSING})"
    data = summary_json(summary, meta)
    data["files"] = {
        "results": str(out / "results.jsonl"),
        "summary_md": str(out / "summary.md"),
        "summary_json": str(out / "summary.json"),
        "plots": [str(p) for p in plots],
    }
    if note:
        data["files"]["note"] = note
    (out / "summary.md").write_text(summary_markdown(summary, meta, [str(p) for p in plots], note), encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return data


def console_table(data: dict[str, Any]) -> Any:
    """A rich Table of the per-method overall numbers, from the JSON summary."""
    from rich.table import Table

    table = Table(title="specdec bench (speedup: geometric mean vs plain)")
    table.add_column("method", no_wrap=True)
    for header in ("γ", "tok/s", "speedup", "decode", "accept", "acc/step", "tok/fwd", "mean k", "plain", "identical"):
        table.add_column(header, justify="right", no_wrap=True)
    for m in data["methods"]:
        table.add_row(
            m["name"], fmt(m["gamma"], "d"), fmt(m["tokens_per_s"], ".1f"), fmt(m["speedup_vs_plain"], ".2f", "×"),
            fmt(m.get("decode_speedup_vs_plain"), ".2f", "×"), pct(m["acceptance_rate"]),
            fmt(m["mean_accepted_per_step"]), fmt(m["tokens_per_target_forward"]),
            fmt(m.get("mean_k")), pct(m.get("plain_fraction")), pct(m["identical_rate"]),
        )
    return table
