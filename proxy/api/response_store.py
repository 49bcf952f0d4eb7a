"""Stored responses (SPEC §12.4): a response, the conversation through it and its thread, in the
state backend for `state.response_ttl_s`, readable only by the key that created it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.api.auth import Caller, KeyRing
from proxy.config.server import ServerConfig
from proxy.json_values import holds_over
from proxy.state.store import StateStore

RESPONSE_RECORD = "response"
ITEM_PREFIXES = ("msg_", "fc_", "mcp_")


@dataclass(slots=True)
class StoredResponse:
    """`messages` is the conversation through the response, as the engine saw it (the
    `instructions` aside: they are not carried over, as OpenAI does); `thread` the chain's
    thread name, before any key scoping."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    thread: str | None
    owner: str  # the agent or model: a key that may not use it may not read it
    key: str | None

    def dumps(self) -> bytes:
        """The record; it ends with its key (`owned_by` reads it there, unparsed)."""
        return orjson.dumps(
            {
                "response": self.response,
                "messages": self.messages,
                "thread": self.thread,
                "owner": self.owner,
                "key": self.key,
            }
        )

    def item(self, item_id: str) -> dict[str, Any] | None:
        for item in self.response.get("output") or ():
            if item.get("id") == item_id:
                return dict(item)
        return None


class ConversationTooLarge(Exception):
    """A stored response whose conversation is larger than a request may be: it goes upstream
    in the body of the request that continues it."""

    def __init__(self, response_id: str, over: str) -> None:
        super().__init__(
            f"the stored response {response_id[:64]!r} (the conversation through it, and what "
            f"it answered) {over}: more than one request may send; start a new one"
        )


def owned_by(record: bytes, key: str) -> bool:
    """Whether a stored response's record was made by `key`: its last field, read unparsed."""
    return record.endswith(b'"key":' + orjson.dumps(key) + b"}")


def response_of_item(item_id: str) -> str | None:
    """The id of the response an output item id belongs to (`fc_<hex>_2` -> `resp_<hex>`)."""
    for prefix in ITEM_PREFIXES:
        if item_id.startswith(prefix):
            hex_part = item_id.removeprefix(prefix).split("_", 1)[0]
            return f"resp_{hex_part}" if hex_part else None
    return None


class ResponseStore:
    def __init__(self, store: StateStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s

    async def save(self, response_id: str, stored: StoredResponse) -> None:
        await self.store.put_record(RESPONSE_RECORD, response_id, stored.dumps(), self.ttl_s)

    async def load(
        self, response_id: str, caller: Caller | None, bounds: ServerConfig | None = None
    ) -> StoredResponse | None:
        """The stored response, when it exists and `caller` made it (None otherwise: another
        key's responses do not exist for it). Raises PermissionDenied when the key may no
        longer use the response's agent, and ConversationTooLarge when the record holds more
        bytes or JSON values than a request's body may (`bounds`; checked before it is
        parsed)."""
        found = await self.store.get_record(RESPONSE_RECORD, response_id)
        if found is None or (caller is not None and not owned_by(found, caller.name)):
            return None  # first: another key's response has no size for it either
        if bounds is not None:
            if len(found) > bounds.max_body_bytes:
                over = f"is larger than {bounds.max_body_bytes} bytes (server.max_body_bytes)"
                raise ConversationTooLarge(response_id, over)
            if await holds_over(found, bounds.max_body_values):
                over = (
                    f"holds more than {bounds.max_body_values} JSON values (server.max_body_values)"
                )
                raise ConversationTooLarge(response_id, over)
        fields = orjson.loads(found)
        stored = StoredResponse(**fields)
        if caller is not None:
            if stored.key != caller.name:
                return None
            KeyRing.check(caller, stored.owner)
        return stored

    async def delete(self, response_id: str) -> bool:
        return await self.store.delete_record(RESPONSE_RECORD, response_id)
