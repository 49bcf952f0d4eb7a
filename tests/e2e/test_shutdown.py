"""`loopwarden serve` told to stop (SIGTERM) with runs in flight: it takes no new connection, the
runs get `server.shutdown_timeout_s` to end, and a run still going then is answered 503
`shutting_down` (a stream: its failure event), with `x-should-retry: false` once its tools ran,
not the ASGI server's bare text 500."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.demo.runner import free_port, serve_in_thread
from tests.e2e.conftest import ROOT, config_file, wait_healthy
from tests.response_events import checked, parse_events
from tests.scripted_upstream import ScriptedUpstream, call, say, say_tool_result
from tests.servers import redis_process
from tests.tools import TOOLS

pytestmark = pytest.mark.e2e
T = TypeVar("T")


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path,
    upstream_url: str,
    drain_s: float,
    state: dict[str, Any] | None = None,
    probe_port: int | None = None,
) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """The proxy with an agent whose `sleep` tool runs as long as a test asks, draining for
    `drain_s` on SIGTERM; its base URL and process."""
    config = {
        "server": {"shutdown_timeout_s": drain_s, "probe_port": probe_port},
        "upstreams": {"main": {"base_url": upstream_url}},
        "default_upstream": "main",
        "tools": {"sleep": TOOLS["sleep"]},
        "agents": {"sleeper": {"model": "gpt-4o-mini", "tools": ["sleep"]}},
        "state": state or {"backend": "memory"},
    }
    port = free_port()
    path = config_file(tmp_path, config)
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.to_thread(
        subprocess.Popen, args, env=env, stderr=subprocess.PIPE, preexec_fn=as_from_a_terminal
    )
    try:
        await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}/readyz", proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        await asyncio.to_thread(proc.wait, 15)
        assert proc.stderr is not None
        proc.stderr.close()


def as_from_a_terminal() -> None:
    """SIGINT as a terminal's shell leaves it to the proxy it starts (a test runner's
    background job ignores it, and so would the proxy)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def redis_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **settings: object
) -> Iterator[tuple[dict[str, Any], subprocess.Popen[bytes]]]:
    """A redis of the test's own (its process, to pause it), and the proxy's `state` on it."""
    with redis_process(tmp_path) as (url, redis):
        monkeypatch.setenv("LW_TEST_REDIS", url)
        yield {"backend": "redis", "url_env": "LW_TEST_REDIS", **settings}, redis


@contextlib.asynccontextmanager
async def storing_paused(
    tmp_path: Path,
    upstream: ScriptedUpstream,
    upstream_url: str,
    state: dict[str, Any],
    redis: subprocess.Popen[bytes],
    stream: bool,
) -> AsyncIterator[tuple[subprocess.Popen[bytes], asyncio.Task[httpx.Response]]]:
    """The proxy (a drain of 1 s) asked for a Responses run whose answer comes at 0.3 s, after
    a tool: `redis` paused as its response is about to be stored, resumed at the end."""
    upstream.script(call("sleep", seconds=0.1), say("done").replace(after_s=0.3))
    async with (
        serving(tmp_path, upstream_url, drain_s=1, state=state) as (base, proc),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        body = {"model": "sleeper", "input": "wait", "stream": stream}
        asking = asyncio.create_task(client.post("/v1/responses", json=body))
        while len(upstream.bodies) < 2:  # noqa: ASYNC110 (recorded in a thread)
            await asyncio.sleep(0.02)
        redis.send_signal(signal.SIGSTOP)
        try:
            yield proc, asking
        finally:
            redis.send_signal(signal.SIGCONT)


async def stopped_while(
    proc: subprocess.Popen[bytes],
    upstream: ScriptedUpstream,
    asked: int,
    request: asyncio.Task[T],
    drained: bool = True,
) -> T:
    """`request`'s outcome, the server told to stop once the upstream was asked `asked` times
    (a tool call then runs); the server exits, its log without a traceback, saying the drain
    stopped the request (`drained`) or not."""
    # (the upstream records its requests in a thread of its own: polled)
    while len(upstream.bodies) < asked and not request.done():  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    await asyncio.sleep(1.0)  # the tool call begins (a busy host takes its time)
    proc.send_signal(signal.SIGTERM)
    outcome = await request
    assert await asyncio.to_thread(proc.wait, 15) in (0, -signal.SIGTERM)  # (uvicorn: either)
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert "Exception in ASGI application" not in log, log
    assert "shutting down: " in log, log
    if drained:  # (a run that ends within the drain may have ended before it began)
        assert "shutting down: 1 request in flight get" in log, log
    # The drain's end told in the proxy's words, as a warning (uvicorn's was an error).
    assert "timeout graceful shutdown exceeded" not in log, log
    ended = "the drain ended (server.shutdown_timeout_s): 1 request(s) still going stopped"
    assert (ended in log) is drained, log
    return outcome


async def test_a_run_past_the_drain_is_answered_shutting_down_and_not_sent_again(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str
) -> None:
    upstream.script(call("sleep", seconds=60))
    async with (
        serving(tmp_path, upstream_url, drain_s=0.5) as (base, proc),
        openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-none", max_retries=2) as client,
    ):
        asking = asyncio.create_task(
            client.chat.completions.create(
                model="sleeper", messages=[{"role": "user", "content": "wait"}]
            )
        )
        with pytest.raises(openai.InternalServerError) as raised:
            await stopped_while(proc, upstream, 1, asking)
    answer = raised.value.response
    assert answer.status_code == 503
    assert answer.headers["x-should-retry"] == "false"  # its tool ran: not sent again
    assert answer.json()["error"]["code"] == "shutting_down"
    assert len(upstream.bodies) == 1


async def test_a_run_past_the_drain_before_any_tool_may_be_sent_again(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str
) -> None:
    upstream.script(say("late").replace(after_s=60))
    async with (
        serving(tmp_path, upstream_url, drain_s=0.5) as (base, proc),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        body = {"model": "sleeper", "messages": [{"role": "user", "content": "hi"}]}
        asking = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        answer = await stopped_while(proc, upstream, 1, asking)
    assert answer.status_code == 503
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["error"]["code"] == "shutting_down"
    assert "x-should-retry" not in answer.headers


async def test_a_run_that_ends_within_the_drain_is_answered(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str
) -> None:
    upstream.script(call("sleep", seconds=1), say_tool_result("Done: {}"))
    async with (
        serving(tmp_path, upstream_url, drain_s=20) as (base, proc),
        openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-none") as client,
    ):
        asking = asyncio.create_task(
            client.chat.completions.create(
                model="sleeper", messages=[{"role": "user", "content": "wait"}]
            )
        )
        completion = await stopped_while(proc, upstream, 1, asking, drained=False)
    assert completion.choices[0].message.content == "Done: slept 1s"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
async def test_a_stream_past_the_drain_ends_with_its_failure(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str, route: str
) -> None:
    upstream.script(call("sleep", seconds=60))
    async with (
        serving(tmp_path, upstream_url, drain_s=0.5) as (base, proc),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        body = (
            {"model": "sleeper", "input": "wait", "stream": True}
            if route == "/v1/responses"
            else {"model": "sleeper", "messages": [{"role": "user", "content": "wait"}],
                  "stream": True, "loop": {"include_loop_events": True}}
        )  # fmt: skip
        asking = asyncio.create_task(client.post(route, json=body))
        answer = await stopped_while(proc, upstream, 1, asking)
    assert answer.status_code == 200  # the stream had begun: the tool's call was shown
    events = [
        orjson.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")
    ]
    last = events[-1]
    if route == "/v1/responses":
        assert last["type"] == "response.failed"
        assert last["response"]["error"]["code"] == "shutting_down"
        assert last["response"]["loop"]["stop_reason"] == "cancelled"
    else:
        assert last["error"]["code"] == "shutting_down"
        assert last["loop"]["stop_reason"] == "cancelled"
        assert answer.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_ended_but_not_yet_answered_at_the_drain_s_end_is_not_sent_again(
    tmp_path: Path,
    upstream: ScriptedUpstream,
    upstream_url: str,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """Its tools ran and its response was being stored (the state backend slow) as the drain
    ended, and still was past the time that is given (a run's keep, to its end as a rule): the
    503 said nothing of the tools, and the SDK sent the run again. (It had no answer at all
    once stored responses were kept as their runs end, past SETTLE_S; a stream's failure
    skipped the events its closing had numbered, and its message was left open.)"""
    with redis_state(tmp_path, monkeypatch, timeout_s=10) as (state, redis):
        async with storing_paused(tmp_path, upstream, upstream_url, state, redis, stream) as (
            proc,
            asking,
        ):
            answer = await stopped_while(proc, upstream, 2, asking)
    if stream:
        events = parse_events(answer.text)
        failed = checked(events)  # (numbered in turn, every item done)
        assert events[-1]["type"] == "response.failed"
        assert failed["error"]["code"] == "shutting_down"
        assert failed["loop"]["stop_reason"] == "cancelled"
        return
    assert answer.status_code == 503
    assert answer.headers["x-should-retry"] == "false"
    error = answer.json()["error"]
    assert (error["code"], error["message"]) == (
        "shutting_down",
        "the server shut down before the run ended",
    )
    assert answer.json()["loop"]["stop_reason"] == "cancelled"


async def test_a_context_s_run_past_the_drain_lets_go_of_its_lock(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requests the drain's end stopped were not waited for: the state store was closed
    under them and the process ended, a `/chat` run answered nothing and kept its context's
    lock for the lease (the next run on it waited 27 s)."""
    upstream.script(call("sleep", seconds=60))
    with redis_state(tmp_path, monkeypatch, lock_lease_s=30) as (state, _):
        async with (
            serving(tmp_path, upstream_url, drain_s=0.5, state=state) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            body = {"context_id": "c1", "agent": "sleeper", "message": "wait"}
            asking = asyncio.create_task(client.post("/chat", json=body))
            answer = await stopped_while(proc, upstream, 1, asking)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "shutting_down"
        upstream.script(say("back"))
        async with (
            serving(tmp_path, upstream_url, drain_s=0.5, state=state) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            again = await asyncio.wait_for(
                client.post("/chat", json={**body, "message": "again"}), 10
            )
    assert again.status_code == 200, again.text


@pytest.mark.parametrize(
    ("route", "stream"),
    [("/v1/chat/completions", False), ("/v1/chat/completions", True), ("/v1/responses", False),
     ("/chat", False)],
)  # fmt: skip
async def test_a_run_past_the_drain_is_answered_with_its_report_and_kept(
    tmp_path: Path,
    upstream: ScriptedUpstream,
    upstream_url: str,
    monkeypatch: pytest.MonkeyPatch,
    route: str,
    stream: bool,
) -> None:
    """A run the drain's end stopped before any of its answer was sent is answered with its
    `loop` report, as a failed run is, and kept: another replica finds it by its id (it was a
    bare error, found by none). A chat stream begins with the upstream's answer: here the
    upstream has not answered yet, and no tool ran."""
    if stream:
        upstream.script(say("late").replace(after_s=60))
    else:
        upstream.script(call("sleep", seconds=60))
    bodies = {
        "/v1/chat/completions": {"model": "sleeper", "stream": stream,
                                 "messages": [{"role": "user", "content": "wait"}]},
        "/v1/responses": {"model": "sleeper", "input": "wait"},
        "/chat": {"context_id": "c1", "agent": "sleeper", "message": "wait"},
    }  # fmt: skip
    with redis_state(tmp_path, monkeypatch) as (state, _):
        async with (
            serving(tmp_path, upstream_url, drain_s=0.5, state=state) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            asking = asyncio.create_task(client.post(route, json=bodies[route]))
            answer = await stopped_while(proc, upstream, 1, asking)
        assert answer.status_code == 503
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers.get("x-should-retry") == (None if stream else "false")
        assert answer.headers["x-loopwarden-stop-reason"] == "cancelled"
        body = answer.json()
        assert body["error"]["code"] == "shutting_down"
        report = body["loop"]
        assert report["stop_reason"] == "cancelled"
        assert answer.headers["x-loopwarden-run-id"] == report["run_id"]
        if route == "/v1/responses":  # the failed response, as `response.failed` shows it
            assert body["response"]["error"]["code"] == "shutting_down"
            assert body["response"]["output"][0]["type"] == "mcp_call"
        if route == "/chat":  # what it made, nothing of it saved
            assert body["saved_ai_messages"] is False
            assert [m.get("sender") or m["type"] for m in body["generated_messages"]] == [
                "human", "tool_call", "tool_response"  # (the call the drain cut)
            ]  # fmt: skip
        async with (
            serving(tmp_path, upstream_url, drain_s=0.5, state=state) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            found = await client.get(f"/v1/runs/{report['run_id']}")
    assert found.status_code == 200, found.text
    assert found.json()["stop_reason"] == "cancelled"


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_a_relayed_request_past_the_drain_is_not_sent_again_once_it_may_have_acted(
    tmp_path: Path, method: str
) -> None:
    """A relayed request the drain's end stopped had reached its upstream, which may have
    acted on it (a file uploaded, an image made): the SDK, told nothing, sent it again. A GET
    may be sent again."""
    arrived = threading.Event()

    async def slow(request: Request) -> JSONResponse:
        arrived.set()
        await asyncio.sleep(60)
        return JSONResponse({"object": "list", "data": []})

    app = Starlette(routes=[Route("/v1/files", slow, methods=["GET", "POST"])])
    with serve_in_thread(app, free_port()) as upstream_url:
        async with (
            serving(tmp_path, f"{upstream_url}/v1", drain_s=0.5) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            asking = asyncio.create_task(client.request(method, "/v1/files", content=b"x"))
            await asyncio.to_thread(arrived.wait, 10)
            answer = await stopped_while(proc, ScriptedUpstream(), 0, asking)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "shutting_down"
    assert answer.headers.get("x-should-retry") == ("false" if method == "POST" else None)


async def test_a_context_s_run_whose_save_ends_after_the_drain_is_answered_as_it_ended(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its save (redis paused) was in flight as the drain ended and then went through: the
    context has the run's messages, so its answer is the run's (it was a 503 saying
    `completed`, and a client sending it again added the message twice)."""
    upstream.script(say("done").replace(after_s=0.5))
    with redis_state(tmp_path, monkeypatch, timeout_s=20) as (state, redis):
        body = {"context_id": "c1", "agent": "sleeper", "message": "wait"}
        async with (
            serving(tmp_path, upstream_url, drain_s=3, state=state) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            asking = asyncio.create_task(client.post("/chat", json=body))
            while not upstream.bodies:  # noqa: ASYNC110 (recorded in a thread)
                await asyncio.sleep(0.01)
            redis.send_signal(signal.SIGSTOP)  # the reply comes at 0.5 s: its save waits
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(5)  # the drain ends at 3 s, the save still waiting
            redis.send_signal(signal.SIGCONT)
            answer = await asking
            assert await asyncio.to_thread(proc.wait, 15) in (0, -signal.SIGTERM)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-loopwarden-stop-reason"] == "completed"
        assert answer.json()["response"] == "done"
        upstream.script(say("back"))
        async with (
            serving(tmp_path, upstream_url, drain_s=0.5, state=state) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            again = await client.post("/chat", json={**body, "message": "again"})
    assert again.status_code == 200, again.text
    sent = [m["content"] for m in upstream.bodies[-1]["messages"] if m["role"] != "system"]
    assert sent == ["wait", "done", "again"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_whose_response_was_being_stored_at_the_drain_s_end_is_answered_once_stored(
    tmp_path: Path,
    upstream: ScriptedUpstream,
    upstream_url: str,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """The run had ended and its response was being stored (redis paused) as the drain ended;
    redis came back within the time its keep is given then. The answer is the run's and the
    response is stored: it was a 503 (a stream: cut short), with the response lost."""
    with redis_state(tmp_path, monkeypatch, timeout_s=10) as (state, redis):
        async with storing_paused(tmp_path, upstream, upstream_url, state, redis, stream) as (
            proc,
            asking,
        ):
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(2)  # the drain ends at 1 s, the keep given 3 s more
            redis.send_signal(signal.SIGCONT)
            answer = await asyncio.wait_for(asking, 10)
            assert await asyncio.to_thread(proc.wait, 15) in (0, -signal.SIGTERM)
        assert answer.status_code == 200, answer.text
        if stream:  # (its headers went before the stop was known)
            assert "event: response.completed" in answer.text
            done = answer.text.split("event: response.completed\ndata: ")[1]
            response_id = orjson.loads(done.split("\n")[0])["response"]["id"]
        else:
            assert answer.headers["x-loopwarden-stop-reason"] == "completed"
            response_id = answer.json()["id"]
        async with (
            serving(tmp_path, upstream_url, drain_s=0.5, state=state) as (base, proc),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            found = await client.get(f"/v1/responses/{response_id}")
    assert found.status_code == 200, found.text
    assert found.json()["output"][-1]["content"][0]["text"] == "done"


def test_ctrl_c_stops_the_server_as_sigterm_does(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C in a terminal) drained and stopped the server, then ended it with a
    KeyboardInterrupt traceback and status -2 (uvicorn raises it again once it has shut down)."""
    upstreams = {"main": {"base_url": "http://127.0.0.1:9/v1"}}
    path = config_file(tmp_path, {"upstreams": upstreams, "default_upstream": "main"})
    port = free_port()
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
    proc = subprocess.Popen(
        args,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
        preexec_fn=as_from_a_terminal,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/readyz", proc)
        proc.send_signal(signal.SIGINT)
        status = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(15)
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    proc.stderr.close()
    assert status == 0, log
    assert "Traceback" not in log, log
    assert "shutting down: 0 requests in flight" in log, log


async def test_the_probe_port_serves_through_the_drain(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str
) -> None:
    """Both ports refused connections from the signal on: no scrape saw the runs the drain
    ended, completed or stopped. The probe port serves until the drain is over; `/readyz` says
    the server is shutting down."""
    upstream.script(call("sleep", seconds=2), say("done"))
    probes = free_port()
    async with (
        serving(tmp_path, upstream_url, drain_s=10, probe_port=probes) as (base, proc),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{probes}", timeout=5) as prober,
    ):
        body = {"model": "sleeper", "messages": [{"role": "user", "content": "wait"}]}
        asking = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        while not upstream.bodies:  # noqa: ASYNC110 (recorded in a thread)
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        ready = await prober.get("/readyz")
        answer = await asyncio.wait_for(asking, 20)
        scraped = (await prober.get("/metrics")).text
        assert await asyncio.to_thread(proc.wait, 15) in (0, -signal.SIGTERM)
    assert (ready.status_code, ready.json()) == (503, {"status": "shutting_down"})
    assert answer.status_code == 200, answer.text
    runs = [
        line
        for line in scraped.splitlines()
        if line.startswith('loopwarden_runs_total{agent="sleeper"') and not line.endswith(" 0.0")
    ]
    assert runs == [
        'loopwarden_runs_total{agent="sleeper",model="gpt-4o-mini",stop_reason="completed"} 1.0'
    ]


async def test_ctrl_c_twice_answers_the_runs_in_flight_and_exits_at_once(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str
) -> None:
    """A second SIGINT forces the exit: the runs still going were cancelled with the drain's
    end never told, and answered bare 500s (`Exception in ASGI application` each in the log)."""
    upstream.script(call("sleep", seconds=60))
    async with (
        serving(tmp_path, upstream_url, drain_s=30) as (base, proc),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        body = {"model": "sleeper", "messages": [{"role": "user", "content": "wait"}]}
        asking = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        while not upstream.bodies:  # noqa: ASYNC110 (recorded in a thread)
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # the tool runs
        proc.send_signal(signal.SIGINT)
        await asyncio.sleep(1)
        proc.send_signal(signal.SIGINT)
        answer = await asyncio.wait_for(asking, 15)
        await asyncio.to_thread(proc.wait, 15)
        assert proc.stderr is not None
        log = proc.stderr.read().decode()
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "shutting_down"
    assert answer.json()["loop"]["stop_reason"] == "cancelled"
    assert "Exception in ASGI application" not in log, log
