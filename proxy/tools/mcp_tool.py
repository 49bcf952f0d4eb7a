"""One tool of an MCP server, exposed as a server tool (SPEC §13): its name, schema and terminal
flag from the entry's config, its call a `tools/call` on the source's session."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mcp_types

from proxy import exact_json
from proxy.engine.values import ToolContext, ToolSpec
from proxy.tools.base import Invoke, Tool, ToolFailed, definition
from proxy.tools.mcp_schemas import OPEN_SCHEMA, checked_schemas
from proxy.tools.mcp_source import McpSource
from proxy.tools.schema import SchemaCheck, schema_validator

# Called as a call starts, with the span attributes of SPEC §13 (the current span is the call's
# `execute_tool` span).
CallHook = Callable[[Mapping[str, Any]], None]

# What a server's tool's description may bring: it goes upstream with every step.
MAX_DESCRIPTION_CHARS = 16_384


def result_text(result: mcp_types.CallToolResult) -> str:
    """What the model reads of a result: `structuredContent` as compact JSON when the server
    gave it, else the text parts joined, other parts as a short note of their type."""
    if result.structured_content is not None:  # its integers exact past 64 bits
        return exact_json.dumps(result.structured_content).decode()
    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        else:
            parts.append(f"[{block.type} content not shown]")
    return "\n".join(parts)


def span_attributes(source: McpSource) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "mcp.method.name": "tools/call",
        "network.transport": source.endpoint.transport,
    }
    if source.session_id:
        attributes["mcp.session.id"] = source.session_id
    if source.endpoint.address:
        attributes["server.address"] = source.endpoint.address
    if source.endpoint.port is not None:
        attributes["server.port"] = source.endpoint.port
    return attributes


def mcp_invoke(
    source: McpSource, tool: str, on_call: CallHook | None, output: SchemaCheck | None = None
) -> Invoke:
    """A call of `tool`; a result that is no error is checked against the tool's `output`
    schema, in a thread and within the schema checks' bounds (the SDK would check it on the
    event loop, unbounded: `McpSource` hands it none)."""

    async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> str:
        if on_call is not None:
            on_call(span_attributes(source))
        result = await source.call(tool, arguments)
        text = result_text(result)
        if result.is_error:
            raise ToolFailed(text or f"the MCP tool {tool!r} failed")
        if output is not None:
            if not isinstance(result.structured_content, dict):
                raise ToolFailed(f"the MCP tool {tool!r} gave no structured content")
            await output.in_thread(result.structured_content)
        return text

    return invoke


def exposed_tool(
    source: McpSource,
    listed: mcp_types.Tool,
    exposed: str,
    default_max_output_bytes: int,
    on_call: CallHook | None = None,
) -> Tool:
    """`listed` as the server tool `exposed`. Raises ValueError for an input schema that is not
    valid JSON Schema (as its source checked it when it read its list, off the event loop)."""
    cfg = source.cfg
    schemas = source.schemas.get(listed.name) or checked_schemas(listed)
    if isinstance(schemas, str):
        raise ValueError(schemas)
    parameters = schemas.parameters
    description = (listed.description or listed.title or "")[:MAX_DESCRIPTION_CHARS] or None
    spec = ToolSpec(
        exposed,
        definition(exposed, description, parameters),
        cfg.is_terminal(listed.name, exposed),
        source=source.name,
    )
    invoke = mcp_invoke(source, listed.name, on_call, schemas.output)
    max_output = cfg.max_output_bytes or default_max_output_bytes
    return Tool(spec, invoke, cfg.timeout_s, schema_validator(parameters), max_output)


def unavailable_tool(source: McpSource, exposed: str, default_max_output_bytes: int) -> Tool:
    """A name the config uses that `source` does not expose now (not connected yet, or no
    longer listed): offered with an open schema, and every call is a tool error."""
    if source.listed:
        why = f"{source.describe()} does not offer the tool {exposed!r} now"
    else:
        why = f"{source.describe()} is not connected yet"

    async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> str:
        raise ToolFailed(why if source.connected else source.not_connected())

    spec = ToolSpec(
        exposed,
        definition(exposed, f"Unavailable: {why}.", OPEN_SCHEMA),
        source.cfg.is_terminal(exposed.removeprefix(source.cfg.prefix or ""), exposed),
        source=source.name,
    )
    return Tool(spec, invoke, source.cfg.timeout_s, lambda args: args, default_max_output_bytes)
