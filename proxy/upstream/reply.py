"""Turning upstream bodies and stream chunks into the engine's `ModelReply`."""

from __future__ import annotations

from typing import Any

from proxy.engine.usage import Usage
from proxy.engine.values import ModelReply, ToolCall


def _cost(usage: Any) -> float | None:
    if isinstance(usage, dict):
        cost = usage.get("cost")
        if isinstance(cost, int | float) and not isinstance(cost, bool):
            return float(cost)
    return None


def _calls(raw: Any) -> list[ToolCall]:
    calls = []
    for i, call in enumerate(raw or []):
        function = call.get("function") or {}
        calls.append(
            ToolCall(
                call.get("id") or f"call_{i}",
                function.get("name") or "",
                function.get("arguments") or "",
            )
        )
    return calls


def reply_from_body(body: dict[str, Any]) -> ModelReply:
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {"role": "assistant", "content": None}
    usage = body.get("usage")
    return ModelReply(
        message=message,
        tool_calls=_calls(message.get("tool_calls")),
        finish_reason=choice.get("finish_reason"),
        usage=Usage.from_openai(usage),
        reported_cost_usd=_cost(usage),
        response_id=body.get("id"),
        response_model=body.get("model"),
        raw=body,
    )


class ChunkAccumulator:
    """Builds one reply from `chat.completion.chunk`s."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.id: str | None = None
        self.model: str | None = None

    def add(self, chunk: dict[str, Any]) -> str | None:
        """Takes a chunk; returns its content delta, if any."""
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not choices:
            return None
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta") or {}
        for call in delta.get("tool_calls") or ():
            slot = self.calls.setdefault(
                call.get("index", len(self.calls)), {"id": None, "name": "", "arguments": []}
            )
            slot["id"] = slot["id"] or call.get("id")
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            slot["arguments"].append(function.get("arguments") or "")
        if delta.get("refusal"):
            self.refusal.append(delta["refusal"])
        content = delta.get("content")
        if content:
            self.content.append(content)
            return str(content)
        return None

    def reply(self) -> ModelReply:
        calls = [
            ToolCall(slot["id"] or f"call_{index}", slot["name"], "".join(slot["arguments"]))
            for index, slot in sorted(self.calls.items())
        ]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content or not calls else None,
        }
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return ModelReply(
            message=message,
            tool_calls=calls,
            finish_reason=self.finish_reason,
            usage=Usage.from_openai(self.usage),
            reported_cost_usd=_cost(self.usage),
            response_id=self.id,
            response_model=self.model,
        )
