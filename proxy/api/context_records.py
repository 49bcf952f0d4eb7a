"""`GET` and `DELETE /v1/contexts/{id}`: a stored context read as last saved, or dropped."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, send_json
from proxy.api.auth import Caller
from proxy.api.context_owners import held, readable, stored_id, unowned_for
from proxy.api.services import Services
from proxy.errors import NotFound
from proxy.state.store import StoredContext


async def read_context(sv: Services, context_id: str, caller: Caller | None) -> StoredContext:
    found = await sv.store.load_context(stored_id(context_id, caller))
    if found is None and caller is not None:  # kept before contexts had namespaces
        found = await sv.store.load_context(context_id)
    return readable(sv, context_id, found, caller)


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
    if not unowned_for(kept, caller):
        readable(sv, context_id, kept, caller)
    await sv.store.delete_context(kept.id)
    return True


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
        # Held (not while a run holds it): the key's, and the one kept under its id before
        # namespaces, both held before either is dropped (as `/chat` holds them to move it).
        async with contextlib.AsyncExitStack() as holds:
            contexts: list[StoredContext | None] = []
            for place in [stored_id(context_id, caller), *([context_id] if caller else [])]:
                holding = await holds.enter_async_context(held(sv.store, place, receive))
                if holding is None:  # the client left
                    return
                contexts.append(holding.context)
            dropped = await _drop(sv, context_id, contexts[0], caller)
            kept = contexts[1] if len(contexts) > 1 else None
            # (one made while no keys were on only when the key has none of its own)
            if kept is not None and caller and (kept.owner == caller.name or not dropped):
                dropped = await _drop(sv, context_id, kept, caller) or dropped
        if not dropped:
            raise NotFound(f"no context {context_id[:256]!r}")
        body = {"id": context_id, "object": "loopwarden.context.deleted", "deleted": True}
        await send_json(send, 200, body)
