"""Server tools: argument checks, python schemas, builtins, timeouts, outputs."""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import math
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel

from proxy.api.app import tools_transport
from proxy.callables import CallThreads
from proxy.config import parse_config
from proxy.config.tools import ToolConfig, digest_name, function_name, might_expose
from proxy.demo.runner import free_port
from proxy.engine.values import ToolCall, ToolContext
from proxy.tools.base import BadArguments, Tool
from proxy.tools.building import build_tool, referenced_tools
from proxy.tools.http_tool import MAX_REWRITTEN_VALUES
from proxy.tools.registry import ToolRegistry
from proxy.tools.schema import SchemaCheck, check_schema, schema_validator
from proxy.tools.schema_budget import PATTERNS_S, WORK_S, work_limit_s

CTX = ToolContext("run_1", None, 1, "call_1")
PATTERNED = {"type": "string", "pattern": "^([a-zA-Z]+ ?)+$"}
THREADS = CallThreads(4)


async def slow_echo(text: str, times: int = 1) -> str:
    await asyncio.sleep(0.01)
    return text * times


async def sleepy() -> str:
    await asyncio.sleep(5)
    return "late"


def registry(**tools: ToolConfig) -> ToolRegistry:
    client = httpx.AsyncClient()
    return ToolRegistry(
        {name: build_tool(name, cfg, client, THREADS) for name, cfg in tools.items()}
    )


def test_python_tool_schema_comes_from_type_hints() -> None:
    reg = registry(echo=ToolConfig(kind="python", callable="tests.unit.test_tools:slow_echo"))
    params = reg.spec("echo").definition["function"]["parameters"]
    assert params["required"] == ["text"]
    assert params["properties"]["text"] == {"type": "string"}
    assert params["properties"]["times"]["default"] == 1


async def test_python_tool_runs_and_validates_arguments() -> None:
    reg = registry(echo=ToolConfig(kind="python", callable="tests.unit.test_tools:slow_echo"))
    ok = await reg.execute(ToolCall("c", "echo", '{"text": "ab", "times": 2}'), CTX)
    assert (ok.output, ok.outcome) == ("abab", "ok")
    defaulted = await reg.execute(ToolCall("c", "echo", '{"text": "ab"}'), CTX)
    coerced = await reg.execute(ToolCall("c", "echo", '{"text": "ab", "times": "3"}'), CTX)
    assert (defaulted.output, coerced.output) == ("ab", "ababab")
    bad = await reg.execute(ToolCall("c", "echo", '{"times": "many"}'), CTX)
    assert bad.outcome == "error"
    assert "invalid arguments" in bad.output
    broken = await reg.execute(ToolCall("c", "echo", '{"text": '), CTX)
    assert broken.outcome == "error"
    assert "not valid JSON" in broken.output


async def test_a_tool_that_takes_too_long_times_out() -> None:
    cfg = ToolConfig(kind="python", callable="tests.unit.test_tools:sleepy", timeout_s=0.05)
    result = await registry(s=cfg).execute(ToolCall("c", "s", "{}"), CTX)
    assert result.outcome == "timeout"


async def test_builtins() -> None:
    reg = registry(
        final_answer=ToolConfig(kind="builtin"), complete_task=ToolConfig(kind="builtin")
    )
    assert reg.spec("final_answer").terminal
    answer = await reg.execute(ToolCall("c", "final_answer", '{"answer": "42"}'), CTX)
    assert answer.output == "42"
    done = await reg.execute(ToolCall("c", "complete_task", '{"result": "shipped"}'), CTX)
    assert done.output == "Task completed: shipped"
    missing = await reg.execute(ToolCall("c", "final_answer", "{}"), CTX)
    assert missing.outcome == "error"


def test_unknown_builtin_and_bad_callable_fail_at_build() -> None:
    client = httpx.AsyncClient()
    with pytest.raises(ValueError, match="no builtin tool"):
        build_tool("nope", ToolConfig(kind="builtin"), client, THREADS)
    with pytest.raises(ValueError, match="cannot import"):
        build_tool("x", ToolConfig(kind="python", callable="no_such_module:f"), client, THREADS)


def scaled(factor: int, value: int) -> int:
    return factor * value


class Greeter:
    def __call__(self, name: str) -> str:
        return f"hello {name}"


class AsyncGreeter:
    async def __call__(self, name: str) -> str:
        return f"hi {name}"


def tagged(label: str, **extra: int) -> dict[str, int]:
    return {label: sum(extra.values())}


def positional(x: int, /) -> int:
    return x


def opened(where: socket.socket) -> str:
    return str(where)


class Person(BaseModel):
    name: str
    born: datetime.date


def returns(kind: str) -> Any:
    circular: list[Any] = []
    circular.append(circular)
    values: dict[str, Any] = {
        "int_keys": {1: "one"},
        "huge": 2**70,
        "model": Person(name="Ada", born=datetime.date(1815, 12, 10)),
        "circular": circular,
    }
    return values[kind]


partial_of_scaled = functools.partial(scaled, 3)
greeter = Greeter()
async_greeter = AsyncGreeter()
SHAPES = ("partial_of_scaled", "greeter", "async_greeter", "tagged")


async def test_callables_of_every_shape_are_tools() -> None:
    """A `functools.partial`, an object with `__call__` (sync or async), `**kwargs`."""
    here = "tests.unit.test_tools"
    reg = registry(**{n: ToolConfig(kind="python", callable=f"{here}:{n}") for n in SHAPES})
    asked = {
        "partial_of_scaled": '{"value": 5}',
        "greeter": '{"name": "Ada"}',
        "async_greeter": '{"name": "Ada"}',
        "tagged": '{"label": "sum", "a": 1, "b": 2}',
    }
    results = {n: (await reg.execute(ToolCall("c", n, a), CTX)).output for n, a in asked.items()}
    assert results == {
        "partial_of_scaled": "15",
        "greeter": "hello Ada",
        "async_greeter": "hi Ada",
        "tagged": '{"sum":3}',
    }
    schema = reg.spec("partial_of_scaled").definition["function"]["parameters"]
    assert list(schema["properties"]) == ["value"]


@pytest.mark.parametrize(
    ("kind", "output", "outcome"),
    [
        ("int_keys", '{"1":"one"}', "ok"),
        ("huge", str(2**70), "ok"),
        ("model", '{"name":"Ada","born":"1815-12-10"}', "ok"),
        ("circular", "the tool's result is no JSON value: Circular reference detected", "error"),
    ],
)
async def test_a_python_tool_s_result_is_written_as_json(
    kind: str, output: str, outcome: str
) -> None:
    reg = registry(r=ToolConfig(kind="python", callable="tests.unit.test_tools:returns"))
    result = await reg.execute(ToolCall("c", "r", orjson.dumps({"kind": kind}).decode()), CTX)
    assert (result.output, result.outcome) == (output, outcome)


@pytest.mark.parametrize(
    ("name", "why"),
    [("positional", "is positional-only"), ("opened", "have no JSON schema")],
)
def test_a_callable_that_cannot_be_a_tool_fails_at_build_saying_why(name: str, why: str) -> None:
    cfg = ToolConfig(kind="python", callable=f"tests.unit.test_tools:{name}")
    with pytest.raises(ValueError, match=why):
        build_tool(name, cfg, httpx.AsyncClient(), THREADS)


def test_http_tool_parameters_must_be_a_valid_schema() -> None:
    cfg = ToolConfig(kind="http", url="http://t/x", parameters={"type": "object", "properties": 3})
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        build_tool("x", cfg, httpx.AsyncClient(), THREADS)


async def test_http_tool_posts_and_maps_failures() -> None:
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if request.url.path == "/down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text="plain result")

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    reg = ToolRegistry(
        {
            "up": build_tool("up", ToolConfig(kind="http", url="http://t/up"), client, THREADS),
            "down": build_tool(
                "down", ToolConfig(kind="http", url="http://t/down"), client, THREADS
            ),
        }
    )
    ok = await reg.execute(ToolCall("c9", "up", '{"q": 1}'), CTX)
    assert ok.output == "plain result"
    assert seen[0] == {
        "name": "up",
        "arguments": {"q": 1},
        "call_id": "call_1",
        "run_id": "run_1",
        "thread_id": None,
    }
    down = await reg.execute(ToolCall("c", "down", "{}"), CTX)
    assert down.outcome == "error"
    assert "unreachable" in down.output


async def test_an_http_tool_refused_is_an_error_and_a_silent_one_times_out_as_configured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over the tools' own pool (the httpx API over aiohttp, which reports a refused
    connection as a `ConnectTimeout`). The operator's log says why, without the URL's path
    and query (they may hold a token); the model reads the error's name alone."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    port = silent.getsockname()[1]
    closed = free_port()
    async with httpx.AsyncClient(transport=tools_transport(4)) as client:
        tools = {
            "refused": ToolConfig(
                kind="http", url=f"http://127.0.0.1:{closed}/hook?token=SECRET", timeout_s=5
            ),
            "silent": ToolConfig(kind="http", url=f"http://127.0.0.1:{port}/", timeout_s=0.3),
        }
        reg = ToolRegistry({n: build_tool(n, cfg, client, THREADS) for n, cfg in tools.items()})
        started = time.monotonic()
        refused = await reg.execute(ToolCall("c", "refused", "{}"), CTX)
        took = time.monotonic() - started
        slow = await reg.execute(ToolCall("c", "silent", "{}"), CTX)
    silent.close()
    assert (refused.outcome, refused.output) == (
        "error",
        "tool server unreachable: ClientConnectorError",
    )
    assert took < 5
    assert (slow.outcome, slow.output) == ("timeout", "tool timed out after 0.3s")
    (told,) = [r.getMessage() for r in caplog.records if "http tool refused" in r.getMessage()]
    assert told.startswith(f"http tool refused: http://127.0.0.1:{closed} unreachable: ")
    assert "Connect call failed" in told or "refused" in told.lower()
    assert "SECRET" not in told


async def test_an_http_tool_s_numbers_stay_exact_past_64_bits() -> None:
    """orjson reads 2**64 as a float: such arguments and answers keep their digits, and an
    answer nested past orjson's depth is passed on as it came."""
    deep = b"[" * 300 + b"1" + b"]" * 300
    answers = {"/big": b'{"id": 123456789012345678901234567890, "ok": true}', "/deep": deep}
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        body = answers[request.url.path]
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    reg = ToolRegistry(
        {
            n: build_tool(n, ToolConfig(kind="http", url=f"http://t/{n}"), client, THREADS)
            for n in ("big", "deep")
        }
    )
    big = await reg.execute(ToolCall("c", "big", '{"n": 18446744073709551616}'), CTX)
    deep_result = await reg.execute(ToolCall("c", "deep", "{}"), CTX)
    assert big.output == '{"id":123456789012345678901234567890,"ok":true}'
    assert b'"arguments":{"n":18446744073709551616}' in seen[0]
    assert deep_result.output == deep.decode()


DRAFT_07 = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {  # a tuple, as zod's `z.tuple` writes it
        "pair": {
            "type": "array",
            "items": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "integer"}],
        }
    },
}
DRAFT_04 = {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "properties": {"n": {"type": "number", "minimum": 0, "exclusiveMinimum": True}},
}


@pytest.mark.parametrize(
    ("schema", "good", "bad", "why"),
    [
        (DRAFT_07, {"pair": ["ab", 1]}, {"pair": ["ab", "c"]}, "at pair/1: 'c' is not of type"),
        (DRAFT_07, {"pair": ["ab", 1]}, {"pair": ["AB", 1]}, "at pair/0: 'AB' does not match"),
        (DRAFT_04, {"n": 0.5}, {"n": 0}, "at n: 0 is less than or equal to the minimum of 0"),
    ],
)
def test_a_schema_is_read_as_the_draft_it_names(
    schema: dict[str, Any], good: dict[str, Any], bad: dict[str, Any], why: str
) -> None:
    """TypeScript MCP servers' schemas (zod's) say draft-07: its list `items` is a tuple."""
    check_schema(schema)
    check = schema_validator(schema)
    assert check(good) == good
    with pytest.raises(BadArguments, match=why):
        check(bad)


@pytest.mark.parametrize("named", [5, {}, ["x"]])
def test_a_schema_naming_no_draft_by_a_string_is_no_valid_schema(named: Any) -> None:
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        check_schema({"$schema": named, "type": "object"})


def test_a_schema_met_again_is_told_as_it_was_checked() -> None:
    """Schemas are checked once each (a config's tools share them): a bad one stays bad,
    however its keys are ordered, and one that is no JSON is still checked."""
    for _ in range(2):
        with pytest.raises(ValueError, match="not a valid JSON schema: 5 is not of type"):
            check_schema({"type": "object", "properties": 5})
        with pytest.raises(ValueError, match="not a valid JSON schema: 5 is not of type"):
            check_schema({"properties": 5, "type": "object"})
        check_schema({"type": "object", "properties": {"a": {"type": "string"}}})
        with pytest.raises(ValueError, match="not a valid JSON schema"):
            check_schema({"type": "object", "properties": {"a": {1, 2}}})
        check_schema({"type": "number", "maximum": math.inf})  # YAML's `.inf`: no `null`
        with pytest.raises(ValueError, match="None is not of type 'number'"):
            check_schema({"type": "number", "maximum": None})


async def test_arguments_longer_than_any_model_writes_are_refused_before_parsing() -> None:
    """30 MB of arguments from an upstream (digits: the long-number scan and the standard
    library's parse) held the event loop 2.7 s; a megabyte is more than any model writes."""
    cfg = ToolConfig(kind="python", callable="tests.unit.test_tools:slow_echo")
    reg = ToolRegistry({"echo": build_tool("echo", cfg, httpx.AsyncClient(), THREADS)})
    long = '{"text": "' + "123456789012345678x" * 60_000 + '"}'  # 1.14 M characters
    refused = await reg.execute(ToolCall("c", "echo", long), CTX)
    assert (refused.outcome, refused.output) == (
        "error",
        "arguments of more than 1048576 characters",
    )
    within = '{"text": "' + "123456789012345678x" * 50_000 + '"}'
    assert (await reg.execute(ToolCall("c", "echo", within), CTX)).outcome == "ok"


async def test_arguments_holding_more_values_than_the_bound_are_refused_before_parsing() -> None:
    """An upstream's call may bring megabytes of `[],`: counted before orjson holds the event
    loop to read them (8 MiB of it took 0.65 s)."""
    cfg = ToolConfig(kind="python", callable="tests.unit.test_tools:slow_echo")
    tool = build_tool("echo", cfg, httpx.AsyncClient(), THREADS)
    reg = ToolRegistry({"echo": tool}, max_argument_values=1000)
    many = '{"text": "x", "times": 1, "junk": [' + "[]," * 2000 + "[]]}"
    refused = await reg.execute(ToolCall("c", "echo", many), CTX)
    fine = await reg.execute(ToolCall("c", "echo", '{"text": "' + "y" * 5000 + '"}'), CTX)
    assert (refused.outcome, refused.output) == (
        "error",
        "arguments hold more than 1000 JSON values (server.max_body_values)",
    )
    assert fine.output == "y" * 5000


def big_answer(size: int) -> str:
    return "x" * size


class Endless(httpx.AsyncByteStream):
    """A 50 MB body in 64 KiB chunks, counting what was read of it."""

    def __init__(self) -> None:
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunk = b"y" * 65536
        while self.sent < 50 * 1024 * 1024:
            self.sent += len(chunk)
            yield chunk


async def test_a_python_tool_output_over_its_cap_is_a_tool_error() -> None:
    target = "tests.unit.test_tools:big_answer"
    capped = ToolConfig(kind="python", callable=target, max_output_bytes=100)
    reg = registry(capped=capped, default=ToolConfig(kind="python", callable=target))
    small = await reg.execute(ToolCall("c", "capped", '{"size": 100}'), CTX)
    assert (small.output, small.outcome) == ("x" * 100, "ok")
    large = await reg.execute(ToolCall("c", "capped", '{"size": 101}'), CTX)
    assert large.outcome == "error"
    assert "larger than 100 bytes" in large.output
    huge = await reg.execute(ToolCall("c", "default", '{"size": 1048577}'), CTX)
    assert huge.outcome == "error"
    assert "larger than 1048576 bytes" in huge.output  # the default cap: 1 MiB


async def test_an_http_tool_body_is_read_only_up_to_its_cap() -> None:
    endless = Endless()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/declared":
            return httpx.Response(200, headers={"content-length": str(10**9)}, stream=endless)
        if request.url.path == "/failing":
            return httpx.Response(500, text="e" * 100_000)
        return httpx.Response(200, stream=endless)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    cap = 256 * 1024

    def tool(path: str) -> Tool:
        cfg = ToolConfig(kind="http", url=f"http://t/{path}", max_output_bytes=cap)
        return build_tool(path, cfg, client, THREADS)

    reg = ToolRegistry({name: tool(name) for name in ("streamed", "declared", "failing")})
    streamed = await reg.execute(ToolCall("c", "streamed", "{}"), CTX)
    assert streamed.outcome == "error"
    assert f"larger than {cap} bytes" in streamed.output
    assert endless.sent <= cap + 65536  # stopped reading past the cap, not at the end
    endless.sent = 0
    declared = await reg.execute(ToolCall("c", "declared", "{}"), CTX)
    assert declared.outcome == "error"
    assert endless.sent == 0  # a declared length over the cap is refused before reading
    failing = await reg.execute(ToolCall("c", "failing", "{}"), CTX)
    assert failing.output == "tool server answered HTTP 500: " + "e" * 500


def test_a_schema_pattern_is_matched_without_backtracking_on_the_event_loop() -> None:
    """Python's `re` takes ~0.6 s for this over 24 characters (doubling with each one more)."""
    validate = schema_validator({"type": "object", "properties": {"city": PATTERNED}})
    started = time.perf_counter()
    with pytest.raises(BadArguments, match="does not match"):
        validate({"city": "a" * 23 + "!"})
    assert time.perf_counter() - started < 0.3  # re: 0.7 s, doubling with each character
    assert validate({"city": "Rio de Janeiro"}) == {"city": "Rio de Janeiro"}


def test_patterns_that_take_longer_than_their_bound_refuse_the_arguments() -> None:
    slow = {"type": "string", "pattern": "^(a|aa)+$"}  # slow for either engine
    validate = schema_validator({"type": "object", "additionalProperties": slow})
    started = time.perf_counter()
    with pytest.raises(BadArguments, match=f"took more than {PATTERNS_S:g} s"):
        validate({f"k{i}": "a" * 40 + "!" for i in range(20)})  # the first match refuses
    assert time.perf_counter() - started < 10 * PATTERNS_S  # (20 x 50 ms, were they each let)


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"x_a": 1, "name": "n"}, None),
        ({"x_a": "one"}, "invalid arguments at x_a: 'one' is not of type 'integer'"),
        ({"y": 1}, "'y' does not match any of the regexes: '^x_'"),
    ],
)
def test_pattern_properties_keep_their_meaning(
    arguments: dict[str, Any], error: str | None
) -> None:
    validate = schema_validator(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "patternProperties": {"^x_": {"type": "integer"}},
            "additionalProperties": False,
        }
    )
    if error is None:
        assert validate(arguments) == arguments
    else:
        with pytest.raises(BadArguments) as raised:
            validate(arguments)
        assert error in str(raised.value)


def test_unevaluated_properties_match_pattern_properties_without_backtracking() -> None:
    """jsonschema finds the keys `unevaluatedProperties` leaves with `re`: 0.7 s for this key."""
    backtracking = PATTERNED["pattern"]
    validate = schema_validator(
        {"patternProperties": {backtracking: {"type": "integer"}}, "unevaluatedProperties": False}
    )
    started = time.perf_counter()
    with pytest.raises(BadArguments, match="Unevaluated properties are not allowed"):
        validate({"a" * 23 + "!": 1})
    assert time.perf_counter() - started < 0.3
    assert validate({"Rio de Janeiro": 1}) == {"Rio de Janeiro": 1}


def shared_references(levels: int) -> dict[str, Any]:
    """A schema of about 100 bytes a level whose checks double with each level."""
    defs: dict[str, Any] = {"l0": {"type": "string"}}
    for i in range(1, levels + 1):
        below = {"$ref": f"#/$defs/l{i - 1}"}
        defs[f"l{i}"] = {"anyOf": [below, below]}
    return {"$defs": defs, "properties": {"x": {"$ref": f"#/$defs/l{levels}"}}}


def test_a_schema_whose_references_multiply_the_work_is_checked_within_its_bound() -> None:
    """Twenty levels: jsonschema alone takes 90 s for arguments that do not match."""
    validate = schema_validator(shared_references(20))
    assert validate.off_loop  # and in a thread of its own
    started = time.perf_counter()
    with pytest.raises(BadArguments, match=f"took more than {WORK_S:g} s"):
        validate({"x": 5})
    assert time.perf_counter() - started < 20 * WORK_S
    assert validate({"x": "fine"}) == {"x": "fine"}


def test_a_reference_outside_the_schema_is_never_fetched() -> None:
    with socket.socket() as closed:  # bound, not listening: a fetch would be refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/schema.json"
        validate = schema_validator({"properties": {"x": {"$ref": url}}})
        with pytest.raises(BadArguments, match="which is not within it"):
            validate({"x": 1})
    embedded = {
        "$defs": {"a": {"$id": "urn:a", "type": "string"}},
        "properties": {"x": {"$ref": "urn:a"}},
    }
    assert schema_validator(embedded)({"x": "s"}) == {"x": "s"}


def test_a_schema_that_refers_to_itself_without_end_refuses_the_arguments() -> None:
    with pytest.raises(BadArguments, match="refers to itself without end"):
        schema_validator({"$ref": "#"})({})
    tree = {"properties": {"child": {"$ref": "#"}}}  # recursion the arguments end
    assert schema_validator(tree)({"child": {"child": {}}}) == {"child": {"child": {}}}


EVALUATING = {
    "properties": {"a": {}},
    "patternProperties": {"^x_": {"type": "integer"}},
    "allOf": [{"properties": {"b": {}}}],
    "anyOf": [{"properties": {"c": {}}, "required": ["c"]}, {"required": ["zz"]}],
    "oneOf": [{"properties": {"d": {}}, "required": ["d"]}, {"required": ["never"]}],
    "if": {"properties": {"kind": {"const": "e"}}, "required": ["kind"]},
    "then": {"properties": {"e": {}}},
    "else": {"properties": {"f": {}}},
    "dependentSchemas": {"a": {"properties": {"g": {}}}},
    "$ref": "#/$defs/h",
    "$defs": {"h": {"properties": {"h": {}}}},
    "unevaluatedProperties": False,
}


@pytest.mark.parametrize(
    "arguments",
    [
        {"a": 1, "x_1": 2, "b": 3, "h": 4, "c": 5, "d": 6},
        {"x_1": "not an integer"},
        {"c": 1, "d": 1},
        {"c": 1, "kind": "e", "e": 1, "d": 1},
        {"c": 1, "d": 1, "kind": "e", "f": 1},
        {"c": 1, "d": 1, "f": 1},
        {"c": 1, "d": 1, "g": 1},
        {"c": 1, "d": 1, "a": 1, "g": 1},
        {"c": 1, "d": 1, "zz": 1},
        {"c": 1, "d": 1, "other": 1},
    ],
)
def test_unevaluated_properties_read_the_keys_every_in_place_applicator_evaluates(
    arguments: dict[str, Any],
) -> None:
    expected = Draft202012Validator(EVALUATING).is_valid(arguments)
    try:
        schema_validator(EVALUATING)(arguments)
    except BadArguments:
        assert not expected
    else:
        assert expected


async def test_a_reply_of_many_calls_to_a_patterned_tool_leaves_the_event_loop_free() -> None:
    """A schema with patterns is checked in a thread, its patterns matched without holding the
    interpreter: twenty calls that each take their whole bound (they held the loop a second)."""
    slow = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^(a|aa)+$"}}}
    reg = registry(slow=ToolConfig(kind="http", url="http://t/x", parameters=slow))
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    arguments = json.dumps({"city": "a" * 40 + "!"})
    calls = [ToolCall(f"c{i}", "slow", arguments) for i in range(20)]
    started = time.perf_counter()
    results = await asyncio.gather(*(reg.execute(call, CTX) for call in calls))
    took = time.perf_counter() - started  # at least 20 x 50 ms: the checks' own bound
    ticker.cancel()
    assert all(f"took more than {PATTERNS_S:g} s" in r.output for r in results)
    # Checked on the loop, they held it from the first to the last: one gap as long as it all.
    # (How long a tick waits is the host's: a busy one stretches the whole alike.)
    assert len(gaps) >= 20
    assert max(gaps) < max(0.25, took / 4)


async def test_arguments_nested_deeper_than_the_proxy_writes_are_a_tool_error() -> None:
    reg = registry(echo=ToolConfig(kind="python", callable="tests.unit.test_tools:slow_echo"))
    deep = '{"text": ' + "[" * 300 + "]" * 300 + "}"
    result = await reg.execute(ToolCall("c", "echo", deep), CTX)
    assert (result.outcome, result.output) == ("error", "arguments nest deeper than 246 levels")


async def test_many_valid_arguments_checked_at_once_are_not_refused_as_slow() -> None:
    """The bound is of matching, in each thread's own time: thirty calls of 400 items each in
    one reply (~10 ms of checking each, alone) shared the interpreter and some were refused."""
    tags = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}}
    schema = {"type": "object", "properties": {"tags": tags}}
    reg = registry(tagged=ToolConfig(kind="http", url="http://t/x", parameters=schema))
    arguments = json.dumps({"tags": ["abc"] * 400, "extra": "x" * 10})
    checks = [SchemaCheck(schema).in_thread(json.loads(arguments)) for _ in range(30)]
    assert all(len(checked["tags"]) == 400 for checked in await asyncio.gather(*checks))
    assert reg.spec("tagged").name == "tagged"


async def test_patterned_arguments_are_checked_beside_a_busy_default_executor() -> None:
    """asyncio's default threads resolve upstream names (a slow resolver holds them): the
    validations have threads of their own."""
    loop = asyncio.get_running_loop()
    threads = min(32, (os.cpu_count() or 1) + 4)  # the default executor's, asyncio's default
    busy = [loop.run_in_executor(None, time.sleep, 2) for _ in range(threads)]
    await SchemaCheck({"type": "object", "properties": {"city": PATTERNED}}).in_thread(
        {"city": "Rio"}
    )
    assert not any(sleeper.done() for sleeper in busy)  # checked before a thread was free
    await asyncio.gather(*busy)


@pytest.mark.parametrize(
    ("name", "offered"),
    [
        ("get_issue", "get_issue"),
        ("github.get_issue", "github_get_issue"),
        ("a/b c", "a_b_c"),
        ("é", "_"),
    ],
)
def test_a_name_is_offered_as_a_function_name(name: str, offered: str) -> None:
    assert function_name(name) == offered


def test_a_long_name_keeps_its_start_and_a_digest_of_the_rest() -> None:
    first, second = function_name("t" * 70 + "a"), function_name("t" * 70 + "b")
    assert len(first) == len(second) == 64
    assert first[:55] == "t" * 55
    assert first != second


async def test_long_valid_arguments_are_checked_in_a_thread_with_time_for_their_size() -> None:
    """Their check grows with them (10,000 rows: 0.4-0.8 s), which the bound on references
    multiplying the work must not refuse, nor the event loop wait for."""
    row = {"$defs": {"row": {"type": "object", "properties": {"id": {"type": "integer"}}}}}
    schema = {**row, "properties": {"rows": {"type": "array", "items": {"$ref": "#/$defs/row"}}}}
    arguments = {"rows": [{"id": i, "name": f"row {i}"} for i in range(10_000)]}
    size = len(json.dumps(arguments))
    check = SchemaCheck(schema)
    assert check.needs_thread(size)
    assert SchemaCheck({"type": "object"}).needs_thread(size)  # no references, but long
    assert not SchemaCheck({"type": "object"}).needs_thread(100)
    assert await check.in_thread(arguments) == arguments
    assert work_limit_s(arguments) > 2 * work_limit_s({})


def test_bytes_that_cost_nothing_to_check_add_nothing_to_the_bound() -> None:
    """A long string is one value: the bound of a schema whose references multiply the work
    grew with it, to 17 s of a thread's time for 4 MiB of padding."""
    validate = schema_validator(shared_references(20))
    padded = {"x": 5, "pad": "p" * (4 << 20)}
    assert work_limit_s(padded) == work_limit_s({"x": 5, "pad": ""})
    started = time.thread_time()
    with pytest.raises(BadArguments, match=f"took more than {work_limit_s(padded):.3g} s"):
        validate(padded)
    assert time.thread_time() - started < 10 * work_limit_s(padded)


@pytest.mark.parametrize(
    ("prefix", "include", "exclude", "name", "could"),
    [
        ("", ["x.y", "x_y"], [], digest_name("x.y"), True),  # offered so beside the own x_y
        ("", ["x.y"], [], "x_y", True),  # x.y as made
        ("", ["x.y"], [], "x.y", False),
        ("", None, ["x.y"], "x_y", True),  # the server's own x_y is not excluded
        ("", None, ["x_y"], "x_y", False),
        ("gh.", None, [], "gh_anything", True),
        ("gh.", None, [], "anything", False),
    ],
)
def test_what_an_entry_might_expose(
    prefix: str, include: list[str] | None, exclude: list[str], name: str, could: bool
) -> None:
    assert might_expose(prefix, include, exclude, name) is could


def test_the_tools_an_agent_names_are_found_in_nested_conditions_and_rules() -> None:
    """Names an MCP source may expose get a stand-in while it is down (SPEC §13): those its
    agents name anywhere, however deep in `stop_when`."""
    config = parse_config(
        {
            "upstreams": {"main": {"base_url": "http://upstream.test/v1"}},
            "default_upstream": "main",
            "tools": {"docs": {"kind": "mcp", "url": "http://mcp.test/mcp", "prefix": "docs_"}},
            "agents": {
                "a": {
                    "model": "m",
                    "tools": ["docs_search"],
                    "tool_rules": [{"type": "run_first", "tool_name": "docs_plan"}],
                    "stop_when": [
                        {"has_tool_call": ["docs_top"]},
                        {"any": [{"all": [{"has_tool_call": ["docs_deep"]}]}]},
                        {"not": {"has_tool_call": ["docs_negated"]}},
                    ],
                    "tool_call_limits": [{"tool_name": "docs_limited", "run_limit": 1}],
                }
            },
        }
    )
    server, named = referenced_tools(config)
    assert server == {"docs_search", "docs_limited"}
    assert named == {
        "docs_search",
        "docs_plan",
        "docs_top",
        "docs_deep",
        "docs_negated",
        "docs_limited",
    }


async def test_an_http_tool_s_json_is_made_compact_up_to_a_bound_and_past_it_comes_as_it_came() -> (
    None
):
    """Rewriting a JSON answer holds the event loop as long as its values take to parse: one of
    more than MAX_REWRITTEN_VALUES goes to the model as its server wrote it."""
    small = b'{"a": [1, 2,  3], "big": 123456789012345678901}'
    large = b"[" + b", ".join([b"1"] * (MAX_REWRITTEN_VALUES + 1)) + b"]"

    def handler(request: httpx.Request) -> httpx.Response:
        body = small if request.url.path == "/small" else large
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    tools = {
        name: build_tool(name, ToolConfig(kind="http", url=f"http://t/{name}"), client, THREADS)
        for name in ("small", "large")
    }
    reg = ToolRegistry(tools)
    assert (await reg.execute(ToolCall("c1", "small", "{}"), CTX)).output == (
        '{"a":[1,2,3],"big":123456789012345678901}'
    )
    assert (await reg.execute(ToolCall("c2", "large", "{}"), CTX)).output == large.decode()
