"""What the fast path must keep doing: a stream's first bytes leave when the upstream's answer
begins, not when its first text arrives; a pass-through completion carries the upstream's
fields unchanged. The proxy talks to a real upstream server over its default transport."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message

from proxy.api.app import create_app
from proxy.config import parse_config
from tests.direct_asgi import body_then_stay, post_scope
from tests.faulty_upstream import (
    CRLF,
    DONE,
    FaultyUpstream,
    completion,
    delta,
    event,
    respond,
    stream,
)


@asynccontextmanager
async def proxy(upstream: FaultyUpstream) -> AsyncIterator[ASGIApp]:
    config = {
        "upstreams": {"main": {"base_url": upstream.url, "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "memory"},
    }
    app = create_app(parse_config(config), registry=CollectorRegistry())
    async with app.router.lifespan_context(app):
        yield app


def held_stream(release: asyncio.Event) -> Any:
    """An SSE answer that sends its role chunk, then waits for `release` before the text."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        writer.write(head + b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        for piece in (delta(), None, delta("Hello", finish_reason="stop"), b"data: [DONE]\n\n"):
            if piece is None:
                await release.wait()
                continue
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0" + CRLF + CRLF)
        await writer.drain()

    return answer


async def test_a_stream_starts_when_the_upstream_answer_begins() -> None:
    release = asyncio.Event()
    sent: list[Message] = []
    first_bytes = asyncio.Event()
    body = orjson.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            first_bytes.set()

    async with FaultyUpstream() as upstream, proxy(upstream) as app:
        upstream.script(held_stream(release))
        scope = post_scope("/v1/chat/completions")
        request = asyncio.create_task(app(scope, body_then_stay(body), send))
        async with asyncio.timeout(10):
            await first_bytes.wait()  # while the upstream still holds its text back
        assert not request.done()
        assert sent[0]["status"] == 200
        opening = sent[1]["body"]
        assert opening.startswith(b"data: ")
        chunk = orjson.loads(opening[6:])
        assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": None}
        release.set()
        async with asyncio.timeout(10):
            await request
    text = b"".join(m.get("body", b"") for m in sent[2:])
    assert b'"content":"Hello"' in text
    assert b'"role"' not in text  # the role was said once, first
    assert text.endswith(b"data: [DONE]\n\n")
    last = sent[-1]  # the last event and the end of the response go in one message
    assert last["body"].endswith(b"data: [DONE]\n\n")
    assert last["more_body"] is False


async def test_a_pass_through_completion_carries_the_upstream_fields_unchanged() -> None:
    upstream_body = completion("Hi there")
    upstream_body.update(
        system_fingerprint="fp_up",
        service_tier="flex",
        provider_extra={"nested": [1, {"a": None}]},
    )
    upstream_body["choices"][0]["logprobs"] = {"content": [{"token": "Hi", "logprob": -0.1}]}
    async with FaultyUpstream() as upstream, proxy(upstream) as app:
        upstream.script(respond(200, upstream_body))
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
    assert r.status_code == 200, r.text
    got = r.json()
    for field in ("system_fingerprint", "service_tier", "provider_extra", "choices", "model"):
        assert got[field] == upstream_body[field], field
    assert got["usage"]["total_tokens"] == upstream_body["usage"]["total_tokens"]
    assert got["id"].startswith("chatcmpl-")
    assert got["id"] != upstream_body["id"]
    assert got["loop"]["stop_reason"] == "completed"


async def test_a_stream_names_the_model_of_the_first_chunk_that_names_one() -> None:
    """Azure OpenAI opens a stream with its prompt filter's results: a chunk of no choices and
    `"model": ""`. The client's chunks name the model of the chunks that follow it."""
    filtered = event(
        orjson.dumps(
            {"id": "", "object": "", "created": 0, "model": "", "choices": [],
             "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}]}
        )
    )  # fmt: skip
    served = {"model": "gpt-4o-2024-08-06", "system_fingerprint": "fp_abc"}
    first = event(orjson.dumps({**orjson.loads(delta("Hi")[6:]), **served}))
    last = event(orjson.dumps({**orjson.loads(delta(finish_reason="stop")[6:]), **served}))
    async with FaultyUpstream() as upstream, proxy(upstream) as app:
        upstream.script(stream(filtered + first, last, DONE))
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "gpt-4o",
                    "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
    chunks = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert len(chunks) >= 2
    assert {(c["model"], c.get("system_fingerprint")) for c in chunks} == {
        ("gpt-4o-2024-08-06", "fp_abc")
    }
