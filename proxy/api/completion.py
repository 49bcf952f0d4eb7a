"""The chat completion a run answers with (SPEC §4.2)."""

from __future__ import annotations

import time
from typing import Any

from proxy.engine.run_spec import RunResult
from proxy.engine.stop import StopReason


def completion_id(run_id: str) -> str:
    """The `id` of a run's completion (and of all its chunks)."""
    return f"chatcmpl-{run_id.removeprefix('run_')}"


def completion_body(
    result: RunResult, model: str, report: dict[str, Any], passthrough: bool
) -> dict[str, Any]:
    reply = result.last_reply
    raw = reply.raw if reply is not None and reply.raw is not None else None
    body: dict[str, Any] = dict(raw) if raw else {}
    body["id"] = completion_id(result.run_id)  # never an upstream step's id (SPEC §4.2)
    body["object"] = "chat.completion"
    body.setdefault("created", int(time.time()))
    body.setdefault("model", model)
    if not (passthrough and raw and result.stop.reason is StopReason.COMPLETED):
        message = dict(result.message)
        message.setdefault("content", None)
        message.setdefault("refusal", None)
        body["choices"] = [
            {
                "index": 0,
                "message": message,
                "finish_reason": result.finish_reason,
                "logprobs": _logprobs(raw, message),
            }
        ]
    body["usage"] = result.usage.to_openai()
    body["loop"] = report
    return body


def _logprobs(raw: dict[str, Any] | None, message: dict[str, Any]) -> Any:
    """The last reply's logprobs, when the run's text is that reply's alone (a run of one step):
    the logprobs of the other steps' texts are not kept."""
    choices = raw.get("choices") if raw else None
    first = choices[0] if isinstance(choices, list) and choices else None
    logprobs = first.get("logprobs") if isinstance(first, dict) else None
    if logprobs is None:  # (as most replies: none asked for)
        return None
    said = first.get("message") if isinstance(first, dict) else None
    if not isinstance(said, dict) or said.get("content") != message.get("content"):
        return None
    return logprobs
