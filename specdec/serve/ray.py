"""`specdec serve --replicas`: the same FastAPI app as `specdec serve`, run as Ray Serve replicas.

One deployment, :class:`SpecdecReplica` (``serve.deployment`` + ``serve.ingress``): each replica
loads its own engine (target + draft) and then serves :func:`specdec.serve.app.create_app`'s app
for it, built by Serve's late-bound ingress hook (``__serve_build_asgi_app__``) once the engine is
there.  Serve's proxy (one per node) routes each request to a replica with room
(``max_ongoing_requests`` = the engine's batch size, see specdec.serve.replicas), cancels a request
whose client leaves, and replaces a replica that dies or fails its health check (``check_health``:
the worker threads are alive).  Every response names the replica that answered it in the
``x-specdec-replica`` header.

/health and /metrics, whichever replica answers, cover all of them: each replica posts its health
and its metrics page every second to a small Ray actor, the :class:`Board` (no CPU), and reads the
others' from it.  /health: ``{"status", "replica", "replicas": {id: {"status", "pid", "node",
"running", "waiting", "seen_s"}}}`` (seen_s: how old that replica's post is), the status code being
the answering replica's; /metrics: per replica,
every sample labelled ``replica="<id>"`` (specdec.serve.metrics.merge_replicas).  A replica not
heard of for 5 s (dead, or stopped) drops out of both.

From Python (the CLI does the same)::

    from specdec.serve import ServeOptions
    from specdec.serve.ray import connect, deploy
    from specdec.serve.replicas import EngineSpec, parse_replicas

    owns = connect(None)  # a new local cluster; or connect("auto") / connect("HOST:6379")
    fleet = deploy(EngineSpec("qwen2.5-coder-1.5b", "lookup+qwen2.5-coder-0.5b", dtype="int8"),
                   ServeOptions(served_names=("coder",), max_batch=4), parse_replicas("2"), port=8000)
    ...  # http://127.0.0.1:8000/v1
    fleet.stop(shutdown_ray=owns)

``deploy`` also takes, instead of an EngineSpec, a function that returns an Engine (called once in
each replica), for engines built from objects of your own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve

from specdec.errors import SpecdecError
from specdec.runtime.engine import Engine
from specdec.serve import ServeOptions
from specdec.serve.app import create_app
from specdec.serve.metrics import merge_replicas
from specdec.serve.replicas import EngineSpec, ReplicaPlan, deployment_options

APP_NAME = "specdec"  # the Serve application (and deployment) name
NAMESPACE = "specdec"  # the Ray namespace of the board actor
REPLICA_HEADER = "x-specdec-replica"
POST_S = 1.0  # how often a replica posts its health and metrics to the board
STALE_S = 5.0  # a replica not heard of for this long has gone (dead or stopped)
BOARD_TIMEOUT_S = 5.0  # the most /health or /metrics wait for the board

log = logging.getLogger("specdec.serve")


@ray.remote(num_cpus=0)
class Board:
    """Each replica's latest health and /metrics page, as the replicas post them."""

    def __init__(self) -> None:
        self.posts: dict[str, tuple[float, dict[str, Any], bytes]] = {}  # replica -> (when, health, page)

    def post(self, replica: str, health: dict[str, Any], page: bytes) -> None:
        self.posts[replica] = (time.monotonic(), health, page)

    def remove(self, replica: str) -> None:
        self.posts.pop(replica, None)

    def read(self) -> dict[str, tuple[dict[str, Any], bytes]]:
        """{replica: (health, page)} for the replicas heard of within STALE_S; each health says how
        long ago that was (seen_s)."""
        now = time.monotonic()
        for replica in [r for r, (when, _, _) in self.posts.items() if now - when > STALE_S]:
            del self.posts[replica]
        return {r: ({**health, "seen_s": round(now - when, 1)}, page) for r, (when, health, page) in self.posts.items()}


def board_name(app_name: str) -> str:
    return f"board:{app_name}"


class ReplicaFleet:
    """One replica's view of the others (specdec.serve.app.Fleet): it posts its own state to the
    board every POST_S and reads everyone's for /health and /metrics.  Without the board (gone, or
    slow) they show this replica alone."""

    def __init__(self, replica: str, board: Any | None) -> None:
        self.replica, self.board = replica, board
        self.node = ray.util.get_node_ip_address()
        self.worker: Any = None  # the app's Worker, once the app is built
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._post_every_while, name="specdec-board-post", daemon=True)

    def attach(self, worker: Any) -> None:
        """Start posting the state of `worker` (the app's)."""
        self.worker = worker
        if self.board is not None:
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self.board is not None:
            self.board.remove.remote(self.replica)

    def state(self, healthy: bool) -> dict[str, Any]:
        return {"status": "ok" if healthy else "error", "pid": os.getpid(), "node": self.node,
                "running": len(self.worker.active), "waiting": self.worker.jobs.qsize()}

    def _post(self) -> Any:
        assert self.board is not None  # (attach starts the posting thread only with a board)
        return self.board.post.remote(self.replica, self.state(self.worker.alive), self.worker.metrics.render())

    def _post_every_while(self) -> None:
        while not self._stop.wait(POST_S):
            try:
                ray.get(self._post(), timeout=BOARD_TIMEOUT_S)
            except Exception:  # the board is gone or slow: this replica then reports itself alone
                pass

    async def _everyone(self) -> dict[str, tuple[dict[str, Any], bytes]]:
        """Every replica's (health, page), this one's fresh."""
        if self.board is None:
            return {}
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._post().future()), BOARD_TIMEOUT_S)
            return await asyncio.wait_for(asyncio.wrap_future(self.board.read.remote().future()), BOARD_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError):
            return {}

    async def health(self, healthy: bool) -> dict[str, Any]:
        replicas = {replica: health for replica, (health, _) in (await self._everyone()).items()}
        replicas[self.replica] = {**self.state(healthy), "seen_s": 0.0}
        return {"replica": self.replica, "replicas": dict(sorted(replicas.items()))}

    async def metrics(self, own: bytes) -> bytes:
        pages = {replica: page for replica, (_, page) in (await self._everyone()).items()}
        pages[self.replica] = own
        return merge_replicas(pages)


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that answered it."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class SpecdecReplica:
    """A replica: its engine, and create_app's app over it (built by Serve once __init__ is done)."""

    def __init__(self, engine: EngineSpec | Callable[[], Engine], options: ServeOptions, board: str | None) -> None:
        import transformers

        transformers.logging.set_verbosity_error()  # no warnings or progress bars in the replicas' logs
        transformers.utils.logging.disable_progress_bar()
        self.engine = Engine.from_config(engine) if isinstance(engine, EngineSpec) else engine()
        self.options = options
        self.replica = serve.get_replica_context().replica_id.unique_id
        handle = None
        if board is not None:
            try:
                handle = ray.get_actor(board, namespace=NAMESPACE)
            except ValueError:  # not there: this replica reports itself alone
                log.warning("the board actor %s is missing: /health and /metrics show one replica", board)
        self.fleet = ReplicaFleet(self.replica, handle)
        self.worker: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.engine, self.options, fleet=self.fleet, host_cancels=True)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        self.worker = app.state.worker
        self.fleet.attach(self.worker)
        return app

    def check_health(self) -> None:
        """Serve's periodic check: a replica whose worker threads stopped is replaced."""
        if self.worker is not None and not self.worker.alive:
            raise RuntimeError("the worker thread has stopped")

    def __del__(self) -> None:
        fleet = getattr(self, "fleet", None)  # None: __init__ failed (loading the engine)
        if fleet is not None:
            fleet.close()


def available_cpus() -> int:
    """The CPUs this process may run on (a local cluster gets them all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def connect(address: str | None, num_cpus: int | None = None, temp_dir: str | None = None) -> bool:
    """Ray for the replicas: a new cluster of this machine alone (`address` None, with
    `num_cpus`, default all; no dashboard), or the running cluster at `address` ("auto", "HOST:PORT",
    "ray://HOST:10001").  The replicas' logs stay in Ray's log files (``<temp dir, default
    /tmp/ray>/session_latest/logs/serve/`` on each node), not on this terminal.
    True when this call started a cluster of its own, to shut down with the
    fleet (Fleet.stop(shutdown_ray=True)); False otherwise (also when already connected)."""
    if ray.is_initialized():
        return False
    if address is None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local cluster phones nowhere
        if "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ:
            # Ray turns token authentication on for a local cluster; give it a token of its own, in
            # the environment the cluster's processes inherit, rather than one written to ~/.ray.
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        ray.init(address="local", num_cpus=num_cpus or available_cpus(), include_dashboard=False,
                 _temp_dir=temp_dir, logging_level=logging.WARNING, log_to_driver=False)
        return True
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        hint = "" if os.environ.get("RAY_AUTH_MODE") else (
            " (a cluster with token authentication needs RAY_AUTH_MODE=token and its token here too)")
        raise SpecdecError(f"cannot connect to the Ray cluster at {address}: {first_line(str(e))}{hint}") from None
    return False


@dataclass
class Fleet:
    """A deployed application: its URL; stop() deletes it."""

    url: str
    app_name: str = APP_NAME

    def stop(self, shutdown_ray: bool = False) -> None:
        """Delete the application and its board; with `shutdown_ray` (a cluster this process
        started: connect() said True), shut down Serve and Ray instead."""
        if shutdown_ray:  # the whole cluster goes: the replicas, the proxies and Serve's controller with it
            ray.shutdown()
            return
        try:
            serve.delete(self.app_name)
        finally:
            try:
                ray.kill(ray.get_actor(board_name(self.app_name), namespace=NAMESPACE))
            except ValueError:  # not there
                pass


def deploy(engine: EngineSpec | Callable[[], Engine], options: ServeOptions, plan: ReplicaPlan,
           host: str = "127.0.0.1", port: int = 8000, app_name: str = APP_NAME) -> Fleet:
    """Deploy the server as `plan`'s replicas on the connected Ray cluster, Serve's proxies on
    host:port (on a cluster already running Serve, its proxies stay where they are); returns once
    every replica has loaded its engine.  A SpecdecError when they cannot start (the application
    is deleted then, as on an interrupt)."""
    serve.start(http_options={"host": host, "port": port})
    board = board_name(app_name)
    # (@ray.remote makes Board an actor class, with options(); ray's types keep the plain class: the ignore)
    Board.options(  # type: ignore[attr-defined]
        name=board, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()
    # Serve holds the waiting requests; a replica's own queue only needs room for those it runs.
    replica_options = replace(options, max_queue=options.max_batch)
    # (serve.deployment on a class gives a Deployment, with options(); ray's types do not say so.  Any, not an
    # ignore: without ray installed, serve is Any and an ignore here would be unused)
    declared: Any = serve.deployment(SpecdecReplica, name=app_name)
    deployment = declared.options(**deployment_options(plan, options.max_batch, options.max_queue))
    try:
        serve.run(deployment.bind(engine, replica_options, board), name=app_name, route_prefix="/")
    except BaseException as e:  # a replica that could not start (its traceback is in the deployment's status), or Ctrl-C
        detail = str(e)
        try:
            status = serve.status().applications.get(app_name)
            detail += "".join("\n" + d.message for d in status.deployments.values()) if status else ""
        except Exception:  # no status to be had: the error alone, then
            pass
        Fleet("", app_name).stop()
        if not isinstance(e, Exception):
            raise
        raise SpecdecError(f"the replicas could not start: {replica_error(detail)}") from None
    shown = f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)
    return Fleet(f"http://{shown}:{port}", app_name)


def replica_error(text: str) -> str:
    """The message of the last SpecdecError in a replica's traceback, else the text's last line."""
    found = re.findall(r"SpecdecError: (.+)", text)
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def serve_until_stopped(engine: EngineSpec, options: ServeOptions, plan: ReplicaPlan, host: str, port: int,
                        address: str | None, announce: Callable[[str], None]) -> None:
    """The CLI's --replicas: connect, deploy, announce the URL, serve until Ctrl-C or SIGTERM, then
    delete the application (and shut down a cluster of our own)."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the URL line says what its INFO lines say
    owns = connect(address)
    stopped = threading.Event()
    try:
        fleet = deploy(engine, options, plan, host, port)
    except BaseException:
        if owns:
            serve.shutdown()
            ray.shutdown()
        raise
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        announce(fleet.url)
        while not stopped.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        fleet.stop(shutdown_ray=owns)
