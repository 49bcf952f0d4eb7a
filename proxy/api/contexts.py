"""Stored contexts (SPEC §10): server-side conversations run with `/chat*`, read and dropped
with `/v1/contexts/{id}`. A context is also the thread of its tool call limits."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, run_or_cancel, send_error, send_json
from proxy.api.auth import Caller
from proxy.api.chat_request import name
from proxy.api.completion import loop_report
from proxy.api.context_end import ContextEnd, kept_messages, messages_size
from proxy.api.failures import failed, send_failure
from proxy.api.headers import not_replayed, run_headers, stopped
from proxy.api.json_body import json_object, read_json
from proxy.api.planning import Plan
from proxy.api.run_request import RunRequest, parse_loop
from proxy.api.services import Services
from proxy.engine.options import TerminatingOptions, problems
from proxy.engine.run import Run
from proxy.errors import (
    BodyTooLarge,
    InvalidRequest,
    NotFound,
    PolicyInvalid,
    StateUnavailable,
)
from proxy.json_values import nests_too_deep
from proxy.state.store import Holding, StateStore, StoredContext

log = logging.getLogger(__name__)

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


def _body(raw: bytes, path: str, max_id_chars: int) -> dict[str, Any]:
    body = json_object(raw)
    fields = MODES[path]
    for key in body:
        if key not in fields:
            raise InvalidRequest(f"unknown field; expected one of {', '.join(fields)}", param=key)
    _text(body.get("context_id"), "context_id")
    check_context_id(body["context_id"], max_id_chars)
    if path == "/chat":
        _text(body.get("message"), "message")
    for key in ("agent", "model"):
        if body.get(key) is not None:
            name(body[key], key)
    if body.get("agent") is not None and body.get("model") is not None:
        raise InvalidRequest("give `agent` or `model`, not both", param="model")
    if body.get("prompt") is not None:
        _text(body["prompt"], "prompt")
    return body


def _made_with(context: StoredContext) -> str:
    """The field a context's agent or model was given by."""
    return "agent" if context.agent is not None else "model"


def _text(value: Any, param: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest("must be a non-empty string", param=param)


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
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in context_id):
        raise InvalidRequest("must not contain control characters", param="context_id")


def stored_id(context_id: str, caller: Caller | None) -> str:
    """Where a context is kept: in its key's own namespace (two keys that name one id have a
    context each, and neither learns of the other's), without keys as it is named."""
    return context_id if caller is None else caller.scoped(context_id)


async def _kept_before(sv: Services, context_id: str, caller: Caller | None) -> bool:
    """Whether the key has a context kept, before contexts had namespaces, as it is named."""
    if caller is None:
        return False
    found = await sv.store.load_context(context_id)
    return found is not None and found.owner == caller.name


def _moved_in(found: StoredContext | None, caller: Caller) -> StoredContext | None:
    """A key's context kept before namespaces, as its next save keeps it in the key's (its
    thread and its counts stay); None when there is none, or it is not the key's."""
    if found is None or found.owner != caller.name:
        return None
    scoped = stored_id(found.id, caller)
    return dataclasses.replace(found, id=scoped, version=0, thread=found.thread_id)


def _visible(context: StoredContext, caller: Caller | None) -> bool:
    """A context belongs to the key that created it; one created without keys, to no key (once
    keys are on, every key read and wrote those of the time before: as a stored response)."""
    return caller is None or context.owner == caller.name


def _unowned_for(context: StoredContext, caller: Caller | None) -> bool:
    """A context made while no keys were on, which a key that may use every agent may drop (no
    key may read or run it)."""
    return context.owner is None and caller is not None and caller.unrestricted


def _plan(sv: Services, body: dict[str, Any], req: RunRequest, caller: Caller | None) -> Plan:
    """The run's plan; a problem in a top-level `terminating_config`, which goes into the run's
    `loop`, is reported where the client put it."""
    try:
        return sv.planner.plan(req, caller)
    except PolicyInvalid as exc:
        if body.get("terminating_config") is None:
            raise
        moved = "loop.terminating_config"
        problems = [
            (path.removeprefix("loop.") if path.startswith(moved) else path, message)
            for path, message in exc.problems
        ]
        raise PolicyInvalid(problems, code=exc.code) from None


def _request(body: dict[str, Any], context: StoredContext, messages: list[Any]) -> RunRequest:
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


def _open(
    body: dict[str, Any], found: StoredContext | None, caller: Caller | None
) -> StoredContext:
    agent, model, context_id = body.get("agent"), body.get("model"), body["context_id"]
    if found is not None and not _visible(found, caller):
        raise NotFound(f"no context {context_id!r}", param="context_id")
    if found is None:
        if agent is None and model is None:
            raise InvalidRequest(
                f"context {body['context_id']!r} does not exist; give `agent` or `model` "
                "to create it",
                param="agent",
            )
        if caller is None:
            return StoredContext(context_id, agent, model)
        # It and its thread are in its key's namespace, as a client's `thread_id` is.
        scoped = stored_id(context_id, caller)
        return StoredContext(scoped, agent, model, owner=caller.name, thread=scoped)
    for key, value, kept in (("agent", agent, found.agent), ("model", model, found.model)):
        if value is not None and value != kept:
            raise InvalidRequest(
                f"context {context_id!r} was created with {key} {kept!r}", param=key
            )
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
    """A call's arguments, parsed when they are JSON an answer can hold, else as they came."""
    if not isinstance(raw, str):
        return raw
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    return raw if nests_too_deep(raw, parsed) else parsed


@contextlib.asynccontextmanager
async def held(
    store: StateStore, context_id: str, receive: Receive
) -> AsyncIterator[Holding | None]:
    """Holds a context for a request, waiting behind the run that holds it for as long as the
    client stays: None when it left first (nothing is to be done, or sent)."""
    async with contextlib.AsyncExitStack() as stack:

        async def take() -> Holding:
            return await stack.enter_async_context(store.hold(context_id))

        yield await run_or_cancel(take, receive)


class ContextRuns:
    """`POST /chat`, `/chat/invoke` and `/chat/add-ai-message` as one raw ASGI app."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        bearer = bearer_token(scope)
        caller = sv.keys.caller(bearer)
        path, max_chars = scope["path"], sv.config.state.max_context_id_chars
        body = await read_json(
            receive, scope, sv.config.server, lambda raw: _body(raw, path, max_chars)
        )
        context_id = body["context_id"]
        async with held(sv.store, stored_id(context_id, caller), receive) as holding:
            if holding is None:
                return
            if holding.context is not None or not await _kept_before(sv, context_id, caller):
                await self._run(sv, caller, bearer, scope, receive, send, body, holding)
                return
            assert caller is not None
            # Moved in under both holds (the key's first, as `DELETE` takes them): saved in the
            # key's namespace, it is dropped where it was.
            async with held(sv.store, context_id, receive) as before:
                if before is None:
                    return
                found = _moved_in(before.context, caller)
                await self._run(sv, caller, bearer, scope, receive, send, body, holding, found)
                if found is not None and found.version > 0:
                    await _drop_quietly(sv, context_id)

    async def _run(
        self,
        sv: Services,
        caller: Caller | None,
        bearer: str | None,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: dict[str, Any],
        holding: Holding,
        moved: StoredContext | None = None,
    ) -> None:
        context = _opened(sv, body, holding.context or moved, caller)
        cap = sv.config.state.max_context_bytes
        messages, run_messages = _messages(body, context, cap)
        plan = _plan(sv, body, _request(body, context, run_messages), caller)
        deps = sv.deps(plan.upstream, bearer, scope["path"])
        owner = plan.agent or context.model or ""
        end = ContextEnd(sv, holding, context, messages, owner, caller)
        run = Run(plan.spec, deps, keep=end.save)
        ended = await run_or_cancel(run.execute, receive)
        result = await sv.unless_left(run, ended, lambda r: loop_report(r, False), owner, caller)
        if result is None:
            return
        report = loop_report(result, False)
        if not end.tried:  # a failed run: kept alone, as the hold is let go
            await end.records(result, report)
        elif failed(result):  # its save refused: the hold is gone
            await sv.remember(result, report, owner, caller)
        refused, added = end.refused, kept_messages(result)
        headers = run_headers(result.run_id)
        stopped(headers, result)
        if failed(result):
            await send_failure(send, result, report, headers)
            return
        if refused is not None:
            not_replayed(headers, result)
            await send_error(send, refused, headers, {"loop": report})
            return
        human = messages[-1:] if body.get("message") is not None else []
        reply = {
            "response": result.message.get("content") or "",
            "saved_ai_messages": True,
            "generated_messages": generated_messages(human + added),
            "loop": report,
        }
        await send_json(send, 200, reply, headers)


def _opened(
    sv: Services, body: dict[str, Any], found: StoredContext | None, caller: Caller | None
) -> StoredContext:
    """The context the request names, as held (made anew on first use), once the caller may
    run it and its agent is still in the config."""
    agent = body.get("agent")
    if agent is not None:  # a key that may not use it learns nothing of whether it exists
        sv.keys.check(caller, agent, "agent")
        if agent not in sv.config.agents:
            raise InvalidRequest(f"no agent named {agent!r}", param="agent")
    context = _open(body, found, caller)
    if context.agent is not None and context.agent not in sv.config.agents:
        raise InvalidRequest(
            f"context {body['context_id']!r} was made with agent {context.agent!r}, which the "
            "config no longer has",
            param="context_id",
            code="agent_not_found",
        )
    sv.keys.check(caller, context.agent or context.model or "", _made_with(context))
    return context


def _messages(
    body: dict[str, Any], context: StoredContext, cap: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The context's messages with the request's new one (within `cap` bytes), and what the
    run sends: those and the request's `prompt`, for this run only."""
    messages = list(context.messages)
    if body.get("message") is not None:
        messages.append({"role": "user", "content": body["message"]})
    if messages_size(messages) > cap:
        param = "message" if body.get("message") is not None else "context_id"
        raise BodyTooLarge(
            f"context {context.name!r} would hold more than {cap} bytes of messages "
            "(state.max_context_bytes)",
            param=param,
            code="context_too_large",
        )
    run_messages = list(messages)
    if body.get("prompt"):
        run_messages.append({"role": "system", "content": body["prompt"]})
    if not run_messages:
        raise InvalidRequest(
            f"context {context.name!r} has no messages yet; send one with POST /chat",
            param="context_id",
        )
    return messages, run_messages


async def read_context(sv: Services, context_id: str, caller: Caller | None) -> StoredContext:
    found = await sv.store.load_context(stored_id(context_id, caller))
    if found is None and caller is not None:  # kept before contexts had namespaces
        found = await sv.store.load_context(context_id)
    return _readable(sv, context_id, found, caller)


def _readable(
    sv: Services, context_id: str, context: StoredContext | None, caller: Caller | None
) -> StoredContext:
    """The context, when it exists, is the caller's (another key's is not found: a 403 would
    tell that it exists) and the caller may use its agent or model."""
    if context is None or not _visible(context, caller):
        raise NotFound(f"no context {context_id[:256]!r}")
    sv.keys.check(caller, context.agent or context.model or "")
    return context


async def context_body(sv: Services, context: StoredContext) -> dict[str, Any]:
    return {
        "id": context.name,
        "object": "loopwarden.context",
        "agent": context.agent,
        "model": context.model,
        "created": context.created,
        "updated": context.updated,
        "messages": context.messages,
        "tool_call_counts": await sv.store.thread_counts(context.thread_id),
    }


async def _drop(
    sv: Services, context_id: str, kept: StoredContext | None, caller: Caller | None
) -> bool:
    """Drops `kept` when it is there and the caller's to drop (404 when it is another key's,
    403 when the key may no longer use its agent); whether it dropped one."""
    if kept is None:
        return False
    if not _unowned_for(kept, caller):
        _readable(sv, context_id, kept, caller)
    await sv.store.delete_context(kept.id)
    return True


async def _drop_quietly(sv: Services, context_id: str) -> None:
    """Drops a context moved into its key's namespace from where it was; a backend that fails
    leaves a copy that no key reads again (its key's `DELETE` drops it)."""
    try:
        await sv.store.delete_context(context_id)
    except StateUnavailable as exc:
        log.warning("context %r was moved; its old copy was not dropped: %s", context_id, exc)


class ContextRecords:
    """`GET` and `DELETE /v1/contexts/{id}`, as a raw ASGI app."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        context_id = scope["path_params"]["context_id"]
        caller = sv.keys.caller(bearer_token(scope))
        if scope["method"] == "GET":  # as last saved: a run that holds it is not in it yet
            found = await read_context(sv, context_id, caller)
            await send_json(send, 200, await context_body(sv, found))
            return
        async with held(sv.store, stored_id(context_id, caller), receive) as holding:
            if holding is None:  # (held: not while a run holds it)
                return
            dropped = await _drop(sv, context_id, holding.context, caller)
            if caller is not None:  # then the key's kept before namespaces, under both holds
                async with held(sv.store, context_id, receive) as before:
                    if before is None:
                        return
                    kept = before.context
                    # (one made while no keys were on, only when the key has none of its own)
                    if kept is not None and (kept.owner == caller.name or not dropped):
                        dropped = await _drop(sv, context_id, kept, caller) or dropped
        if not dropped:
            raise NotFound(f"no context {context_id[:256]!r}")
        body = {"id": context_id, "object": "loopwarden.context.deleted", "deleted": True}
        await send_json(send, 200, body)
