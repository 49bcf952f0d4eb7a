"""Stored contexts (SPEC §10): server-side conversations run with `/chat*`, read and dropped
with `/v1/contexts/{id}`. A context is also the thread of its tool call limits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, read_body, run_or_cancel, send_json
from proxy.api.auth import Caller
from proxy.api.chat_request import json_object
from proxy.api.completion import loop_report
from proxy.api.failures import failed, send_failure
from proxy.api.run_request import RunRequest, parse_loop
from proxy.api.services import Services
from proxy.engine.options import TerminatingOptions, problems
from proxy.engine.run import Run
from proxy.engine.run_spec import RunResult
from proxy.engine.stop import StopReason
from proxy.errors import InvalidRequest, NotFound, PolicyInvalid
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
KEPT_ROLES = frozenset({"user", "assistant", "tool"})  # nudges and directives are per run


def _body(raw: bytes, path: str) -> dict[str, Any]:
    body = json_object(raw)
    fields = MODES[path]
    for key in body:
        if key not in fields:
            raise InvalidRequest(f"unknown field; expected one of {', '.join(fields)}", param=key)
    _text(body.get("context_id"), "context_id")
    if path == "/chat":
        _text(body.get("message"), "message")
    for key in ("agent", "model", "prompt"):
        if body.get(key) is not None:
            _text(body[key], key)
    return body


def _text(value: Any, param: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest("must be a non-empty string", param=param)


def _request(body: dict[str, Any], context: StoredContext, messages: list[Any]) -> RunRequest:
    loop = parse_loop(body.get("loop") or {})
    if loop.agent is not None:
        raise InvalidRequest("a context's agent is set by `agent`", param="loop.agent")
    if loop.thread_id is not None:
        raise InvalidRequest("a context is its own thread", param="loop.thread_id")
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
    return RunRequest(model, messages, loop, has_loop=True, thread_id=context.id)


def _open(body: dict[str, Any], found: StoredContext | None) -> StoredContext:
    agent, model = body.get("agent"), body.get("model")
    if found is None:
        if agent is None and model is None:
            raise InvalidRequest(
                f"context {body['context_id']!r} does not exist; give `agent` or `model` "
                "to create it",
                param="agent",
            )
        return StoredContext(body["context_id"], agent, model)
    for key, value, kept in (("agent", agent, found.agent), ("model", model, found.model)):
        if value is not None and value != kept:
            raise InvalidRequest(f"context {found.id!r} was created with {key} {kept!r}", param=key)
    return found


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
    try:
        return orjson.loads(raw) if isinstance(raw, str) else raw
    except orjson.JSONDecodeError:
        return raw


def kept_messages(result: RunResult) -> list[dict[str, Any]]:
    """What a run adds to its context: its messages, which end with the reply it gave."""
    return [m for m in result.generated if m.get("role") in KEPT_ROLES]


class ContextRuns:
    """`POST /chat`, `/chat/invoke` and `/chat/add-ai-message` as one raw ASGI app."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        bearer = bearer_token(scope)
        caller = sv.keys.caller(bearer)
        raw = await read_body(receive, scope, sv.config.server.max_body_bytes)
        body = _body(raw, scope["path"])
        async with sv.store.hold(body["context_id"]):
            await self._run(sv, caller, bearer, scope, receive, send, body)

    async def _run(
        self,
        sv: Services,
        caller: Caller | None,
        bearer: str | None,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: dict[str, Any],
    ) -> None:
        agent = body.get("agent")
        if agent is not None and agent not in sv.config.agents:
            raise InvalidRequest(f"no agent named {agent!r}", param="agent")
        context = _open(body, await sv.store.load_context(body["context_id"]))
        messages = list(context.messages)
        if body.get("message") is not None:
            messages.append({"role": "user", "content": body["message"]})
        run_messages = list(messages)
        if body.get("prompt"):
            run_messages.append({"role": "system", "content": body["prompt"]})
        if not run_messages:
            raise InvalidRequest(
                f"context {context.id!r} has no messages yet; send one with POST /chat",
                param="context_id",
            )
        plan = sv.planner.plan(_request(body, context, run_messages), caller)
        deps = sv.deps(plan.upstream, bearer, scope["path"])
        result = await run_or_cancel(Run(plan.spec, deps).execute, receive)
        if result is None or result.stop.reason is StopReason.CANCELLED:
            return
        headers = {
            "x-loopwarden-run-id": result.run_id,
            "x-loopwarden-stop-reason": result.stop.reason.value,
        }
        report = loop_report(result, False)
        await sv.remember(result, report, plan.agent or context.model or "")
        if failed(result):  # a failed run saves nothing
            await send_failure(send, result, report, headers)
            return
        added = kept_messages(result)
        context.messages = messages + added
        context.updated = int(time.time())
        await sv.store.save_context(context)
        human = messages[-1:] if body.get("message") is not None else []
        reply = {
            "response": result.message.get("content") or "",
            "saved_ai_messages": True,
            "generated_messages": generated_messages(human + added),
            "loop": report,
        }
        await send_json(send, 200, reply, headers)


async def read_context(sv: Services, context_id: str, bearer: str | None) -> StoredContext:
    """The context, when it exists and the caller may use its agent or model."""
    caller = sv.keys.caller(bearer)
    context = await sv.store.load_context(context_id)
    if context is None:
        raise NotFound(f"no context {context_id!r}")
    sv.keys.check(caller, context.agent or context.model or "")
    return context


async def context_body(sv: Services, context: StoredContext) -> dict[str, Any]:
    return {
        "id": context.id,
        "object": "loopwarden.context",
        "agent": context.agent,
        "model": context.model,
        "created": context.created,
        "updated": context.updated,
        "messages": context.messages,
        "tool_call_counts": await sv.store.thread_counts(context.id),
    }


class ContextRecords:
    """`GET` and `DELETE /v1/contexts/{id}`, as a raw ASGI app."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        context_id = scope["path_params"]["context_id"]
        async with sv.store.hold(context_id):  # not while a run holds it
            found = await read_context(sv, context_id, bearer_token(scope))
            if scope["method"] == "DELETE":
                await sv.store.delete_context(found.id)
                body = {"id": found.id, "object": "loopwarden.context.deleted", "deleted": True}
                await send_json(send, 200, body)
                return
            await send_json(send, 200, await context_body(sv, found))
