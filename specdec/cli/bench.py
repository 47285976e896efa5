"""`specdec bench` (plain, speculative and the peers' decoding side by side on a prompt set; or the decode step
beside llama-bench, or start-up times) and `specdec quality` (a cheaper target against the fp32 model: greedy
agreement and perplexity).  The harness itself is specdec.bench."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

from specdec.cli.common import PullProgress, err, fail, quiet_libraries, status
from specdec.cli.options import engine_options
from specdec.engine_config import DTYPE_HELP, HF, EngineConfig
from specdec.errors import SpecdecError


@engine_options(
    draft={"help": "Drafter, as for generate (the same default, auto): a draft model, 'lookup' (prompt lookup), 'lookup+<model>' (hybrid), 'suffix' or 'suffix+<model>' (suffix drafts), 'recycle' or 'recycle+<model>' (Token Recycling), 'head' or 'lookup+head' (a trained draft head; the methods' summary names it), or 'none' (then only plain, hf-plain, hf-pld, llamacpp)."},
    dtype={"help": DTYPE_HELP + " For every method."},
    draft_dtype={"help": "The draft's dtype (default: --dtype), for every method that drafts."},
    threads={"help": "CPU threads for torch and llama.cpp (default: torch's choice, llama.cpp all CPUs)."},
    backend={"help": "Target's backend for plain and specdec: hf or llamacpp (the hf* methods need hf)."},
    draft_backend={"help": "Draft's backend, as for generate (the same default: auto)."},
)
def bench(
    models: EngineConfig = None,  # type: ignore[assignment]  # the model options (engine_options), bench's help
    prompts: str | None = typer.Option(None, "--prompts", help="'builtin' (the default: user-shaped prompts, multi-turn chats), 'short' (the first short set), a Spec-Bench .jsonl (\"replies\" make a conversation), or a text file with one prompt per line (\\n escapes allowed)."),
    workload: str | None = typer.Option(None, "--workload", help="Instead of --prompts, sessions of repeated text run turn by turn, each turn's prompt holding the method's own earlier answers: edit (code-edit sessions), agent (tool-call loops), template (templated generation), comma-separated, or .jsonl session files; --limit-per-category takes the first M sessions of each."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most tokens to generate per prompt."),
    methods: str = typer.Option("default", "--methods", help="Comma-separated: plain, specdec, specdec-auto (k chosen by the cost-model controller, as generate runs it), specdec-tree (specdec-auto with --tree auto), specdec-stairs, specdec-intersection, hf, hf-auto, hf-plain, hf-pld, llamacpp (plain llama.cpp on the target's GGUF), int8-plain, llama-server, llama-server-draft, llama-server-ngram (llama.cpp's own server: plain, with the draft model's GGUF, with n-gram drafts; built by scripts/install-llamacpp.sh --server); plain always runs: it is the reference. Our loop's methods take another drafter of the run's models after '@' (specdec-auto@lookup beside specdec-auto with --draft suffix+<model>), to compare drafters in one run; llama-server-draft@N drafts N tokens a step, llama-server-ngram@<type> another n-gram type. default: plain, specdec-auto, specdec, hf-pld, hf (when the draft runs in transformers), llamacpp (when installed) and the three llama-server methods (when llama-server is built)."),
    gammas: str = typer.Option("5", "--gammas", help="Draft tokens per step γ; a list (1,3,5) sweeps specdec, hf and hf-pld."),
    repeats: int = typer.Option(1, "--repeats", help="Runs per prompt and method; the median is reported."),
    limit_per_category: int | None = typer.Option(None, "--limit-per-category", help="Take only the first M prompts of each category."),
    chat: bool = typer.Option(False, "--chat", help="Apply the target's chat template to each prompt."),
    across_sessions: bool = typer.Option(False, "--across-sessions", help="With --workload: each method's suffix store and cached prompt keep the run's earlier sessions, as a server's do (default: every session starts afresh); --repeats 1."),
    temperature: float = typer.Option(0.0, "--temperature", help="> 0: every method samples (then no identical-output rate is reported)."),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    top_p: float = typer.Option(1.0, "--top-p", help="1.0 = off."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling."),
    out: str = typer.Option("bench-out", "--out", help="Output directory: results.jsonl, summary.md, summary.json, PNG plots."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object on stdout."),
    concurrency: str | None = typer.Option(None, "--concurrency", help="Client counts, e.g. 1,2,4,8: run the batched engine under that many concurrent clients and report total tokens/s, latency and mean k per count (methods: plain, specdec, specdec-auto)."),
    decode_vs_llama_bench: int | None = typer.Option(None, "--decode-vs-llama-bench", help="Time the target's one-token decode instead, beside llama.cpp's llama-bench tg64 on the same GGUF file and threads: N rounds, each --repeats runs of 64 one-token forwards from an empty cache, then llama-bench -p 0 -n 64 -r <repeats>; per-round records, medians and their ratio in --out."),
    structured: str | None = typer.Option(None, "--structured", help="Constrained decoding instead: 'builtin' (24 JSON schemas with their prompts) or a .jsonl of {id, category, prompt, schema}; each request's output held to its schema, plain constrained decoding (one token a forward) against -k auto with the run's drafter, interleaved, --repeats each; identical output, valid JSON, speed, forced tokens and the mask's cost per step in --out's summary.md."),
    startup: int | None = typer.Option(None, "--startup", help="Time start-up instead, N interleaved rounds after a warm-up one: import specdec, --help, generate -n 1 and serve to /health 200 (the run's drafter, and --draft none), beside llama-server plain and with the draft model where it is built; medians in --out's summary.md."),
) -> None:
    """Benchmark plain, speculative and transformers' decoding side by side on a prompt set."""
    from specdec.bench.report import console_table
    from specdec.bench.runner import BenchOptions, run_bench, run_concurrency_bench

    quiet_libraries()
    if workload is not None and prompts is not None:
        fail("give --prompts or --workload, not both")
    if decode_vs_llama_bench is not None:
        if prompts is not None or workload is not None or concurrency is not None or startup is not None:
            fail("--decode-vs-llama-bench times the target's one-token step: give no --prompts, --workload, "
                 "--concurrency or --startup")
        bench_decode(models, decode_vs_llama_bench, repeats, Path(out), as_json)
        return
    if structured is not None:
        if prompts is not None or workload is not None or concurrency is not None or startup is not None:
            fail("--structured runs its own schema set: give no --prompts, --workload, --concurrency or --startup")
        bench_structured(models, structured, max_new_tokens, repeats, Path(out), as_json)
        return
    if startup is not None:
        if prompts is not None or workload is not None or concurrency is not None:
            fail("--startup times launches with the run's models: give no --prompts, --workload or --concurrency")
        bench_startup(models, startup, Path(out))
        return
    progress = PullProgress()
    options = BenchOptions(
        engine=models, prompts=prompts or "builtin", workload=workload,
        max_new_tokens=max_new_tokens, methods=methods, gammas=gammas, repeats=repeats,
        limit_per_category=limit_per_category, chat=chat, out=out,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, across_sessions=across_sessions,
    )
    try:
        if concurrency is not None:
            data = run_concurrency_bench(options, concurrency, console=err, load_progress=progress)
        else:
            data = run_bench(options, console=err, load_progress=progress)
    except SpecdecError as e:
        progress.close()
        fail(str(e))
    progress.close()
    if concurrency is not None:
        if as_json:
            print(json.dumps(data, ensure_ascii=False))
        else:
            err.print((Path(out) / "summary.md").read_text(), soft_wrap=True)
            err.print(f"results in {out}/ (summary.md, results.jsonl, concurrency.png)")
            if "note" in data:  # no matplotlib: the bench extra's one line
                err.print(data["note"])
        return
    if as_json:
        print(json.dumps(data, ensure_ascii=False))
    else:
        err.print(console_table(data))
        err.print(f"results in {out}/ (summary.md, results.jsonl, plots)")
        if "note" in data["files"]:
            err.print(data["files"]["note"])


def bench_structured(models: EngineConfig, source: str, max_new_tokens: int, repeats: int, out: Path,
                     as_json: bool) -> None:
    """bench --structured: specdec.bench.structured.run_structured_bench on the run's models, its summary on stderr
    (--json: summary.json's object on stdout)."""
    from specdec.bench.structured import load_schema_prompts, run_structured_bench
    from specdec.cli.common import load_engine

    def run(progress: PullProgress) -> dict:
        load_schema_prompts(source)  # a bad file before the models load
        engine = load_engine(models, progress)
        return run_structured_bench(engine, source, max_new_tokens, repeats, out,
                                    tick=lambda what: err.print(f"structured bench: {what}"))

    run_mode(run, out, as_json)


def run_mode(run: Callable[[PullProgress], dict], out: Path, as_json: bool) -> None:
    """A bench mode that writes summary.md, summary.json and results.jsonl in `out`: `run` (given the pull
    progress) with its one-line errors, then summary.md on stderr (--json: summary.json's object on stdout)."""
    progress = PullProgress()
    try:
        data = run(progress)
    except SpecdecError as e:
        progress.close()
        fail(str(e))
    progress.close()
    if as_json:
        print(json.dumps(data, ensure_ascii=False))
        return
    err.print((out / "summary.md").read_text(), soft_wrap=True)
    err.print(f"results in {out}/ (summary.md, summary.json, results.jsonl)")


def bench_startup(models: EngineConfig, rounds: int, out: Path) -> None:
    """bench --startup: the start-up bench (specdec.bench.startup), its table on stderr."""
    from specdec.bench.startup import run_startup_bench

    try:  # no spinner: the bench's own process stays quiet on the machine it times
        run_startup_bench(models, rounds, out, tick=lambda what: err.print(f"start-up bench: {what}"))
    except SpecdecError as e:
        fail(str(e))
    err.print((out / "summary.md").read_text(), soft_wrap=True)
    err.print(f"results in {out}/ (summary.md, summary.json)")


def bench_decode(models: EngineConfig, rounds: int, repeats: int, out: Path, as_json: bool) -> None:
    """bench --decode-vs-llama-bench: specdec.bench.llamabench.run_decode_bench, its summary on stderr (--json:
    summary.json's object on stdout)."""
    from specdec.bench.llamabench import run_decode_bench

    # no spinner: the bench's own process stays quiet on the machine it times
    run_mode(lambda progress: run_decode_bench(models, rounds, repeats, out,
                                               tick=lambda what: err.print(f"decode bench: {what}"), progress=progress),
             out, as_json)


@engine_options(
    "target", "dtype", "backend", "threads",
    target={"help": "Model: zoo name, .gguf, directory or hub id."},
    dtype={"help": "The candidate's dtype on specdec's side (default: what generate runs)."},
    backend={"help": "The candidate's backend: hf or llamacpp."},
    threads={"help": "CPU threads for torch and llama.cpp."},
)
def quality(
    models: EngineConfig = None,  # type: ignore[assignment]  # the candidate (engine_options)
    prompts: str = typer.Option("builtin", "--prompts", help="Prompts for greedy agreement (as for bench)."),
    limit_per_category: int | None = typer.Option(2, "--limit-per-category", help="First M prompts of each category."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Tokens decoded per prompt."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Apply the chat template to each prompt."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Compare a cheaper target (gguf, int8, bf16, llama.cpp) with the fp32 model: greedy agreement and perplexity."""
    from specdec.bench.prompts import load_prompts
    from specdec.bench.quality import agreement, perplexity, reference_texts
    from specdec.machine import cpu_description
    from specdec.runtime.engine import Engine

    quiet_libraries()
    progress = PullProgress()
    try:
        if max_new_tokens <= 0:
            raise SpecdecError(f"--max-new-tokens must be > 0, got {max_new_tokens}")
        if models.threads:
            import torch

            torch.set_num_threads(models.threads)
        prompt_set = load_prompts(prompts, limit_per_category)
        target, backend = models.target, models.backend
        with status(f"loading {target} (fp32 and {backend} {models.dtype})"):
            reference = Engine.load(target, dtype="fp32", progress=progress)
            candidate = Engine.load(target, dtype=models.dtype, backend=backend, progress=progress,
                                    threads=models.threads)
        progress.close()
        label = f"{backend} {candidate.dtype}" if backend == HF else "llamacpp (exact)"
        outputs: dict[str, list[list[int]]] = {"fp32": [], label: []}
        with status(f"greedy decoding {len(prompt_set)} prompts with both"):
            for p in prompt_set:
                ids = reference.encode_messages(p.messages) if chat else reference.encode(p.plain_text)
                for name, engine in (("fp32", reference), (label, candidate)):
                    outputs[name].append(engine.generate(ids, max_new_tokens=max_new_tokens, use_draft=False).token_ids)
        agree = agreement(outputs["fp32"], outputs[label])
        ppl: dict[str, dict[str, float]] = {}
        with status("perplexity on the reference texts"):
            for text_name, text in reference_texts().items():
                ids = reference.encode(text)[: min(1024, reference.target_runner.max_context)]
                ppl[text_name] = {name: perplexity(engine.target_runner, ids)
                                  for name, engine in (("fp32", reference), (label, candidate))}
    except SpecdecError as e:
        progress.close()
        fail(str(e))
    result = {
        "target": models.target, "candidate": label, "cpu": cpu_description(), "prompts": len(prompt_set),
        "max_new_tokens": max_new_tokens, "mean_first_divergence": agree.mean_first_divergence,
        "identical_rate": agree.identical_rate, "first_divergence": agree.divergences, "perplexity": ppl,
    }
    if as_json:
        print(json.dumps(result))
        return
    Console().print(
        f"{models.target}: {label} vs fp32 on {len(prompt_set)} prompts, {max_new_tokens} greedy tokens each: "
        f"first divergence at token {agree.mean_first_divergence:.1f} on average, "
        f"{agree.identical_rate:.0%} of outputs identical"
    )
    for text_name, values in ppl.items():
        Console().print(f"perplexity on the {text_name} text: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items()))
