"""Stored responses (SPEC §12.4): a response, the conversation through it and its thread, in the
state backend for `state.response_ttl_s`, readable only by the key that created it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from starlette.types import Scope

from proxy.api.asgi import bearer_token
from proxy.api.auth import Caller, KeyRing
from proxy.api.fingerprint_records import (
    CALL_RECORD,
    FINGERPRINT_RECORD,
    Lineage,
    StoredFingerprint,
    client_call_keys,
)
from proxy.api.record_owner import owned_fields
from proxy.api.services import Services
from proxy.api.stored_conversation import (
    CONVERSATION_RECORD,
    TAIL_RECORD,
    Conversation,
    Fingerprint,
    Gone,
    Part,
    fingerprint,
    joined,
    joined_size,
    named_parts,
    parsed_parts,
    read_parts,
    stored_form,
    whole,
)
from proxy.config.server import ServerConfig
from proxy.errors import NotFound
from proxy.json_values import holds_over
from proxy.parse_turns import parse_turn
from proxy.state.store import RECORDS_AT_ONCE, Record, StateStore

# A stored response is four records: the response (its body, thread and owner), read by `GET`,
# by run lookups and by the request that continues it; its output items, read with it and alone
# by item references (the response also echoes the request's `tools` and `instructions`, which
# would be read at every reference); the conversation through it (a conversation record, or a
# tail record that names the earlier records holding the rest: `stored_conversation`), read
# only by the request that continues it (it goes upstream in that request's body); and its own
# input items with the response it continued, read by `GET .../input_items` and by references to
# those items. One made without `previous_response_id` has a fifth, its fingerprint, read by the
# request that sends its conversation whole again, and a record for each client call it ends
# with (`fingerprint_records`).
RESPONSE_RECORD = "response"
OUTPUTS_RECORD = "outputs"
INPUT_RECORD = "input"
RESPONSE_PREFIX = "resp_"
INPUT_ITEM_PREFIX = "in_"  # the ids the proxy gives input items that came without one
ITEM_PREFIXES = ("msg_", "fc_", "mcp_", INPUT_ITEM_PREFIX)
# The records of a response read with it before it is known to be the caller's: another key's
# request is sent no more of them, and learns no more of their size.
AHEAD_BYTES = 256 * 1024


@dataclass(slots=True)
class StoredResponse:
    """`thread` is the chain's thread name, before any key scoping."""

    response: dict[str, Any]
    thread: str | None
    owner: str  # the agent or model: a key that may not use it may not read it
    key: str | None

    def dumps(self) -> bytes:
        """The record; it ends with its key (`owned_by` reads it there, unparsed)."""
        return orjson.dumps(
            {"response": self.response, "thread": self.thread, "owner": self.owner, "key": self.key}
        )


@dataclass(slots=True)
class StoredOutputs:
    """A stored response's output items, and who may read them (as `StoredResponse`)."""

    output: list[dict[str, Any]]
    owner: str
    key: str | None

    def dumps(self) -> bytes:
        """The record; it ends with its key (`owned_by` reads it there, unparsed)."""
        return orjson.dumps({"output": self.output, "owner": self.owner, "key": self.key})


@dataclass(slots=True)
class StoredInput:
    """A response's own input items as given (item references read; `input_items.listed`
    gives them ids and forms), and the response it continued with that one's output items:
    the items used to generate it are those of `previous`, then `outputs`, then `items`."""

    previous: str | None
    items: list[dict[str, Any]]
    outputs: list[dict[str, Any]] = field(default_factory=list)

    def dumps(self) -> bytes:
        return orjson.dumps(
            {"previous": self.previous, "items": self.items, "outputs": self.outputs}
        )


class ConversationTooLarge(Exception):
    """A stored response whose conversation is larger than a request may be: it goes upstream
    in the body of the request that continues it."""

    def __init__(self, response_id: str, over: str) -> None:
        super().__init__(
            f"the stored response {response_id[:64]!r} (the conversation through it, and what "
            f"it answered) {over}: more than one request may send; start a new one"
        )


def chain_thread(thread: str | None) -> bool:
    """Whether a thread is a chain's: named by a response id, as a chain's own is."""
    return thread is not None and thread.startswith(RESPONSE_PREFIX)


def parsed(record: bytes | None, caller: Caller | None) -> StoredResponse | None:
    """A response record as `ResponseStore.load` reads it: None unless `caller` made it."""
    fields = owned_fields(record, caller)
    if fields is None:
        return None
    fields.pop("messages", None)  # stored as one record, by an earlier version
    return StoredResponse(**fields)


def parsed_outputs(record: bytes | None, caller: Caller | None) -> StoredOutputs | None:
    """An outputs record (or the response record of one stored before outputs had their own),
    as `parsed` reads a response record: None unless `caller` made it."""
    fields = owned_fields(record, caller)
    if fields is None:
        return None
    if "response" in fields:
        output = fields["response"].get("output") or []
        return StoredOutputs(output, fields["owner"], fields["key"])
    return StoredOutputs(fields["output"], fields["owner"], fields["key"])


Owned = TypeVar("Owned", StoredResponse, StoredOutputs)


def usable(stored: Owned | None, caller: Caller | None) -> Owned | None:
    """`stored`; raises PermissionDenied when the key may no longer use its agent or model."""
    if stored is not None and caller is not None:
        KeyRing.check(caller, stored.owner)
    return stored


def response_of_item(item_id: str) -> str | None:
    """The id of the response an output item id belongs to (`fc_<hex>_2` -> `resp_<hex>`)."""
    for prefix in ITEM_PREFIXES:
        if item_id.startswith(prefix):
            hex_part = item_id.removeprefix(prefix).split("_", 1)[0]
            return f"resp_{hex_part}" if hex_part else None
    return None


async def asked_for(sv: Services, scope: Scope) -> tuple[ResponseStore, StoredResponse]:
    """The stored response a request's path names (`response_id`), if its key may read it:
    else NotFound (another key's responses do not exist for it)."""
    store = ResponseStore(sv.store, sv.config.state.response_ttl_s)
    asked = scope["path_params"]["response_id"]
    return store, await store.found(asked, sv.keys.caller(bearer_token(scope)))


class ResponseStore:
    """`earlier_form`: write responses as the version before conversations in parts and
    outputs records did (`state.rolling_upgrade`), so that its replicas read and delete them
    whole."""

    def __init__(self, store: StateStore, ttl_s: float, earlier_form: bool = False) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.earlier_form = earlier_form

    async def save(
        self,
        response_id: str,
        stored: StoredResponse,
        messages: list[dict[str, Any]],
        inputs: StoredInput,
        chain: str | None,
        continued: Conversation | None,
        lineage: Lineage | None = None,
    ) -> None:
        """Keeps the response (and its output items alone), `messages` (the conversation through
        it, as the engine saw it, the `instructions` aside: they are not carried over, as OpenAI
        does; it begins with the messages of the conversation it `continued`) and `inputs`, in
        one write (its client calls' records in writes before it, when they are more than one
        write takes); and the `chain`'s thread (when the response continues one) and the records of
        the earlier parts of the conversation as long (when one of them is gone since, expired or
        deleted, the conversation is kept whole, in a second write). `lineage`: its request
        sent the whole conversation (no `previous_response_id`), and the next may too: it keeps
        a fingerprint (`StoredFingerprint`)."""
        if self.earlier_form:  # each conversation whole, and no outputs record
            continued = None
        conversation, parts = stored_form(response_id, messages, continued)
        await asyncio.sleep(0)  # each long record made in a turn of its own, others' between
        marked: StoredFingerprint | None = None
        calls: list[Record] = []
        records = [conversation, Record(INPUT_RECORD, response_id, inputs.dumps())]
        if not self.earlier_form:  # the output items in a record of their own, not twice
            output = stored.response.get("output") or []
            outputs = StoredOutputs(output, stored.owner, stored.key)
            records.append(Record(OUTPUTS_RECORD, response_id, outputs.dumps()))
            await asyncio.sleep(0)  # (the fingerprint's hashing in a turn of its own)
            if lineage is not None:
                made = await fingerprint(response_id, conversation, parts, messages, continued)
                marked = StoredFingerprint(made, lineage, stored.thread, stored.key)
                records.append(Record(FINGERPRINT_RECORD, response_id, marked.dumps()))
                called = orjson.dumps({"response": response_id, "key": stored.key})
                calls = [
                    Record(CALL_RECORD, key, called) for key in client_call_keys(stored.key, output)
                ]
            body = {**stored.response, "output": None}
            stored = StoredResponse(body, stored.thread, stored.owner, stored.key)
        if len(records) + len(calls) < RECORDS_AT_ONCE:
            records += calls
        else:  # more than one write takes: the calls first, each naming the response to come
            for at in range(0, len(calls), RECORDS_AT_ONCE):
                await self.store.put_records(calls[at : at + RECORDS_AT_ONCE], self.ttl_s)
        records.append(Record(RESPONSE_RECORD, response_id, stored.dumps()))  # last: names all
        kept = [part.record for part in parts]
        found = await self.store.put_records(records, self.ttl_s, keep_thread=chain, keep=kept)
        if found < len(kept):
            await self._whole(response_id, messages, marked)

    async def _whole(
        self, response_id: str, messages: list[dict[str, Any]], marked: StoredFingerprint | None
    ) -> None:
        """Keeps the conversation through a response whole, its fingerprint naming it so: a
        part it named was gone (the record of the conversation is read before its tail)."""
        record, _ = stored_form(response_id, messages, None)
        records = [record]
        if marked is not None:
            one = whole(response_id, record.value, messages).parts
            printed = Fingerprint(marked.conversation.digest, one)
            again = dataclasses.replace(marked, conversation=printed)
            records.append(Record(FINGERPRINT_RECORD, response_id, again.dumps()))
        await self.store.put_records(records, self.ttl_s)

    async def input(
        self, response_id: str, charge: Callable[[bytes], Awaitable[None]] | None = None
    ) -> StoredInput | None:
        """The input record of a response `readable` found (None when it has none: it is gone
        since, or was stored without one); `charge` is given it before it is parsed (and may
        raise to refuse it)."""
        found = await self.store.get_record(INPUT_RECORD, response_id)
        if found is None:
            return None
        async with parse_turn(len(found)):
            if charge is not None:
                await charge(found)
            fields = orjson.loads(found)
        return StoredInput(fields["previous"], fields["items"], fields.get("outputs", []))

    async def load(self, response_id: str, caller: Caller | None) -> StoredResponse | None:
        """The stored response, when it exists and `caller` made it (None otherwise: another
        key's responses do not exist for it), without its conversation."""
        wanted = [(RESPONSE_RECORD, response_id), (OUTPUTS_RECORD, response_id)]
        found = await self.store.get_records(wanted, max_bytes=AHEAD_BYTES)
        stored = parsed(found[0], caller)
        return None if stored is None else await self.with_outputs(stored, found[1:])

    async def with_outputs(
        self,
        stored: StoredResponse,
        found: Sequence[bytes | None] = (),
        charge: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> StoredResponse | None:
        """`stored` with its output items, which a response record written beside its outputs
        record holds as `null` (None when that record is gone: the response is, in part);
        `found`, the outputs record when it was read already; `charge` is given it before it is
        parsed (and may raise to refuse it)."""
        if stored.response.get("output") is not None:
            return stored
        response_id = stored.response["id"]
        record = found[0] if found else await self.store.get_record(OUTPUTS_RECORD, response_id)
        if record is None:
            return None
        async with parse_turn(len(record)):
            if charge is not None:
                await charge(record)
            stored.response["output"] = orjson.loads(record)["output"]
        return stored

    async def readable(self, response_id: str, caller: Caller | None) -> StoredResponse | None:
        """`load`, and raises PermissionDenied when the key may no longer use the response's
        agent or model."""
        return usable(await self.load(response_id, caller), caller)

    async def found(self, response_id: str, caller: Caller | None) -> StoredResponse:
        """`readable`, else NotFound: another key's responses do not exist for `caller`."""
        stored = await self.readable(response_id, caller)
        if stored is None:
            raise NotFound(f"no stored response {response_id[:64]!r}")
        return stored

    async def conversation(
        self, response_id: str, bounds: ServerConfig, found: Sequence[bytes | None] = ()
    ) -> Conversation | None:
        """The conversation through a response the key may read (None when it is gone since,
        deleted or expired, or a part of it is); `found`, the first of its conversation and
        tail records (`conversation_records`) when they were read already (a conversation
        record is read first: one kept whole beside its tail, as `_whole` keeps it). Raises
        ConversationTooLarge when it holds more bytes or JSON values than a request's body may
        (checked before it is parsed, and its size before its parts are read)."""
        found = list(found)
        if not found or (found[0] is None and len(found) == 1):
            found += await self.store.get_records(conversation_records(response_id)[len(found) :])
        conversation, tail = found[0], found[1] if len(found) > 1 else None
        try:
            if conversation is not None:
                async with parse_turn(len(conversation)):
                    await _check(response_id, conversation, bounds)
                    return whole(response_id, conversation, list(orjson.loads(conversation)))
            if tail is not None:
                return await self._parted(response_id, tail, bounds)
        except Gone:
            return None
        # Stored as one record by an earlier version, or gone since.
        legacy = await self.store.get_record(RESPONSE_RECORD, response_id)
        if legacy is None:
            return None
        async with parse_turn(len(legacy)):
            await _check(response_id, legacy, bounds)
            fields = orjson.loads(legacy)
        return Conversation(list(fields["messages"]), ()) if "messages" in fields else None

    async def _parted(self, response_id: str, tail: bytes, bounds: ServerConfig) -> Conversation:
        parts, own = named_parts(response_id, tail)
        parts.append(Part(response_id, False, len(own), -1))
        size = joined_size([part.size for part in parts])
        _check_size(response_id, size, bounds)
        texts = await read_parts(self.store, parts[:-1], own)
        async with parse_turn(size):
            if size > bounds.max_body_values:  # else it holds fewer values than bytes
                await _check(response_id, joined(texts), bounds)
            return parsed_parts(parts, texts)

    async def delete(self, stored: StoredResponse) -> bool:
        """Drops the response's records: a later response whose conversation names its part
        can then no longer be continued (as if it had expired)."""
        response_id = stored.response["id"]
        kinds = (INPUT_RECORD, OUTPUTS_RECORD, FINGERPRINT_RECORD, RESPONSE_RECORD)
        records = [*conversation_records(response_id), *((kind, response_id) for kind in kinds)]
        output = stored.response.get("output") or []
        records += [(CALL_RECORD, key) for key in client_call_keys(stored.key, output)]
        found = 0
        for at in range(0, len(records), RECORDS_AT_ONCE):  # the response's own first
            found += await self.store.delete_records(records[at : at + RECORDS_AT_ONCE])
        return found > 0


def continued_records(response_id: str) -> list[tuple[str, str]]:
    """What a request that continues a response reads of it at once (within AHEAD_BYTES): the
    response, its outputs, and the records that may hold the conversation through it."""
    ahead = [(RESPONSE_RECORD, response_id), (OUTPUTS_RECORD, response_id)]
    return [*ahead, *conversation_records(response_id)]


def conversation_records(response_id: str) -> list[tuple[str, str]]:
    """The records that may hold the conversation through a response: one of them does."""
    return [(CONVERSATION_RECORD, response_id), (TAIL_RECORD, response_id)]


def _check_size(response_id: str, size: int, bounds: ServerConfig) -> None:
    """Raises ConversationTooLarge when a conversation's JSON of `size` bytes is larger than a
    request's body may be."""
    if size > bounds.max_body_bytes:
        over = f"is larger than {bounds.max_body_bytes} bytes (server.max_body_bytes)"
        raise ConversationTooLarge(response_id, over)


async def _check(response_id: str, text: bytes, bounds: ServerConfig) -> None:
    """Raises ConversationTooLarge when a conversation's JSON holds more bytes or values than a
    request's body may."""
    _check_size(response_id, len(text), bounds)
    if await holds_over(text, bounds.max_body_values):
        over = f"holds more than {bounds.max_body_values} JSON values (server.max_body_values)"
        raise ConversationTooLarge(response_id, over)
