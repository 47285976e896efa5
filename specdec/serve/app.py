"""The HTTP side: FastAPI routes in OpenAI's shapes, between clients and the worker.

A thin layer: parse and check a request (every limit before it is queued), tokenize it off the
event loop, queue it for the worker, and turn the worker's per-step events into an OpenAI response
or a stream of server-sent events.  Models are named on the command line only: a request's `model`
must be one of the served names, and nothing in a request can load anything.  Who may call the
API (keys, JSON-only bodies, CORS) is specdec.serve.access's, checked before a body is read.

Each streamed chunk carries, beside OpenAI's fields, ``"specdec": {"drafted", "accepted",
"emitted", "accepted_text"}``: that decode step's draft tokens proposed, how many of its emitted
tokens were accepted draft tokens (the rest came from the target itself), how many tokens it
emitted, and which leading part of the chunk's text came from the accepted ones.  The chunk that
finishes, the usage chunk (``stream_options.include_usage``) and every non-streamed response carry
``"speculative_decoding"``: the request's drafted / accepted counts, acceptance_rate,
mean_accepted_per_step and so on.  OpenAI clients ignore fields they do not know.

What a request constrains its output to (``response_format`` and the other CONSTRAINTS of
specdec.serve.protocol, or a ``tool_choice`` that forces a call: specdec.serve.tools) is compiled before the
request is queued, so that a bad schema or grammar is a 400 naming its field.  A chat request with ``tools`` is
rendered with them (specdec.chat.openai_chat_ids) and, unless its tool_choice is "none", its answer's tool calls
are read into ``message.tool_calls`` (streamed: specdec.serve.tools.ToolCallStream's deltas, one chunk a step).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from importlib import resources
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdec.algorithm.logprobs import TokenLogprob
from specdec.algorithm.loop import Stats
from specdec.chat import check_tools, openai_chat_ids, renders_tools
from specdec.constrain.spec import Constraint
from specdec.errors import SpecdecError
from specdec.request import RequestError, served_fields
from specdec.runtime.engine import Engine
from specdec.serve import ServeOptions
from specdec.serve.access import allow_origins, check_json, check_key
from specdec.serve.metrics import Metrics
from specdec.serve.protocol import APIError, ChatRequest, CompletionRequest, GenerationRequest, parse, speculative_changes
from specdec.serve.tools import ToolCallStream, chosen_tools, merged_delta, parse_tool_calls, tool_call_lark
from specdec.serve.worker import SHUTTING_DOWN, ErrorEvent, Job, OverBudget, QueueFull, Request, StepEvent, Worker
from specdec.text import ChatTemplateError, PromptError
from specdec.vocab import decoded

DISCONNECT_POLL_S = 0.1  # how often a request waiting for its next event checks that its client is still there
CLIENT_GONE = 499  # the status logged for a request whose client left (nginx's convention)


class Fleet(Protocol):
    """The other servers behind the same address (Ray Serve replicas: specdec.serve.ray), which
    /health and /metrics report beside this one."""

    async def health(self, healthy: bool) -> dict[str, Any]:
        """Fields added to /health's body, this server's own state being `healthy`."""

    async def metrics(self, own: bytes) -> bytes:
        """The /metrics page for all of them, this server's own page being `own`."""


def create_app(engine: Engine, options: ServeOptions = ServeOptions(), fleet: Fleet | None = None,
               host_cancels: bool = False) -> FastAPI:
    """An app serving `engine`; its worker thread runs while the app runs (its lifespan).
    With a `fleet`, /health and /metrics also report the servers beside this one.  `host_cancels`:
    the server running the app (Ray Serve) cancels the handler of a client that left, so a handler
    does not look for the disconnect itself (see :func:`next_event`)."""
    worker = Worker(engine, max_queue=options.max_queue, max_batch=options.max_batch, defaults=options.defaults,
                    memory_budget=options.memory_budget)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    allow_origins(app, options.allowed_origins)
    add_error_handlers(app)
    add_status_routes(app, engine, options, worker, fleet)
    add_generation_routes(app, Generations(engine, options, worker, host_cancels))
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's shape, whatever raised it: ours, routing (404, 405), or a bug (500)."""

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return error_response(APIError(e.status_code, str(e.detail), None, code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: HTTPRequest, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, str(e), None, "invalid_value"))

    @app.exception_handler(Exception)
    async def internal_error(_: HTTPRequest, e: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(e).__name__}", None, "internal_error"))


def add_status_routes(app: FastAPI, engine: Engine, options: ServeOptions, worker: Worker, fleet: Fleet | None) -> None:
    """The routes that answer without generating: the playground page (/), /health, /metrics and
    /v1/models; /health and /metrics also report the `fleet`'s servers where there is one."""
    metrics = worker.metrics

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        return HTMLResponse(resources.files("specdec.serve").joinpath("static/index.html").read_text("utf-8"))

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = worker.alive
        body: dict[str, Any] = {"status": "ok"} if alive else {
            "status": "error", "message": "the worker thread has stopped"}
        if fleet is not None:
            body.update(await fleet.health(alive))
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics_page(http: HTTPRequest) -> Response:
        if options.metrics_need_key:
            check_key(http.headers, options.api_keys)
        page = metrics.render()
        if fleet is not None:
            page = await fleet.metrics(page)
        return Response(page, media_type=metrics.content_type)

    server_k = options.defaults.k if isinstance(options.defaults.k, (int, str)) else "auto"

    @app.get("/v1/models")
    async def models(http: HTTPRequest) -> JSONResponse:
        check_key(http.headers, options.api_keys)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "specdec",
             "target": engine.target_name, "draft": engine.draft_name if engine.can_draft else None,
             "k": server_k}  # the server's -k: what a request that does not name one drafts with
            for name in options.served_names]})


def add_generation_routes(app: FastAPI, generations: Generations) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        return await generations.generate(http, "/v1/completions", CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        return await generations.generate(http, "/v1/chat/completions", ChatRequest)


class Generations:
    """The generation endpoints of one app: a request checked, tokenized (off the event loop), queued
    for the worker, and its events turned into a response; every request counted by endpoint and code."""

    def __init__(self, engine: Engine, options: ServeOptions, worker: Worker, host_cancels: bool) -> None:
        self.engine = engine
        self.options = options
        self.worker = worker
        self.metrics = worker.metrics
        self.host_cancels = host_cancels  # see create_app
        self.encode_lock = threading.Lock()  # one tokenization at a time, off the event loop

    async def generate(self, http: HTTPRequest, endpoint: str, model: type[GenerationRequest]) -> Response:
        metrics = self.metrics
        code, queued = 200, False
        try:
            req, gen, job = await self.admit(http, model)
            queued = True
            watched = None if self.host_cancels else http  # whose disconnect next_event looks for
            first = await next_event(job, watched)
            if first is None:
                code = CLIENT_GONE
                return Response(status_code=CLIENT_GONE)
            if isinstance(first, ErrorEvent):
                raise event_error(first)
            reply = Reply(endpoint, req.model, gen, len(gen.prompt_ids), req.stream_options is not None
                          and req.stream_options.include_usage, self.token_text,
                          tool_calls=isinstance(req, ChatRequest) and req.parses_tool_calls)
            if req.stream:
                return StreamingResponse(stream(reply, job, first, metrics), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            result = await collect(reply, job, first, watched)
            if result is None:
                code = CLIENT_GONE
                return Response(status_code=CLIENT_GONE)
            return JSONResponse(result)
        except APIError as e:
            code = e.status
            if not queued:  # refused before it ran: counted by reason
                metrics.record_refusal(e.code)
            raise
        except asyncio.CancelledError:  # cancelled from outside: Ray Serve does so when the client leaves
            code = CLIENT_GONE
            raise
        except ClientDisconnect:  # the client left (or its body broke off) before the whole body came
            code = CLIENT_GONE
            return Response(status_code=CLIENT_GONE)
        except Exception:  # a bug: internal_error() answers it with a 500, which is what is counted
            code = 500
            raise
        finally:
            metrics.requests.labels(endpoint=endpoint, code=str(code)).inc()
            if code == CLIENT_GONE:
                metrics.disconnects.inc()

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it: decoded alone, special tokens included (a token that holds part
        of a character shows U+FFFD, as OpenAI's do)."""
        return decoded(self.engine.tokenizer.decode([token], skip_special_tokens=False))

    async def admit(self, http: HTTPRequest, model: type[GenerationRequest]) -> tuple[GenerationRequest, Request, Job]:
        """The request checked (key, body, fields, model), tokenized and queued: (the parsed request, the
        worker's request, its job); an APIError for anything refused before it is queued."""
        options, worker = self.options, self.worker
        check_key(http.headers, options.api_keys)
        check_json(http.headers)  # before the body is read: a browser's cross-site form post stops here
        body = await read_body(http, options.max_body_bytes)
        req = parse(model, body)
        req.refuse_unsupported()
        if req.model not in options.served_names:
            raise APIError(404, f"model '{req.model}' is not served here; this server serves "
                                f"{', '.join(repr(n) for n in options.served_names)}", "model", "model_not_found")
        prompt_ids = await asyncio.to_thread(self.tokenize, req)
        constraint, param = self.constraint(req)
        gen = self.generation(req, prompt_ids, constraint)
        if constraint is not None:  # compiled now (cached: the engine's stream finds it), off the event loop
            await asyncio.to_thread(self.compile, constraint, param)
        job = Job(gen, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull:
            if worker.closing:
                raise APIError(503, "the server is shutting down", None, SHUTTING_DOWN) from None
            raise APIError(503, f"the server is busy: {options.max_queue} requests are already waiting; "
                                "retry later", None, "queue_full", {"Retry-After": "1"}) from None
        except OverBudget as e:
            raise APIError(413, str(e), None, "memory_budget_exceeded") from None
        return req, gen, job

    def constraint(self, req: GenerationRequest) -> tuple[Constraint | None, str | None]:
        """What the output must be, and the field that asks for it: a constraint field's (GenerationRequest.
        constraint), or a chat's tool_choice of "required" or a named function (the Lark grammar of its calls,
        specdec.serve.tools.tool_call_lark); a 400 for both at once, or a tool_choice naming no tool given."""
        constraint, param = req.constraint()
        if not isinstance(req, ChatRequest) or not req.tools:
            return constraint, param
        try:
            functions = chosen_tools(req.tools, req.tool_choice)
        except SpecdecError as e:
            raise APIError(400, str(e), "tool_choice", "invalid_value") from None
        if functions is None:
            return constraint, param
        if constraint is not None:
            raise APIError(400, f"tool_choice {json.dumps(req.tool_choice)} and {param} both constrain the output: "
                                "send one of them", param, "invalid_value")
        parallel = req.parallel_tool_calls is not False  # OpenAI's default: true
        return Constraint("lark", tool_call_lark(functions, self.engine.tokenizer, parallel)), "tools"

    def compile(self, constraint: Constraint, param: str | None) -> None:
        """`constraint` compiled for the target (Engine.grammar, cached); a 400 naming `param` for one the library
        refuses (a bad schema, regex or grammar; for a tool_choice, a tool's parameters schema), or whose start the
        library cannot follow (a grammar with an empty language, ``start: start``: specdec.constrain.Grammar)."""
        try:
            self.engine.grammar(constraint)
        except SpecdecError as e:
            raise APIError(400, f"{param}: {e}", param, "invalid_value") from None

    def tokenize(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids (through the chat template for a chat request: with its tools, tool calls and
        tool results where it has some, specdec.chat.openai_chat_ids), checked as every prompt is
        (Engine.prompt_ids: specdec.text.check_prompt), and against --max-prompt-tokens."""
        engine, options = self.engine, self.options
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        if isinstance(req, ChatRequest) and req.tools:
            self.check_tools(req)
        with self.encode_lock:
            try:
                if isinstance(req, ChatRequest) and req.uses_tools:
                    ids = engine.prompt_ids(openai_chat_ids(engine.tokenizer, [m.openai() for m in req.messages],
                                                            req.tools or None, engine.target_name))
                elif isinstance(req, ChatRequest):
                    ids = engine.prompt_ids(engine.encode_messages([(m.role, m.content or "") for m in req.messages]))
                else:
                    assert isinstance(req, CompletionRequest)  # the other kind of generation request
                    ids = engine.prompt_ids(req.prompt)
            except ChatTemplateError as e:
                if e.missing:
                    raise APIError(400, f"model '{engine.target_name}' has no chat template: use /v1/completions",
                                   "messages", "no_chat_template") from None
                raise APIError(400, str(e), "messages", "invalid_value") from None
            except PromptError as e:
                raise APIError(400, str(e), param, "context_length_exceeded" if e.too_long else "invalid_value") from None
            except SpecdecError as e:
                raise APIError(400, str(e), None, "invalid_value") from None
        if options.max_prompt_tokens is not None and len(ids) > options.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than this server takes "
                                f"(--max-prompt-tokens {options.max_prompt_tokens})", param, "context_length_exceeded")
        return ids

    def check_tools(self, req: ChatRequest) -> None:
        """A 400 naming tools for malformed ones (specdec.chat.check_tools), or for a target whose chat template
        cannot show the model its tools (rather than a prompt rendered without them)."""
        try:
            check_tools(req.tools)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "tools", "invalid_value") from None
        tokenizer = self.engine.tokenizer
        if getattr(tokenizer, "chat_template", None) and not renders_tools(tokenizer):
            raise APIError(400, f"the chat template of model '{self.engine.target_name}' cannot render tools: "
                                "send the request without tools", "tools", "unsupported_value")

    def generation(self, req: GenerationRequest, prompt_ids: list[int], constraint: Constraint | None = None) -> Request:
        """The worker's request: sampling, limits, speculation and the output's constraint settled."""
        engine, options = self.engine, self.options
        max_tokens, param = req.max_tokens, "max_tokens"
        if isinstance(req, ChatRequest) and max_tokens is None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:  # chat: as much as fits; completions: OpenAI's 16
            max_tokens = (min(options.max_tokens_limit, engine.target_runner.max_context - len(prompt_ids))
                          if isinstance(req, ChatRequest) else options.default_max_tokens)
        if max_tokens <= 0:
            raise APIError(400, f"{param} must be > 0, got {max_tokens}", param, "invalid_value")
        if max_tokens > options.max_tokens_limit:
            raise APIError(400, f"{param} must be at most {options.max_tokens_limit} on this server, "
                                f"got {max_tokens}", param, "invalid_value")
        temperature = 1.0 if req.temperature is None else req.temperature
        given = speculative_changes_of(req)
        if options.defaults.verify == "stairs" and "verify" not in given and temperature > 0:
            raise APIError(400, "this server verifies with stairs, which is greedy only: send temperature 0",
                           "temperature", "invalid_value")
        # speculative only where the engine can draft (a plain engine decodes plainly whatever is asked)
        speculative = engine.can_draft and given.pop("speculative", options.defaults.speculative)
        # what the target's distribution goes through (specdec.algorithm.processors), and the logprobs asked for
        processing = {name: getattr(req, name) for name in PROCESSING if getattr(req, name) is not None}
        try:
            config = replace(options.defaults, max_new_tokens=max_tokens, temperature=temperature,
                             top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
                             seed=req.seed, stop=req.stop, speculative=speculative, constraint=constraint,
                             logprobs=req.top_logprobs_asked(), **processing, **given)
        except RequestError as e:
            if e.field in processing:  # the request's own field: a 400 naming it
                raise APIError(400, str(e), e.field, "invalid_value") from None
            if e.field not in given:
                raise APIError(400, str(e), None, "invalid_value") from None
            raise extension_error(e, wire_name(e.field)) from None
        except SpecdecError as e:
            raise APIError(400, str(e), None, "invalid_value") from None
        vocab = engine.target_runner.vocab_size
        if config.logit_bias and config.logit_bias[-1][0] >= vocab:  # (pairs in id order)
            raise APIError(400, f"logit_bias: token id {config.logit_bias[-1][0]} is not in the vocabulary "
                                f"(0..{vocab - 1})", "logit_bias", "invalid_value")
        return Request(prompt_ids, config)


PROCESSING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")  # requests' own fields


def speculative_changes_of(req: GenerationRequest) -> dict[str, Any]:
    """The RequestConfig changes of the request's "speculative" object; an APIError naming a bad key."""
    try:
        return speculative_changes(req.speculative or {})
    except RequestError as e:
        raise extension_error(e, e.field) from None


def extension_error(e: RequestError, key: str) -> APIError:
    """A 400 for key `key` of the "speculative" object."""
    return APIError(400, f"speculative.{key}: {e.reason}", f"speculative.{key}", "invalid_value")


def wire_name(field_name: str) -> str:
    """A RequestConfig field's key in the "speculative" object."""
    return next(key for key, (f, _) in served_fields().items() if f.name == field_name)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(http: HTTPRequest, limit: int) -> bytes:
    """The request body; a 413 past `limit` bytes (announced or received)."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; this server takes at most {limit}",
                       None, "body_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes, the most this server takes",
                           None, "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def next_event(job: Job, http: HTTPRequest | None) -> StepEvent | ErrorEvent | None:
    """The job's next event; None (and the job cancelled) when the client of `http` has gone meanwhile.

    The client is looked for before each event and every DISCONNECT_POLL_S while one is awaited;
    with `http` None (Ray Serve, which cancels the handler itself) it is not.  Starlette's
    is_disconnected() on Serve's proxied receive could hang there, and the handler then absorbed
    Serve's cancel and left its generation running for nobody.

    A handler cancelled from outside cancels its job too, even when the cancel lands in the same
    turn as the next event (Python 3.11's asyncio.wait_for returns the event then and loses the
    cancel; asyncio.timeout does not)."""
    try:
        if http is None:
            return await job.next_event()
        while not await http.is_disconnected():
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    return await job.next_event()
            except TimeoutError:
                pass
    except asyncio.CancelledError:
        job.cancel()
        raise
    job.cancel()
    return None


class Reply:
    """Builds one request's response objects in OpenAI's shapes."""

    def __init__(self, endpoint: str, model: str, request: Request, prompt_tokens: int, include_usage: bool,
                 token_text: Callable[[int], str] = str, tool_calls: bool = False) -> None:
        """`tool_calls`: read the answer's tool calls into tool_calls (a chat with tools, tool_choice not "none")."""
        self.chat = endpoint.endswith("/chat/completions")
        self.tools = ToolCallStream() if tool_calls else None  # a stream's; a whole answer is parsed at once
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model, self.request, self.prompt_tokens = model, request, prompt_tokens
        self.include_usage = include_usage
        self.token_text = token_text  # a token id's text in logprobs
        self.text_offset = 0  # completions' logprobs: where the next token's text starts in the completion

    def logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """The logprobs object of a choice (or a chunk's) for these tokens, in the endpoint's shape: chat's
        {content: [{token, logprob, bytes, top_logprobs}], refusal}, completions' {tokens, token_logprobs,
        top_logprobs, text_offset}; None where the request did not ask for them."""
        if self.request.config.logprobs is None:
            return None
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                text = self.token_text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            content = [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                       for lp in logprobs]
            return {"content": content, "refusal": None}
        texts = [self.token_text(lp.token) for lp in logprobs]
        offsets = []
        for text in texts:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        top = [{self.token_text(t): v for t, v in lp.top} for lp in logprobs]
        return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": top,
                "text_offset": offsets}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage(self, stats: Stats) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": stats.new_tokens,
                "total_tokens": self.prompt_tokens + stats.new_tokens}

    def speculation(self, stats: Stats) -> dict[str, Any]:
        return {
            "enabled": self.request.config.speculative,
            "k": self.request.config.k if self.request.config.speculative else None,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 6),
            "mean_accepted_per_step": round(stats.mean_accepted_per_step, 6),
            "draft_steps": stats.draft_steps,
            "accepted_per_position": list(stats.accepted_at),
            "target_forwards": stats.target_forwards,
            "tree_drafts": stats.tree_steps,
            "tree_nodes": stats.tree_nodes,
            "by_source": {source: {**counts, "acceptance_rate": round(counts["acceptance_rate"], 6)}
                          for source, counts in stats.acceptance_by_source.items()},
            "tokens_per_second": round(stats.tokens_per_s, 3),
        }

    def chunk(self, event: StepEvent, first: bool) -> dict[str, Any]:
        """One streamed chunk: a decode step's text, with its speculative decoding details."""
        if self.chat:
            finish_reason = event.finish_reason
            if self.tools is None:
                delta: dict[str, Any] = {"content": event.text}
            else:  # the step's text through the tool call parser: content and calls, as far as they are known
                deltas = self.tools.feed(event.text) + (self.tools.finish() if finish_reason is not None else [])
                delta = merged_delta(deltas)
                finish_reason = tool_finish_reason(finish_reason, bool(self.tools.tool_calls))
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(event.logprobs),
                      "finish_reason": finish_reason}
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": event.text, "logprobs": self.logprobs(event.logprobs),
                      "finish_reason": event.finish_reason}
            out = self._envelope("text_completion", [choice])
        out["specdec"] = {"drafted": event.drafted, "accepted": event.accepted, "emitted": event.emitted,
                          "accepted_text": event.accepted_text}
        if event.stats is not None:
            out["speculative_decoding"] = self.speculation(event.stats)
        return out

    def usage_chunk(self, stats: Stats) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out.update(usage=self.usage(stats), speculative_decoding=self.speculation(stats))
        return out

    def whole(self, text: str, finish_reason: str, stats: Stats, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """The non-streamed response."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                parsed = parse_tool_calls(text)
                message["content"] = parsed.content
                if parsed.tool_calls:
                    message["tool_calls"] = parsed.tool_calls
                finish_reason = "tool_calls" if parsed.tool_calls and finish_reason == "stop" else finish_reason
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish_reason}
            out = self._envelope("chat.completion", [choice])
        else:
            out = self._envelope("text_completion", [{"index": 0, "text": text, "logprobs": self.logprobs(logprobs),
                                                      "finish_reason": finish_reason}])
        out.update(usage=self.usage(stats), speculative_decoding=self.speculation(stats))
        return out


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """An answer's finish reason where its tool calls are read: "tool_calls" for one that made some and ended on
    its own (EOS or a stop string); "length" stays (a cut answer may have lost a call)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def event_error(event: ErrorEvent) -> APIError:
    """The OpenAI-shaped error of a request the worker ended with `event` (its status and code)."""
    return APIError(event.status, event.message, None, event.code)


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def stream(reply: Reply, job: Job, event: StepEvent | ErrorEvent, metrics: Metrics) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per decode step, the usage chunk if asked for, then [DONE].
    A client that goes away closes this generator: its job is cancelled (the worker stops within a step)."""
    finished = False
    try:
        first = True
        while True:
            if isinstance(event, ErrorEvent):  # a failure (or the shutdown) after the first token: in the stream
                yield sse({"error": event_error(event).body()["error"]})
                break
            yield sse(reply.chunk(event, first))
            first = False
            if event.finish_reason is not None:
                if reply.include_usage:
                    assert event.stats is not None  # a final event's
                    yield sse(reply.usage_chunk(event.stats))
                break
            event = await job.next_event()
        yield sse("[DONE]")
        finished = True
    finally:
        if not finished:
            job.cancel()
            metrics.disconnects.inc()


async def collect(reply: Reply, job: Job, event: StepEvent | ErrorEvent,
                  http: HTTPRequest | None) -> dict[str, Any] | None:
    """The whole response, from the job's events; None if the client left first."""
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    while True:
        if isinstance(event, ErrorEvent):
            raise event_error(event)
        text.append(event.text)
        logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            assert event.stats is not None  # a final event's
            return reply.whole("".join(text), event.finish_reason, event.stats, logprobs)
        following = await next_event(job, http)
        if following is None:
            return None
        event = following
