"""`specdec bench --structured`: constrained decoding with speculation against plain constrained decoding, on a set
of JSON schemas with their prompts (issue 75).

Each record of the set (the shipped ``specdec/bench/prompts/structured.jsonl``, 24 schemas in six categories:
extraction, classification, tool calls, generation, reasoning, translation and summarization; or a .jsonl file of
one's own with the same fields: ``{"id", "category", "prompt", "schema"}``) is one request whose output must
validate against its schema (specdec.constrain: the target's distribution masked by it at every position).
Methods, interleaved per record and repeat (their order alternating):

- ``plain``: constrained decoding one token a forward (the request's ``speculative: false``, ``--draft none``):
  forced tokens are speculation's to take, so plain takes none of them;
- ``specdec-auto``: the same request with speculation on, every default (``-k auto``, the run's drafter): the
  drafts cut at the first token the grammar forbids, the forced tokens verified as drafts that need no proposal.

A warm-up compiles every grammar and runs both methods once first (not recorded).  Reported per record (medians
over repeats): tokens, whether the speculative output is the plain one token for
token and whether it parses and validates against the schema (jsonschema, where installed), the whole call's and
the decode's tokens/s and the ratios, the forced tokens, acceptance, tokens per target forward, and the mask's cost:
the time in the grammar (masks, forced tokens, draft checks) per plain step, against that step's time without it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError

SHIPPED = "structured.jsonl"  # in specdec/bench/prompts
FIELDS = ("id", "category", "prompt", "schema")


@dataclass(frozen=True)
class SchemaPrompt:
    """One record: a prompt whose answer must be JSON that validates against `schema`."""

    id: str
    category: str
    prompt: str
    schema: dict[str, Any]


def load_schema_prompts(source: str | None = None) -> list[SchemaPrompt]:
    """The shipped set (None or "builtin") or a .jsonl file of records with FIELDS; a one-line SpecdecError for a bad
    file or record."""
    if source in (None, "builtin"):
        text = resources.files("specdec.bench").joinpath("prompts", SHIPPED).read_text(encoding="utf-8")
        name = SHIPPED
    else:
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecdecError(f"--structured: cannot read {source}: {e}") from None
        name = path.name
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{name}:{number}: not JSON ({e})") from None
        if not isinstance(obj, dict) or any(field not in obj for field in FIELDS):
            raise SpecdecError(f"{name}:{number}: a record needs {', '.join(FIELDS)}")
        if not isinstance(obj["schema"], dict) or not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise SpecdecError(f"{name}:{number}: \"schema\" must be an object and \"prompt\" a non-empty string")
        records.append(SchemaPrompt(str(obj["id"]), str(obj["category"]), obj["prompt"], obj["schema"]))
    if not records:
        raise SpecdecError(f"{name}: no records")
    if len({r.id for r in records}) != len(records):
        raise SpecdecError(f"{name}: record ids must be unique")
    return records


def validates(text: str, schema: dict[str, Any]) -> bool | None:
    """Whether `text` is JSON that validates against `schema` (None where jsonschema is not installed)."""
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _measure(engine: Any, ids: list[int], config: Any) -> dict[str, Any]:
    result = engine.generate(ids, config)
    s = result.stats
    decode_s = s.wall_s - s.prefill_s
    steps = s.target_forwards - 1  # after the prefill
    return {"token_ids": result.token_ids, "text": result.text, "finish": result.finish_reason,
            "wall_s": s.wall_s, "decode_s": decode_s, "tokens": s.new_tokens, "forwards": s.target_forwards,
            "forced": s.forced, "drafted": s.drafted, "accepted": s.accepted, "process_s": s.process_s,
            # the grammar's share of a plain step: its time per step against the rest of the step
            "mask_ms_per_step": 1000 * s.process_s / max(steps + 1, 1),
            "step_ms_without_mask": 1000 * (decode_s - s.process_s) / max(steps, 1)}


def run_structured_bench(engine: Any, source: str | None, max_new_tokens: int, repeats: int, out: Path,
                         tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Both methods over the set on a loaded `engine`; summary.md, summary.json and results.jsonl in `out`."""
    from specdec.constrain import Constraint
    from specdec.machine import cpu_description
    from specdec.request import RequestConfig

    if repeats < 1:
        raise SpecdecError(f"--repeats must be >= 1, got {repeats}")
    records = load_schema_prompts(source)
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    out.mkdir(parents=True, exist_ok=True)
    # warm-up, not recorded: every grammar compiled (the tokenizer's llguidance view is built once per process, ~3 s),
    # and both methods run once (the controller's step costs are measured at its first use)
    grammars = [Constraint.json_schema(record.schema) for record in records]
    for constraint in grammars:
        engine.grammar(constraint)
    warm = engine.prompt_ids(records[0].prompt, chat=chat)
    for speculative in (False, True):
        engine.generate(warm, RequestConfig(max_new_tokens=16, speculative=speculative, constraint=grammars[0]))
    rows = []
    with open(out / "results.jsonl", "w", encoding="utf-8") as log:
        for i, record in enumerate(records):
            if tick is not None:
                tick(f"{i + 1}/{len(records)} {record.id}")
            constraint = grammars[i]
            ids = engine.prompt_ids(record.prompt, chat=chat)
            configs = {"plain": RequestConfig(max_new_tokens=max_new_tokens, speculative=False, constraint=constraint),
                       "specdec-auto": RequestConfig(max_new_tokens=max_new_tokens, constraint=constraint)}
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
            for r in range(repeats):
                for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
                    m = _measure(engine, ids, configs[name])
                    runs[name].append(m)
                    log.write(json.dumps({"id": record.id, "method": name, "repeat": r,
                                          **{k: v for k, v in m.items() if k != "token_ids"}}, ensure_ascii=False) + "\n")
            rows.append(_row(record, runs))
    summary = _summary(rows, engine, max_new_tokens, repeats, cpu_description(), source or "builtin")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(summary_markdown(summary), encoding="utf-8")
    return summary


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(m[key] for m in runs))


def _row(record: SchemaPrompt, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    plain, spec = runs["plain"], runs["specdec-auto"]
    first = spec[0]
    tokens = first["tokens"]
    whole = _median(plain, "wall_s") / _median(spec, "wall_s")
    decode = _median(plain, "decode_s") / _median(spec, "decode_s") if _median(spec, "decode_s") > 0 else 0.0
    return {"id": record.id, "category": record.category, "tokens": tokens, "finish": first["finish"],
            "identical": all(m["token_ids"] == plain[0]["token_ids"] for m in spec + plain),
            "valid": validates(plain[0]["text"], record.schema) if first["finish"] == "stop" else False,
            "plain_tok_s": tokens / _median(plain, "wall_s"), "spec_tok_s": tokens / _median(spec, "wall_s"),
            "whole": whole, "decode": decode, "forced": first["forced"],
            "acceptance": first["accepted"] / first["drafted"] if first["drafted"] else 0.0,
            "tokens_per_forward": tokens / first["forwards"],
            "mask_ms": _median(plain, "mask_ms_per_step"), "step_ms": _median(plain, "step_ms_without_mask")}


def _summary(rows: list[dict[str, Any]], engine: Any, max_new_tokens: int, repeats: int, cpu: str,
             source: str) -> dict[str, Any]:
    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in rows))

    return {"target": f"{engine.target_name} ({engine.dtype})", "draft": engine.draft_name or "none", "cpu": cpu,
            "set": source, "records": len(rows), "max_new_tokens": max_new_tokens, "repeats": repeats,
            "identical": sum(r["identical"] for r in rows), "valid": sum(r["valid"] is True for r in rows),
            "whole_median": med("whole"), "whole_min": min(r["whole"] for r in rows),
            "whole_total": sum(r["tokens"] / r["plain_tok_s"] for r in rows) / sum(r["tokens"] / r["spec_tok_s"] for r in rows),
            "decode_median": med("decode"), "plain_tok_s": med("plain_tok_s"), "spec_tok_s": med("spec_tok_s"),
            "forced_share": sum(r["forced"] for r in rows) / max(sum(r["tokens"] for r in rows), 1),
            "mask_ms": med("mask_ms"), "step_ms": med("step_ms"), "mask_share": med("mask_ms") / med("step_ms"),
            "rows": rows}


def summary_markdown(s: dict[str, Any]) -> str:
    """summary.md: the set's totals, then one line per record."""
    lines = [
        "# Structured output: constrained decoding with speculation vs plain constrained decoding", "",
        f"- target {s['target']}, drafter {s['draft']} (-k auto), CPU: {s['cpu']}",
        f"- set: {s['set']} ({s['records']} schemas), -n {s['max_new_tokens']}, {s['repeats']} repeats (medians), "
        "methods interleaved",
        f"- identical to plain constrained: **{s['identical']}/{s['records']}**; valid JSON for its schema: "
        f"**{s['valid']}/{s['records']}**",
        f"- whole call: median **{s['whole_median']:.2f}x** (lowest {s['whole_min']:.2f}x; the set's total time "
        f"{s['whole_total']:.2f}x); decode: median {s['decode_median']:.2f}x; plain {s['plain_tok_s']:.1f} tok/s, "
        f"specdec {s['spec_tok_s']:.1f} tok/s (medians, whole call)",
        f"- forced tokens: {s['forced_share']:.0%} of the output; the grammar's time per plain step "
        f"{s['mask_ms']:.2f} ms against {s['step_ms']:.1f} ms for the step without it (**{s['mask_share']:.1%}**)", "",
        "| id | category | tokens | identical | valid | plain tok/s | specdec tok/s | whole | decode | forced | "
        "acceptance | tokens/forward | mask ms/step |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        lines.append(f"| {r['id']} | {r['category']} | {r['tokens']} | {'yes' if r['identical'] else 'NO'} | "
                     f"{'yes' if r['valid'] else 'no' if r['valid'] is False else 'n/a'} | {r['plain_tok_s']:.1f} | "
                     f"{r['spec_tok_s']:.1f} | {r['whole']:.2f}x | {r['decode']:.2f}x | {r['forced']} | "
                     f"{r['acceptance']:.0%} | {r['tokens_per_forward']:.2f} | {r['mask_ms']:.2f} |")
    return "\n".join(lines) + "\n"
