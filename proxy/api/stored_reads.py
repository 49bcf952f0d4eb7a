"""The stored responses one Responses request reads (SPEC §12.4): the one it continues, with
the conversation through it, and those its item references name, read together and bounded."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from proxy.api.auth import Caller
from proxy.api.fingerprint_records import (
    CALL_RECORD,
    FINGERPRINT_RECORD,
    StoredFingerprint,
    call_key,
    parsed_call,
    parsed_fingerprint,
)
from proxy.api.input_items import listed
from proxy.api.read_budget import ReadBudget
from proxy.api.record_owner import owned_by
from proxy.api.response_store import (
    AHEAD_BYTES,
    OUTPUTS_RECORD,
    RESPONSE_RECORD,
    ConversationTooLarge,
    ResponseStore,
    StoredOutputs,
    StoredResponse,
    continued_records,
    conversation_records,
    parsed,
    parsed_outputs,
    response_of_item,
    usable,
)
from proxy.api.stored_conversation import Conversation
from proxy.config.server import ServerConfig
from proxy.errors import (
    BodyTooLarge,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    StateUnavailable,
)
from proxy.parse_turns import parse_turn
from proxy.state.store import RECORDS_AT_ONCE

Read = TypeVar("Read")


@dataclass(frozen=True, slots=True)
class Named:
    """The response a request sending a conversation whole again names last, and its
    fingerprint (None when it has none, is gone, or is not the key's)."""

    response_id: str
    fingerprint: StoredFingerprint | None


# Stored responses one request may read: its previous one and those its item references name
# (the AI SDK names an item of every earlier response of a conversation), and the bytes of
# their records it may parse (`READ_BODIES`), giving the loop to others every so many.
MAX_STORED_READS = 1_000
YIELD_EVERY_BYTES = 1024 * 1024


class StoredReads:
    """The stored responses one request reads (its previous one, those its item references
    name): each read once, at most MAX_STORED_READS of them and READ_BODIES request
    bodies of their records (and of the input records its references read), charged before
    they are parsed. They are read together, in the order the request names them: the previous
    one with the conversation through it, the others RECORDS_AT_ONCE at a time and only as many
    bytes of them as the budget has left. Of a response an item reference names, only its
    output items are read (its outputs record), and its input items when a reference names one;
    the conversation of the previous one may hold no more bytes or values than a request's body
    (it goes upstream in this one's)."""

    def __init__(self, store: ResponseStore, caller: Caller | None, bounds: ServerConfig) -> None:
        self.store = store
        self.caller = caller
        self.bounds = bounds
        self._outputs: dict[str, dict[str, dict[str, Any]]] = {}  # by response id, by item id
        self._readable: set[str] = set()
        self._inputs: set[str] = set()  # the responses whose input items are in `_outputs`
        self._ahead: dict[str, None] = {}  # the responses the request names, not read yet
        self._fetched: dict[str, bytes | None] = {}  # outputs records read, not yet parsed
        self._budget = ReadBudget.of(bounds)
        self._yielded = 0
        self._key = caller.name if caller is not None else None

    def will_read(self, named: list[str]) -> None:
        """The responses the request's item references name, in order: read together."""
        unread = [response_id for response_id in named if response_id not in self._outputs]
        self._ahead = dict.fromkeys(list(dict.fromkeys(unread))[:MAX_STORED_READS])

    async def previous(self, response_id: str, param: str) -> tuple[StoredResponse, Conversation]:
        """The response a request continues, its outputs and the conversation through it: read
        together when they hold at most AHEAD_BYTES (most do: one round trip), else what is left
        once the response is known to be the key's own, as are the earlier parts it names."""
        wanted = continued_records(response_id)
        read = await self.store.store.get_records(wanted, max_bytes=AHEAD_BYTES)
        self._ahead.pop(response_id, None)
        self._admit(response_id, param)
        stored = usable(await self._parsed(read[0], param, parsed), self.caller)
        if stored is not None:  # its output items, charged too
            charge = functools.partial(self._charge, param=param)
            stored = await self.store.with_outputs(stored, read[1:2], charge)
        if stored is None:  # none, another key's, or its outputs record is gone
            raise NotFound(f"no stored response {response_id[:64]!r}", param=param)
        self._keep_outputs(response_id, stored.response["output"])
        try:
            conversation = await self.store.conversation(response_id, self.bounds, read[2:])
        except ConversationTooLarge as exc:
            raise BodyTooLarge(str(exc), param=param) from None
        if conversation is None:  # it expired or was deleted since, or a part of it was
            raise NotFound(
                f"the conversation through stored response {response_id!r} is no longer kept",
                param=param,
            )
        return stored, conversation

    async def item(self, item_id: str, param: str) -> dict[str, Any]:
        """The stored output item `item_id` names."""
        owner = response_of_item(item_id)
        if owner is not None and owner not in self._outputs:
            await self._read(owner, param)
        item = self._outputs[owner].get(item_id) if owner is not None else None
        if item is None and owner in self._readable and owner not in self._inputs:
            self._inputs.add(owner)
            charge = functools.partial(self._charge, param=param)
            found = await self.store.input(owner, charge)
            for given in listed(found.items, owner) if found is not None else ():
                self._outputs[owner].setdefault(given["id"], given)
            item = self._outputs[owner].get(item_id)
        if item is None:
            raise NotFound(f"no stored item {item_id[:64]!r}", param=param)
        return dict(item)

    async def _read(self, response_id: str, param: str) -> None:
        """The output items of a response an item reference names."""
        self._admit(response_id, param)
        found = await self._record(response_id)
        outputs = usable(await self._parsed(found, param, parsed_outputs), self.caller)
        if outputs is not None:
            self._keep_outputs(response_id, outputs.output)

    async def named(self, response_id: str) -> Named:
        """The response a request without `previous_response_id` names last (by an item
        reference, or by the id of an item it sends whole), and its fingerprint: none when the
        backend failed (the request then reads what it names as any other)."""
        try:
            found = await self.store.store.get_record(FINGERPRINT_RECORD, response_id)
        except StateUnavailable:
            return Named(response_id, None)
        return Named(response_id, parsed_fingerprint(found, self.caller))

    async def called(self, call_id: str) -> str | None:
        """The response whose output holds the client call `call_id` (`CALL_RECORD`): None when
        none of the key's does that has a fingerprint, or the backend failed."""
        try:
            found = await self.store.store.get_record(CALL_RECORD, call_key(self._key, call_id))
        except StateUnavailable:
            return None
        return parsed_call(found, self.caller)

    async def continued_output(
        self, response_id: str, param: str
    ) -> tuple[list[dict[str, Any]], list[bytes | None]] | None:
        """The output items of the response `named` found, once a request is known to begin
        with its request's items, read with what fits of the records of the conversation
        through it (within AHEAD_BYTES); None when they are gone, or not the key's to use."""
        wanted = [(OUTPUTS_RECORD, response_id), *conversation_records(response_id)]
        try:
            found = await self.store.store.get_records(wanted, max_bytes=AHEAD_BYTES)
        except StateUnavailable:
            return None
        async with parse_turn(len(found[0] or b"")):
            outputs = parsed_outputs(found[0], self.caller)
        if outputs is None or not self._may_use(outputs):
            return None
        self._admit(response_id, param)
        await self._charged(found[0], param)
        self._keep_outputs(response_id, outputs.output)
        return outputs.output, found[1:]

    async def conversation(
        self, response_id: str, found: list[bytes | None]
    ) -> Conversation | None:
        """The conversation through a response `continued_output` read (`found`, what it read
        of its records): None when it is gone, larger than a request's body, or could not be
        read."""
        try:
            return await self.store.conversation(response_id, self.bounds, found)
        except (ConversationTooLarge, StateUnavailable):
            return None

    def _may_use(self, outputs: StoredOutputs) -> bool:
        """Whether the key may still use the agent or model of a response it made."""
        try:
            usable(outputs, self.caller)
        except PermissionDenied:
            return False
        return True

    def _admit(self, response_id: str, param: str) -> None:
        """Counts a response read (whatever it holds), within MAX_STORED_READS."""
        if len(self._outputs) >= MAX_STORED_READS:
            raise InvalidRequest(
                f"a request may read at most {MAX_STORED_READS} stored responses (its "
                "previous_response_id and the responses its item references name); continue "
                "the conversation with previous_response_id instead of naming so many of its "
                "items (the AI SDK: providerOptions.openai.previousResponseId)",
                param=param,
            )
        self._outputs[response_id] = {}

    async def _parsed(
        self, found: bytes | None, param: str, parse: Callable[[bytes | None, Caller | None], Read]
    ) -> Read:
        """A record charged (`_charged`) and parsed by `parse` in the loop's parse turn."""
        async with parse_turn(len(found or b"")):
            await self._charged(found, param)
            return parse(found, self.caller)

    async def _charged(self, found: bytes | None, param: str) -> None:
        """Charges a record the key made (another key's has no size for it), and gives the loop
        to others every YIELD_EVERY_BYTES."""
        if found is not None and (self.caller is None or owned_by(found, self.caller.name)):
            await self._charge(found, param)
        if self._budget.read_bytes - self._yielded >= YIELD_EVERY_BYTES:
            self._yielded = self._budget.read_bytes
            await asyncio.sleep(0)  # other requests' turn

    def _keep_outputs(self, response_id: str, output: list[Any]) -> None:
        self._readable.add(response_id)
        self._outputs[response_id] = {item.get("id"): item for item in output}

    async def _record(self, response_id: str) -> bytes | None:
        """The outputs record of a response, read with those the request names after it: as
        many as RECORDS_AT_ONCE and the bytes its budget has left allow (what is not read is
        not held); the response records of those stored without one, in a second read."""
        if response_id not in self._fetched:
            self._ahead.pop(response_id, None)
            chunk = [response_id, *itertools.islice(self._ahead, RECORDS_AT_ONCE - 1)]
            left = self._budget.bytes_left
            wanted = [(OUTPUTS_RECORD, named) for named in chunk]
            found = await self.store.store.get_records(wanted, max_bytes=left)
            older = [named for named, record in zip(chunk, found, strict=False) if record is None]
            responses: dict[str, bytes | None] = {}
            if older:  # stored before outputs had a record of their own
                left = max(0, left - sum(len(record or b"") for record in found))
                wanted = [(RESPONSE_RECORD, named) for named in older]
                read = await self.store.store.get_records(wanted, max_bytes=left)
                responses = dict(zip(older, read, strict=False))
            for named, record in zip(chunk, found, strict=False):  # the first ones only
                if record is None:
                    if named not in responses:
                        break  # not read within the budget: read in a later chunk
                    record = responses[named]
                self._fetched[named] = record
                self._ahead.pop(named, None)
        return self._fetched.pop(response_id)

    async def _charge(self, record: bytes, param: str) -> None:
        """Counts a record read against the budget, before it is parsed."""
        over = await self._budget.charge(record)
        if over is not None:
            raise BodyTooLarge(
                f"the stored responses this request reads hold more than {over}; continue the "
                "conversation with previous_response_id instead of naming so many of its items",
                param=param,
            )
