"""Separate pools with bounded waits, against real servers on 127.0.0.1: the upstreams' connection
pool (`server.upstream_connections`) is not the http tools' (`server.tool_connections`), a
request that finds the upstream pool full answers 503 `upstream_pool_exhausted` after
`server.upstream_pool_timeout_s`, and runs past `server.max_concurrent_runs` answer 503
`server_busy` at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.trace import NoOpTracerProvider
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.api.app import create_app
from proxy.config import parse_config
from proxy.demo.runner import free_port, serve_in_thread
from tests.bodies import user

WAIT_S = 20  # the longest any event of these tests may take: far beyond what it needs


async def until(event: threading.Event) -> None:
    """Waits for a test's go-ahead without blocking the server's loop."""
    for _ in range(WAIT_S * 100):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the test never gave the go-ahead")


class SlowUpstream:
    """Chat completions: a first step waits for `answer_first`, then calls the `lookup` tool;
    a step after a tool result says "done". Embeddings wait for `answer_embeddings`."""

    def __init__(self) -> None:
        self.answer_first = threading.Event()
        self.answer_embeddings = threading.Event()
        self.first_waiting = threading.Event()
        self.embeddings_waiting = threading.Event()
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            ]
        )

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        if body["messages"][-1]["role"] == "tool":
            return JSONResponse(completion({"role": "assistant", "content": "done"}))
        self.first_waiting.set()
        await until(self.answer_first)
        lookup = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        return JSONResponse(
            completion({"role": "assistant", "content": None, "tool_calls": [lookup]})
        )

    async def embeddings(self, request: Request) -> Response:
        self.embeddings_waiting.set()
        await until(self.answer_embeddings)
        return JSONResponse({"object": "list", "data": []})


def completion(message: dict[str, Any]) -> dict[str, Any]:
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    return {
        "id": "x",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


class ToolServer:
    def __init__(self) -> None:
        self.called = threading.Event()
        self.app = Starlette(routes=[Route("/lookup", self.lookup, methods=["POST"])])

    async def lookup(self, request: Request) -> Response:
        self.called.set()
        return JSONResponse({"found": "it"})


@pytest.fixture
def slow_upstream() -> Iterator[tuple[SlowUpstream, str]]:
    upstream = SlowUpstream()
    with serve_in_thread(upstream.app, free_port()) as url:
        yield upstream, url
        upstream.answer_first.set()  # nothing waits on past the test
        upstream.answer_embeddings.set()


@pytest.fixture
def tool_server() -> Iterator[tuple[ToolServer, str]]:
    tools = ToolServer()
    with serve_in_thread(tools.app, free_port()) as url:
        yield tools, url


@contextlib.asynccontextmanager
async def proxy(
    upstream_url: str, tools_url: str, **server: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """The proxy in-process with its real connection pools; yields a client of it."""
    config = {
        "server": server,
        "upstreams": {"main": {"base_url": f"{upstream_url}/v1", "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "memory"},
        "tools": {"lookup": {"kind": "http", "url": f"{tools_url}/lookup", "timeout_s": 10}},
        "agents": {"a": {"model": "m", "tools": ["lookup"]}},
    }
    app = create_app(
        parse_config(config), registry=CollectorRegistry(), tracer_provider=NoOpTracerProvider()
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://proxy.test", timeout=WAIT_S
        ) as client,
    ):
        yield client


async def happened(event: threading.Event, within_s: float = WAIT_S) -> bool:
    for _ in range(int(within_s * 100)):
        if event.is_set():
            return True
        await asyncio.sleep(0.01)
    return False


def run(client: httpx.AsyncClient, content: str = "go") -> asyncio.Task[httpx.Response]:
    body = {"model": "a", "messages": user(content)}
    return asyncio.create_task(client.post("/v1/chat/completions", json=body))


def embeddings(client: httpx.AsyncClient) -> asyncio.Task[httpx.Response]:
    body = {"model": "m", "input": "x"}
    return asyncio.create_task(client.post("/v1/embeddings", json=body))


async def test_an_http_tool_is_called_while_every_upstream_connection_is_taken(
    slow_upstream: tuple[SlowUpstream, str], tool_server: tuple[ToolServer, str]
) -> None:
    upstream, upstream_url = slow_upstream
    tools, tools_url = tool_server
    async with proxy(upstream_url, tools_url, upstream_connections=1) as client:
        first = run(client)  # holds the one upstream connection until the test answers it
        assert await happened(upstream.first_waiting)
        queued = embeddings(client)  # waits for that connection
        await asyncio.sleep(0.3)
        assert not upstream.embeddings_waiting.is_set()
        upstream.answer_first.set()  # the run gets its tool call: the embeddings get the pool
        assert await happened(upstream.embeddings_waiting)
        # The upstream pool is full until the embeddings are answered, after the tool call.
        assert await happened(tools.called, within_s=5)
        upstream.answer_embeddings.set()
        assert (await queued).status_code == 200
        answer = await first
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "done"


async def test_a_request_that_finds_the_upstream_pool_full_gets_a_503(
    slow_upstream: tuple[SlowUpstream, str], tool_server: tuple[ToolServer, str]
) -> None:
    upstream, upstream_url = slow_upstream
    _, tools_url = tool_server
    server = {"upstream_connections": 1, "upstream_pool_timeout_s": 0.2}
    async with proxy(upstream_url, tools_url, **server) as client:
        holding = embeddings(client)
        assert await happened(upstream.embeddings_waiting)
        refused = await run(client)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == "upstream_pool_exhausted"
        assert "server.upstream_connections" in error["message"]
        assert refused.json()["loop"]["stop_reason"] == "upstream_error"
        assert (await client.get("/healthz")).status_code == 200
        upstream.answer_embeddings.set()
        assert (await holding).status_code == 200


async def test_runs_past_the_cap_answer_503_at_once(
    slow_upstream: tuple[SlowUpstream, str], tool_server: tuple[ToolServer, str]
) -> None:
    upstream, upstream_url = slow_upstream
    _, tools_url = tool_server
    async with proxy(upstream_url, tools_url, max_concurrent_runs=1) as client:
        first = run(client)
        assert await happened(upstream.first_waiting)
        refused = await run(client, "me too")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_busy"
        assert "server.max_concurrent_runs" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        assert (await client.get("/readyz")).status_code == 200
        upstream.answer_first.set()
        assert (await first).status_code == 200
        again = await run(client, "now?")  # the cap counts runs in flight, not runs ever
        assert again.status_code == 200
