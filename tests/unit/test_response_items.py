"""Responses items to Chat Completions messages and back, item by item (SPEC §12.1, §12.2)."""

from __future__ import annotations

import json
from typing import Any

from proxy.api.response_items import (
    ClientTool,
    ServerCalls,
    client_call_item,
    custom_input,
    items_to_messages,
    output_items,
    upstream_name,
)
from proxy.engine import events as ev
from proxy.engine.run_spec import RunResult
from proxy.engine.stop import Stop, StopReason
from proxy.engine.usage import Usage
from proxy.engine.values import ToolCall, ToolResult, ToolSpec


def fn_call(call_id: str, name: str = "f", arguments: str = "{}", **more: Any) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        **more,
    }


def test_a_string_message_keeps_its_role_and_developer_is_system() -> None:
    assert items_to_messages(
        [
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "developer", "content": "Rules."},
            {"role": "system", "content": "Sys."},
        ]
    ) == [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Rules."},
        {"role": "system", "content": "Sys."},
    ]


def test_user_parts_become_chat_parts() -> None:
    [message] = items_to_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Look"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                    {"type": "input_file", "file_id": "file-1", "filename": "a.pdf"},
                ],
            }
        ]
    )
    assert message["content"] == [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
        {"type": "file", "file": {"file_id": "file-1", "filename": "a.pdf"}},
    ]


def test_assistant_output_text_parts_become_one_string() -> None:
    content = [{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]
    assert items_to_messages([{"role": "assistant", "content": content}]) == [
        {"role": "assistant", "content": "a\nb"}
    ]


def test_consecutive_calls_are_one_assistant_message_joined_to_its_text() -> None:
    messages = items_to_messages(
        [
            {"role": "assistant", "content": "Let me look."},
            fn_call("c1", "a"),
            fn_call("c2", "b", '{"x":1}'),
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
        ]
    )
    assert messages == [
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "b", "arguments": '{"x":1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_assistant_text_after_client_calls_goes_with_them_before_their_outputs() -> None:
    """A JSON response lists its client calls before its text: sent back, the text is the
    calls' message's (a message between calls and their outputs is refused upstream); the
    text after a server call's result is an answer of its own."""
    messages = items_to_messages(
        [
            fn_call("c1", "a"),
            {"type": "message", "role": "assistant", "content": "Let me ask."},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ]
    )
    assert messages == [
        {
            "role": "assistant",
            "content": "Let me ask.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
    ]
    server = {"type": "mcp_call", "id": "mcp_1", "name": "s", "arguments": "{}", "output": "ok"}
    answered = items_to_messages([server, {"role": "assistant", "content": "Done."}])
    assert [m["role"] for m in answered] == ["assistant", "tool", "assistant"]
    assert answered[-1] == {"role": "assistant", "content": "Done."}
    both = items_to_messages(  # a JSON response's server and client calls, then its text
        [
            server,
            fn_call("c1", "a"),
            {"type": "message", "role": "assistant", "content": "Looked, asking."},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ]
    )
    assert [(m["role"], m.get("content")) for m in both] == [
        ("assistant", "Looked, asking."),
        ("tool", "ok"),
        ("tool", "one"),
    ]
    assert [c["id"] for c in both[0]["tool_calls"]] == ["mcp_1", "c1"]


def test_reasoning_and_hosted_items_are_left_out_without_splitting_calls() -> None:
    messages = items_to_messages(
        [
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
            fn_call("c1"),
            {"type": "web_search_call", "id": "ws_1"},
            fn_call("c2"),
        ]
    )
    assert len(messages) == 1
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["c1", "c2"]


def test_an_output_as_parts_is_text() -> None:
    output = [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]
    [_, tool] = items_to_messages(
        [fn_call("c1"), {"type": "function_call_output", "call_id": "c1", "output": output}]
    )
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "a\n[input_image]"}


def test_custom_calls_carry_their_input_as_json_arguments() -> None:
    [assistant, tool] = items_to_messages(
        [
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** x"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
        ]
    )
    function = assistant["tool_calls"][0]["function"]
    assert function["name"] == "apply_patch"
    assert json.loads(function["arguments"]) == {"input": "*** x"}
    assert tool["content"] == "ok"


def test_namespaced_calls_use_the_flat_upstream_name() -> None:
    [assistant] = items_to_messages([fn_call("c1", "find", namespace="crm")])
    assert assistant["tool_calls"][0]["function"]["name"] == "crm__find"
    assert upstream_name("find", "mcp__docs__") == "mcp__docs__find"
    assert upstream_name("find", None) == "find"


def test_an_mcp_call_is_a_call_followed_by_its_result() -> None:
    ok = {"type": "mcp_call", "id": "mcp_1", "server_label": "loopwarden", "name": "s",
          "arguments": "{}", "output": "found", "error": None}  # fmt: skip
    bad = {**ok, "id": "mcp_2", "output": None, "error": {"type": "mcp_tool_execution_error",
           "content": [{"type": "text", "text": "boom"}]}}  # fmt: skip
    as_string = {**ok, "id": "mcp_3", "output": None, "error": "down"}
    assistant, *results = items_to_messages([ok, bad, as_string])
    assert [c["id"] for c in assistant["tool_calls"]] == ["mcp_1", "mcp_2", "mcp_3"]
    assert [r["content"] for r in results] == [
        "found",
        json.dumps({"error": "boom"}, separators=(",", ":")),
        json.dumps({"error": "down"}, separators=(",", ":")),
    ]


def spec(name: str, source: str | None = None) -> ToolSpec:
    return ToolSpec(name, {"type": "function", "function": {"name": name}}, source=source)


def test_server_calls_become_mcp_call_items_in_the_order_they_started() -> None:
    calls = ServerCalls("abc", {"search": spec("search", "notes"), "fetch": spec("fetch")})
    first, second = ToolCall("c1", "search", '{"q":1}'), ToolCall("c2", "fetch", "{}")
    calls.on_event(ev.ToolStarted("run_abc", 1, first))
    calls.on_event(ev.ToolStarted("run_abc", 1, second))
    calls.on_event(ev.ToolExecuted("run_abc", 1, second, ToolResult("nope", "error"), 0.1))
    calls.on_event(ev.ToolExecuted("run_abc", 1, first, ToolResult("found"), 0.1))
    assert calls.unfinished() == []
    ok, failed = calls.items
    assert ok == {
        "id": "mcp_abc_0",
        "type": "mcp_call",
        "status": "completed",
        "server_label": "notes",  # the tool's MCP source
        "name": "search",
        "arguments": '{"q":1}',
        "output": "found",
        "error": None,
    }
    assert failed["status"] == "failed"
    assert failed["server_label"] == "loopwarden"  # a tool of the proxy's own
    assert failed["output"] is None
    assert failed["error"]["message"] == "nope"


def test_a_call_that_never_finished_is_incomplete() -> None:
    calls = ServerCalls("abc", {})
    calls.on_event(ev.ToolStarted("run_abc", 1, ToolCall("c1", "sleep", "{}")))
    [item] = calls.unfinished()
    assert item["status"] == "incomplete"
    assert item["error"]["message"]


def test_client_calls_are_function_or_custom_items_under_the_clients_names() -> None:
    names = {
        "crm__find": ClientTool("function", "find", "crm"),
        "apply_patch": ClientTool("custom", "apply_patch"),
    }
    call = {"id": "c1", "type": "function", "function": {"name": "plain", "arguments": "{}"}}
    assert client_call_item(call, "fc_1", names) == {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "call_id": "c1",
        "name": "plain",
        "arguments": "{}",
    }
    call["function"]["name"] = "crm__find"
    item = client_call_item(call, "fc_1", names)
    assert (item["name"], item["namespace"]) == ("find", "crm")
    call["function"] = {"name": "apply_patch", "arguments": '{"input": "x"}'}
    item = client_call_item(call, "fc_1", names)
    assert (item["type"], item["input"]) == ("custom_tool_call", "x")


def test_custom_input_falls_back_to_the_raw_arguments() -> None:
    assert custom_input('{"input": "a"}') == "a"
    assert custom_input("not json") == "not json"
    assert custom_input('{"other": 1}') == '{"other": 1}'


def test_output_items_are_server_calls_then_client_calls_then_the_message() -> None:
    message = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    result = RunResult("run_abc", Stop(StopReason.CLIENT_TOOL_CALL), message, "tool_calls",
                       Usage(), None, 1, 0, [], False)  # fmt: skip
    server = [{"id": "mcp_abc_0", "type": "mcp_call"}]
    items = output_items(result, "abc", {}, server, None)
    assert [i["type"] for i in items] == ["mcp_call", "function_call", "message"]
    assert items[1]["id"] == "fc_abc_0"
    assert items[2]["id"] == "msg_abc"
    assert items[2]["content"][0]["text"] == "Checking."
    result.message = {"role": "assistant", "content": ""}
    assert output_items(result, "abc", {}, [], None) == []
