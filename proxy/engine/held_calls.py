"""Calls held back from the client (SPEC §5.1.6): a run that ends calling client tools keeps
the server calls of its reply, their results and its earlier steps out of the client's sight,
gives the client calls ids of the proxy's own, and puts what it held back into the history when
the client sends those calls back."""

from __future__ import annotations

import secrets
import string
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from proxy.engine.values import ModelReply, ToolCall

# The characters of an id a client call is given in place of the upstream's.
_ID_CHARACTERS = string.ascii_letters + string.digits


def private_call_id(upstream_id: str) -> str:
    """The id a client call is given by an agent with server tools, whose runs may hold server
    calls back (SPEC §5.1.6): one no other conversation has or can guess, whatever ids the
    upstream gives (some give every conversation `call_0`, and every turn), so that only the
    conversation it went to brings the held calls back, and none of its own calls bears the
    id of another. Of the upstream's form when that is nine letters and digits (some upstreams
    take no other), else OpenAI's (`call_` and 24 hex digits)."""
    if len(upstream_id) == 9 and upstream_id.isascii() and upstream_id.isalnum():
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def held_calls(
    earlier: list[dict[str, Any]],
    reply: ModelReply,
    ids: list[str],
    server: list[ToolCall],
    outputs: Mapping[str, str],
) -> dict[str, Any]:
    """What the client is not shown of a run that ends calling its tools (SPEC §5.1.6): the
    run's earlier steps, the reply with every call as the upstream gave it (what it adds, a
    Gemini `thought_signature` say, kept) under the ids the calls go by (`ids`, in order: the
    client's were given ids of the proxy's own), and the results of its server calls."""
    entries = reply.message.get("tool_calls") or []
    if len(entries) == len(ids) and all(isinstance(e, dict) for e in entries):
        calls = [{**entry, "id": call_id} for entry, call_id in zip(entries, ids, strict=True)]
    else:
        calls = [replace(c, id=i).to_openai() for c, i in zip(reply.tool_calls, ids, strict=True)]
    return {
        "earlier": earlier,
        "message": {**reply.message, "tool_calls": calls},
        "results": [
            {"role": "tool", "tool_call_id": c.id, "content": outputs[c.id]} for c in server
        ],
    }


def restore_held_calls(
    messages: list[dict[str, Any]], held: Mapping[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` with each assistant message the client got back with its calls replaced
    by the run's earlier steps and the reply it came from, followed by the server calls'
    results, so the model sees everything that ran, as it ran. `held` maps the index of such a
    message to what `held_calls` kept for it. A history that already holds those results under
    their ids (a stored conversation) is left as it is. A client that sent the server calls
    back as Responses `mcp_call` items (under ids of their own; found by their names and
    arguments in the same turn) had them joined to its calls in one step, or parted from them,
    as the items read: they give way to the steps they came from, as do the earlier steps'
    texts a client kept without their calls."""
    answered = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    restored: list[dict[str, Any]] = []
    turn = 0  # where the turn (since the last user message) begins in `restored`
    turn_calls: set[tuple[Any, Any]] = set()  # the calls sent since the last user message
    replaced: set[Any] = set()  # ids of sent-back calls put back as they ran: their results go
    for at, message in enumerate(messages):
        if message.get("role") == "tool" and message.get("tool_call_id") in replaced:
            continue
        if message.get("role") == "user":
            turn_calls.clear()
            turn = len(restored) + 1
        turn_calls.update(_named(message))
        kept = held.get(at)
        server = _server_calls_of(kept) if kept is not None else set()
        if (
            kept is None
            or not _client_calls_of(message, kept["message"], server)
            or not answered.isdisjoint(_results_of(kept))
        ):
            restored.append(message)
            continue
        texts = {_said(m) for m in [*kept.get("earlier", ()), kept["message"]]} - {""}
        if turn_calls.isdisjoint(server):  # left out: the steps' texts alone may be there
            while restored and not _named(restored[-1]) and _said(restored[-1]) in texts:
                restored.pop()  # a text-only copy of an earlier step, now put back whole
        else:
            replaced |= _drop_sent_back(restored, turn, message, server, texts)
        restored.extend(kept.get("earlier", ()))
        restored.append(kept["message"])
        restored.extend(kept["results"])
    return restored


def _client_calls_of(
    message: dict[str, Any], original: dict[str, Any], server: set[tuple[Any, Any]]
) -> bool:
    """The client's message holds client calls of the original reply, and else only server
    calls of the run, sent back (by their names and arguments)."""
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    known = {c.get("id") for c in original.get("tool_calls") or []}
    return any(c.get("id") in known for c in calls) and all(
        c.get("id") in known or _name_and_arguments(c) in server for c in calls
    )


def _drop_sent_back(
    restored: list[dict[str, Any]],
    turn: int,
    message: dict[str, Any],
    server: set[tuple[Any, Any]],
    texts: set[str],
) -> set[Any]:
    """Drops from the end of `restored` (within the turn) the steps a client made of the run's
    server calls it sent back: assistant messages of those calls alone, or of the steps'
    texts alone, and the calls' results, as far back as they go (an earlier run's steps
    before them stay, whatever it called). Returns the ids of the sent-back calls of
    `message`, whose results, after it, go too."""
    begins = len(restored)
    while begins > turn:
        earlier = restored[begins - 1]
        if earlier.get("role") != "tool" and not _sent_back(earlier, server, texts):
            break
        begins -= 1
    gone: set[Any] = set()
    for earlier in restored[begins:]:
        if earlier.get("role") == "assistant":
            gone.update(c.get("id") for c in earlier.get("tool_calls") or ())
    restored[begins:] = [
        m
        for m in restored[begins:]
        if m.get("role") == "tool" and m.get("tool_call_id") not in gone
    ]
    return {
        c.get("id")
        for c in message.get("tool_calls") or []
        if isinstance(c, dict) and _name_and_arguments(c) in server
    }


def _sent_back(message: dict[str, Any], server: set[tuple[Any, Any]], texts: set[str]) -> bool:
    """An assistant message a client made of a run's server calls or of its steps' texts."""
    if message.get("role") != "assistant":
        return False
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        return all(_name_and_arguments(c) in server for c in calls)
    return _said(message) in texts


def _name_and_arguments(call: Mapping[str, Any]) -> tuple[Any, Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        return (None, None)
    return (function.get("name"), function.get("arguments"))


def _named(message: Mapping[str, Any]) -> set[tuple[Any, Any]]:
    """The names and arguments of an assistant message's calls."""
    if message.get("role") != "assistant":
        return set()
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return set()
    return {_name_and_arguments(c) for c in calls if isinstance(c, dict)}


def _server_calls_of(kept: Mapping[str, Any]) -> set[tuple[Any, Any]]:
    """The names and arguments of the server calls a held record brings back."""
    ran = _results_of(kept)
    messages = [*kept.get("earlier", ()), kept["message"]]
    calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or ()]
    return {
        (c["function"].get("name"), c["function"].get("arguments"))
        for c in calls
        if c.get("id") in ran
    }


def _said(message: Mapping[str, Any]) -> str:
    """An assistant message's text, without the blank lines a stream parts steps with."""
    if message.get("role") != "assistant" or not isinstance(message.get("content"), str):
        return ""
    return str(message["content"]).strip()


def _results_of(kept: Mapping[str, Any]) -> set[str]:
    """The ids of the server calls whose results a held record brings back."""
    tool_messages = [*kept.get("earlier", ()), *kept["results"]]
    return {m["tool_call_id"] for m in tool_messages if m.get("role") == "tool"}


def first_call_id(message: dict[str, Any]) -> str | None:
    """The id of an assistant message's first tool call: what names the record of the calls
    held back with it."""
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not isinstance(calls, list) or not calls or not isinstance(calls[0], dict):
        return None
    call_id = calls[0].get("id")
    return call_id if isinstance(call_id, str) else None


def call_ids(message: dict[str, Any]) -> list[str]:
    """The ids of an assistant message's tool calls."""
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not isinstance(calls, list):
        return []
    return [i for c in calls if isinstance(c, dict) and isinstance(i := c.get("id"), str)]
