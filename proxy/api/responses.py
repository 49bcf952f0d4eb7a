"""Raw ASGI responses: JSON bodies and OpenAI-shaped errors, with no per-call overhead."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import Send

from proxy.errors import ProxyError

JSON = b"application/json"


def header_list(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def send_json(
    send: Send, status: int, body: Any, headers: dict[str, str] | None = None
) -> None:
    content = orjson.dumps(body)
    await send_bytes(send, status, content, JSON, headers)


async def send_bytes(
    send: Send,
    status: int,
    content: bytes,
    content_type: bytes,
    headers: dict[str, str] | None = None,
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(content)).encode())]
    if headers:
        raw.extend(header_list(headers))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


async def send_error(
    send: Send,
    error: ProxyError,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    body = error.body()
    if extra:
        body.update(extra)
    await send_json(send, error.status, body, headers)
