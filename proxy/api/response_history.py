"""The conversation a Responses request's run begins with (SPEC §12.4): the stored one it
continues (`previous_response_id`, or a conversation sent whole again), then its new items,
each reference read, every call of the turn answered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.api.fingerprint_records import Lineage
from proxy.api.resent import Resent, first_lineage, last_stored, resumed
from proxy.api.response_items import CLIENT_CALLS, OUTPUT_ITEMS, items_to_messages
from proxy.api.response_store import StoredInput, response_of_item
from proxy.api.responses_request import ResponsesRequest
from proxy.api.stored_conversation import Conversation
from proxy.api.stored_reads import Named, StoredReads
from proxy.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class History:
    """The messages a request's run begins with (`instructions` aside), its input items with
    references read and what they follow, the stored conversation the messages begin with
    (that of `previous_response_id`, or of the response a conversation sent whole names:
    `resent`), and, without `previous_response_id`, what its fingerprint goes on from."""

    messages: list[dict[str, Any]]
    inputs: StoredInput
    continued: Conversation | None
    lineage: Lineage | None


@dataclass(slots=True)
class _Continuation:
    """Where a request's conversation begins: the stored conversation it continues (`continued`,
    whose `messages` come first), the output of the response it continues (its client calls'
    outputs are due), the first of its items not yet held (`start`), and the thread it goes on
    in; for one without `previous_response_id`, the response its items name last (`named`), the
    continuation it is of that one (`resent`) and what its fingerprint goes on from."""

    continued: Conversation | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    start: int = 0
    thread: str | None = None
    named: Named | None = None
    resent: Resent | None = None
    lineage: Lineage | None = None

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return self.continued.messages if self.continued is not None else []


async def _continuation(req: ResponsesRequest, reads: StoredReads) -> _Continuation:
    """The stored conversation of `previous_response_id`; else that of the response a
    conversation sent whole again names last, when it continues it; else none."""
    if req.previous_response_id is not None:
        reads.will_read(_referenced(req.items))
        previous, continued = await reads.previous(req.previous_response_id, "previous_response_id")
        outputs = list(previous.response.get("output") or ())
        return _Continuation(continued, outputs, thread=previous.thread)
    # A request that stores nothing (Codex's) sends its calls back whole each turn: no read for
    # them, as no response of its has a record of its calls.
    last = await last_stored(req.items, reads, by_call=req.store)
    if last is None:
        return _Continuation(lineage=await first_lineage(req.items) if req.store else None)
    named = await reads.named(last[1])
    resent, lineage = await resumed(req.items, last[0], named, reads)
    if resent is None:
        reads.will_read(_referenced(req.items))
        return _Continuation(named=named, lineage=lineage)
    return _Continuation(
        resent.conversation, [], resent.start, resent.thread, named, resent, lineage
    )


def _calls_of(conversation: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """The ids of a conversation's calls, and of those an output follows the last call of. (An
    upstream may give every turn the same call ids, `call_0`: an output is one too many only
    after its call's last output.)"""
    known: set[str] = set()
    done: dict[str, bool] = {}  # by call id: whether an output follows its last call
    for message in conversation:
        for call in message.get("tool_calls") or ():
            known.add(call["id"])
            done[call["id"]] = False
        if message.get("role") == "tool":
            done[message.get("tool_call_id") or ""] = True
    return known, {call_id for call_id, output in done.items() if output}


async def _new_items(
    req: ResponsesRequest, at: _Continuation, reads: StoredReads
) -> list[dict[str, Any]]:
    """The request's items after those its conversation holds, each `item_reference` read.
    A function call output must answer a call of the conversation or of the items before it;
    an item the conversation holds already is refused (the model would see it twice)."""
    previous_id = req.previous_response_id
    known, answered = _calls_of(at.conversation)
    # A call is the previous response's by its place in it.
    previous_calls = {i.get("call_id") for i in at.outputs if i.get("type") in CLIENT_CALLS}
    # The client calls still without an output, in order: the continued response's, then those
    # the items make (OpenAI refuses a turn that leaves one).
    unanswered = dict.fromkeys(
        i.get("call_id")
        for i in at.outputs
        if i.get("type") in CLIENT_CALLS and i.get("call_id") not in answered
    )
    if not at.outputs:  # a conversation resent whole: the calls its last reply made
        last: dict[str, Any] = next(
            (m for m in reversed(at.conversation) if m.get("role") == "assistant"), {}
        )
        unanswered.update(
            dict.fromkeys(c["id"] for c in last.get("tool_calls") or () if c["id"] not in answered)
        )
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i in range(at.start, len(req.items)):
        item = req.items[i]
        kind = item.get("type", "message")
        if kind == "item_reference":
            ref: str = item["id"]
            if ref in seen:  # the same stored item named twice (a call, and its result)
                continue
            seen.add(ref)
            if previous_id is not None and response_of_item(ref) == previous_id:
                raise _held_already("id", ref, f"input[{i}].id")
            item = await reads.item(ref, f"input[{i}].id")
            kind = item.get("type", "message")
        if kind in CLIENT_CALLS:
            if item["call_id"] in previous_calls:
                raise _held_already("call_id", item["call_id"], f"input[{i}].call_id")
            known.add(item["call_id"])
            answered.discard(item["call_id"])
            unanswered[item["call_id"]] = None
        elif kind == "mcp_call":
            known.add(item["id"])
        elif kind in OUTPUT_ITEMS:
            if item["call_id"] in answered:
                raise _held_already("call_id", item["call_id"], f"input[{i}].call_id")
            if item["call_id"] not in known:
                raise InvalidRequest(
                    f"no tool call with call_id {item['call_id'][:64]!r} comes before this output",
                    param=f"input[{i}].call_id",
                )
            unanswered.pop(item["call_id"], None)
        items.append(item)
    if unanswered:
        first = str(next(iter(unanswered)))
        raise InvalidRequest(f"No tool output found for function call {first[:64]}.", param="input")
    return items


async def request_history(req: ResponsesRequest, reads: StoredReads) -> History:
    """The conversation a request continues (`_continuation`), then its new items; the run takes
    the thread it goes on in, unless it names one."""
    at = await _continuation(req, reads)
    if req.run.thread_id is None:
        req.run.thread_id = at.thread
    items = await _new_items(req, at, reads)
    messages = [*at.conversation, *items_to_messages(items)]
    if not messages:  # (what OpenAI answers too; the upstream's own error was relayed)
        raise InvalidRequest(
            "input holds no item a model reads (reasoning, hosted tool calls and approvals are "
            "left out): send a message",
            param="input",
        )
    if req.previous_response_id is not None:
        inputs = StoredInput(req.previous_response_id, items, at.outputs)
        return History(messages, inputs, at.continued, None)
    if at.resent is not None:
        inputs = StoredInput(at.resent.named, items, at.resent.output)
        return History(messages, inputs, at.continued, at.lineage)
    continued = None
    fingerprint = at.named.fingerprint if at.named is not None and req.store else None
    if fingerprint is not None:  # its conversation may still begin with named's: its thread
        continued = await fingerprint.conversation.begun(messages)
        if continued is not None and req.run.thread_id is None:
            req.run.thread_id = fingerprint.thread
    return History(messages, StoredInput(None, items, []), continued, at.lineage)


def _referenced(items: list[dict[str, Any]]) -> list[str]:
    """The responses the item references among `items` name, in order."""
    refs = [item["id"] for item in items if item.get("type") == "item_reference"]
    return [owner for ref in refs if (owner := response_of_item(ref)) is not None]


def _held_already(key: str, value: str, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"Duplicate item found with {key} {value[:64]!r}: the conversation this request "
        "continues (its previous_response_id, or the stored response its items name last) "
        "holds it already; send only the items that follow it",
        param=param,
    )
