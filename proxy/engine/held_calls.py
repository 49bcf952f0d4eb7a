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
    """`messages` with each assistant message the client got back with only its calls replaced
    by the run's earlier steps and the reply it came from, followed by the server calls'
    results, so the model sees everything that ran. `held` maps the index of such a message
    to what `held_calls` kept for it. A history that already holds those results (a stored
    conversation, or a client that sent the server calls back: by their ids, or, as Responses
    `mcp_call` items under ids of their own, by their names and arguments in the same turn) is
    left as it is. The earlier steps' texts a client kept without their calls (a Responses
    client that leaves out the `mcp_call` items) give way to the steps they came from."""
    answered = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    restored: list[dict[str, Any]] = []
    turn_calls: set[tuple[Any, Any]] = set()  # the calls sent since the last user message
    for at, message in enumerate(messages):
        if message.get("role") == "user":
            turn_calls.clear()
        turn_calls.update(_named(message))
        kept = held.get(at)
        if (
            kept is None
            or not _same_client_calls(message, kept["message"])
            or not answered.isdisjoint(_results_of(kept))
            or not turn_calls.isdisjoint(_server_calls_of(kept))
        ):
            restored.append(message)
            continue
        earlier = kept.get("earlier", ())
        texts = {_said(m) for m in earlier if m.get("role") == "assistant"} - {""}
        while restored and not _named(restored[-1]) and _said(restored[-1]) in texts:
            restored.pop()  # a text-only copy of an earlier step, now put back whole
        restored.extend(earlier)
        restored.append(kept["message"])
        restored.extend(kept["results"])
    return restored


def _named(message: Mapping[str, Any]) -> set[tuple[Any, Any]]:
    """The names and arguments of an assistant message's calls."""
    if message.get("role") != "assistant":
        return set()
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return set()
    return {
        (f.get("name"), f.get("arguments"))
        for c in calls
        if isinstance(c, dict) and isinstance(f := c.get("function"), dict)
    }


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


def _same_client_calls(message: dict[str, Any], original: dict[str, Any]) -> bool:
    """The client's message holds exactly the client calls of the original reply."""
    ids = [c.get("id") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    known = {c.get("id") for c in original.get("tool_calls") or []}
    return bool(ids) and set(ids) <= known
