"""The schemas of an MCP server's tools, checked as its list is read: each tool's input schema
must be one (else the tool is left out), its output schema is the check of its results when it
is one. Checking holds the GIL ~40 µs a JSON value (a 5,000-value schema: 0.2 s; a page of the
list may hold 100,000 values): the whole list is checked in a thread, off the event loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import mcp_types
import orjson

from proxy.json_values import values_in
from proxy.tools.schema import SchemaCheck, check_schema

# What a server's tool may bring: a larger schema leaves the tool out.
MAX_SCHEMA_VALUES = 5_000
# What the schemas of one list's tools may hold together (~2 s of a thread's checking): the
# tools past it are left out (128 tools of two 4,200-value schemas each held the start-up 45 s,
# and its thread cannot be cancelled).
MAX_LISTING_VALUES = 50_000
OPEN_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Schemas:
    parameters: dict[str, Any]  # the input schema, one
    output: SchemaCheck | None  # the check of structured results, if the tool has one


def checked_schemas(listed: mcp_types.Tool) -> Schemas:
    """`listed`'s schemas; raises ValueError for an input schema that is not one, holds more
    than MAX_SCHEMA_VALUES JSON values or nests too deeply to check."""
    parameters = dict(listed.input_schema) if listed.input_schema else dict(OPEN_SCHEMA)
    try:
        _bounded(parameters, "input")
        check_schema(parameters)
    except RecursionError:
        raise ValueError("its input schema is nested too deeply") from None
    except ValueError:
        raise
    except Exception as exc:  # a pattern the `re` module refuses (`a{4294967296}`), say
        raise ValueError(f"its input schema cannot be checked: {type(exc).__name__}") from None
    return Schemas(parameters, output_check(listed))


def checked_listing(
    tools: Iterable[mcp_types.Tool], wanted: Callable[[str], bool], most: int
) -> dict[str, Schemas | str]:
    """The schemas of the first `most` tools whose names are `wanted`, or why a tool's input
    schema is none, by name (the first of a name listed twice: the one exposed). A tool left
    out here that is exposed all the same is checked as it is (`exposed_tool`)."""
    checked: dict[str, Schemas | str] = {}
    spent = 0
    for tool in tools:
        if len(checked) >= most:
            break
        if tool.name in checked or not wanted(tool.name):
            continue
        values = _values(tool.input_schema) + _values(tool.output_schema)
        if spent + values > MAX_LISTING_VALUES:
            checked[tool.name] = (
                f"the schemas of the tools listed with it hold more than {MAX_LISTING_VALUES} "
                "JSON values together"
            )
            continue
        spent += values
        try:
            checked[tool.name] = checked_schemas(tool)
        except ValueError as exc:
            checked[tool.name] = str(exc)
    return checked


def _values(schema: dict[str, Any] | None) -> int:
    """The JSON values of a schema its check goes through: none for one over MAX_SCHEMA_VALUES
    or too deep to write (refused unchecked)."""
    if not schema:
        return 0
    try:
        values = values_in(orjson.dumps(schema), MAX_SCHEMA_VALUES)
    except orjson.JSONEncodeError:
        return 0
    return values if values <= MAX_SCHEMA_VALUES else 0


def output_check(listed: mcp_types.Tool) -> SchemaCheck | None:
    """The check of a tool's structured content, if it has an output schema that is one."""
    if not listed.output_schema:
        return None
    schema = dict(listed.output_schema)
    try:
        _bounded(schema, "output")
        check_schema(schema)
    except Exception:  # (a RecursionError, or what else a schema's check raises)
        return None  # nothing to check against: its results go to the model as they are
    return SchemaCheck(schema, "structured content")


def _bounded(schema: dict[str, Any], which: str) -> None:
    """Raises ValueError for a schema of more than MAX_SCHEMA_VALUES JSON values, or nested
    deeper than JSON is written."""
    try:
        text = orjson.dumps(schema)
    except orjson.JSONEncodeError:
        raise ValueError(f"its {which} schema is nested too deeply") from None
    if values_in(text, MAX_SCHEMA_VALUES) > MAX_SCHEMA_VALUES:
        raise ValueError(f"its {which} schema holds more than {MAX_SCHEMA_VALUES} JSON values")
