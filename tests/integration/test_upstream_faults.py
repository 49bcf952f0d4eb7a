"""Upstream faults below HTTP, through the real network stack: a `FaultyUpstream` on 127.0.0.1
that drips, resets, cuts streams short, sends invalid UTF-8, huge bodies and status 999, and
the proxy in-process on its default (aiohttp) transport. Each fault ends the run as a clear
upstream error, or as a repaired reading that is logged; never a hang or a silent `completed`."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message

from proxy.api.app import create_app
from proxy.config import parse_config
from proxy.engine.values import ModelRequest
from proxy.errors import ClientDisconnected
from proxy.upstream.client import Upstream
from proxy.upstream.http1_transport import Http1Transport
from tests.direct_asgi import body_then_stay, post_scope
from tests.faulty_upstream import (
    DONE,
    FaultyUpstream,
    completion,
    delta,
    drip,
    event,
    raw,
    reset,
    respond,
    stream,
)
from tests.integration.test_chat_stream import events
from tests.response_events import checked, parse_events

UPSTREAM_KEY = "sk-upstream-secret-0123456789abcdef"
USER = [{"role": "user", "content": "hi"}]
# Generous: a fault that is not bounded hangs forever, one that is ends in about a second.
HANG_S = 20


class FaultProxy:
    def __init__(
        self, client: httpx.AsyncClient, registry: CollectorRegistry, app: ASGIApp
    ) -> None:
        self.client = client
        self.registry = registry
        self.app = app

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def chat(self, **body: Any) -> httpx.Response:
        body.setdefault("messages", USER)
        body.setdefault("model", "scripted")
        async with asyncio.timeout(HANG_S):
            return await self.client.post("/v1/chat/completions", json=body)


ProxyTo = Callable[..., Any]


@pytest.fixture
async def upstream() -> AsyncIterator[FaultyUpstream]:
    async with FaultyUpstream() as server:
        yield server


@pytest.fixture
def proxy_to(upstream: FaultyUpstream, monkeypatch: pytest.MonkeyPatch) -> ProxyTo:
    """A proxy whose one upstream is the faulty one, reached over the default transport;
    `fields` are set on that upstream's config."""
    monkeypatch.setenv("FAULTY_KEY", UPSTREAM_KEY)

    @asynccontextmanager
    async def make(**fields: Any) -> AsyncIterator[FaultProxy]:
        upstream_config = {
            "base_url": upstream.url,
            "api_key_env": "FAULTY_KEY",
            "max_retries": 0,
            **fields,
        }
        config = {
            "upstreams": {"main": upstream_config},
            "default_upstream": "main",
            "pricing": {"scripted": {"input": 1.0, "output": 4.0}},
            "state": {"backend": "memory"},
        }
        registry = CollectorRegistry()
        app = create_app(parse_config(config), registry=registry)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://proxy.test"
            ) as client,
        ):
            yield FaultProxy(client, registry, app)

    return make


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The error of a response: its body's, or that of the final event of a stream."""
    if r.headers["content-type"].startswith("text/event-stream"):
        chunks = events(r.text)
        assert chunks[-1] == "[DONE]"
        final = chunks[-2]
        assert "choices" not in final
        return dict(final["error"], stop_reason=final["loop"]["stop_reason"])
    return dict(r.json()["error"], stop_reason=r.headers.get("x-loopwarden-stop-reason"))


# Item 6: a total deadline for the upstream call of one step


async def test_an_upstream_that_drips_comments_is_cut_at_the_step_deadline(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(drip(b": still thinking\n\n", every_s=0.02))
    async with proxy_to(timeout_s=5, step_timeout_s=1) as proxy:
        started = asyncio.get_running_loop().time()
        r = await proxy.chat(stream=True)
        took = asyncio.get_running_loop().time() - started
    assert r.status_code == 504
    assert error_of(r) == {
        "message": "upstream main did not finish within 1 s",
        "type": "server_error",
        "param": None,
        "code": "upstream_timeout",
        "stop_reason": "upstream_error",
    }
    assert took < HANG_S / 2


async def test_a_stream_that_trickles_content_ends_with_a_timeout_event(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(drip(b"a", every_s=0.02, head=delta("Once upon") + b'data: {"x": "'))
    async with proxy_to(timeout_s=5, step_timeout_s=1) as proxy:
        r = await proxy.chat(stream=True)
    assert r.status_code == 200  # the stream had started: the error is its last event
    assert error_of(r)["code"] == "upstream_timeout"
    assert error_of(r)["stop_reason"] == "upstream_error"
    assert "Once upon" in r.text


class SlowClient:
    """A stream's client whose socket is full: each of its reads takes `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def begin(self, head: Mapping[str, str], text: str) -> None:
        await asyncio.sleep(self.delay_s)

    async def __call__(self, text: str) -> None:
        await asyncio.sleep(self.delay_s)


async def test_the_time_a_slow_client_takes_to_read_is_not_the_upstream_s(
    upstream: FaultyUpstream,
) -> None:
    """A client whose socket is full holds each delta up: the step deadline waits as long."""
    words = [delta(f"w{i} ") for i in range(6)]
    upstream.script(stream(*words, delta(finish_reason="stop"), DONE, every_s=0.01))
    attempts: list[str] = []
    main = Upstream(
        "main",
        upstream.url,
        Http1Transport(),
        step_timeout_s=0.3,
        max_retries=0,
        on_attempt=lambda name, outcome: attempts.append(outcome),
    )
    request = ModelRequest("scripted", USER, [], stream=True)

    reply = await main.complete(request, SlowClient(0.2))  # longer than the step's deadline
    assert reply.text == "w0 w1 w2 w3 w4 w5 "
    assert reply.finish_reason == "stop"

    upstream.script(stream(*words, delta(finish_reason="stop"), DONE, every_s=0.01))
    with pytest.raises(ClientDisconnected, match=r"the client took no text for 0\.3 s"):
        # never takes it, never leaves: as long as a step may take, then gone
        await main.complete(request, SlowClient(60))
    assert attempts == ["2xx", "2xx"]  # the client's slowness is no failure of the upstream's


async def test_a_json_body_that_drips_is_cut_at_the_step_deadline(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(drip(b" ", every_s=0.02, head=b"{"))
    async with proxy_to(timeout_s=5, step_timeout_s=1) as proxy:
        r = await proxy.chat()
    assert (r.status_code, error_of(r)["code"]) == (504, "upstream_timeout")


# Item 9: upstream output misread


async def test_a_stream_cut_short_without_done_or_finish_reason_is_an_upstream_error(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(stream(delta("The answer is"), delta(" forty")))
    async with proxy_to() as proxy:
        r = await proxy.chat(stream=True)
    error = error_of(r)
    assert error["code"] == "upstream_error"
    assert error["stop_reason"] == "upstream_error"
    assert "ended before the reply was complete" in error["message"]


async def test_a_stream_with_a_finish_reason_but_no_done_is_complete(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(stream(delta("Fine."), delta(finish_reason="stop")))
    async with proxy_to() as proxy:
        r = await proxy.chat(stream=True)
    assert events(r.text)[-2]["loop"]["stop_reason"] == "completed"


async def test_invalid_utf8_in_a_stream_is_replaced_and_logged(
    proxy_to: ProxyTo, upstream: FaultyUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.script(
        stream(delta("caf"), delta(b"\xe9 cr\xffme"), delta(finish_reason="stop"), DONE)
    )
    async with proxy_to() as proxy:
        with caplog.at_level(logging.WARNING, logger="proxy.upstream"):
            r = await proxy.chat(stream=True)
    chunks = events(r.text)
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c.get("choices")
    )
    assert text == "caf\ufffd cr\ufffdme"
    assert chunks[-2]["loop"]["stop_reason"] == "completed"
    assert any("invalid UTF-8" in record.getMessage() for record in caplog.records)


async def test_invalid_utf8_in_a_json_body_is_replaced_and_logged(
    proxy_to: ProxyTo, upstream: FaultyUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    body = respond(
        200,
        b'{"choices": [{"message": {"role": "assistant", "content": "\xff!"}, '
        b'"finish_reason": "stop"}]}',
    )
    upstream.script(body)
    async with proxy_to() as proxy:
        with caplog.at_level(logging.WARNING, logger="proxy.upstream"):
            r = await proxy.chat()
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "\ufffd!"
    assert any("invalid UTF-8" in record.getMessage() for record in caplog.records)


async def test_an_event_that_is_not_json_is_an_upstream_error(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(stream(event(b"{not json"), delta(finish_reason="stop"), DONE))
    async with proxy_to() as proxy:
        r = await proxy.chat(stream=True)
    assert r.status_code == 502
    assert error_of(r)["code"] == "upstream_error"
    assert "not JSON" in error_of(r)["message"]


@pytest.mark.parametrize("status", [999, 600])
async def test_a_status_that_cannot_be_relayed_is_a_502(
    proxy_to: ProxyTo, upstream: FaultyUpstream, status: int
) -> None:
    upstream.script(
        respond(status, b"odd", content_type="text/plain"),
        respond(status, b"odd", content_type="text/plain"),
    )
    async with proxy_to() as proxy:
        r = await proxy.chat()
        relayed = await proxy.client.post("/v1/embeddings", json={"model": "e", "input": "x"})
    for answer in (r, relayed):
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "upstream_error"
        assert f"HTTP {status}" in answer.json()["error"]["message"]
    assert r.headers["x-loopwarden-stop-reason"] == "upstream_error"


async def test_a_redirect_is_no_reply_of_a_model(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(respond(302, b"", headers={"location": "http://elsewhere.test/"}))
    async with proxy_to() as proxy:
        r = await proxy.chat()
    assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_error")
    assert "HTTP 302" in r.json()["error"]["message"]


async def test_a_reset_before_any_answer_is_a_connection_error(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(reset())
    async with proxy_to() as proxy:
        r = await proxy.chat()
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unavailable"
        attempts = "loopwarden_upstream_requests_total"
        assert proxy.metric(attempts, upstream="main", status_class="connect_error") == 1
        assert proxy.metric(attempts, upstream="main", status_class="timeout") == 0


@pytest.mark.parametrize(
    "head",
    [
        b"HELLO THERE\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\n{}",
    ],
)
async def test_an_answer_that_is_no_http_is_a_bad_reply_not_retried(
    proxy_to: ProxyTo, upstream: FaultyUpstream, head: bytes
) -> None:
    """The upstream answered (a generation may have been billed): no other attempt is made."""
    upstream.script(raw(head), raw(head), raw(head))
    async with proxy_to() as proxy:
        r = await proxy.chat()
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_error"
    assert r.json()["error"]["message"].startswith("upstream main sent what is not HTTP (")
    assert len(upstream.requests) == 1


async def test_a_reset_mid_stream_is_a_connection_error(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(stream(delta("Half an ans"), then="reset"))
    async with proxy_to() as proxy:
        r = await proxy.chat(stream=True)
        assert error_of(r)["code"] == "upstream_unavailable"
        assert "reset" in error_of(r)["message"] or "closed" in error_of(r)["message"]
        labels = {
            "gen_ai_operation_name": "chat",
            "gen_ai_provider_name": "openai",
            "gen_ai_request_model": "scripted",
        }
        duration = "gen_ai_client_operation_duration_seconds_count"
        assert proxy.metric(duration, **labels, error_type="upstream_unavailable") == 1
        assert proxy.metric(duration, **labels, error_type="upstream_timeout") == 0
        # The attempt's 200 came, but its answer did not: the error ratio counts it.
        attempts = "loopwarden_upstream_requests_total"
        assert proxy.metric(attempts, upstream="main", status_class="connect_error") == 1
        assert proxy.metric(attempts, upstream="main", status_class="2xx") == 0


async def test_a_responses_message_cut_by_a_reset_mid_stream_is_incomplete(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    upstream.script(stream(delta("Half an ans"), then="reset"))
    async with proxy_to() as proxy:
        body = {"model": "scripted", "input": "hi", "stream": True}
        r = await proxy.client.post("/v1/responses", json=body)
    events = parse_events(r.text)
    final = checked(events)
    assert final["status"] == "failed"
    (message,) = final["output"]
    assert (message["status"], message["content"][0]["text"]) == ("incomplete", "Half an ans")


# Item 10: upstream error bodies, OpenAI-shaped and scrubbed


async def test_an_upstream_401_that_echoes_the_key_is_relayed_scrubbed(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    echo = {
        "error": {
            "message": f"Incorrect API key provided: {UPSTREAM_KEY}. Header: Bearer {UPSTREAM_KEY}",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    upstream.script(respond(401, echo), respond(401, echo))
    async with proxy_to() as proxy:
        r = await proxy.chat()
        relayed = await proxy.client.post("/v1/embeddings", json={"model": "e", "input": "x"})
    for answer in (r, relayed):
        assert answer.status_code == 401
        assert answer.headers["content-type"] == "application/json"
        assert UPSTREAM_KEY not in answer.text
        assert "sk-upstream" not in answer.text
        error = answer.json()["error"]
        assert error["message"] == "Incorrect API key provided: [redacted]. Header: [redacted]"
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


async def test_an_html_error_page_is_relayed_as_an_openai_error(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    page = b"<html><body><h1>502 Bad Gateway</h1>nginx</body></html>"
    upstream.script(
        respond(503, page, content_type="text/html", headers={"retry-after": "7"}),
        respond(503, page, content_type="text/html"),
    )
    async with proxy_to() as proxy:
        r = await proxy.chat()
        relayed = await proxy.client.get("/v1/files")
    for answer in (r, relayed):
        assert answer.status_code == 503
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"] == {
            "message": "upstream main answered HTTP 503; its text/html body is not shown",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }


# Item 11: bounds on what is read from an upstream


async def test_a_json_body_over_the_cap_is_a_502(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    big = completion("x" * 300_000)
    upstream.script(
        respond(200, big),
        stream(b'{"choices": [' + b" " * 300_000, then="hang", content_type="application/json"),
    )
    async with proxy_to(max_response_bytes=100_000, max_event_bytes=50_000) as proxy:
        declared = await proxy.chat()  # a content-length over the cap: refused before reading
        chunked = await proxy.chat()  # no length given: refused once the cap is passed
    for r in (declared, chunked):
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_error"
        assert "more than 100000 bytes" in r.json()["error"]["message"]


async def test_a_stream_over_the_cap_is_cut(proxy_to: ProxyTo, upstream: FaultyUpstream) -> None:
    pieces = [delta("y" * 1000) for _ in range(200)]
    upstream.script(stream(*pieces, then="hang"), stream(b"data: " + b"z" * 60_000, then="hang"))
    async with proxy_to(max_response_bytes=100_000, max_event_bytes=50_000) as proxy:
        total = await proxy.chat(stream=True)
        one_event = await proxy.chat(stream=True)
    assert error_of(total)["code"] == "upstream_error"
    assert "more than 100000 bytes" in error_of(total)["message"]
    assert one_event.status_code == 502
    assert "an event of more than 50000 bytes" in error_of(one_event)["message"]


# What a failed run leaves behind: no cycle that holds it (its request, its reply) until the
# full collection that this process makes rare (`gc.freeze`, high thresholds).
OURS = {"Run", "RunState", "RunSpec", "Connection", "Answer", "frame"}


async def test_failed_runs_leave_nothing_for_the_cycle_collector(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    """A relayed 400, a reply over `max_response_bytes`, a reset mid-stream, a read timeout:
    each run's error and connection let go of the run when it ends."""
    garbage: list[str] = []
    async with proxy_to(max_response_bytes=64 * 1024, timeout_s=0.3) as proxy:
        await proxy.chat()  # at rest: the pool, the app's own objects
        upstream.script(
            respond(400, {"error": {"message": "too long", "type": "invalid_request_error"}}),
            stream(event(delta("x" * 1024)) * 100),
            stream(event(delta("so far")), then="reset"),
            stream(event(delta("then nothing")), then="hang"),
        )
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            failures = [error_of(await proxy.chat(stream=True))["stop_reason"] for _ in range(4)]
            gc.collect()
            garbage = sorted({type(o).__name__ for o in gc.garbage} & OURS)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert failures == ["upstream_error"] * 4
    assert garbage == []


async def test_a_relayed_answer_that_trickles_is_cut_at_the_step_timeout(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    """A relayed route is one step's call too: its upstream does not hold a connection of the
    shared pool for longer than `step_timeout_s`, however it trickles; the answer begun is
    left unfinished (the server closes its connection), never ended as if whole."""
    async with proxy_to(step_timeout_s=0.5) as proxy:
        upstream.script(drip(b'{"data": []}', every_s=0.05))
        sent: list[Message] = []

        async def reading(message: Message) -> None:
            sent.append(message)

        body = orjson.dumps({"model": "e", "input": "x"})
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(HANG_S):
            await proxy.app(post_scope("/v1/embeddings"), body_then_stay(body), reading)
        took = asyncio.get_running_loop().time() - started
    assert sent[0]["status"] == 200
    assert all(m.get("more_body", True) for m in sent)  # no end: the client sees it cut
    assert 0.5 <= took < 5


async def test_a_relay_to_a_client_that_does_not_read_lets_go_at_the_step_timeout(
    proxy_to: ProxyTo, upstream: FaultyUpstream
) -> None:
    """A client whose socket is full (it reads nothing) holds no upstream connection for
    longer than `step_timeout_s`."""
    async with proxy_to(step_timeout_s=0.3) as proxy:
        upstream.script(drip(b"x" * 4096, every_s=0.001))
        sent: list[Message] = []

        async def full_socket(message: Message) -> None:
            sent.append(message)
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()  # never drained

        body = orjson.dumps({"model": "e", "input": "x"})
        async with asyncio.timeout(HANG_S):
            await proxy.app(post_scope("/v1/embeddings"), body_then_stay(body), full_socket)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
