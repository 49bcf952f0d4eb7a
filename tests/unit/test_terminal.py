"""SPEC §7: terminal tools and terminating config, including every failure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.engine.options import DEFAULT_NUDGE
from proxy.engine.stop import StopReason
from tests.fakes import reply
from tests.unit.harness import Harness, problem


def fail(_: dict[str, Any]) -> str:
    raise ValueError("report rejected")


async def test_terminal_tool_output_is_the_reply_verbatim() -> None:
    h = Harness(
        [reply(calls=[("search", "{}")]), reply(calls=[("submit", '{"r": 1}')])],
        {"search": lambda _: "x", "submit": lambda _: "REPORT #7 filed"},
        terminal=("submit",),
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TERMINAL_TOOL
    assert result.message == {"role": "assistant", "content": "REPORT #7 filed"}
    assert result.finish_reason == "stop"


async def test_calls_after_a_successful_terminal_call_are_dropped_from_history() -> None:
    h = Harness(
        [reply(calls=[("search", "{}"), ("submit", "{}"), ("search", "{}")])],
        {"search": lambda _: "x", "submit": lambda _: "done"},
        terminal=("submit",),
    )
    result = await h.run()
    assert [c[0] for c in h.tools.calls] == ["search", "submit"]
    assistant = result.generated[0]
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["search", "submit"]
    tool_ids = [m["tool_call_id"] for m in result.generated if m["role"] == "tool"]
    assert tool_ids == [c["id"] for c in assistant["tool_calls"]]


async def test_failed_terminal_tool_does_not_end_the_run_and_blocks_later_terminal_calls() -> None:
    h = Harness(
        [reply(calls=[("submit", "{}"), ("final", "{}")]), reply("giving up")],
        {"submit": fail, "final": lambda _: "never"},
        terminal=("submit", "final"),
    )
    result = await h.run()
    assert [c[0] for c in h.tools.calls] == ["submit"]
    tool_msgs = [m for m in h.model.requests[1].messages if m["role"] == "tool"]
    assert json.loads(tool_msgs[0]["content"]) == {"error": "report rejected"}
    assert "already failed" in json.loads(tool_msgs[1]["content"])["error"]
    assert result.stop.reason is StopReason.COMPLETED


async def test_terminating_config_makes_tools_terminal_by_name() -> None:
    h = Harness(
        [reply(calls=[("done", '{"x": 1}')])],
        {"done": lambda _: "finished"},
        terminating={"tool_ids": ["done"]},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TERMINAL_TOOL


async def test_content_only_reply_is_nudged_with_the_default_message() -> None:
    h = Harness(
        [reply("I think I'm done"), reply(calls=[("done", "{}")])],
        {"done": lambda _: "ok"},
        terminating={"tool_ids": ["done"]},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TERMINAL_TOOL
    second = h.model.requests[1].messages
    assert second[-2] == {"role": "assistant", "content": "I think I'm done"}
    assert second[-1] == {"role": "system", "content": DEFAULT_NUDGE}


async def test_nudges_exhausted_fails_with_its_code() -> None:
    h = Harness(
        [reply("a"), reply("b"), reply("c")],
        {"done": lambda _: "ok"},
        terminating={"tool_ids": ["done"], "consecutive_nudges": 2, "nudge_message": "Call done."},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.NUDGES_EXHAUSTED
    assert result.stop.error_code == "max_consecutive_nudges_exceeded"
    assert result.steps == 3
    assert h.model.requests[2].messages[-1]["content"] == "Call done."


async def test_a_tool_call_resets_the_nudge_counter() -> None:
    h = Harness(
        [reply("a"), reply(calls=[("work", "{}")]), reply("b"), reply(calls=[("done", "{}")])],
        {"done": lambda _: "ok", "work": lambda _: "w"},
        terminating={"tool_ids": ["done"], "consecutive_nudges": 1},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TERMINAL_TOOL


async def test_a_call_to_an_unknown_tool_resets_the_nudge_counter_too() -> None:
    h = Harness(
        [reply("a"), reply(calls=[("nope", "{}")]), reply("b"), reply(calls=[("done", "{}")])],
        {"done": lambda _: "ok"},
        terminating={"tool_ids": ["done"], "consecutive_nudges": 1},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TERMINAL_TOOL  # not nudges_exhausted
    assert "Unknown tool 'nope'" in result.generated[3]["content"]


async def test_zero_nudges_fails_on_the_first_content_reply() -> None:
    h = Harness(
        [reply("a")],
        {"done": lambda _: "ok"},
        terminating={"tool_ids": ["done"], "consecutive_nudges": 0},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.NUDGES_EXHAUSTED


async def test_max_invocations_fails_the_run() -> None:
    h = Harness(
        [reply(calls=[("work", "{}")]) for _ in range(5)],
        {"done": lambda _: "ok", "work": lambda _: "w"},
        terminating={"tool_ids": ["done"], "max_invocations": 3},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.MAX_INVOCATIONS
    assert result.stop.error_code == "max_invocations_exceeded"
    assert len(h.model.requests) == 3
    assert result.stop.details["threshold"] == 3


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({}, "terminating_config.tool_ids"),
        ({"tool_ids": []}, "terminating_config.tool_ids"),
        ({"tool_ids": [1]}, "terminating_config.tool_ids[0]"),
        ({"tool_ids": ["a"], "consecutive_nudges": -1}, "terminating_config.consecutive_nudges"),
        ({"tool_ids": ["a"], "max_invocations": 0}, "terminating_config.max_invocations"),
        ({"tool_ids": ["a"], "nudge_message": ""}, "terminating_config.nudge_message"),
        ({"tool_ids": ["a"], "nudges": 1}, "terminating_config.nudges"),
        ([], "terminating_config"),
    ],
)
def test_bad_terminating_config_names_its_path(raw: Any, param: str) -> None:
    assert problem({"terminating_config": raw})[0] == param
