"""`kind: python`: a sync or async callable; its type hints give the parameters schema."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict, ValidationError, create_model

from proxy.callables import CallThreads, awaited, is_async
from proxy.engine.values import ToolContext
from proxy.tools.base import BadArguments, Invoke


def _arguments_model(func: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    """The model of a callable's keyword arguments (a function, a `functools.partial`, an
    object with `__call__`) and its JSON schema; ValueError when the model cannot be called
    by keyword or its parameters have no JSON schema."""
    try:  # annotations written as strings (`from __future__ import annotations`) resolved
        parameters = inspect.signature(func, eval_str=True).parameters
    except (TypeError, ValueError, NameError, AttributeError, SyntaxError) as exc:
        raise ValueError(f"its parameters cannot be read: {exc}") from None
    fields: dict[str, Any] = {}
    extra: Literal["allow", "forbid"] = "forbid"
    for name, param in parameters.items():
        if param.kind is param.POSITIONAL_ONLY:
            raise ValueError(f"its parameter {name!r} is positional-only: a tool is called by name")
        if param.kind is param.VAR_KEYWORD:
            extra = "allow"  # `**kwargs` takes the arguments not named
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (annotation, default)
    called = getattr(func, "__name__", None) or type(func).__name__
    try:
        model = create_model(f"{called}_arguments", __config__=ConfigDict(extra=extra), **fields)
        schema = model.model_json_schema()
    except Exception as exc:  # pydantic's errors for a type it has no schema of
        said = str(exc).strip().splitlines()[0]
        raise ValueError(f"its parameters have no JSON schema: {said}") from None
    return model, schema


def python_tool(
    func: Callable[..., Any], threads: CallThreads
) -> tuple[Invoke, dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]]]:
    """The invoke, the parameters schema and the argument validator of a callable; a sync
    callable runs in one of `threads`. ValueError when it cannot be a tool."""
    model, schema = _arguments_model(func)
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)

    def validate(arguments: dict[str, Any]) -> dict[str, Any]:
        try:  # its fields as they are (iterating the model instead costs four times more)
            checked = model.model_validate(arguments)
            return {**checked.__dict__, **(checked.__pydantic_extra__ or {})}
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "arguments"
            raise BadArguments(f"invalid arguments at {where}: {first['msg']}") from None

    # Which way it runs is known once (asking on each call costs more than the call's own
    # layer): async on the loop, sync in one of the threads.
    if is_async(func):

        async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> Any:
            return await awaited(func(**arguments))

    else:

        async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> Any:
            return await threads.run(func, **arguments)

    return invoke, schema, validate
