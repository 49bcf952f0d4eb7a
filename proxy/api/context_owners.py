"""Whose a stored context is (SPEC §10, with proxy keys): each key's are kept in its own
namespace, `<key>/<context id>`; one made while no keys were on is no key's. A context is held
for a request while it runs, reads or drops it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from starlette.types import Receive

from proxy.api.asgi import run_or_cancel
from proxy.api.auth import Caller
from proxy.api.services import Services
from proxy.errors import NotFound, StateUnavailable
from proxy.state.store import Holding, StateStore, StoredContext

log = logging.getLogger(__name__)


def stored_id(context_id: str, caller: Caller | None) -> str:
    """Where a context is kept: in its key's own namespace (two keys that name one id have a
    context each, and neither learns of the other's), without keys as it is named."""
    return context_id if caller is None else caller.scoped(context_id)


async def kept_before(sv: Services, context_id: str, caller: Caller | None) -> bool:
    """Whether the key has a context kept, before contexts had namespaces, as it is named."""
    if caller is None:
        return False
    found = await sv.store.load_context(context_id)
    return found is not None and found.owner == caller.name


def moved_in(found: StoredContext | None, caller: Caller) -> StoredContext | None:
    """A key's context kept before namespaces, as its next save keeps it in the key's (its
    thread and its counts stay); None when there is none, or it is not the key's."""
    if found is None or found.owner != caller.name:
        return None
    scoped = stored_id(found.id, caller)
    return dataclasses.replace(found, id=scoped, version=0, thread=found.thread_id)


def visible(context: StoredContext, caller: Caller | None) -> bool:
    """A context belongs to the key that created it; one created without keys, to no key (once
    keys are on, every key read and wrote those of the time before: as a stored response)."""
    return caller is None or context.owner == caller.name


def unowned_for(context: StoredContext, caller: Caller | None) -> bool:
    """A context made while no keys were on, which a key that may use every agent may drop (no
    key may read or run it)."""
    return context.owner is None and caller is not None and caller.unrestricted


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


async def drop_quietly(sv: Services, context_id: str) -> None:
    """Drops a context moved into its key's namespace from where it was; a backend that fails
    leaves a copy, read again only once the moved one is gone (its key's `DELETE` drops both
    at once)."""
    try:
        await sv.store.delete_context(context_id)
    except StateUnavailable as exc:
        log.warning("context %r was moved; its old copy was not dropped: %s", context_id, exc)


def readable(
    sv: Services, context_id: str, context: StoredContext | None, caller: Caller | None
) -> StoredContext:
    """The context, when it exists, is the caller's (another key's is not found: a 403 would
    tell that it exists) and the caller may use its agent or model."""
    if context is None or not visible(context, caller):
        raise NotFound(f"no context {context_id[:256]!r}")
    sv.keys.check(caller, context.agent or context.model or "")
    return context
