"""The body deadline (`server.body_timeout_s`) on every route that reads a body: a client that
sends half its body gets an OpenAI-shaped 408 and its connection is closed."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from starlette.types import ASGIApp, Message

from tests.integration.conftest import ProxyFactory


async def half_a_body(app: ASGIApp, path: str) -> list[Message]:
    """Sends the first half of a body to `path` and then nothing; gives what the app sent."""
    messages: list[Message] = [
        {"type": "http.request", "body": b'{"model": "a", ', "more_body": True}
    ]

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("proxy.test", 80),
        "http_version": "1.1",
    }
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat", "/v1/embeddings"])
async def test_half_a_body_is_a_408_that_closes_the_connection(
    proxy_for: ProxyFactory, path: str
) -> None:
    async with proxy_for({"server": {"body_timeout_s": 0.2}}) as proxy:
        sent = await half_a_body(proxy.client._transport.app, path)
    start = sent[0]
    assert start["status"] == 408
    assert (b"connection", b"close") in start["headers"]
    error = orjson.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["code"] == "request_timeout"
    assert error["type"] == "invalid_request_error"
