"""The names an MCP source's tools are offered under, as the registry gives them out."""

from __future__ import annotations

from typing import Any

import httpx
import mcp_types

from proxy.config.tools import ToolConfig
from proxy.tools.mcp_schemas import MAX_SCHEMA_VALUES
from proxy.tools.mcp_source import McpSource
from proxy.tools.mcp_tool import MAX_DESCRIPTION_CHARS
from proxy.tools.registry import ToolRegistry
from tests.unit.test_tools import THREADS, build_tool


class ListingSource:
    """What the registry reads of a connected source: its name, config and tool list."""

    def __init__(self, name: str, tools: list[str], **config: Any) -> None:
        self.name = name
        self.cfg = ToolConfig(kind="mcp", command=["true"], **config)
        self.tools = tuple(
            mcp_types.Tool(name=tool, input_schema={"type": "object"}) for tool in tools
        )
        self.schemas: dict[str, Any] = {}  # none checked as listed: checked as they are built
        self.listeners: list[Any] = []
        self.listed = self.connected = True


def test_max_tools_counts_the_tools_a_source_exposes_not_those_left_out() -> None:
    """A name the config has leaves the source's own tool out: it takes none of the room."""
    echo = ToolConfig(kind="python", callable="tests.unit.test_tools:slow_echo")
    config_tools = {"echo": build_tool("echo", echo, httpx.AsyncClient(), THREADS)}
    source: Any = ListingSource("srv", ["echo", "a", "b", "c"], max_tools=2)
    registry = ToolRegistry(config_tools, sources=[source])
    assert registry.groups["srv"] == ("a", "b")
    assert registry.problems == [
        "tools.srv: 'echo' is also a tool of the config",
        "tools.srv: more than max_tools (2) tools; 'c' and later ones are left out",
    ]


def test_why_a_source_is_not_connected_is_told_without_its_url() -> None:
    """The reason a session failed may quote the URL (a transport's error): a tool error, which
    the model reads, names the server alone; the log names its host."""
    url = "https://mcp.example.test/s/PATHTOKEN1234567890/mcp?api_key=QUERYTOKEN1234567890"
    source = McpSource("hosted", ToolConfig(kind="mcp", url=url), max_values=1000)
    source.error = f"Client error '401 Unauthorized' for url '{url}'"
    told = source.not_connected()
    assert told.startswith("MCP server 'hosted' is not connected: Client error '401")
    assert "TOKEN1234567890" not in told
    assert source.located() == "MCP server 'hosted' (https://mcp.example.test)"
    # Another URL, or the server's own host, in a reason is no secret: kept for the operator.
    source.error = "see https://docs.vendor.test/auth (mcp.example.test said 401)"
    assert source.error in source.not_connected()


def test_a_tool_whose_schema_nests_too_deeply_is_left_out_alone() -> None:
    """The schema check overflowed the stack: the error escaped the registry's refresh, and
    every tool of the server went (its calls handed to the client as client calls)."""
    source: Any = ListingSource("srv", ["fine", "deep"])
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(3000):
        deep = {"not": deep}
    source.tools = (source.tools[0], source.tools[1].model_copy(update={"input_schema": deep}))
    registry = ToolRegistry({}, sources=[source])
    assert registry.groups["srv"] == ("fine",)
    (problem,) = registry.problems
    assert problem.startswith("tools.srv: tool 'deep': ")
    assert problem.endswith("nested too deeply; it is left out")


def test_a_tool_whose_schema_is_too_large_is_left_out_and_a_long_description_cut() -> None:
    """Its schema was checked on the event loop at every change of the list (15,000 properties
    took 3.3 s), and its description went upstream with every step (15 MB each)."""
    source: Any = ListingSource("srv", ["fine", "large"])
    properties = {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_VALUES)}
    large = {"type": "object", "properties": properties}
    fine = source.tools[0].model_copy(update={"description": "x" * (MAX_DESCRIPTION_CHARS + 9)})
    source.tools = (fine, source.tools[1].model_copy(update={"input_schema": large}))
    registry = ToolRegistry({}, sources=[source])
    assert registry.groups["srv"] == ("fine",)
    assert registry.problems == [
        f"tools.srv: tool 'large': its input schema holds more than {MAX_SCHEMA_VALUES} JSON "
        "values; it is left out"
    ]
    (offered,) = registry.specs().values()
    assert offered.definition["function"]["description"] == "x" * MAX_DESCRIPTION_CHARS
