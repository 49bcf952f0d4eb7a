"""`GET /v1/responses/{id}/input_items` (SPEC §12.4): the items used to generate a stored
response, a page at a time, as OpenAI lists them.

Each response keeps its own input items as they were given (their ids and forms are made as
they are listed), and the response it continued with that one's output items: the items of a
chain are those of its first response, that response's output, the next one's input, and so
on. The newest come first from the walk (a record a response), so the default order (`desc`)
reads only as far back as its page needs; `asc` reads the whole chain, at most MAX_CHAIN
responses and as many bytes as a chain that could still be continued holds. An id is listed
once, where it came last (a client may send a stored item again), so that a page's last id
says where the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import send_json
from proxy.api.read_budget import ReadBudget
from proxy.api.response_store import (
    INPUT_ITEM_PREFIX,
    RESPONSE_PREFIX,
    ResponseStore,
    asked_for,
)
from proxy.api.services import Services
from proxy.errors import InvalidRequest

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
MAX_CHAIN = 1_000  # responses one listing walks back through: a store read each
ORDERS = ("asc", "desc")


def listed(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """The input items of a response, kept as they were given, as it lists them: each typed,
    with an id (its own, else `in_<response hex>_<n>`, from its place); a message with a
    status, its text content as one part."""
    prefix = INPUT_ITEM_PREFIX + response_id.removeprefix(RESPONSE_PREFIX)
    return [listed_item(given, item_id(given, prefix, i)) for i, given in enumerate(items)]


def item_id(given: dict[str, Any], prefix: str, place: int) -> str:
    """A listed input item's id: its own, else `<prefix>_<place>`."""
    own = given.get("id")
    return own if isinstance(own, str) and own else f"{prefix}_{place}"


def listed_item(given: dict[str, Any], listed_id: str) -> dict[str, Any]:
    """An input item as a listing shows it (`listed`)."""
    item = dict(given)
    kind = item.setdefault("type", "message")
    item["id"] = listed_id
    if kind == "message":
        item.setdefault("status", "completed")
        if isinstance(item.get("content"), str):
            text = item["content"]
            if item.get("role") == "assistant":
                part = {"type": "output_text", "text": text, "annotations": []}
            else:
                part = {"type": "input_text", "text": text}
            item["content"] = [part]
    return item


class InputItems:
    """`GET /v1/responses/{id}/input_items`: for the key that created the response only."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        limit, order, after = _query(scope.get("query_string", b""))
        store, _ = await asked_for(sv, scope)
        asked = scope["path_params"]["response_id"]
        budget = ReadBudget.of(sv.config.server)
        async with contextlib.aclosing(_segments(store, asked, budget)) as segments:
            ordered = _newest_first if order == "desc" else _oldest_first
            page = await _page(ordered(segments), after, limit)
        data = [listed_item(item, id_) if given else item for id_, item, given in page[:limit]]
        await send_json(
            send,
            200,
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(page) > limit,
            },
        )


def _query(raw: bytes) -> tuple[int, str, str | None]:
    """`limit`, `order` and `after`; others (`include`) are accepted and change nothing."""
    limit, order, after = DEFAULT_LIMIT, "desc", None
    for key, value in parse_qsl(raw.decode("latin-1"), keep_blank_values=True):
        if key == "limit":
            digits = value.lstrip("0") if value.isascii() and value.isdigit() else ""
            if not digits or len(digits) > 3 or int(digits) > MAX_LIMIT:
                raise InvalidRequest(f"must be an integer from 1 to {MAX_LIMIT}", param="limit")
            limit = int(digits)
        elif key == "order":
            if value not in ORDERS:
                raise InvalidRequest("must be asc or desc", param="order")
            order = value
        elif key == "after":
            after = value
    return limit, order, after


# A listing's item, read but not yet shown: its id, the item as stored, and whether it is an
# input item as it was given (`listed_item` shows it) rather than an output item. Only the
# page's are shown.
Entry = tuple[Any, dict[str, Any], bool]
YIELD_EVERY = 4096  # items a listing walks between turns of other requests


async def _segments(
    store: ResponseStore, response_id: str, budget: ReadBudget, max_chain: int = MAX_CHAIN
) -> AsyncGenerator[list[Entry]]:
    """The chain's items, newest first in runs (a response's input items, the output of the
    response it continued, that one's input items...), each run in its own order. The walk
    stops at a response deleted or expired since."""
    current = response_id

    async def charge(record: bytes) -> None:
        over = await budget.charge(record)
        if over is not None:
            raise InvalidRequest(
                f"the input items of response {response_id[:64]!r} hold more than {over}: "
                "they are not listed",
                param="response_id",
            )

    for _ in range(max_chain):
        inputs = await store.input(current, charge)
        if inputs is None:
            return
        prefix = INPUT_ITEM_PREFIX + current.removeprefix(RESPONSE_PREFIX)
        yield [(item_id(given, prefix, i), given, True) for i, given in enumerate(inputs.items)]
        yield [(item.get("id"), item, False) for item in inputs.outputs]
        if inputs.previous is None:
            return
        current = inputs.previous
        await asyncio.sleep(0)  # a chain read from memory: other requests' turn between reads
    raise InvalidRequest(
        f"response {response_id[:64]!r} continues a chain of more than {max_chain} responses: "
        "its input items are not listed",
        param="response_id",
    )


async def _newest_first(segments: AsyncIterator[list[Entry]]) -> AsyncIterator[Entry]:
    seen: set[Any] = set()
    walked = 0
    async for segment in segments:
        for entry in reversed(segment):
            walked += 1
            if walked % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            if entry[0] not in seen:
                seen.add(entry[0])
                yield entry


async def _oldest_first(segments: AsyncIterator[list[Entry]]) -> AsyncIterator[Entry]:
    newest_first = [entry async for entry in _newest_first(segments)]  # all are read
    for entry in reversed(newest_first):
        yield entry


async def _page(ordered: AsyncIterator[Entry], after: str | None, limit: int) -> list[Entry]:
    """Up to `limit + 1` items that follow `after` (from the first, without it): one more than
    the page, to say whether there are more."""
    page: list[Entry] = []
    found = after is None
    async for entry in ordered:
        if not found:
            found = entry[0] == after
            continue
        page.append(entry)
        if len(page) > limit:
            break
    if not found:
        raise InvalidRequest(f"no input item {str(after)[:64]!r} in this response", param="after")
    return page
