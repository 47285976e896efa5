"""`specdec serve`: its limits checked, then the OpenAI-compatible server in this process (the port bound at once,
the models loaded while /health says "loading") or as Ray Serve replicas (--replicas).  The serve extra's
modules load only when serving."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import typer

from specdec.cli.common import PullProgress, check_n_ctx_and_threads, err, fail, load_engine, quiet_libraries
from specdec.cli.options import engine_options, request_options
from specdec.engine_config import HF, EngineConfig
from specdec.errors import SpecdecError
from specdec.request import RequestConfig

if TYPE_CHECKING:  # the serve extra's modules load only when serving
    from specdec.serve import ServeOptions
    from specdec.serve.connections import ConnectionLimits
    from specdec.serve.replicas import ReplicaPlan


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
        return HF
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
