"""A `/chat*` request (SPEC §10): its body, checked for its endpoint, and the run it asks
for."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from proxy.api.auth import Caller
from proxy.api.body_fields import UNSAFE_NAME, name, text
from proxy.api.json_body import json_object
from proxy.api.planning import Plan
from proxy.api.run_request import RunRequest, parse_loop
from proxy.api.services import Services
from proxy.engine.option_errors import problems
from proxy.engine.options import TerminatingOptions
from proxy.errors import InvalidRequest, PolicyInvalid
from proxy.state.store import StoredContext

# Each endpoint and the fields its body takes.
MODES: dict[str, tuple[str, ...]] = {
    "/chat": ("context_id", "message", "agent", "model", "terminating_config", "loop"),
    "/chat/invoke": ("context_id", "agent", "model", "terminating_config", "loop"),
    "/chat/add-ai-message": (
        "context_id",
        "prompt",
        "agent",
        "model",
        "terminating_config",
        "loop",
    ),
}


def context_body(raw: bytes, path: str, max_id_chars: int) -> dict[str, Any]:
    """A `/chat*` body, each field checked for the endpoint at `path`."""
    body = json_object(raw)
    fields = MODES[path]
    for key in body:
        if key not in fields:
            raise InvalidRequest(f"unknown field; expected one of {', '.join(fields)}", param=key)
    text(body.get("context_id"), "context_id")
    check_context_id(body["context_id"], max_id_chars)
    if path == "/chat":
        text(body.get("message"), "message")
    for key in ("agent", "model"):
        if body.get(key) is not None:
            name(body[key], key)
    if body.get("agent") is not None and body.get("model") is not None:
        raise InvalidRequest("give `agent` or `model`, not both", param="model")
    if body.get("prompt") is not None:
        text(body["prompt"], "prompt")
    return body


def check_context_id(context_id: str, max_chars: int) -> None:
    """Refuses an id that `/v1/contexts/{id}` could not address (SPEC §10)."""
    if len(context_id) > max_chars:
        raise InvalidRequest(
            f"must be at most {max_chars} characters (state.max_context_id_chars)",
            param="context_id",
        )
    if "/" in context_id or context_id in (".", ".."):
        raise InvalidRequest(
            "must not contain '/' or be '.' or '..': GET /v1/contexts/{id} could not name it",
            param="context_id",
        )
    if UNSAFE_NAME.search(context_id):
        raise InvalidRequest(
            "must not contain control or text direction characters", param="context_id"
        )


async def planned(
    sv: Services, body: dict[str, Any], req: RunRequest, caller: Caller | None
) -> Plan:
    """The run's plan; a problem in a top-level `terminating_config`, which goes into the run's
    `loop`, is reported where the client put it."""
    try:
        return await sv.plan(req, caller)
    except PolicyInvalid as exc:
        if body.get("terminating_config") is None:
            raise
        moved = "loop.terminating_config"
        problems = [
            (path.removeprefix("loop.") if path.startswith(moved) else path, message)
            for path, message in exc.problems
        ]
        raise PolicyInvalid(problems, code=exc.code) from None


def context_request(
    body: dict[str, Any], context: StoredContext, messages: list[Any]
) -> RunRequest:
    """The run a context's request asks for: its own thread, its agent or model."""
    loop = parse_loop(body["loop"] if body.get("loop") is not None else {})
    if loop.agent is not None:
        raise InvalidRequest("a context's agent is set by `agent`", param="loop.agent")
    if loop.thread_id is not None:
        raise InvalidRequest("a context is its own thread", param="loop.thread_id")
    if loop.include_messages:
        raise InvalidRequest(
            "a context's answer has its generated_messages", param="loop.include_messages"
        )
    if body.get("terminating_config") is not None:
        if loop.terminating_config is not None:
            raise InvalidRequest(
                "set terminating_config once, here or in loop", param="terminating_config"
            )
        try:
            terminating = TerminatingOptions.model_validate(body["terminating_config"])
        except ValidationError as exc:
            raise PolicyInvalid(problems(exc, "terminating_config")) from None
        loop = loop.model_copy(update={"terminating_config": terminating})
    model = context.agent or context.model or ""
    return RunRequest(model, messages, loop, has_loop=True, thread_id=context.thread_id)
