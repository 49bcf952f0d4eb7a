"""An MCP tool's result as the model reads it: checked against the tool's output schema by the
proxy (in a thread, bounded), not by the SDK."""

from __future__ import annotations

from typing import Any

import mcp_types
import pytest

from proxy.engine.values import ToolContext
from proxy.tools.base import ToolFailed
from proxy.tools.mcp_schemas import output_check
from proxy.tools.mcp_tool import mcp_invoke

CTX = ToolContext("run_1", None, 1, "call_1")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


class AnsweringSource:
    """What a source's call gives back (the part of McpSource the call reads)."""

    def __init__(self, result: mcp_types.CallToolResult) -> None:
        self.result = result

    async def call(self, tool: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        return self.result


def listed(output_schema: dict[str, Any] | None) -> mcp_types.Tool:
    return mcp_types.Tool(name="t", input_schema={"type": "object"}, output_schema=output_schema)


async def answer(result: mcp_types.CallToolResult, schema: dict[str, Any] | None) -> str:
    source: Any = AnsweringSource(result)
    invoke = mcp_invoke(source, "t", None, output_check(listed(schema)))
    return str(await invoke({}, CTX))


async def test_structured_content_that_matches_its_schema_is_the_answer() -> None:
    result = mcp_types.CallToolResult(content=[], structured_content={"n": 3})
    assert await answer(result, SCHEMA) == '{"n":3}'


@pytest.mark.parametrize(
    ("structured", "why"),
    [
        ({"n": "three"}, "invalid structured content at n: 'three' is not of type 'integer'"),
        (None, "the MCP tool 't' gave no structured content"),
    ],
)
async def test_a_result_that_does_not_match_its_output_schema_is_a_tool_error(
    structured: dict[str, Any] | None, why: str
) -> None:
    text = [mcp_types.TextContent(type="text", text="three")]
    result = mcp_types.CallToolResult(content=text, structured_content=structured)
    with pytest.raises(ToolFailed, match=f"^{why}$"):
        await answer(result, SCHEMA)


async def test_a_tool_without_a_usable_output_schema_is_not_checked() -> None:
    result = mcp_types.CallToolResult(content=[], structured_content={"n": "three"})
    assert await answer(result, None) == '{"n":"three"}'
    assert await answer(result, {"type": "object", "properties": 5}) == '{"n":"three"}'
