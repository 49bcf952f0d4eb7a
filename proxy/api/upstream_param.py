"""An upstream's error `param` in the client's terms. A run's upstream request is not the
client's: an agent's system prompt comes first, held server calls are put back, server tools
come before the client's, a Responses request's items became messages. An index the upstream
names (`messages[3].content`, `tools[0].function.name`) is turned into the index of the
client's own message or tool it was sent as (found by identity: the proxy sends the client's
objects), and dropped when it names something the proxy made or the client named otherwise."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.engine.values import ModelRequest

# `messages[3].content`, or `messages.[3].content` as some upstreams write it.
_INDEXED = re.compile(r"(messages|tools)(\.?\[)(\d{1,9})\](.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ClientTerms:
    """How a client named the parts of its request: its `messages` (None: it sent none, as a
    Responses or stored context's request), its tools, and where it named each tool's name
    when not as Chat Completions does (Responses' `tools[i].name`, no `function` member)."""

    messages: Sequence[dict[str, Any]] | None
    tools: Sequence[dict[str, Any]] = ()
    tool_params: Sequence[str] = ()


def client_param(
    param: str | None, sent: ModelRequest | None, terms: ClientTerms | None
) -> str | None:
    """`param` of an upstream's error about the request `sent`, as the client named it; None
    when it names a part the client did not send as such. Other params (`model`,
    `temperature`, …) are the client's own fields, relayed as they are."""
    found = _INDEXED.fullmatch(param) if param is not None else None
    if found is None:
        return param
    field, opening, index, rest = found.groups()
    if sent is None or terms is None:
        return None
    parts = sent.messages if field == "messages" else sent.tools
    ours = terms.messages if field == "messages" else terms.tools
    if ours is None or int(index) >= len(parts):
        return None
    part = parts[int(index)]
    at = next((i for i, own in enumerate(ours) if own is part), None)
    if at is None:
        return None
    if field == "tools" and terms.tool_params:  # `tools[i].name`, its fields beside the name
        return terms.tool_params[at].removesuffix(".name") + rest.removeprefix(".function")
    return f"{field}{opening}{at}]{rest}"


def client_message(message: str, sent_param: str, param: str | None) -> str:
    """An upstream's error `message` that names the part `sent_param` indexes, as the client
    knows it: by the index of its own part (`param`), or, for a part the proxy made, as one of
    the request sent upstream."""
    found = _INDEXED.fullmatch(sent_param)
    if found is None or sent_param == param:
        return message
    field, opening, index, _ = found.groups()
    sent_part = f"{field}{opening}{index}]"
    if param is None:
        named = sent_param if sent_param in message else sent_part
        return message.replace(named, f"{named} (of the request sent upstream)", 1)
    renamed = _INDEXED.fullmatch(param)
    if renamed is None:  # a Responses tool, named by its own path
        return message.replace(sent_param, param)
    field, opening, index, _ = renamed.groups()
    return message.replace(sent_part, f"{field}{opening}{index}]")
