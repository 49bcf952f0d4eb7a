"""The server tools of a config, and the executor the engine calls."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import httpx
import orjson

from proxy.callables import CallThreads, NoWorkerFree, load_callable
from proxy.config import Config, ToolConfig
from proxy.engine.values import ToolCall, ToolContext, ToolResult, ToolSpec
from proxy.tools.base import Tool, ToolFailed, as_text, definition, output_too_large
from proxy.tools.builtin import BUILTINS, builtin_invoke
from proxy.tools.http_tool import http_invoke
from proxy.tools.python_tool import python_tool
from proxy.tools.schema import check_schema, schema_validator

OPEN_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


class ToolRegistry:
    """Runs server tools. Tool failures become error results, never exceptions."""

    def __init__(self, tools: Mapping[str, Tool]) -> None:
        self.tools = dict(tools)

    def spec(self, name: str) -> ToolSpec:
        return self.tools[name].spec

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"unknown tool {call.name!r}", "error")
        try:
            arguments = orjson.loads(call.arguments or "{}")
        except orjson.JSONDecodeError as exc:
            return ToolResult(f"arguments are not valid JSON: {exc}", "error")
        if not isinstance(arguments, dict):
            return ToolResult("arguments must be a JSON object", "error")
        try:
            arguments = tool.validate(arguments)
            output = await asyncio.wait_for(tool.invoke(arguments, ctx), tool.timeout_s)
        except TimeoutError:
            return ToolResult(f"tool timed out after {tool.timeout_s:g}s", "timeout")
        except (ToolFailed, NoWorkerFree) as exc:
            return ToolResult(str(exc), "error")
        except Exception as exc:
            return ToolResult(f"{type(exc).__name__}: {exc}", "error")
        text = as_text(output)
        # Characters are at most 4 bytes: only a long text needs encoding to be measured.
        if len(text) * 4 > tool.max_output_bytes and len(text.encode()) > tool.max_output_bytes:
            return ToolResult(str(output_too_large(tool.max_output_bytes)), "error")
        return ToolResult(text)


def build_tool(
    name: str,
    cfg: ToolConfig,
    client: httpx.AsyncClient,
    threads: CallThreads,
    default_max_output_bytes: int = 1024 * 1024,
) -> Tool:
    """One configured tool: http tools call through `client`, sync python tools run in
    `threads`. Raises ValueError when it cannot be built."""
    max_output = cfg.max_output_bytes or default_max_output_bytes
    terminal = cfg.terminal
    description = cfg.description
    if cfg.kind == "builtin":
        which = cfg.builtin or name
        builtin = BUILTINS.get(which)
        if builtin is None:
            raise ValueError(f"no builtin tool {which!r}; builtins: {', '.join(BUILTINS)}")
        parameters = cfg.parameters or builtin.parameters
        invoke = builtin_invoke(builtin)
        validate = schema_validator(parameters)
        description = description or builtin.description
        terminal = terminal or builtin.terminal
    elif cfg.kind == "python":
        assert cfg.callable is not None
        invoke, inferred, validate = python_tool(load_callable(cfg.callable), threads)
        parameters = cfg.parameters or inferred
        if cfg.parameters:
            validate = schema_validator(cfg.parameters)
    else:
        assert cfg.url is not None
        headers = {}
        for header, env in cfg.headers_env.items():
            value = os.environ.get(env)
            if value is None:
                raise ValueError(f"environment variable {env} (header {header}) is not set")
            headers[header] = value
        invoke = http_invoke(name, cfg.url, headers, client, cfg.timeout_s, max_output)
        parameters = cfg.parameters or OPEN_SCHEMA
        validate = schema_validator(parameters)
    check_schema(parameters)
    spec = ToolSpec(name, definition(name, description, parameters), terminal, cfg.id)
    # The registry's own timeout backs up the transport's, a little later.
    timeout_s = cfg.timeout_s + (1.0 if cfg.kind == "http" else 0.0)
    return Tool(spec, invoke, timeout_s, validate, max_output)


def build_registry(config: Config, client: httpx.AsyncClient, threads: CallThreads) -> ToolRegistry:
    tools: dict[str, Tool] = {}
    problems: list[str] = []
    default_max_output = config.server.max_tool_output_bytes
    for name, cfg in config.tools.items():
        try:
            tools[name] = build_tool(name, cfg, client, threads, default_max_output)
        except ValueError as exc:
            problems.append(f"tools.{name}: {exc}")
    if problems:
        raise ValueError("\n".join(problems))
    return ToolRegistry(tools)
