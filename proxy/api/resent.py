"""A conversation sent whole again each turn (SPEC §12.4), without `previous_response_id`: the
AI SDK names the earlier output items by `item_reference`, other clients add each response's
output to their input. Such a request is known by the response its last stored item names
(`last_stored`): when its items begin with the items that response's request sent (by their
digest, kept in its fingerprint), followed by that response's output items in the order it
listed them (by reference, or whole: null members aside, and the `id` and `status` a client
may leave out), it continues that response as `previous_response_id` would (its conversation
read from its parts, its input record continuing that response's chain, its thread), reading
none of the responses its earlier items name. One that does not is read item by item and its
input items stored whole, its conversation still continuing that response's when its messages
begin with it (`Fingerprint.begun`: the parts are named, not read), so that what is stored
grows with the conversation, not with its square."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.api import input_items
from proxy.api.fingerprint_records import Lineage
from proxy.api.json_digest import JsonDigest, without_nulls
from proxy.api.response_items import CLIENT_CALLS
from proxy.api.response_store import response_of_item
from proxy.api.stored_conversation import Conversation
from proxy.api.stored_reads import Named, StoredReads


@dataclass(frozen=True, slots=True)
class Resent:
    """A request known as the continuation of the response it names last (`named`): its items
    from `start` on are its own, those before are that response's request's and output; it
    goes on in that response's chain's thread, as a continuation by id does."""

    named: str
    start: int
    conversation: Conversation
    output: list[dict[str, Any]]
    thread: str | None  # that response's chain's thread


async def last_stored(
    items: list[dict[str, Any]], reads: StoredReads, by_call: bool = True
) -> tuple[int, str] | None:
    """The place of the last item that names a stored response, and that response's id: by its
    id (a reference, or an item sent whole with one of the proxy's), or, `by_call`, for the last
    client call sent whole without one (the AI SDK's way), by its call id (`StoredReads.called`:
    one read, for that call alone)."""
    asked = not by_call
    for place in range(len(items) - 1, -1, -1):
        item = items[place]
        given = item.get("id")
        if isinstance(given, str) and (owner := response_of_item(given)) is not None:
            return place, owner
        call_id = item.get("call_id")
        if not asked and item.get("type") in CLIENT_CALLS and isinstance(call_id, str):
            asked = True
            if (owner := await reads.called(call_id)) is not None:
                return place, owner
    return None


async def resumed(
    items: list[dict[str, Any]], place: int, named: Named, reads: StoredReads
) -> tuple[Resent | None, Lineage]:
    """Whether a request that sends `items`, the one at `place` naming the response `named`
    last, continues it; and what its own fingerprint keeps."""
    found = named.fingerprint.lineage if named.fingerprint is not None else None
    sent = JsonDigest(orjson.OPT_SORT_KEYS)
    if found is None or found.count > place:
        return None, await first_lineage(items)
    await sent.extended(items[: found.count])
    resent = None
    if sent.hexdigest() == found.sent and not (
        found.depth >= input_items.MAX_CHAIN and _held(items[: place + 1])
    ):
        resent = await _continued(items, found.count, place, named, reads)
    await sent.extended(items[found.count :])
    depth = found.depth + 1 if resent is not None else 1
    return resent, Lineage(sent.hexdigest(), len(items), depth)


async def _continued(
    items: list[dict[str, Any]], count: int, place: int, named: Named, reads: StoredReads
) -> Resent | None:
    """The continuation of `named` when its output items follow its request's `count` items,
    through the one at `place`, and the conversation through it is there."""
    found = await reads.continued_output(named.response_id, f"input[{place}].id")
    if found is None:
        return None
    start = _after(items, count, found[0])
    if start is None or start <= place:
        return None
    conversation = await reads.conversation(named.response_id, found[1])
    if conversation is None:
        return None
    thread = named.fingerprint.thread if named.fingerprint is not None else None
    return Resent(named.response_id, start, conversation, found[0], thread)


async def first_lineage(items: list[dict[str, Any]]) -> Lineage:
    """What the fingerprint of a request that names no stored response keeps."""
    sent = await JsonDigest(orjson.OPT_SORT_KEYS).extended(items)
    return Lineage(sent.hexdigest(), len(items), 1)


def _after(items: list[dict[str, Any]], at: int, output: list[dict[str, Any]]) -> int | None:
    """The place after the output items `output` when `items` from `at` on begin with them, each
    by reference or sent whole (`_same`); a reference named again is passed over, as it is read
    once."""
    seen: set[str] = set()
    for expected in output:
        while at < len(items) and _again(items[at], seen):
            at += 1
        if at == len(items) or not _same(items[at], expected, seen):
            return None
        at += 1
    return at


def _again(item: dict[str, Any], seen: set[str]) -> bool:
    return item.get("type") == "item_reference" and item["id"] in seen


def _same(item: dict[str, Any], expected: dict[str, Any], seen: set[str]) -> bool:
    """Whether `item` is the output item `expected`: a reference to it, or it sent whole, null
    members aside, and its `id` and `status` when left out (the AI SDK sends a call so)."""
    if item.get("type") == "item_reference":
        seen.add(item["id"])
        return bool(item["id"] == expected.get("id"))
    given, stored = without_nulls(item), without_nulls(expected)
    for key in ("id", "status"):
        if key not in given:
            stored.pop(key, None)
    return bool(given == stored)


def _held(items: list[dict[str, Any]]) -> bool:
    """Whether `items` hold what they stand for (no references): a chain past MAX_CHAIN input
    records then begins anew with them, for a listing to walk no further; one whose items name
    earlier ones by reference goes on (its `asc` listing is refused, as a chain continued by
    `previous_response_id` is past that many)."""
    return not any(item.get("type") == "item_reference" for item in items)
