"""Running the benchmark: warm-up, interleaving and repeats, then the whole `specdec bench` run.

Schedule.  One warm-up generation per method (on the first prompt, not
recorded), then for each prompt, for each repeat, every method once, in an
order rotated by one place per (prompt, repeat): slow drift of the machine
(thermal state, other load) then falls on all methods alike instead of on
whichever ran last.  With ``--workload`` the sessions of a workload run instead,
turn by turn, every method on its own conversation (:mod:`specdec.bench.sessions`).
The records are aggregated by :mod:`specdec.bench.results` and written out by
:mod:`specdec.bench.report`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from specdec.bench.methods import Method
from specdec.bench.results import Record, aggregate, identical_share, mark_identical
from specdec.bench.sessions import check_across_sessions, rotated, run_sessions
from specdec.drafters.choice import auto_note
from specdec.drafters.spec import DrafterSpec
from specdec.engine_config import HF, LLAMACPP, EngineConfig, feeds_heads
from specdec.errors import SpecdecError
from specdec.prompt_files import Prompt, conversation_text


def run_interleaved(
    methods: Sequence[Method],
    prompts: Sequence[tuple[Prompt, list[int]]],
    repeats: int = 1,
    warmup: bool = True,
    advance: Callable[[str], None] | None = None,
    on_prompt_done: Callable[[list[Record]], None] | None = None,
    compare_outputs: bool = True,
) -> list[Record]:
    """Run every method on every (prompt, token ids) `repeats` times, interleaved; returns the records.

    A one-turn prompt is a session of one turn: the method's ``before_session()`` runs before each
    generation, so no run drafts from what an earlier one wrote (its own earlier repeat included).
    advance(description) is called after each generation (warm-ups included);
    on_prompt_done(records) after each prompt, with its records marked
    identical or not to plain (left None with compare_outputs=False: sampled
    outputs are not expected to match).
    """
    if repeats < 1:
        raise SpecdecError(f"--repeats must be >= 1, got {repeats}")
    advance = advance or (lambda _: None)
    if warmup and prompts:
        for m in methods:
            m.before_session()
            m.run(prompts[0][1])
            advance(f"warm-up {m.name}")
    records: list[Record] = []
    for i, (prompt, ids) in enumerate(prompts):
        done: list[Record] = []
        for r in range(repeats):
            for m in rotated(methods, i * repeats + r):
                m.start_repeat(r)
                m.before_session()
                measurement = m.run(ids)
                done.append(Record(prompt.id, prompt.category, m.name, m.family, m.gamma, r, len(ids), measurement))
                advance(f"{prompt.category} #{prompt.id} {m.name}")
        if compare_outputs:
            mark_identical(done)
        records.extend(done)
        if on_prompt_done is not None:
            on_prompt_done(done)
    return records


# --- the whole benchmark, as the CLI runs it ------------------------------------------------------


@dataclass
class BenchOptions:
    """A bench run's options: the models (`engine`: the CLI's model options, as generate's) and the run's own."""

    engine: EngineConfig = field(default_factory=EngineConfig)  # target, draft (None: no drafter), dtypes, backends...
    prompts: str = "builtin"
    workload: str | None = None  # "edit,agent,template" (specdec.bench.workloads): sessions instead of prompts
    max_new_tokens: int = 128
    methods: str = "default"  # methods.default_methods
    gammas: str = "5"
    repeats: int = 1
    limit_per_category: int | None = None
    chat: bool = False
    out: str = "bench-out"
    warmup: bool = True
    temperature: float = 0.0  # > 0: every method samples (then no identical_rate: sampled outputs differ)
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    across_sessions: bool = False  # workloads: drafters and caches keep earlier sessions (sessions.run_sessions)


def encode_prompt(engine: Any, prompt: Prompt, chat: bool, max_new_tokens: int,
                  conversation: bool = False) -> list[int]:
    """A prompt's token ids, checked against the target's window: a conversation through the chat
    template whole, or as "User: …\\n\\nAssistant:" text without one (conversation=True: a session's
    first turn too, not its bare text)."""
    if chat:
        ids = engine.encode_messages(prompt.messages)
    else:
        ids = engine.encode(conversation_text(prompt.messages) if conversation else prompt.plain_text)
    window = engine.target_runner.max_context
    if len(ids) + max_new_tokens > window:
        raise SpecdecError(
            f"prompt {prompt.id} ({prompt.category}) has {len(ids)} tokens: with --max-new-tokens {max_new_tokens} it "
            f"does not fit the target's context window of {window} tokens"
        )
    return ids


def _encode_all(engine: Any, prompts: Sequence[Prompt], chat: bool,
                max_new_tokens: int) -> list[tuple[Prompt, list[int]]]:
    return [(p, encode_prompt(engine, p, chat, max_new_tokens)) for p in prompts]


def environment() -> dict[str, Any]:
    """Versions and machine facts for the report."""
    import torch
    import transformers

    from specdec.machine import cpu_description

    return {
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_description(),
        "python": platform.python_version(),
        "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0),
    }


def check_run_options(options: BenchOptions) -> None:
    """The checks of --max-new-tokens, --repeats and --threads every bench makes (a one-line SpecdecError)."""
    if options.max_new_tokens <= 0:
        raise SpecdecError(f"--max-new-tokens must be > 0, got {options.max_new_tokens}")
    if options.repeats < 1:
        raise SpecdecError(f"--repeats must be >= 1, got {options.repeats}")
    if options.engine.threads is not None and options.engine.threads < 1:
        raise SpecdecError(f"--threads must be >= 1, got {options.engine.threads}")


def output_dir(options: BenchOptions) -> Path:
    """--out as a path, refused in one line if it exists and is not a directory."""
    out = Path(options.out).expanduser()
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"--out {out} exists and is not a directory")
    return out


def run_bench(
    options: BenchOptions,
    console: Any = None,
    load_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Validate, load, run, write results.jsonl / summary.md / summary.json / plots; returns the JSON summary.

    console: a rich Console (stderr) for the loading status and the progress
    bar; load_progress: the zoo's download/convert progress callback.
    """
    from contextlib import nullcontext

    from specdec.bench.methods import build_methods

    plan = _plan_bench(options)  # every user mistake is caught before any model is loaded
    engine, peer = _load_bench_models(options, plan, console, load_progress)
    encoded, units = _bench_units(options, engine, plan)
    skipped: dict[str, str] = {}
    target_gguf, draft_gguf = server_files(plan.families, options.engine.target, plan.draft_model, load_progress)
    with console.status(escape("starting llama-server")) if console and target_gguf else nullcontext():
        methods = build_methods(engine, plan.families, plan.gammas, options.max_new_tokens, plan.sampling,
                                llamacpp_target=peer, target_gguf=target_gguf, draft_gguf=draft_gguf,
                                threads=options.engine.threads, n_ctx=options.engine.n_ctx, skipped=skipped)
    for name, why in skipped.items():
        if console is not None:
            console.print(escape(f"{name}: not run: {why}"))
    try:
        summary, meta, records = _run_methods(options, engine, methods, encoded, plan.sessions, units, plan.sampling,
                                              plan.gammas, plan.draft_backend if plan.draft_model is not None else None,
                                              skipped, plan.out, console)
    finally:
        for m in methods:
            m.close()
    # Every server of the run is stopped before llama-bench times the machine (llamabench.run refuses otherwise).
    if target_gguf is not None and meta.get("servers"):
        meta["machine_bench"] = machine_bench(engine, target_gguf, options.engine.threads, console)
    files = draft_files(plan.draft_model, meta["draft_backend"], engine.draft_dtype,
                        draft_gguf if any(getattr(m, "family", "") == "llama-server-draft" for m in methods) else None)
    if files:
        meta["draft_files"] = files
    from specdec.bench import report

    return report.write_all(summary, meta, plan.out, records)


@dataclass
class _BenchPlan:
    """What run_bench loads and runs, from its options checked (_plan_bench)."""

    sampling: Any  # specdec.algorithm.sampling.SamplingParams
    drafter: DrafterSpec  # the drafter as Engine.load takes it ("auto" resolved)
    draft_model: str | None  # its draft model, if any
    draft_backend: str  # the draft's backend and dtype as Engine.load takes them
    draft_dtype: str | None
    families: list[str]  # the methods' entries
    gammas: list[int]
    sessions: list[Any]  # a workload's sessions (specdec.bench.workloads.Session), or none
    prompts: list[Prompt]  # a prompt set's prompts, or none (a workload)
    out: Path


def _plan_bench(options: BenchOptions) -> _BenchPlan:
    """run_bench's options checked, the drafter, the methods and the prompts (or sessions) resolved; a
    SpecdecError for any user mistake, before any model is loaded."""
    from specdec.algorithm.sampling import SamplingParams
    from specdec.bench.methods import (
        DEFAULT,
        check_backends,
        check_drafters,
        default_methods,
        needs_draft,
        parse_gammas,
        parse_methods,
    )
    from specdec.bench.prompts import load_prompts
    from specdec.bench.workloads import load_workloads
    from specdec.drafters.spec import resolve_drafter, split_drafter
    from specdec.runtime.loading import llamacpp_can_run, resolve_draft

    sampling = SamplingParams(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
                              seed=options.seed)
    check_run_options(options)
    if options.across_sessions and options.workload is None:
        raise SpecdecError("--across-sessions is for --workload sessions: a prompt set's prompts start afresh")
    check_across_sessions(options.across_sessions, options.repeats)
    models = options.engine
    drafter = resolve_drafter(models.draft, models.target, feeds_heads(models.backend))  # "auto": a head, or the 0.5B
    _, draft_model, head = split_drafter(drafter)
    # The draft's backend and dtype as Engine.load takes them (the same defaults as `specdec generate`).
    backend, draft_backend, draft_dtype = resolve_draft(draft_model, models.backend, models.draft_backend,
                                                        models.draft_dtype, models.device)
    if options.methods.strip().lower() == DEFAULT:
        families = default_methods(models.draft is not None, draft_model is not None, models.backend, draft_backend,
                                   draft_dtype, llamacpp_can_run(models.target), llama_server_can_run(models.target))
    else:
        families = parse_methods(options.methods)
    check_backends(families, models.backend, draft_backend, draft_dtype)
    own_drafters = check_drafters(families, draft_model, head)  # "specdec-auto@lookup": the run's draft model only
    for _, _, method_head in own_drafters.values():  # "specdec-auto@lookup+head" beside a draft model
        if method_head is not None:
            from specdec.head.use import precheck

            precheck(method_head, backend, models.target, feeds_heads(backend))
    if LLAMACPP in families:
        from specdec.runtime.loading import check_spec

        check_spec(models.target, LLAMACPP)  # the peer needs the target as a GGUF, and llama-cpp-python
    if models.n_ctx is not None and models.n_ctx < 1:
        raise SpecdecError(f"--n-ctx must be >= 1, got {models.n_ctx}")
    gammas = parse_gammas(options.gammas)
    # a workload's sessions, or a prompt set
    sessions = load_workloads(options.workload, options.limit_per_category) if options.workload is not None else []
    prompts = load_prompts(options.prompts, options.limit_per_category) if options.workload is None else []
    wanting = [f for f in needs_draft(families) if f not in own_drafters]
    if wanting and models.draft is None:
        raise SpecdecError(f"method(s) {', '.join(wanting)} need a draft model: give --draft or drop them")
    return _BenchPlan(sampling, drafter, draft_model, draft_backend, draft_dtype, families, gammas, sessions, prompts,
                      output_dir(options))


def _load_bench_models(options: BenchOptions, plan: _BenchPlan, console: Any,
                       load_progress: Callable[[str, int, int], None] | None) -> tuple[Any, Any]:
    """(the engine, the llamacpp method's plain llama.cpp target or None), loaded under a status line."""
    from contextlib import nullcontext

    import torch

    from specdec.runtime.engine import Engine

    if options.engine.threads:
        torch.set_num_threads(options.engine.threads)
    loading = f"loading {options.engine.target}" + (f" and {options.engine.draft}" if options.engine.draft else "")
    status = console.status(escape(loading)) if console else nullcontext()
    with status:
        engine = Engine.load(options.engine.target, plan.drafter, progress=load_progress, config=options.engine,
                             draft_backend=plan.draft_backend, draft_dtype=plan.draft_dtype)
        peer = None
        if LLAMACPP in plan.families:  # plain llama.cpp on the target's GGUF, its fastest kernels
            from specdec.runtime.loading import load_llamacpp

            peer = load_llamacpp(options.engine.target, n_ctx=options.engine.n_ctx, exact=False, progress=load_progress,
                                 n_threads=options.engine.threads)
    return engine, peer


def _bench_units(options: BenchOptions, engine: Any, plan: _BenchPlan) -> tuple[list[tuple[Prompt, list[int]]], list[Any]]:
    """(the prompt set's prompts with their token ids, or none; what the progress counts: those prompts, or
    the sessions' turns), every prompt checked against the context window before anything runs."""
    encoded: list[tuple[Prompt, list[int]]] = []
    if options.workload is None:
        encoded = _encode_all(engine, plan.prompts, options.chat, options.max_new_tokens)
        units = [p for p, _ in encoded]
    else:  # the turns' prompts are made as the sessions run, each method's from its own answers;
        # with the answers left empty, a turn that could never fit is refused before anything runs
        units = [s.prompt(t, [""] * (t - 1)) for s in plan.sessions for t in range(1, len(s.turns) + 1)]
        for p in units:
            encode_prompt(engine, p, options.chat, options.max_new_tokens, conversation=True)
    return encoded, units


def _run_methods(options: BenchOptions, engine: Any, methods: list[Any], encoded: list[tuple[Prompt, list[int]]],
                 sessions: list[Any], units: list[Any], sampling: Any, gammas: list[int], draft_backend: str | None,
                 skipped: dict[str, str], out: Path, console: Any) -> tuple[Any, dict[str, Any], list[Record]]:
    """run_bench's timed part: every method over the prompts (or sessions); (the summary, the run's meta, the
    records), results.jsonl written as they come."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from specdec.bench.workloads import parse_workloads

    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    total = len(methods) * (len(units) * options.repeats + (1 if options.warmup else 0))
    progress = Progress(
        TextColumn("[bold]bench[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        TextColumn("{task.description}"), console=console, transient=False, disable=console is None,
    )
    with results_path.open("w", encoding="utf-8") as sink, progress:
        task = progress.add_task("warm-up", total=total)

        def advance(description: str) -> None:
            progress.update(task, advance=1, description=description)

        def write(rows: list[Record]) -> None:
            for row in rows:
                sink.write(json.dumps(row.to_dict(), ensure_ascii=False) + "\n")
            sink.flush()

        if options.workload is None:
            records = run_interleaved(methods, encoded, options.repeats, options.warmup, advance, write,
                                      compare_outputs=sampling.greedy)
        else:
            def encode(prompt: Prompt) -> list[int]:
                return encode_prompt(engine, prompt, options.chat, options.max_new_tokens, conversation=True)

            def decode(token_ids: list[int]) -> str:
                return engine.decode_text(token_ids).strip()

            records = run_sessions(methods, sessions, encode, decode, options.repeats, options.warmup, advance,
                                   write, compare_outputs=sampling.greedy, across_sessions=options.across_sessions)

    summary = aggregate(records, compare_outputs=sampling.greedy)
    meta = {
        "target": options.engine.target,
        "draft": engine.draft_name if options.engine.draft else None,  # as resolved: "lookup+head", "lookup+<model>"...
        "draft_choice": auto_note(options.engine.draft, options.engine.target,
                                  feeds_heads(options.engine.backend)),  # auto's why
        "dtype": engine.dtype,
        "draft_dtype": engine.draft_dtype,
        "backend": options.engine.backend,
        "draft_backend": draft_backend,
        "sampling": {"temperature": options.temperature, "top_k": options.top_k, "top_p": options.top_p,
                     "seed": options.seed},
        "max_new_tokens": options.max_new_tokens,
        "gammas": gammas,
        "methods": [m.name for m in methods],
        "repeats": options.repeats,
        "chat": options.chat,
        "prompts": options.prompts if options.workload is None else None,
        "num_prompts": len(units),  # a workload's: its turns
        "prompts_per_category": {c: sum(p.category == c for p in units) for c in summary.categories},
        "warmup": options.warmup,
        **environment(),
    }
    from specdec.bench.methods import SERVER_METHODS

    servers = {m.name: m.command for m in methods if isinstance(m, SERVER_METHODS)}
    if servers or skipped:
        from specdec.bench.llamaserver import SERVER

        meta["servers"] = servers
        meta["skipped"] = skipped
        if sampling.greedy:
            meta["servers_identical"] = identical_share(records, reference=SERVER, family=SERVER)
    if options.workload is not None:
        meta["workload"] = parse_workloads(options.workload)
        meta["sessions_per_category"] = {c: sum(s.category == c for s in sessions) for c in summary.categories}
        meta["across_sessions"] = options.across_sessions
    if options.engine.device != "cpu":
        meta["device"] = f"{options.engine.device}: {meta['device']}"
    return summary, meta, records


def llama_server_can_run(target: str) -> bool:
    """Whether the default methods take llama.cpp's own server: llama-server found, the target a GGUF."""
    from specdec.bench.llamaserver import SERVER, find_tool
    from specdec.runtime.loading import resolve

    try:
        return find_tool(SERVER) is not None and resolve(target)[0] in ("zoo", "gguf")
    except SpecdecError:
        return False


def server_files(families: Sequence[str], target: str, draft_model: str | None,
                 progress: Callable[[str, int, int], None] | None = None) -> tuple[Path | None, Path | None]:
    """The GGUF files llama-server's methods start with: the target's, and the draft model's where the run
    has one that is a GGUF (None otherwise); (None, None) when no such method runs."""
    from specdec.bench.methods import METHODS, SERVER_METHODS, split_method
    from specdec.runtime.loading import gguf_file, resolve

    if not any(issubclass(METHODS[split_method(f)[0]], SERVER_METHODS) for f in families):
        return None, None
    draft = None
    if draft_model is not None and resolve(draft_model)[0] in ("zoo", "gguf"):
        draft = gguf_file(draft_model, progress)
    return gguf_file(target, progress), draft


def machine_bench(engine: Any, target_gguf: Path, threads: int | None, console: Any = None) -> dict[str, Any]:
    """The machine block beside llama-server's rows: llama-bench's pp512 / tg64 on the target's file and
    our target's one-token step t(1) and prefill at 512 tokens (specdec.runtime.profile), measured after the run
    with its servers stopped; a one-line "error" where llama-bench is missing or fails."""
    import torch

    from specdec.bench.llamabench import run_llama_bench
    from specdec.runtime.profile import measure_forwards, measure_prefill

    threads = threads or torch.get_num_threads()
    block: dict[str, Any] = {"threads": threads}
    try:
        block["llama_bench"] = run_llama_bench(target_gguf, threads)
    except SpecdecError as err:
        block["llama_bench"] = {"error": str(err)}
        if console is not None:
            console.print(escape(f"llama-bench: {err}"))
    runner = engine.target_runner
    t1 = measure_forwards(runner, ks=(1,), repeats=5).ms[1]
    block["specdec"] = {"dtype": engine.dtype, "t1_ms": t1, "tg_tokens_per_s": 1000.0 / t1,
                        "pp512_tokens_per_s": measure_prefill(runner, (512,), repeats=2).get(512)}
    return block


# How specdec runs a draft model, by (its backend, its dtype as the engine reports it): the summary's words.
DRAFT_FORMATS = {(LLAMACPP, "gguf"): "run as is by llama.cpp (llama-cpp-python)",
                 (HF, "gguf"): "its own blocks on specdec's gguf kernels",
                 (HF, "int4"): ("requantised at load to specdec's int4 (4 bits, an fp16 scale and minimum per 32 "
                                  "columns: Q4_1 blocks on the gguf kernel for a llama / qwen2 / mistral GGUF, the "
                                  "int4 kernel from its int8 copy otherwise)"),
                 (HF, "int8"): "quantised at load to specdec's int8 (a scale per output channel)"}


def draft_files(draft_model: str | None, draft_backend: str | None, draft_dtype: str | None,
                server_draft: Path | None) -> dict[str, str]:
    """What each side drafted with: {"specdec": the run's draft model, its file and how specdec runs it,
    "llama-server": the file llama-server-draft's -md loaded and its types}, each where there was one."""
    from specdec.native.gguf import GGUFFile
    from specdec.runtime.loading import gguf_file, resolve

    found: dict[str, str] = {}
    if draft_model is not None:
        how = DRAFT_FORMATS.get((draft_backend or HF, draft_dtype or ""))
        if resolve(draft_model)[0] in ("zoo", "gguf"):
            path = gguf_file(draft_model)
            how = how or f"de-quantised at load to {draft_dtype} for transformers"
            found["specdec"] = f"{path} ({GGUFFile(path).weight_types()}), {how}"
        else:
            found["specdec"] = f"{draft_model}, {how or f'{draft_dtype} in transformers'}"
    if server_draft is not None:
        found["llama-server"] = f"{server_draft} ({GGUFFile(server_draft).weight_types()}), loaded as is (-md)"
    return found


CONCURRENCY_METHODS = ("plain", "specdec", "specdec-auto")


def run_concurrency_bench(
    options: BenchOptions,
    levels_text: str,
    console: Any = None,
    load_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """`specdec bench --concurrency`: the batched engine under 1..N clients (specdec.bench.concurrency);
    writes results.jsonl, summary.md, summary.json and concurrency.png; returns the JSON summary."""
    from specdec.bench import concurrency
    from specdec.bench.methods import DEFAULT, parse_gammas, parse_methods
    from specdec.bench.prompts import load_prompts
    from specdec.runtime.engine import Engine

    levels = concurrency.parse_levels(levels_text)
    check_run_options(options)
    if options.workload is not None:
        raise SpecdecError("--workload runs sessions turn by turn, one request at a time: drop --concurrency")
    if options.temperature > 0:
        raise SpecdecError("--concurrency measures greedy decoding: drop --temperature")
    if options.engine.backend != HF:
        raise SpecdecError("--concurrency batches transformers targets: drop --backend llamacpp")
    default = options.methods.strip().lower() == DEFAULT
    families = list(CONCURRENCY_METHODS) if default else parse_methods(options.methods)
    other = [f for f in families if f not in CONCURRENCY_METHODS]
    if other:
        raise SpecdecError(f"--concurrency runs {', '.join(CONCURRENCY_METHODS)}; drop {', '.join(other)} from --methods")
    if options.engine.draft is None and families != ["plain"]:
        raise SpecdecError("--concurrency with speculative methods needs --draft (a model, lookup or lookup+<model>)")
    gammas = parse_gammas(options.gammas)
    methods: list[tuple[str, int | str | None]] = [("plain", None)]
    if "specdec-auto" in families:
        methods.append(("specdec-auto", "auto"))
    if "specdec" in families:
        methods += [("specdec" if len(gammas) == 1 else f"specdec-g{g}", g) for g in gammas]
    prompts = load_prompts(options.prompts, options.limit_per_category)
    out = output_dir(options)

    import torch

    if options.engine.threads:
        torch.set_num_threads(options.engine.threads)
    # A batch drafts with a cache per request over one transformers model.
    draft_backend = HF if options.engine.draft_backend in (None, "auto") else options.engine.draft_backend
    from contextlib import nullcontext

    status = console.status(escape(f"loading {options.engine.target}")) if console else nullcontext()
    with status:
        engine = Engine.load(options.engine.target, options.engine.draft, progress=load_progress, config=options.engine,
                             backend=HF, draft_backend=draft_backend)
        engine.enable_batching(max(levels))
        if options.engine.draft is not None:
            from specdec.runtime.batching import BatchPool

            assert isinstance(engine.pool, BatchPool)  # enable_batching's, for a concurrency above 1
            engine.pool.costs()  # measured before the clock starts
    encoded = [ids for _, ids in _encode_all(engine, prompts, options.chat, options.max_new_tokens)]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.jsonl").open("w", encoding="utf-8") as sink:
        def write(row: Any) -> None:
            sink.write(json.dumps(row.to_dict(), ensure_ascii=False) + "\n")
            sink.flush()

        def advance(what: str) -> None:
            if console is not None:
                console.print(f"[dim]bench --concurrency: {what} done[/]")

        results = concurrency.run_concurrency(engine, encoded, levels, options.max_new_tokens, methods,
                                              options.repeats, advance, write)
    meta = {"target": options.engine.target, "draft": engine.draft_name if options.engine.draft else None, "dtype": engine.dtype,
            "draft_dtype": engine.draft_dtype,
            "max_new_tokens": options.max_new_tokens, "repeats": options.repeats, "levels": levels,
            "requests": results[0].requests, "chat": options.chat, "prompts": options.prompts,
            "methods": [m for m, _ in methods], **environment()}
    return concurrency.write_all(results, meta, out)
