"""Stored contexts (SPEC §10): server-side conversations run with `/chat*`, read and dropped
with `/v1/contexts/{id}`. A context is also the thread of its tool call limits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from proxy.api.auth import Caller
from proxy.api.chat import header, read_body, run_or_cancel
from proxy.api.chat_request import ChatRequest, json_object, parse_loop
from proxy.api.gateway import Gateway
from proxy.api.report import failed, loop_report, send_failure
from proxy.api.responses import send_error, send_json
from proxy.engine.fields import text
from proxy.engine.policies.terminal import parse_terminating_config
from proxy.engine.run import Run, RunResult
from proxy.engine.stop import StopReason
from proxy.errors import ClientDisconnected, InvalidRequest, NotFound, ProxyError
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
    text(body.get("context_id"), "context_id")
    if path == "/chat":
        text(body.get("message"), "message")
    for key in ("agent", "model", "prompt"):
        if body.get(key) is not None:
            text(body[key], key)
    return body


def _request(body: dict[str, Any], context: StoredContext, messages: list[Any]) -> ChatRequest:
    loop = parse_loop(body.get("loop") or {})
    if loop.agent is not None:
        raise InvalidRequest("a context's agent is set by `agent`", param="loop.agent")
    if loop.thread_id is not None:
        raise InvalidRequest("a context is its own thread", param="loop.thread_id")
    if body.get("terminating_config") is not None:
        if loop.terminating is not None:
            raise InvalidRequest(
                "set terminating_config once, here or in loop", param="terminating_config"
            )
        loop.terminating = parse_terminating_config(
            body["terminating_config"], "terminating_config"
        )
    loop.thread_id = context.id
    model = context.agent or context.model or ""
    return ChatRequest(model, messages, False, False, [], None, None, {}, loop, True)


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
    """What a run adds to its context: its messages, ending with the reply it gave."""
    kept = [m for m in result.generated if m.get("role") in KEPT_ROLES]
    final = result.message
    if final.get("content") and (not kept or kept[-1] != final):
        kept.append({"role": "assistant", "content": final["content"]})
    return kept


class ContextRuns:
    """`POST /chat`, `/chat/invoke` and `/chat/add-ai-message` as one raw ASGI app."""

    def __init__(self, gateway: Callable[[], Gateway]) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway()
        path = scope["path"]
        try:
            caller = gw.keys.caller(header(scope, b"authorization"))
            body = _body(await read_body(receive, scope, gw.config.server.max_body_bytes), path)
            async with gw.store.hold(body["context_id"]):
                await self._run(gw, caller, scope, receive, send, body)
        except ClientDisconnected:
            return
        except ProxyError as exc:
            await send_error(send, exc)

    async def _run(
        self,
        gw: Gateway,
        caller: Caller | None,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: dict[str, Any],
    ) -> None:
        agent = body.get("agent")
        if agent is not None and agent not in gw.config.agents:
            raise InvalidRequest(f"no agent named {agent!r}", param="agent")
        context = _open(body, await gw.store.load_context(body["context_id"]))
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
        req = _request(body, context, run_messages)
        resolved = gw.resolver.resolve(req, None)
        resolved.spec.route = scope["path"]
        gw.keys.check(caller, resolved.agent or req.model)
        deps = gw.deps(resolved.upstream, header(scope, b"authorization"))
        result = await run_or_cancel(Run(resolved.spec, deps).execute, receive)
        if result is None or result.stop.reason is StopReason.CANCELLED:
            return
        headers = {
            "x-loopwarden-run-id": result.run_id,
            "x-loopwarden-stop-reason": result.stop.reason.value,
        }
        report = loop_report(result, False)
        if failed(result):  # a failed run saves nothing
            await send_failure(send, result, report, headers)
            return
        added = kept_messages(result)
        context.messages = messages + added
        context.updated = int(time.time())
        await gw.store.save_context(context)
        human = messages[-1:] if body.get("message") is not None else []
        reply = {
            "response": result.message.get("content") or "",
            "saved_ai_messages": True,
            "generated_messages": generated_messages(human + added),
            "loop": report,
        }
        await send_json(send, 200, reply, headers)


async def read_context(gw: Gateway, context_id: str, authorization: str | None) -> StoredContext:
    """The context, when it exists and the caller may use its agent or model."""
    caller = gw.keys.caller(authorization)
    context = await gw.store.load_context(context_id)
    if context is None:
        raise NotFound(f"no context {context_id!r}")
    gw.keys.check(caller, context.agent or context.model or "")
    return context


async def context_body(gw: Gateway, context: StoredContext) -> dict[str, Any]:
    return {
        "id": context.id,
        "object": "loopwarden.context",
        "agent": context.agent,
        "model": context.model,
        "created": context.created,
        "updated": context.updated,
        "messages": context.messages,
        "tool_call_counts": await gw.store.thread_counts(context.id),
    }
