"""Tool output is capped (`server.max_tool_output_bytes`, a tool's own `max_output_bytes`): more
is a tool error the model reads (SPEC §5.4), never an HTTP error."""

from __future__ import annotations

import logging
import os
from typing import Any

import orjson
import pytest

from tests.bodies import tool_results, user
from tests.integration.conftest import ProxyFactory
from tests.scripted_upstream import call, calls, last_tool_result, say_tool_result
from tests.tools import TOOLS

CAPPED = {
    "server": {"max_tool_output_bytes": 200},
    "tools": {**TOOLS, "get_weather": {**TOOLS["get_weather"], "max_output_bytes": 20}},
    "agents": {"a": {"model": "scripted", "tools": ["search_notes", "get_weather"]}},
}


async def test_an_output_over_the_cap_is_a_tool_error_for_the_model(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(CAPPED) as proxy:
        proxy.upstream.script(
            call("search_notes", query="q" * 150),
            say_tool_result("notes: {}"),
            call("search_notes", query="q" * 300),
            say_tool_result("notes: {}"),
            call("get_weather", city="Oslo"),
            say_tool_result("weather: {}"),
        )
        fits = await proxy.chat(model="a", messages=user("short"))
        too_long = await proxy.chat(model="a", messages=user("long"))
        own_cap = await proxy.chat(model="a", messages=user("weather"))
    assert fits.status_code == 200
    assert "none settles it" in fits.json()["choices"][0]["message"]["content"]
    for response, cap in ((too_long, 200), (own_cap, 20)):
        assert response.status_code == 200
        text = response.json()["choices"][0]["message"]["content"]
        assert f"larger than {cap} bytes" in text
        assert response.json()["loop"]["stop_reason"] == "completed"
    tool_message = proxy.upstream.bodies[3]["messages"][-1]
    assert "error" in orjson.loads(tool_message["content"])


def loud_failure(size: int) -> str:
    raise ValueError("x" * size)


def leaky() -> str:
    raise RuntimeError("db connect failed: postgres://admin:hunter2@db:5432/app, token=abc123")


def undecodable_name() -> str:
    return os.fsdecode(b"caf\xe9.txt")  # a Latin-1 file name: a lone surrogate in the text


def _own(name: str) -> dict[str, Any]:
    return {"kind": "python", "callable": f"tests.integration.test_tool_output:{name}"}


OWN = {
    "tools": {
        "loud_failure": {**_own("loud_failure"), "max_output_bytes": 10_000},
        "undecodable_name": _own("undecodable_name"),
        "leaky": _own("leaky"),
    },
    "agents": {"a": {"model": "scripted", "tools": ["loud_failure", "undecodable_name", "leaky"]}},
}


async def test_a_tool_s_error_text_is_capped_as_its_output_is(proxy_for: ProxyFactory) -> None:
    async with proxy_for(OWN) as proxy:
        proxy.upstream.script(call("loud_failure", size=5_000_000), say_tool_result())
        r = await proxy.chat(model="a", messages=user("go"))
    error = orjson.loads(last_tool_result(proxy.upstream.bodies[1]))["error"]
    assert r.status_code == 200
    assert error.startswith("ValueError: xxx")
    assert error.endswith("…")
    assert len(error.encode()) <= 10_000


async def test_a_lone_surrogate_in_a_tool_s_output_is_replaced(proxy_for: ProxyFactory) -> None:
    async with proxy_for(OWN) as proxy:
        proxy.upstream.script(call("undecodable_name"), say_tool_result("Found {}."))
        r = await proxy.chat(model="a", messages=user("go"))
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Found caf?.txt."


async def test_a_tool_s_error_text_leaves_out_what_looks_like_a_credential(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(OWN) as proxy:
        proxy.upstream.script(call("leaky"), say_tool_result())
        await proxy.chat(model="a", messages=user("go"))
    error = orjson.loads(last_tool_result(proxy.upstream.bodies[1]))["error"]
    assert error == (
        "RuntimeError: db connect failed: postgres://[redacted]@db:5432/app, [redacted]"
    )


async def test_the_outputs_of_a_run_s_calls_together_are_bounded_too(
    proxy_for: ProxyFactory,
) -> None:
    """Each output within its cap, 128 parallel calls of 1 MiB sent the upstream a body of
    131 MB (and a Responses run stored it, read whole at every look): past
    `server.max_run_tool_output_bytes` a call's output is a tool error, in the next step's
    calls too."""
    config = {
        "server": {"max_run_tool_output_bytes": 2500},
        "agents": {"a": {"model": "scripted", "tools": ["search_notes"]}},
    }
    notes = [call("search_notes", query=f"{n}" * 1000) for n in range(3)]
    async with proxy_for(config) as proxy:
        proxy.upstream.script(
            calls(*notes), call("search_notes", query="short"), say_tool_result("last: {}")
        )
        r = await proxy.chat(model="a", messages=user("notes"))
        sent = proxy.upstream.bodies
        outcomes = {
            o: proxy.metric("loopwarden_tool_calls_total", tool="search_notes", outcome=o)
            for o in ("ok", "error")
        }
    assert r.status_code == 200
    assert outcomes == {"ok": 4, "error": 0}  # the tool's health: each call succeeded
    first, second, third = tool_results(sent[1])
    assert (first.count("0"), second.count("1")) == (1000, 1000)  # 2 x ~1,040 bytes
    assert "was left out" in orjson.loads(third)["error"]
    assert "(server.max_run_tool_output_bytes)" in orjson.loads(third)["error"]
    later = tool_results(sent[2])[-1]
    assert "none settles it" in later  # a short one still fits what is left


async def test_a_terminal_tool_ends_the_run_whatever_the_run_s_output_left(
    proxy_for: ProxyFactory,
) -> None:
    """`final_answer`'s output is the answer: counted, it was a tool error once earlier calls
    had given the model what the run may, and the run went on to `max_steps`."""
    config = {
        "server": {"max_run_tool_output_bytes": 1500},
        "agents": {"a": {"model": "scripted", "tools": ["search_notes", "final_answer"]}},
    }
    async with proxy_for(config) as proxy:
        proxy.upstream.script(
            call("search_notes", query="q" * 1400), call("final_answer", answer="A" * 1000)
        )
        r = await proxy.chat(model="a", messages=user("notes"))
    assert r.json()["loop"]["stop_reason"] == "terminal_tool"
    assert r.json()["choices"][0]["message"]["content"] == "A" * 1000


async def test_a_message_naming_tools_lists_a_few_of_them(proxy_for: ProxyFactory) -> None:
    """An unknown tool's message listed every server tool (an MCP source may expose 4,096),
    uncounted by any bound: 128 such calls a reply made megabytes."""
    many = {f"tool_{n:03}": TOOLS["search_notes"] for n in range(100)}
    config = {
        "tools": {**TOOLS, **many},
        "agents": {"a": {"model": "scripted", "tools": sorted(many)}},
    }
    async with proxy_for(config) as proxy:
        proxy.upstream.script(call("nope" * 100), say_tool_result("{}"))
        await proxy.chat(model="a", messages=user("hi"))
        told = orjson.loads(tool_results(proxy.upstream.bodies[1])[0])["error"]
    assert told.startswith("Unknown tool '" + "nope" * 16 + "'. Tools: tool_000, tool_001")
    assert told.endswith("tool_031 and 68 more.")


async def test_a_tool_s_failures_are_told_in_the_log_once_a_second(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The model read why a tool failed, the span said `tool_error`: the log said nothing, the
    operator's only place for the reason."""
    config = {"agents": {"a": {"model": "scripted", "tools": ["broken"]}}}
    async with proxy_for(config) as proxy:
        proxy.upstream.script(
            calls(call("broken", reason="disk full"), call("broken", reason="disk full")),
            say_tool_result(),
        )
        with caplog.at_level(logging.WARNING, logger="proxy.tools"):
            r = await proxy.chat(model="a", messages=user("go"))
    assert r.status_code == 200
    told = [rec.getMessage() for rec in caplog.records if "tool broken failed" in rec.getMessage()]
    assert told == ["tool broken failed: ValueError: disk full"]  # the second: within a second
