"""The conversation through a stored response (SPEC §12.4), kept in parts, so that a chain
continued turn after turn takes space that grows with its conversation, not with its square.

A response's record holds the messages its turn added, after a list of the earlier records
that hold the rest (a tail record); or, when it names none, its whole conversation (a
conversation record, as every response had before: a version that knows no tails reads these).
A conversation of up to WHOLE_BYTES is kept whole (read with its response in one read). Past
it, each turn copies into its own record the earlier parts no larger than what it holds (or
than MIN_PART_BYTES), as a binary counter carries: the parts a conversation names are larger
the older they are, so there are few of them (read together in a second read), and a message
is copied a few times (about the logarithm of the conversation's size in parts) rather than
once a turn. A record keeps the parts it names as long as itself. Deleting a response deletes
its records: a later response whose conversation names one can no longer be continued.

A client may send the whole conversation again each turn instead (the AI SDK names the earlier
output items by item references, without `previous_response_id`): a response made so keeps a
fingerprint of the conversation through it (the digest of its messages as items carry them, and
the parts that hold it), and a request whose messages begin with that conversation is stored as
its continuation, naming those parts without reading them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.api.json_digest import JsonDigest
from proxy.state.store import Record, StateStore

log = logging.getLogger(__name__)

CONVERSATION_RECORD = "conversation"  # a whole conversation: its messages, a JSON array
# The messages one turn added (a JSON array), after a line that lists the earlier parts: a JSON
# array of [response id, whether its record is a conversation record, the bytes of its part].
TAIL_RECORD = "conversation_tail"
WHOLE_BYTES = 64 * 1024  # a conversation up to this size is kept whole: one read
MIN_PART_BYTES = 16 * 1024  # a smaller part is copied into the next turn's record
MAX_PARTS = 32  # the most records one conversation is read from


class Gone(Exception):
    """A part of the conversation is gone (it expired, or its response was deleted)."""


@dataclass(frozen=True, slots=True)
class Part:
    """The messages of one record of a conversation: `size` bytes of them (a JSON array),
    `count` messages; `whole`: the record is a conversation record (the part that begins it)."""

    response_id: str
    whole: bool
    size: int
    count: int

    @property
    def record(self) -> tuple[str, str]:
        return (CONVERSATION_RECORD if self.whole else TAIL_RECORD, self.response_id)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A stored conversation's messages, and the parts that hold them, in order; `hashing`,
    when it was known by its fingerprint: the digest of its messages' `canonical` forms, for
    the fingerprint of the conversation that goes on from it."""

    messages: list[dict[str, Any]]
    parts: tuple[Part, ...]
    hashing: ConversationDigest | None = None


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The conversation through a response, kept for a client that sends that conversation
    whole again: the digest of its messages' `canonical` forms and the parts that hold it."""

    digest: str
    parts: tuple[Part, ...]

    async def begun(self, messages: list[dict[str, Any]]) -> Conversation | None:
        """The conversation it fingerprints, when `messages` begin with it (as items carry it:
        the stored conversation is sent on, the parts it names as they were stored)."""
        count = sum(part.count for part in self.parts)
        if len(messages) < count:
            return None
        hashing = await ConversationDigest().extended(messages[:count])
        if hashing.hexdigest() != self.digest:
            return None
        return Conversation(messages[:count], self.parts, hashing)

    def form(self) -> list[Any]:
        """Its JSON form: `[digest, [[response id, whole, size, count], ...]]`."""
        return [self.digest, [[p.response_id, p.whole, p.size, p.count] for p in self.parts]]

    @staticmethod
    def read(form: Any) -> Fingerprint | None:
        """The fingerprint of a JSON `form`; None when it is not one (or none was kept)."""
        try:
            digest, parts = form
            read = tuple(_part(*named) for named in parts)
        except (TypeError, ValueError):
            return None
        if not isinstance(digest, str) or not 0 < len(read) <= MAX_PARTS:
            return None
        if any(part.count < 0 for part in read):
            return None
        return Fingerprint(digest, read)


async def fingerprint(
    response_id: str,
    record: Record,
    named: Sequence[Part],
    messages: list[dict[str, Any]],
    continued: Conversation | None,
) -> Fingerprint:
    """The fingerprint of `messages`, the conversation through `response_id`, kept in `record`
    and the `named` parts (as `stored_form` made them from the conversation it `continued`):
    the digest goes on from that conversation's when it has one, so that a conversation sent
    whole is hashed once a turn."""
    own = record.value if not named else record.value.partition(b"\n")[2]
    count = len(messages) - sum(part.count for part in named)
    parts = (*named, Part(response_id, not named, len(own), count))
    if continued is not None and continued.hashing is not None:
        hashing, rest = continued.hashing.copy(), messages[len(continued.messages) :]
    else:
        hashing, rest = ConversationDigest(), messages
    return Fingerprint((await hashing.extended(rest)).hexdigest(), parts)


class CallNumbers:
    """The calls of a conversation numbered as they come, and each result by the number of the
    call it answers, for a fingerprint that holds no call id: the conversation as stored (the
    upstream's ids) and as its items carry it (a server call under the id of the `mcp_call`
    item that shows it) are then one. An id given again (an upstream that gives every turn
    `call_0`) is a new call; a result answers the latest call of its id."""

    __slots__ = ("count", "latest")

    def __init__(self) -> None:
        self.count = 0
        self.latest: dict[str, int] = {}

    def call(self, call_id: Any) -> Any:
        if not isinstance(call_id, str):
            return call_id
        self.latest[call_id] = number = self.count
        self.count += 1
        return number

    def answered(self, call_id: Any) -> Any:
        return self.latest.get(call_id, call_id) if isinstance(call_id, str) else call_id

    def copy(self) -> CallNumbers:
        other = CallNumbers()
        other.count, other.latest = self.count, dict(self.latest)
        return other


class ConversationDigest:
    """The digest of a conversation's `canonical` forms, as it grows."""

    __slots__ = ("calls", "json")

    def __init__(self) -> None:
        self.json = JsonDigest()
        self.calls = CallNumbers()

    async def extended(self, messages: list[dict[str, Any]]) -> ConversationDigest:
        """Adds `messages` (hashed a piece at a time: `JsonDigest.extended`); gives itself."""
        await self.json.extended(messages, functools.partial(canonical, calls=self.calls))
        return self

    def copy(self) -> ConversationDigest:
        other = ConversationDigest()
        other.json, other.calls = self.json.copy(), self.calls.copy()
        return other

    def hexdigest(self) -> str:
        return self.json.hexdigest()


def canonical(
    messages: list[dict[str, Any]], calls: CallNumbers | None = None
) -> list[dict[str, Any]]:
    """Messages as their items carry them when a client sends them back (`items_to_messages`
    makes no more of them): a role, content, tool calls (type, name, arguments) and the call a
    result answers, each call by its number in the conversation (`calls`, going on from the
    messages before). What else an upstream's reply holds (`refusal: null`, `annotations`,
    `reasoning_content`, a call's extra fields) is not part of a conversation's fingerprint."""
    calls = calls if calls is not None else CallNumbers()
    forms = []
    for message in messages:
        form = {"role": message.get("role"), "content": message.get("content")}
        if called := message.get("tool_calls"):
            form["tool_calls"] = [_call_form(call, calls) for call in called]
        if "tool_call_id" in message:
            form["tool_call_id"] = calls.answered(message["tool_call_id"])
        forms.append(form)
    return forms


def _call_form(call: Any, calls: CallNumbers) -> Any:
    if not isinstance(call, dict) or not isinstance(function := call.get("function"), dict):
        return call
    named = {"name": function.get("name"), "arguments": function.get("arguments")}
    return {"id": calls.call(call.get("id")), "type": call.get("type"), "function": named}


def stored_form(
    response_id: str, messages: list[dict[str, Any]], continued: Conversation | None
) -> tuple[Record, list[Part]]:
    """The record that keeps `messages`, the conversation through `response_id` (which begins
    with the messages of the conversation it `continued`), and the earlier parts it names (to
    keep as long as it)."""
    parts = list(continued.parts) if continued is not None else []
    start = sum(part.count for part in parts)
    own = orjson.dumps(messages[start:])
    size = len(own)
    small = sum(part.size for part in parts) + size <= WHOLE_BYTES
    copied = 0
    while parts and (
        small or len(parts) >= MAX_PARTS or parts[-1].size <= max(size, MIN_PART_BYTES)
    ):
        part = parts.pop()
        copied += part.count
        size += part.size
    if copied:  # the parts copied in, with what the turn added
        own = orjson.dumps(messages[start - copied :])
    if not parts:
        return Record(CONVERSATION_RECORD, response_id, own), []
    named = orjson.dumps([[part.response_id, part.whole, part.size] for part in parts])
    return Record(TAIL_RECORD, response_id, named + b"\n" + own), parts


def whole(response_id: str, record: bytes, messages: list[dict[str, Any]]) -> Conversation:
    """The conversation of a conversation record, `messages` parsed from it."""
    return Conversation(messages, (Part(response_id, True, len(record), len(messages)),))


def named_parts(response_id: str, record: bytes) -> tuple[list[Part], bytes]:
    """The earlier parts a tail record names (their counts unknown yet: -1), and its own
    messages, unparsed. Raises Gone when it is not in the form this version writes."""
    line, _, own = record.partition(b"\n")
    try:
        parts = [_part(*named) for named in orjson.loads(line)]
    except (orjson.JSONDecodeError, TypeError, ValueError):
        parts = []
    if not parts or len(parts) >= MAX_PARTS or len(own) < 2:
        log.warning("the stored conversation of %s is not in a known form", response_id)
        raise Gone
    return parts, own


def _part(response_id: object, whole: object, size: object, count: object = -1) -> Part:
    if not (isinstance(response_id, str) and isinstance(whole, bool) and type(size) is int):
        raise TypeError("not a part")
    if type(count) is not int:
        raise TypeError("not a part")
    return Part(response_id, whole, size, count)


async def read_parts(store: StateStore, parts: Sequence[Part], own: bytes) -> list[bytes]:
    """The messages of each part (JSON arrays, unparsed), the tail's `own` last, in one read.
    Raises Gone when one is missing or not the size its tail says (it expired or was deleted)."""
    found = await store.get_records([part.record for part in parts])
    texts = []
    for part, record in zip(parts, found, strict=True):
        text = record if part.whole or record is None else record.partition(b"\n")[2]
        if text is None or len(text) != part.size:
            raise Gone
        texts.append(text)
    texts.append(own)
    return texts


def joined(texts: Sequence[bytes]) -> bytes:
    """One JSON array of the messages of JSON arrays, copied once (they may be megabytes)."""
    pieces: list[bytes | memoryview] = [b"["]
    for text in texts:
        if len(text) > 2:
            pieces += (memoryview(text)[1:-1], b",")
    if len(pieces) > 1:
        pieces.pop()  # the last comma
    pieces.append(b"]")
    return b"".join(pieces)


def joined_size(sizes: Sequence[int]) -> int:
    """The bytes `joined` makes of JSON arrays of these sizes."""
    held = [size - 2 for size in sizes if size > 2]
    return 2 + sum(held) + max(0, len(held) - 1)


def parsed_parts(parts: Sequence[Part], texts: Sequence[bytes]) -> Conversation:
    """The conversation of a tail record's parts (the tail's own last), each parsed on its own:
    their counts. Raises Gone when one is not a JSON array."""
    messages: list[dict[str, Any]] = []
    counted = []
    for part, text in zip(parts, texts, strict=True):
        held = orjson.loads(text)
        if not isinstance(held, list):
            raise Gone
        messages += held
        counted.append(Part(part.response_id, part.whole, len(text), len(held)))
    return Conversation(messages, tuple(counted))
