"""`kind: python`: a sync or async callable; its type hints give the parameters schema."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from pydantic import ConfigDict, ValidationError, create_model

from proxy.callables import CallThreads, awaited
from proxy.engine.values import ToolContext
from proxy.tools.base import BadArguments, Invoke


def _arguments_model(func: Callable[..., Any]) -> Any:
    fields: dict[str, Any] = {}
    for name, param in inspect.signature(func).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (annotation, default)
    config = ConfigDict(extra="forbid")
    return create_model(f"{func.__name__}_arguments", __config__=config, **fields)


def python_tool(
    func: Callable[..., Any], threads: CallThreads
) -> tuple[Invoke, dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]]]:
    """The invoke, the parameters schema and the argument validator of a callable; a sync
    callable runs in one of `threads`."""
    model = _arguments_model(func)
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)

    def validate(arguments: dict[str, Any]) -> dict[str, Any]:
        try:  # its fields as they are (iterating the model instead costs four times more)
            return dict(model.model_validate(arguments).__dict__)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "arguments"
            raise BadArguments(f"invalid arguments at {where}: {first['msg']}") from None

    # Which way it runs is known once (asking on each call costs more than the call's own
    # layer): async on the loop, sync in one of the threads.
    if inspect.iscoroutinefunction(func):

        async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> Any:
            return await awaited(func(**arguments))

    else:

        async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> Any:
            return await threads.run(func, **arguments)

    return invoke, schema, validate
