"""What a stored response made without `previous_response_id` keeps for a later request that
sends its conversation whole again (SPEC §12.4, `resent`): its fingerprint record, and a record
for each client call it ends with, by call id, for a request that sends the call back whole
without its item's id (the AI SDK does) to be known as that response's continuation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.api.auth import Caller
from proxy.api.record_owner import owned_fields
from proxy.api.response_items import CLIENT_CALLS
from proxy.api.stored_conversation import Fingerprint

FINGERPRINT_RECORD = "fingerprint"
CALL_RECORD = "call"  # by `call_key`: the response that made the call


@dataclass(frozen=True, slots=True)
class Lineage:
    """What a request made without `previous_response_id` keeps in its response's fingerprint
    for the next request, which may send its items again: the digest of its items as sent
    (their JSON, keys sorted), how many there are, and the input records of the chain its
    input record ends (a listing's reads)."""

    sent: str
    count: int
    depth: int


@dataclass(frozen=True, slots=True)
class StoredFingerprint:
    """What a response made without `previous_response_id` keeps for a later request that
    sends its conversation whole again (a record of its own: a version before never reads
    it): the conversation's fingerprint; its request's `Lineage` (None in a fingerprint a
    version before wrote); its chain's thread, as `StoredResponse` keeps it; and its key
    (last)."""

    conversation: Fingerprint
    lineage: Lineage | None
    thread: str | None
    key: str | None

    def dumps(self) -> bytes:
        fields: dict[str, Any] = {"conversation": self.conversation.form()}
        if self.lineage is not None:
            lineage = self.lineage
            fields |= {"sent": lineage.sent, "count": lineage.count, "depth": lineage.depth}
        return orjson.dumps({**fields, "thread": self.thread, "key": self.key})


def parsed_fingerprint(record: bytes | None, caller: Caller | None) -> StoredFingerprint | None:
    """A fingerprint record, as `parsed` reads a response record: None unless `caller` made it
    (or it is in no form this version writes)."""
    fields = owned_fields(record, caller)
    if fields is None:
        return None
    conversation = Fingerprint.read(fields.get("conversation"))
    if conversation is None:
        return None
    sent, count, depth = fields.get("sent"), fields.get("count"), fields.get("depth")
    lineage = None  # a version before's: its conversation only
    if isinstance(sent, str) and type(count) is int and type(depth) is int:
        lineage = Lineage(sent, count, depth)
    thread = fields.get("thread")
    thread = thread if isinstance(thread, str) else None
    return StoredFingerprint(conversation, lineage, thread, fields["key"])


def call_key(key: str | None, call_id: str) -> str:
    """The key of a client call's `CALL_RECORD`: its id in the namespace of the API key that
    made it (an upstream's call ids are not unique between keys)."""
    return call_id if key is None else f"{key}/{call_id}"


def client_call_keys(key: str | None, output: list[dict[str, Any]]) -> list[str]:
    """The `CALL_RECORD` keys of the client calls among a response's output items."""
    calls = (item.get("call_id") for item in output if item.get("type") in CLIENT_CALLS)
    return [call_key(key, call_id) for call_id in calls if isinstance(call_id, str)]


def parsed_call(record: bytes | None, caller: Caller | None) -> str | None:
    """The response a `CALL_RECORD` names, None unless `caller` made it."""
    fields = owned_fields(record, caller)
    response_id: Any = fields.get("response") if fields is not None else None
    return response_id if isinstance(response_id, str) else None
