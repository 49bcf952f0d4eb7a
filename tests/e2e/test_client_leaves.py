"""A client that goes away mid-stream stops its run and its upstream stream, through the real
server and the openai SDK: at once when it leaves mid-run, and within the run's first 50 ms
(when the server starts watching) when it leaves sooner."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from openai import OpenAI
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tests.e2e.conftest import config_file, proxy_process, serving_post

GAP_S = 0.05
CHUNKS = 200  # 10 s of stream: far longer than any test waits


class SlowUpstream:
    """Streams CHUNKS chat chunks GAP_S apart; records when each stream was abandoned."""

    def __init__(self) -> None:
        self.abandoned: list[float] = []  # time.monotonic() of each
        self.changed = threading.Condition()

    async def chat(self, request: Request) -> StreamingResponse:
        await request.body()

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(CHUNKS):
                    chunk = {
                        "id": "chatcmpl-slow", "object": "chat.completion.chunk", "created": 1,
                        "model": "slow",
                        "choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                     "finish_reason": None}],
                    }  # fmt: skip
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                    await asyncio.sleep(GAP_S)
            except BaseException:
                with self.changed:
                    self.abandoned.append(time.monotonic())
                    self.changed.notify_all()
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    def wait_abandoned(self, count: int, timeout_s: float) -> float | None:
        """When the `count`th stream was abandoned, or None if not within `timeout_s`."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.abandoned) >= count, timeout_s)
            return self.abandoned[count - 1] if len(self.abandoned) >= count else None


@pytest.fixture(scope="module")
def slow() -> Iterator[tuple[str, SlowUpstream]]:
    upstream = SlowUpstream()
    with serving_post("/v1/chat/completions", upstream.chat) as url:
        yield url, upstream


@pytest.fixture(scope="module")
def proxy(
    slow: tuple[str, SlowUpstream], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    url, _ = slow
    config = {
        "upstreams": {"slow": {"base_url": f"{url}/v1", "max_retries": 0}},
        "default_upstream": "slow",
    }
    path = config_file(Path(tmp_path_factory.mktemp("leaves")), config)
    with proxy_process(path, health="/healthz") as base:
        yield base


def cancelled_runs(proxy: str) -> float:
    text = httpx.get(f"{proxy}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("loopwarden_runs_total{") and 'stop_reason="cancelled"' in line
    )


@pytest.mark.parametrize(("stay_s", "noticed_within_s"), [(0.0, 0.05 + 0.5), (0.3, 0.5)])
def test_a_client_that_leaves_stops_the_upstream_stream(
    slow: tuple[str, SlowUpstream], proxy: str, stay_s: float, noticed_within_s: float
) -> None:
    _, upstream = slow
    before = len(upstream.abandoned)
    cancelled = cancelled_runs(proxy)
    client = OpenAI(base_url=f"{proxy}/v1", api_key="sk-test", max_retries=0)
    started = time.monotonic()
    stream = client.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "go on"}], stream=True
    )
    texts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            texts.append(chunk.choices[0].delta.content)
            if time.monotonic() - started >= stay_s:
                break
    stream.close()
    left = time.monotonic()
    assert texts
    assert texts[0].startswith("w0 ")

    abandoned = upstream.wait_abandoned(before + 1, 5.0)
    assert abandoned is not None, "the upstream kept streaming after the client left"
    assert abandoned - left < noticed_within_s
    assert abandoned - started < CHUNKS * GAP_S / 4  # long before the stream would end
    deadline = time.monotonic() + 3
    while cancelled_runs(proxy) < cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled_runs(proxy) == cancelled + 1
    run_id = stream.response.headers["x-loopwarden-run-id"]
    report = httpx.get(f"{proxy}/v1/runs/{run_id}").json()  # kept, as every run is
    assert (report["run_id"], report["stop_reason"]) == (run_id, "cancelled")


def test_a_responses_stream_the_client_leaves_is_kept_as_cancelled(proxy: str) -> None:
    client = OpenAI(base_url=f"{proxy}/v1", api_key="sk-test", max_retries=0)
    stream = client.responses.create(model="slow", input="go on", stream=True)
    response_id = None
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert response_id is not None
    deadline = time.monotonic() + 3
    found = httpx.get(f"{proxy}/v1/runs/{response_id}")
    while found.status_code == 404 and time.monotonic() < deadline:
        time.sleep(0.05)
        found = httpx.get(f"{proxy}/v1/runs/{response_id}")
    assert found.status_code == 200
    assert found.json()["stop_reason"] == "cancelled"
