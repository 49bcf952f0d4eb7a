"""Building the server tools of a config: each configured tool, the MCP sources, and the
names the config's agents and keys use (those an MCP source may expose get a stand-in while it
is down)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from proxy.callables import CallThreads, load_callable
from proxy.config import Config
from proxy.config.agents import AgentConfig
from proxy.config.environment import setting
from proxy.config.tools import ToolConfig
from proxy.engine.values import ToolSpec
from proxy.tools.base import Tool, definition
from proxy.tools.builtin import BUILTINS, builtin_invoke
from proxy.tools.http_tool import http_invoke
from proxy.tools.mcp_schemas import OPEN_SCHEMA
from proxy.tools.mcp_source import McpSource
from proxy.tools.mcp_tool import CallHook
from proxy.tools.python_tool import python_tool
from proxy.tools.registry import ToolRegistry
from proxy.tools.schema import check_schema, schema_validator


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
    terminal = cfg.terminal is True
    description = cfg.description
    if cfg.kind == "builtin":
        which = cfg.builtin or name
        builtin = BUILTINS.get(which)
        if builtin is None:
            raise ValueError(f"no builtin tool {which!r}; builtins: {', '.join(BUILTINS)}")
        parameters = cfg.parameters or builtin.parameters
        invoke = builtin_invoke(builtin)
        validate: Callable[[dict[str, Any]], dict[str, Any]] = schema_validator(parameters)
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
            value = setting(env)
            if value is None:
                raise ValueError(f"environment variable {env} (header {header}) is not set")
            headers[header] = value
        invoke = http_invoke(name, cfg.url, headers, client, cfg.timeout_s, max_output)
        parameters = cfg.parameters or OPEN_SCHEMA
        validate = schema_validator(parameters)
    check_schema(parameters)
    spec = ToolSpec(name, definition(name, description, parameters), terminal, cfg.id)
    # The registry's own timeout backs up the transport's, a little later.
    grace_s = 1.0 if cfg.kind == "http" else 0.0
    return Tool(spec, invoke, cfg.timeout_s, validate, max_output, grace_s)


def build_registry(
    config: Config,
    client: httpx.AsyncClient,
    threads: CallThreads,
    on_call: CallHook | None = None,
    env: Mapping[str, str] = os.environ,
) -> ToolRegistry:
    """The config's tools; its MCP sources are not connected until `open()`. Raises ValueError
    naming every tool that cannot be built."""
    tools: dict[str, Tool] = {}
    sources: list[McpSource] = []
    problems: list[str] = []
    default_max_output = config.server.max_tool_output_bytes
    for name, cfg in config.tools.items():
        try:
            if cfg.kind == "mcp":
                sources.append(McpSource(name, cfg, config.server.max_body_values, env))
            else:
                tools[name] = build_tool(name, cfg, client, threads, default_max_output)
        except ValueError as exc:
            problems.append(f"tools.{name}: {exc}")
    if problems:
        raise ValueError("\n".join(problems))
    server, named = referenced_tools(config)
    return ToolRegistry(
        tools, sources, named, server, default_max_output, on_call, config.server.max_body_values
    )


def referenced_tools(config: Config) -> tuple[set[str], set[str]]:
    """The tool names the config's agents and keys use: those that must be server tools (tools,
    terminating config, limits, keys), and all of them (rules and `has_tool_call` conditions
    may name client tools too)."""
    server: set[str] = set()
    named: set[str] = set()
    for agent in config.agents.values():
        server.update(agent.tools)
        if agent.terminating_config is not None:
            server.update(agent.terminating_config.tool_ids)
        server.update(limit.tool_name for limit in agent.tool_call_limits if limit.tool_name)
        named.update(_rules_and_conditions(agent))
    for key in config.auth.keys:
        server.update(ref for ref in key.tools or [] if ref != "*")
    entries = set(config.tools)
    return server - entries, (server | named) - entries


def _rules_and_conditions(agent: AgentConfig) -> set[str]:
    names: set[str] = set()
    for rule in agent.tool_rules:
        for field in ("tool_name", "default_child"):
            value = getattr(rule, field, None)
            if isinstance(value, str):
                names.add(value)
        names.update(getattr(rule, "children", None) or [])
        names.update((getattr(rule, "child_output_mapping", None) or {}).values())
    names.update(limit.tool_name for limit in agent.tool_call_limits if limit.tool_name)
    if agent.terminating_config is not None:
        names.update(agent.terminating_config.tool_ids)
    conditions: list[Any] = list(agent.stop_when)
    while conditions:
        condition = conditions.pop()
        names.update(getattr(condition, "has_tool_call", None) or [])
        conditions.extend(getattr(condition, "any", None) or [])
        conditions.extend(getattr(condition, "all", None) or [])
        inner = getattr(condition, "not_", None)
        if inner is not None:
            conditions.append(inner)
    return names
