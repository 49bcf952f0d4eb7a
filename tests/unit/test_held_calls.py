"""What a run that ends calling the client's tools keeps of the server calls it held back."""

from __future__ import annotations

from proxy.engine.held_calls import held_calls
from proxy.engine.values import ModelReply, ToolCall, Usage


def test_the_held_reply_keeps_what_the_upstream_gave_each_call_under_the_ids_they_go_by() -> None:
    signed = {"google": {"thought_signature": "c2ln"}}
    entries = [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"},
         "extra_content": signed},
        {"id": "call_1", "type": "function", "function": {"name": "ask_user", "arguments": "{}"}},
    ]  # fmt: skip
    calls = [ToolCall("call_0", "get_weather", "{}"), ToolCall("call_1", "ask_user", "{}")]
    reply = ModelReply({"role": "assistant", "tool_calls": entries}, calls, "tool_calls", Usage())
    held = held_calls([], reply, ["call_0", "call_mine"], calls[:1], {"call_0": "4°C"})
    assert held["message"]["tool_calls"] == [entries[0], {**entries[1], "id": "call_mine"}]
    assert held["results"] == [{"role": "tool", "tool_call_id": "call_0", "content": "4°C"}]
