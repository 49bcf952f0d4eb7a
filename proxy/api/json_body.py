"""A request's JSON body, bounded before the work of parsing it: its bytes while it is read
(`server.max_body_bytes`), the values it holds before it is parsed (`server.max_body_values`),
and its nesting as it is parsed.

Parsing is the work that needs a bound of its own: orjson holds the event loop for as long as it
parses, and 8 MiB of `[],` takes it more than half a second, during which no other request
moves. The values are counted first (`proxy.json_values`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from starlette.types import Receive, Scope

from proxy.api.asgi import read_body
from proxy.config.server import ServerConfig
from proxy.errors import BodyTooLarge, InvalidRequest
from proxy.json_values import MAX_DEPTH, holds_over, nests_too_deep
from proxy.parse_turns import parse_turn

Parsed = TypeVar("Parsed")


async def read_json(
    receive: Receive, scope: Scope, server: ServerConfig, parse: Callable[[bytes], Parsed]
) -> Parsed:
    """The body of a request, read and given to `parse`: refused (413 `request_too_large`) when
    it has more bytes or more JSON values than the server takes, and 415 when it is compressed
    (read as plain, it would be "not valid JSON"). A large body is counted and parsed in the
    loop's parse turn."""
    raw = await read_body(receive, scope, server.max_body_bytes)
    limit = server.max_body_values
    async with parse_turn(len(raw)):
        if await holds_over(raw, limit):
            raise BodyTooLarge(
                f"the body holds more than {limit} JSON values (server.max_body_values)"
            )
        return parse(raw)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object, nested at most MAX_DEPTH deep."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    if nests_too_deep(raw, body):
        raise InvalidRequest(f"the body nests deeper than {MAX_DEPTH} levels")
    return body
