"""A request's JSON body, bounded before the work of parsing it: its bytes while it is read
(`server.max_body_bytes`), the values it holds before it is parsed (`server.max_body_values`),
and its nesting as it is parsed.

Parsing is the work that needs a bound of its own: orjson holds the event loop for as long as it
parses, and 8 MiB of `[],` takes it more than half a second, during which no other request
moves. The values are counted first (`proxy.json_values`).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import Receive, Scope

from proxy.api.asgi import read_body
from proxy.config.server import ServerConfig
from proxy.errors import BodyTooLarge, InvalidRequest
from proxy.json_values import holds_over

# orjson reads 1,024 levels of nesting but writes only 254. The proxy puts what a body holds
# into objects of its own, a few levels deeper than it came (a Responses tool's `parameters`
# one level down for the upstream, a response's echoed settings in its stream's events and its
# stored record): a body nested deeper than it could then write is refused when it is read.
WRITTEN_DEPTH = 254
HEADROOM = 8  # levels the proxy may add
MAX_JSON_DEPTH = WRITTEN_DEPTH - HEADROOM
_COUNT_BRACKETS_UP_TO = 64 * 1024


async def read_json(receive: Receive, scope: Scope, server: ServerConfig) -> bytes:
    """The body of a request, refused (413 `request_too_large`) when it has more bytes or more
    JSON values than the server takes."""
    raw = await read_body(receive, scope, server.max_body_bytes)
    limit = server.max_body_values
    if await holds_over(raw, limit):
        raise BodyTooLarge(f"the body holds more than {limit} JSON values (server.max_body_values)")
    return raw


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object, nested at most MAX_JSON_DEPTH deep."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    # A small body with few brackets cannot nest that deep; a large one is written back whole
    # (counting its brackets first would take as long as that, and it has more than enough).
    if len(raw) > _COUNT_BRACKETS_UP_TO or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        wrapped: Any = body
        for _ in range(HEADROOM):
            wrapped = [wrapped]
        try:
            orjson.dumps(wrapped)
        except TypeError:
            raise InvalidRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    return body
