"""Reading the bodies the tests send and get: what a request offered, a reply's loop report."""

from __future__ import annotations

from typing import Any


def user(content: str) -> list[dict[str, str]]:
    """The messages of a request that is one user message."""
    return [{"role": "user", "content": content}]


def offered(body: dict[str, Any]) -> list[str]:
    """The names of the tools an upstream request offered, in order."""
    return [t["function"]["name"] for t in body.get("tools") or []]


def loop_of(obj: Any) -> dict[str, Any]:
    """The `loop` report of a reply or chunk parsed by the `openai` SDK (an extra field)."""
    return dict((obj.model_extra or {})["loop"])


def tool_results(body: dict[str, Any]) -> list[str]:
    """The tool results an upstream request carried, in order."""
    return [str(m["content"]) for m in body["messages"] if m["role"] == "tool"]
