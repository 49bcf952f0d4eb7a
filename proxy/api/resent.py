"""A conversation sent whole again each turn (SPEC §12.4), without `previous_response_id`: the
AI SDK names the earlier output items by `item_reference`, other clients add each response's
output to their input. Such a request is stored as the continuation of the response its last
stored item names, when what it sends begins with what that response's fingerprint says, so
that its records grow with the conversation, not with its square: its conversation, when its
messages begin with that response's conversation (`Fingerprint.begun`: the stored parts are
named, not read), and its input items, when the items up to that one are that response's
chain's through its output (keys sorted, null members left out: a listing then shows the same
items), within MAX_CHAIN input records. What does not begin so is stored whole, as sent."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.api import input_items
from proxy.api.json_digest import JsonDigest, without_nulls
from proxy.api.response_store import Lineage, StoredInput
from proxy.api.stored_conversation import Conversation
from proxy.api.stored_reads import StoredReads


async def resumed(
    messages: list[dict[str, Any]],
    items: list[dict[str, Any]],
    reads: StoredReads,
    place: int,
    named: str,
) -> tuple[StoredInput, Conversation | None, Lineage]:
    """How a request that sends `items` (references read), making `messages`, is stored: its
    input record, the conversation it continues, and what its fingerprint goes on from; the
    item at `place` is the last the request names of a stored response's (`named`)."""
    fingerprint, output = await reads.fingerprint(named)
    whole = StoredInput(None, items, [])
    if fingerprint is None:
        return whole, None, Lineage.first()
    continued = await fingerprint.conversation.begun(messages)
    chain = await JsonDigest(orjson.OPT_SORT_KEYS).extended(items[: place + 1], without_nulls)
    depth = fingerprint.depth + 1
    if output is None or depth > input_items.MAX_CHAIN or chain.hexdigest() != fingerprint.items:
        return whole, continued, Lineage.first()
    return StoredInput(named, items[place + 1 :], output), continued, Lineage(chain, depth)
