"""A context run's messages in the shape SPEC §10 answers them in."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.json_values import nests_too_deep


def generated_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's messages in the shape of SPEC §10."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "user":
            out.append({"sender": "human", "message": message.get("content")})
        elif role == "tool":
            out.append(
                {
                    "type": "tool_response",
                    "tool_call_id": message.get("tool_call_id"),
                    "tool_output": message.get("content"),
                }
            )
        elif role == "assistant":
            if message.get("content"):
                out.append({"sender": "ai", "message": message["content"]})
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                out.append(
                    {
                        "type": "tool_call",
                        "tool_call_id": call.get("id"),
                        "tool_name": function.get("name"),
                        "tool_input": _arguments(function.get("arguments")),
                    }
                )
    return out


def _arguments(raw: Any) -> Any:
    """A call's arguments, parsed when they are JSON an answer can hold, else as they came."""
    if not isinstance(raw, str):
        return raw
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    return raw if nests_too_deep(raw, parsed) else parsed
