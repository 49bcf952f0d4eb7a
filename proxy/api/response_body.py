"""The `response` object a run answers with on `/v1/responses` (SPEC §12.2)."""

from __future__ import annotations

import time
from typing import Any

from proxy.engine.run_spec import RunResult
from proxy.engine.stop import StopReason
from proxy.engine.usage import Usage

# Stops whose last step the upstream may have cut at the client's own `max_output_tokens`.
OWN_CUT = frozenset({StopReason.COMPLETED, StopReason.FINISH_REASON})


def response_id(run_id: str) -> str:
    return f"resp_{run_id.removeprefix('run_')}"


def item_prefix(run_id: str) -> str:
    """What every output item id of a run starts with after its kind (`msg_<prefix>`)."""
    return run_id.removeprefix("run_")


def response_usage(usage: Usage) -> dict[str, Any]:
    prompt = usage.details.get("prompt_tokens_details") or {}
    completion = usage.details.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": prompt.get("cached_tokens", 0),
            "cache_write_tokens": prompt.get("cache_write_tokens", 0),
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": completion.get("reasoning_tokens", 0)},
        "total_tokens": usage.total_tokens,
    }


def cut_short(result: RunResult, max_output_tokens: int | None) -> bool:
    """The last step stopped at the client's own `max_output_tokens` (status `incomplete`): cut
    for length with as many output tokens (or with none reported); an upstream that stopped
    for length below them stopped for a reason of its own (its context window)."""
    reply = result.last_reply
    if max_output_tokens is None or reply is None or result.stop.reason not in OWN_CUT:
        return False
    tokens = reply.usage.completion_tokens
    return reply.finish_reason == "length" and (tokens == 0 or tokens >= max_output_tokens)


def response_object(
    run_id: str,
    created_at: int,
    model: str,
    echo: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
) -> dict[str, Any]:
    """A response with no usage yet: what `response.created` shows, and the base of the rest."""
    return {
        "id": response_id(run_id),
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": output,
        **echo,
        "usage": None,
    }


def finished_response(
    result: RunResult,
    created_at: int,
    model: str,
    echo: dict[str, Any],
    output: list[dict[str, Any]],
    report: dict[str, Any],
    max_output_tokens: int | None,
) -> dict[str, Any]:
    """The response of a run that did not fail: `completed`, or `incomplete` when cut at the
    client's own token cap (SPEC §12.2)."""
    incomplete = cut_short(result, max_output_tokens)
    body = response_object(
        result.run_id, created_at, model, echo, "incomplete" if incomplete else "completed", output
    )
    if incomplete:
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        body["completed_at"] = int(time.time())
    body["usage"] = response_usage(result.usage)
    body["loop"] = report
    return body
