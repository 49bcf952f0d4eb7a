"""Stored contexts (SPEC §10): server-side conversations run with `/chat*` (read and dropped
with `/v1/contexts/{id}`: `context_records`). A context is also the thread of its tool call
limits."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, send_json
from proxy.api.auth import Caller
from proxy.api.context_end import ContextEnd, kept_messages, messages_size
from proxy.api.context_messages import generated_messages
from proxy.api.context_owners import (
    drop_quietly,
    held,
    kept_before,
    moved_in,
    stored_id,
    visible,
)
from proxy.api.context_request import context_body, context_request, planned
from proxy.api.failures import drain_end_answer, failed, send_failure
from proxy.api.headers import run_headers, with_stop_reason
from proxy.api.json_body import read_json
from proxy.api.loop_report import loop_report
from proxy.api.services import Services
from proxy.engine.run import Run
from proxy.engine.run_spec import RunResult
from proxy.errors import (
    BodyTooLarge,
    InvalidRequest,
    NotFound,
    ProxyError,
)
from proxy.state.store import Holding, StoredContext

log = logging.getLogger(__name__)


def _made_with(context: StoredContext) -> str:
    """The field a context's agent or model was given by."""
    return "agent" if context.agent is not None else "model"


def _open(
    body: dict[str, Any], found: StoredContext | None, caller: Caller | None
) -> StoredContext:
    agent, model, context_id = body.get("agent"), body.get("model"), body["context_id"]
    if found is not None and not visible(found, caller):
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
    made = {"agent": found.agent, "model": found.model}
    for key, value in (("agent", agent), ("model", model)):
        if value is not None and value != made[key]:
            given = " and ".join(f"{k} {kept!r}" for k, kept in made.items() if kept is not None)
            raise InvalidRequest(f"context {context_id!r} was created with {given}", param=key)
    return found


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
            receive, scope, sv.config.server, lambda raw: context_body(raw, path, max_chars)
        )
        context_id = body["context_id"]
        async with held(sv.store, stored_id(context_id, caller), receive) as holding:
            if holding is None:
                return
            if holding.context is not None or not await kept_before(sv, context_id, caller):
                await self._run(sv, caller, bearer, scope, receive, send, body, holding)
                return
            assert caller is not None
            # Moved in under both holds (the key's first, as `DELETE` takes them): saved in the
            # key's namespace, it is dropped where it was.
            async with held(sv.store, context_id, receive) as before:
                if before is None:
                    return
                found = moved_in(before.context, caller)
                await self._run(sv, caller, bearer, scope, receive, send, body, holding, found)
                if found is not None and found.version > 0:
                    await drop_quietly(sv, context_id)

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
        plan = await planned(sv, body, context_request(body, context, run_messages), caller)
        deps = sv.deps(plan.upstream, bearer, scope["path"])
        owner = plan.agent or context.model or ""
        end = ContextEnd(sv, holding, context, messages, owner, caller)
        run = Run(plan.spec, deps, keep=end.save)
        reported = partial(loop_report, include_messages=False)
        human = messages[-1:] if body.get("message") is not None else []

        def unsaved(
            result: RunResult, _report: object = None, _error: ProxyError | None = None
        ) -> dict[str, Any]:
            """What a failed run's answer gives of it besides its report, whatever its error:
            what it made, nothing of it saved."""
            added = generated_messages(human + kept_messages(result))
            return {"saved_ai_messages": False, "generated_messages": added}

        ended = await sv.execute(run, receive)
        drain_end = drain_end_answer(send, run_headers(plan.spec.run_id), reported, unsaved)
        result = await sv.answerable(run, ended, reported, owner, caller, drain_end=drain_end)
        if result is None:
            return
        report = reported(result)
        if not end.tried:  # a failed run: kept alone, as the hold is let go
            await end.records(result, report)
        elif failed(result):  # its save refused: the hold is gone
            await sv.remember(result, report, owner, caller)
        refused, added = end.refused, kept_messages(result)
        headers = run_headers(result.run_id)
        with_stop_reason(headers, result)
        if failed(result):  # what it made is the client's: told, though not saved
            await send_failure(send, result, report, headers, extra=unsaved(result))
            return
        reply = {
            "response": result.message.get("content") or "",
            "saved_ai_messages": refused is None,
            "generated_messages": generated_messages(human + added),
            "loop": report,
        }
        if refused is not None:  # the answer is the client's still: why it was not saved told
            reply["save_error"] = refused.body()["error"]
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
