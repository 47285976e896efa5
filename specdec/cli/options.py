"""The commands' options made from a config's fields, declared once there: RequestConfig's request options
(request_options) and EngineConfig's model options (engine_options), each put in place of one parameter of the
command, which is called with the config they make.  A value the config refuses is a one-line error naming its
flag."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import typer

from specdec.cli.common import fail
from specdec.engine_config import EngineConfig, engine_fields
from specdec.errors import SpecdecError
from specdec.request import Option, RequestConfig, RequestError, cli_fields, field_type


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
