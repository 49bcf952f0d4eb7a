"""Server calls held back from the client (SPEC §5.1.6): kept for `state.run_ttl_s` under the
id of the first client call they came with and a digest of the conversation before it, in the
key's namespace. A client that sends that call back after the same conversation gets them put
back in place; an upstream that gives every conversation the same call ids (`call_0`) cannot
make one conversation take another's calls."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from proxy.api.auth import Caller
from proxy.engine.run_spec import RunResult
from proxy.engine.tool_calls import first_call_id, restore_held_calls
from proxy.state.store import StateStore

HELD_RECORD = "held_calls"
# How many of a history's assistant messages with tool calls a request looks up held calls for.
HELD_LOOKUPS = 16


async def keep(
    store: StateStore,
    result: RunResult,
    asked: list[dict[str, Any]],
    caller: Caller | None,
    ttl_s: float,
) -> None:
    """Keeps what `result` held back, for the conversation `asked` (the messages the client
    sent, as it sent them) followed by the reply the client got."""
    calls = result.message.get("tool_calls") or []
    if result.held is None or not calls:
        return
    (digest,) = _digests(asked, [len(asked)])
    key = _key(caller, calls[0]["id"], digest)
    await store.put_record(HELD_RECORD, key, orjson.dumps(result.held), ttl_s)


async def restore(
    store: StateStore, messages: list[dict[str, Any]], caller: Caller | None
) -> list[dict[str, Any]]:
    """`messages` with the server calls held back from the client put back in place; the
    latest HELD_LOOKUPS assistant messages with tool calls are looked up."""
    asked = [i for i, message in enumerate(messages) if first_call_id(message) is not None]
    asked = asked[-HELD_LOOKUPS:]
    held: dict[int, dict[str, Any]] = {}
    for at, digest in zip(asked, _digests(messages, asked), strict=True):
        key = _key(caller, first_call_id(messages[at]) or "", digest)
        found = await store.get_record(HELD_RECORD, key)
        if found is not None:
            held[at] = orjson.loads(found)
    return restore_held_calls(messages, held) if held else messages


def _key(caller: Caller | None, call_id: str, digest: str) -> str:
    name = f"{call_id}:{digest}"
    return caller.scoped(name) if caller is not None else name


def _digests(messages: list[dict[str, Any]], ends: list[int]) -> list[str]:
    """The digest of `messages[:end]` for each of `ends` (ascending), in one pass: each
    message's role, content, tool calls (id, name, arguments) and tool call id, so that what
    a client library adds or leaves out (`refusal: null`, `annotations: []`) does not count."""
    hashed = hashlib.sha256()
    found: list[str] = []
    at = 0
    for end in ends:
        for message in messages[at:end]:
            hashed.update(_canonical(message))
        at = end
        found.append(hashed.copy().hexdigest()[:32])
    return found


def _canonical(message: dict[str, Any]) -> bytes:
    calls = message.get("tool_calls")
    named = (
        [[c.get("id"), *_function(c)] for c in calls if isinstance(c, dict)]
        if isinstance(calls, list)
        else None
    )
    form = [message.get("role"), message.get("content") or None, named, message.get("tool_call_id")]
    return orjson.dumps(form, option=orjson.OPT_SORT_KEYS) + b"\n"


def _function(call: dict[str, Any]) -> list[Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        return [None, None]
    return [function.get("name"), function.get("arguments")]
