"""An MCP server's tool list checked as it is read (`proxy/tools/mcp_schemas.py`)."""

from __future__ import annotations

import mcp_types

from proxy.tools.mcp_schemas import MAX_LISTING_VALUES, MAX_SCHEMA_VALUES, Schemas, checked_listing


def tool(name: str, input_schema: dict[str, object], **more: object) -> mcp_types.Tool:
    return mcp_types.Tool(name=name, input_schema=input_schema, **more)  # type: ignore[arg-type]


def test_each_tool_s_schemas_are_checked_or_why_not_said() -> None:
    wide = {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_VALUES)}
    deep: dict[str, object] = {"type": "object"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"in": deep}}
    output = {"type": "object", "properties": {"n": {"type": "integer"}}}
    checked = checked_listing(
        [
            tool("plain", {"type": "object"}, outputSchema=output),
            tool("wide", {"type": "object", "properties": wide}),
            tool("deep", deep),
            tool("wrong", {"type": "object", "properties": 7}),
        ],
        lambda name: True,
        10,
    )
    plain = checked["plain"]
    assert isinstance(plain, Schemas)
    assert plain.parameters == {"type": "object"}
    assert plain.output is not None
    assert plain.output({"n": 1}) == {"n": 1}
    assert checked["wide"] == f"its input schema holds more than {MAX_SCHEMA_VALUES} JSON values"
    assert "nested too deeply" in str(checked["deep"])
    assert isinstance(checked["wrong"], str)


def test_only_the_tools_a_source_may_expose_are_checked_the_first_of_a_name() -> None:
    """Tools its config leaves out, past `max_tools`, or listed again were checked too (1,280
    large schemas: 194 s, past the connect deadline); a pattern `re` refuses failed the list."""
    listing = [
        tool("left_out", {"type": "object", "properties": 7}),
        tool("a", {"type": "object", "properties": {"x": {"type": "string"}}}),
        tool("a", {"type": "object", "properties": 7}),  # listed again: the first is exposed
        tool("odd", {"type": "object", "properties": {"x": {"pattern": "a{4294967296}"}}}),
        tool("b", {"type": "object"}),
        tool("past_most", {"type": "object"}),
    ]
    checked = checked_listing(listing, lambda name: name != "left_out", 3)
    assert list(checked) == ["a", "odd", "b"]
    assert isinstance(checked["a"], Schemas)
    assert checked["odd"] == "its input schema cannot be checked: OverflowError"


def test_the_schemas_of_one_list_are_checked_up_to_a_bound_together() -> None:
    """128 tools of two 4,200-value schemas each held start-up 45 s (a thread's checking,
    which cannot be cancelled): past MAX_LISTING_VALUES together, the tools are left out."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    listing = [tool(f"t{n}", wide) for n in range(20)]  # 4,004 values each
    checked = checked_listing(listing, lambda name: True, 128)
    kept = [name for name, schemas in checked.items() if isinstance(schemas, Schemas)]
    assert kept == [f"t{n}" for n in range(MAX_LISTING_VALUES // 4004)]
    assert checked["t19"] == (
        f"the schemas of the tools listed with it hold more than {MAX_LISTING_VALUES} JSON "
        "values together"
    )


def test_a_schema_refused_unchecked_spends_nothing_of_the_list_s_bound() -> None:
    over = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    listing = [tool(f"over{n}", over) for n in range(20)] + [tool(f"kept{n}", wide) for n in (1, 2)]
    checked = checked_listing(listing, lambda name: True, 128)
    assert isinstance(checked["kept1"], Schemas)
    assert isinstance(checked["kept2"], Schemas)
    assert checked["over0"] == f"its input schema holds more than {MAX_SCHEMA_VALUES} JSON values"
