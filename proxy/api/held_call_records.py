"""Server calls held back from the client (SPEC §5.1.6), kept for `state.run_ttl_s` in the
key's namespace under the id of the first client call they came with: an id of the proxy's own
(`private_call_id`), which only the conversation it went to can send back."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.api.auth import Caller
from proxy.engine.held_calls import call_ids, first_call_id, restore_held_calls
from proxy.engine.run_spec import Keep, RunResult
from proxy.state.store import Record, StateStore

HELD_RECORD = "held"
# How many of a history's assistant messages with tool calls a request looks up held calls for,
# and how many of their calls' ids at most (a client that sends server calls back as Responses
# items has them in one message with its own: each of a message's calls is looked up).
HELD_LOOKUPS = 16
HELD_LOOKUP_IDS = 64


def record(result: RunResult, caller: Caller | None) -> Record | None:
    """The record of what `result` held back from the client, if anything."""
    first = first_call_id(result.message) if result.held is not None else None
    if first is None:
        return None
    return Record(HELD_RECORD, _key(caller, first), orjson.dumps(result.held))


def keeper(store: StateStore, ttl_s: float, caller: Caller | None) -> Keep:
    """A run's keep that writes the server calls it held back, if any, before its answer: its
    client's next request needs them (the model would not see what ran, and may run it again).
    A backend that fails raises StateUnavailable: the run ends `state_unavailable`."""

    async def keep(result: RunResult) -> None:
        held = record(result, caller)
        if held is not None:
            await store.put_records([held], ttl_s)

    return keep


async def restore(
    store: StateStore, messages: list[dict[str, Any]], caller: Caller | None
) -> list[dict[str, Any]]:
    """`messages` with the server calls held back from the client put back in place; the
    calls of the latest HELD_LOOKUPS assistant messages with tool calls are looked up."""
    calling = [i for i, m in enumerate(messages) if first_call_id(m) is not None]
    asked = [(i, c) for i in calling[-HELD_LOOKUPS:] for c in call_ids(messages[i])]
    asked = asked[-HELD_LOOKUP_IDS:]
    if not asked:
        return messages
    keys = [_key(caller, call_id) for _, call_id in asked]
    found = await store.get_records([(HELD_RECORD, key) for key in keys])
    held: dict[int, dict[str, Any]] = {}
    for (at, _), value in zip(asked, found, strict=True):
        if value is not None and at not in held:
            held[at] = orjson.loads(value)
    return restore_held_calls(messages, held) if held else messages


def _key(caller: Caller | None, call_id: str) -> str:
    return caller.scoped(call_id) if caller is not None else call_id
