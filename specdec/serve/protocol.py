"""Request bodies of the OpenAI-compatible API, and the OpenAI-style error every refusal answers with.

A body is parsed strictly (a string where a number belongs is an error, not a conversion); fields
this server does not know are ignored, as OpenAI clients send some we have no use for (``user``,
``metadata``, ``store``, ``service_tier``...: HARMLESS); fields OpenAI defines whose meaning it cannot honour
(n > 1, audio, functions...: UNSERVED) are refused with a 400 naming them rather than silently dropped.
Penalties, logit_bias and logprobs are served (specdec.algorithm.processors, specdec.algorithm.logprobs); so are
``response_format`` and the other projects' fields that constrain the output (CONSTRAINTS: llama-server's
``json_schema`` and ``grammar``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar``; at most one a
request: specdec.constrain.Constraint), and on chat completions ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (specdec.serve.tools), with messages of role ``tool`` and assistant ``tool_calls``.

The extension: ``"speculative": {"enabled": true, "k": 3 | "auto", ...}`` -- whether the request drafts
at all, how many tokens per step, and any other option of specdec.request.RequestConfig marked
per-request (draft_mode, draft_confidence, verify...); what a request leaves out (or sends as null,
where null is not a value of the option) is the server's default (``specdec serve -k`` etc.).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specdec.constrain.spec import Constraint
from specdec.errors import SpecdecError
from specdec.request import RequestError, message_text, served_fields

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_TOP_LOGPROBS = 20  # (specdec.request's)
# OpenAI's fields that this server reads nothing of and that change nothing a client relies on: ignored.
HARMLESS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# OpenAI's fields whose meaning this server cannot honour: a 400 naming them when set to anything but their
# neutral value (null, false, [], {} or, for modalities, ["text"]).  n, best_of, echo and suffix are checked
# on their own (their neutral values are 1, 1, false and "").
UNSERVED = ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
            "reasoning_effort", "verbosity")
# the tool fields: served on chat completions (specdec.serve.tools), refused like UNSERVED on completions
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
# the fields that constrain the output (at most one a request): OpenAI's, llama-server's, vLLM's
CONSTRAINTS = ("response_format", "json_schema", "grammar", "guided_json", "guided_regex", "guided_grammar")


class APIError(Exception):
    """A refusal: an HTTP status and the body {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
             422: "invalid_request_error", 503: "server_overloaded", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def speculative_changes(given: dict[str, Any]) -> dict[str, Any]:
    """A request's "speculative" object -> RequestConfig field changes.  A RequestError (its field the
    key as sent) for a key no request may set, a value of the wrong JSON type, or one over the
    server's limit; the values themselves are RequestConfig's to check."""
    fields = served_fields()
    changes = {}
    for key, value in given.items():
        if key not in fields:
            raise RequestError(key, f"is not an option a request may set; expected one of {', '.join(fields)}")
        f, option = fields[key]
        kinds = typing.get_args(option.json_type) or (option.json_type,)
        if value is None and type(None) not in kinds:
            continue  # null: the server's default
        if not any(json_is(value, kind) for kind in kinds):
            raise RequestError(key, f"must be {' or '.join(JSON_NAMES[kind] for kind in kinds)}, "
                                    f"got {type(value).__name__}")
        limit = option.server_max
        if limit is not None and json_is(value, float) and value > limit:
            raise RequestError(key, f"must be at most {limit} on this server, got {value}")
        changes[f.name] = value
    return changes


JSON_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def json_is(value: Any, kind: type) -> bool:
    """Whether a parsed JSON value is of `kind`: a bool is no number, an integer is a float."""
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 = off (vLLM's and llama.cpp's convention)
    seed: int | None = None
    stop: Any = Field(None, validate_default=True)  # a string or a list of strings (-> a tuple)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    speculative: dict[str, Any] | None = None  # the extension (speculative_changes)
    presence_penalty: float | None = None  # -2..2 (specdec.request.RequestConfig checks the ranges)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension: > 0, 1 = off
    logit_bias: dict[str, Any] | None = None  # {"token id": bias in -100..100}
    # completions: an integer 0..20 (the alternatives per token); chat: true / false, with top_logprobs
    logprobs: Any = None
    best_of: int | None = None
    echo: bool | None = None
    # CONSTRAINTS (constraint()): what the output must be
    response_format: Any = None  # OpenAI's: {"type": "text" | "json_object" | "json_schema" | "regex" | "grammar"}
    json_schema: Any = None  # llama-server's: a JSON schema object
    grammar: Any = None  # llama-server's: a GBNF grammar
    guided_json: Any = None  # vLLM's: a JSON schema (an object, or its JSON text)
    guided_regex: Any = None  # vLLM's: a regex
    guided_grammar: Any = None  # vLLM's: a GBNF grammar (with "::="), else a Lark one
    # TOOL_FIELDS: served on chat completions (ChatRequest), refused on completions
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # UNSERVED: whatever they hold, refused unless neutral (refuse_unsupported)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters long")
        return tuple(stops)

    def refuse_unsupported(self) -> None:
        """A 400 for a field whose meaning this server would silently drop."""
        if self.n is not None and self.n != 1:
            raise APIError(400, f"n must be 1: this server returns one choice per request (send n copies of the "
                                f"request for more), got {self.n}", "n", "unsupported_value")
        if self.best_of is not None and self.best_of != 1:
            raise APIError(400, "best_of is not supported (it must be 1)", "best_of", "unsupported_value")
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo", "unsupported_value")
        for name in UNSERVED:
            value = getattr(self, name)
            if value in (None, False, [], {}) or (name == "modalities" and value == ["text"]):
                continue
            raise APIError(400, f"{name} is not supported by this server", name, "unsupported_value")

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token the request asks for: None (no logprobs) or 0..20; an APIError
        naming the field for a value out of range or of the wrong type."""
        raise NotImplementedError

    def constraint_field(self) -> str | None:
        """The one field of CONSTRAINTS the request sets (response_format {"type": "text"} is none), or None; a
        400 naming the second where two are set."""
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None
                 and not (name == "response_format" and isinstance(self.response_format, dict)
                          and self.response_format.get("type") == "text")]
        if len(given) > 1:
            raise APIError(400, f"{given[0]} and {given[1]} both constrain the output: send one of them", given[1],
                           "invalid_value")
        return given[0] if given else None

    def constraint(self) -> tuple[Constraint | None, str | None]:
        """What the request's output must be (specdec.constrain.Constraint; None: free text) and the field that
        says so; a 400 naming the field for a malformed one.  The grammar itself is compiled later (a bad schema
        is a 400 then too: specdec.serve.app)."""
        name = self.constraint_field()
        if name is None:
            return None, None
        value = getattr(self, name)
        try:
            if name == "response_format":
                return Constraint.from_response_format(value), name
            if name in ("json_schema", "guided_json"):  # not strict: a keyword the library cannot enforce is ignored
                if name == "guided_json" and isinstance(value, str):
                    return Constraint("json_schema", value, strict=False), name
                if not isinstance(value, dict):
                    raise SpecdecError("must be a JSON schema (an object)")
                return Constraint.json_schema(value, strict=False), name
            if not isinstance(value, str) or not value:
                raise SpecdecError("must be a non-empty string")
            if name == "guided_regex":
                return Constraint("regex", value), name
            # llama-server's grammar is GBNF; vLLM's guided_grammar is GBNF where it has rules ("::="), else Lark
            return Constraint("gbnf" if name == "grammar" or "::=" in value else "lark", value), name
        except SpecdecError as e:
            message = str(e)
            raise APIError(400, message if message.startswith(name) else f"{name}: {message}", name,
                           "invalid_value") from None


class CompletionRequest(GenerationRequest):
    prompt: Any  # a string, a list of one string, or a list of token ids
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]  # a batch of one
        # its shape only: an empty one is refused as every prompt is, once tokenized (specdec.text.check_prompt)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        raise ValueError("must be a string or a list of token ids (one prompt per request)")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix", "unsupported_value")
        for name in TOOL_FIELDS:
            if getattr(self, name) not in (None, False, [], {}):
                raise APIError(400, f"{name} is served on /v1/chat/completions only", name, "unsupported_value")

    def top_logprobs_asked(self) -> int | None:
        """logprobs: null, or an integer 0..20 (OpenAI's legacy completions take up to 5; vLLM more)."""
        value = self.logprobs
        if value is None:
            return None
        if not json_is(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {value!r}", "logprobs",
                           "invalid_value")
        return int(value)


class Message(BaseModel):
    """A chat message: its role and text, and for tool use an assistant's ``tool_calls`` and a tool result's
    ``tool_call_id`` (their shapes are specdec.chat's to check, which renders them)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]  # specdec.chat.ROLES
    content: str | None = None  # a string, a list of {"type": "text", "text": ...} parts (joined), or null
    tool_calls: list[Any] | None = None  # an assistant's: [{"id", "type": "function", "function": {name, arguments}}]
    tool_call_id: str | None = None  # a tool result's: the call it answers
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        text = message_text(value)
        if text is None:
            raise ValueError("must be a string or a list of text parts ({'type': 'text', 'text': ...})")
        return None if value is None else text

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)

    def openai(self) -> dict[str, Any]:
        """The message as specdec.chat.openai_chat_ids takes it."""
        return {name: value for name, value in (("role", self.role), ("content", self.content),
                                                ("tool_calls", self.tool_calls), ("tool_call_id", self.tool_call_id),
                                                ("name", self.name)) if value is not None}


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    top_logprobs: int | None = None  # 0..20 alternatives per token, with logprobs: true

    @property
    def uses_tools(self) -> bool:
        """Whether the prompt is rendered with specdec.chat (tools given, or tool calls and results among the
        messages); plain (role, content) turns else."""
        return bool(self.tools) or any(m.uses_tools for m in self.messages)

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the answer's tool calls are read into tool_calls: tools given, tool_choice not "none", and the
        output not held to a response_format (or another constraint) of its own."""
        return bool(self.tools) and self.tool_choice != "none" and self.constraint_field() is None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.parallel_tool_calls is not None and not isinstance(self.parallel_tool_calls, bool):
            raise APIError(400, f"parallel_tool_calls must be true or false, got {self.parallel_tool_calls!r}",
                           "parallel_tool_calls", "invalid_value")
        if self.tool_choice is not None and not self.tools:  # as OpenAI answers it
            raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice", "invalid_value")

    def top_logprobs_asked(self) -> int | None:
        """logprobs: true (with top_logprobs 0..20, default 0) or false / null; top_logprobs without logprobs is
        refused, as OpenAI does."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise APIError(400, f"logprobs must be true or false, got {self.logprobs!r}", "logprobs", "invalid_value")
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {top}", "top_logprobs",
                           "invalid_value")
        if not self.logprobs:
            if top:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
            return None
        return top or 0


def parse(model: type[BaseModel], body: bytes) -> Any:
    """A request model from a JSON body; an APIError (400) naming the first bad field.

    One pass of pydantic's JSON parser (jiter), which also bounds the nesting: a body nested
    deeper than about 200 levels is refused as invalid JSON, never parsed by recursion."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "json_invalid":  # not JSON, not UTF-8, nested too deep, a number too large...
            reason = error["msg"].removeprefix("Invalid JSON: ")
            raise APIError(400, f"the body is not valid JSON: {reason}", None, "invalid_json") from None
        if error["type"] == "model_type" and not error["loc"]:
            raise APIError(400, "the body must be a JSON object", None, "invalid_json") from None
        param = field_path(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param or None, "invalid_value") from None
    except RecursionError:  # a validator recursing into a nested value: refused like any bad body
        raise APIError(400, "the body nests too deeply", None, "invalid_json") from None


def field_path(loc: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
