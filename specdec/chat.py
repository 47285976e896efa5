"""OpenAI chat requests through a chat template: messages of every role (tool calls and tool results among them)
and the request's ``tools``, rendered as transformers renders them.

:func:`text.chat_ids` takes plain (role, content) turns; :func:`openai_chat_ids` takes what an OpenAI chat request
carries: ``messages`` with the roles system, developer (rendered as system), user, assistant and tool, an
assistant message's ``tool_calls`` (id, function name, arguments as a JSON string) and a tool message's
``tool_call_id``, and ``tools`` ([{"type": "function", "function": {name, description, parameters}}]).  Each
is checked here (a fault is one line, a ChatTemplateError the server answers with a 400) and put in the shape
chat templates read: a tool call's arguments as an object (Qwen's and Llama's templates write them with
``tojson``), text parts joined into one string, a missing content left out.  A template that does not mention
``tools`` cannot show the model its tools: a request with tools is refused there rather than rendered without them.

On the ground floor (tests/test_structure.py), beside specdec.text: no torch, no transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.text import ChatTemplateError, chat_ids

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(message: Mapping[str, Any], where: str) -> str | None:
    """A message's content as one string (OpenAI's list of text parts joined), or None where it has none."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatTemplateError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                        "are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string, a list of text parts or null")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """One of an assistant message's ``tool_calls`` in the template's shape: the arguments parsed into an object."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise ChatTemplateError(f"{where}: a tool call is {{\"id\": ..., \"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"arguments\": ...}}")
    name, arguments = function.get("name"), function.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ChatTemplateError(f"{where}.function.name must be a non-empty string")
    if isinstance(arguments, str):  # OpenAI's shape: the arguments' JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{where}.function.arguments is not JSON ({e})") from None
    if not isinstance(arguments, Mapping):
        raise ChatTemplateError(f"{where}.function.arguments must be a JSON object")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI chat `messages`, checked, in the shape chat templates read (see the module doc)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where} must be an object with a role")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {', '.join(ROLES)} (got {role!r})")
        # OpenAI's newer name for the system role, which templates do not know (Qwen's would drop the turn)
        turn: dict[str, Any] = {"role": "system" if role == "developer" else role}
        content = _content(message, where)
        if content is not None:  # left out, not None: a template tests `message.content` as it would a missing one
            turn["content"] = content
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise ChatTemplateError(f"{where}.tool_calls: a list, on an assistant message only")
            turn["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif content is None:
            raise ChatTemplateError(f"{where} ({role}) needs a content" + (" or tool_calls" if role == "assistant" else ""))
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ChatTemplateError(f"{where} (tool) needs the tool_call_id it answers")
            turn["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            turn["name"] = message["name"]
        out.append(turn)
    return out


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """A request's `tools`, checked: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    (parameters: a JSON schema object)."""
    if not isinstance(tools, list):
        raise ChatTemplateError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type") != "function":
            raise ChatTemplateError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError(f"tools[{i}].function.name must be a non-empty string")
        if name in names:
            raise ChatTemplateError(f"tools: the function name {name!r} is given twice")
        names.add(name)
        if not isinstance(function.get("parameters", {}), Mapping):
            raise ChatTemplateError(f"tools[{i}].function.parameters must be a JSON schema object")
    return [dict(t) for t in tools]


def renders_tools(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template can show the model its tools (its source names ``tools``)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def openai_chat_ids(tokenizer: Any, messages: Sequence[Any], tools: Any = None, name: str = "") -> list[int]:
    """An OpenAI chat request's `messages` and `tools` through `tokenizer`'s chat template, the assistant's turn
    opened: token ids, as ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)`` gives them
    in transformers.  A ChatTemplateError (one line) for a malformed message or tool, a tokenizer without a
    template, a template that cannot render tools when some are given, or one that refuses the conversation."""
    turns = template_messages(messages)
    listed = check_tools(tools) if tools else None  # an empty list: no tools, as OpenAI reads it
    if listed is not None and getattr(tokenizer, "chat_template", None) and not renders_tools(tokenizer):
        target = f"target '{name}'" if name else "the target"
        raise ChatTemplateError(f"the chat template of {target} cannot render tools: send the request without tools")
    return chat_ids(tokenizer, turns, name, tools=listed)
