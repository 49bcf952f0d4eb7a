"""The tests' scripted upstream itself: what the other tests rely on it to do."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.scripted_upstream import (
    Call,
    ScriptedUpstream,
    call,
    calls,
    fail,
    keep,
    say,
    say_tool_result,
)

HI = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedUpstream, httpx.AsyncClient]]:
    upstream = ScriptedUpstream()
    transport = httpx.ASGITransport(upstream.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://up.test/v1") as client:
        yield upstream, client


def sse(text: str) -> list[Any]:
    blocks = [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]
    return [b if b == "[DONE]" else json.loads(b) for b in blocks]


async def test_turns_are_replayed_in_order_and_requests_recorded(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(
        calls(call("get_weather", city="Oslo"), Call("lookup", '{"q": 1}', id="c-7")),
        say("Done."),
    )
    first = await client.post("/chat/completions", json=HI, headers={"authorization": "Bearer k"})
    second = await client.post("/chat/completions", json=HI, headers={"traceparent": "00-a-b-01"})
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["id"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("call_1", '{"city":"Oslo"}'),
        ("c-7", '{"q": 1}'),
    ]
    assert second.json()["choices"][0]["message"] == {"role": "assistant", "content": "Done."}
    assert second.json()["choices"][0]["finish_reason"] == "stop"
    assert upstream.bodies == [HI, HI]
    assert upstream.authorizations == ["Bearer k", None]
    assert upstream.traceparents == [None, "00-a-b-01"]
    upstream.check()


async def test_usage_is_counted_from_the_json_sizes_unless_given(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(say("12345678"), say("x", finish_reason="length").replace(usage={"cost": 0.5}))
    counted = (await client.post("/chat/completions", json=HI)).json()
    priced = (await client.post("/chat/completions", json=HI)).json()
    prompt = -(-len(json.dumps(HI["messages"], separators=(",", ":"))) // 4)
    assert counted["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 3,  # '"12345678"' is 10 bytes
        "total_tokens": prompt + 3,
    }
    assert priced["usage"]["cost"] == 0.5
    assert priced["choices"][0]["finish_reason"] == "length"


async def test_a_reply_over_the_cap_is_cut_to_it_without_tool_calls(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(say("x" * 100), call("search_notes", query="a long query " * 4))
    text = (await client.post("/chat/completions", json={**HI, "max_tokens": 5})).json()
    tool = (await client.post("/chat/completions", json={**HI, "max_completion_tokens": 5})).json()
    assert text["choices"][0]["message"]["content"] == "x" * 20
    assert text["choices"][0]["finish_reason"] == "length"
    assert text["usage"]["completion_tokens"] == 5
    assert "tool_calls" not in tool["choices"][0]["message"]
    assert tool["choices"][0]["finish_reason"] == "length"


async def test_a_stream_is_a_role_chunk_pieces_deltas_finish_usage_and_done(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(call("get_weather", city="Oslo").replace(content="Let me check."))
    body = {**HI, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert chunks[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d["content"] for d in deltas[1:3]] == ["Let me c", "heck."]
    head, arguments = deltas[3]["tool_calls"][0], deltas[4]["tool_calls"][0]
    assert (head["index"], head["function"]) == (0, {"name": "get_weather", "arguments": ""})
    assert arguments["function"]["arguments"] == '{"city":"Oslo"}'
    assert chunks[-3]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-2]["choices"] == []
    assert chunks[-2]["usage"]["total_tokens"] > 0


async def test_keep_answers_forever_and_a_callable_turn_reads_the_request(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(keep(say_tool_result("Got: {}")))
    for content in ("one", "two", "three"):
        messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": content}]
        r = await client.post("/chat/completions", json={**HI, "messages": messages})
        assert r.json()["choices"][0]["message"]["content"] == f"Got: {content}"
    upstream.check()


async def test_a_failure_turn_is_an_openai_shaped_error(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(fail(429, "slow down", headers={"retry-after": "0"}))
    r = await client.post("/chat/completions", json=HI)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "0"
    assert r.json()["error"]["message"] == "slow down"
    upstream.check()


async def test_an_exhausted_script_is_a_500_and_fails_the_check(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(say("The only turn."))
    await client.post("/chat/completions", json=HI)
    r = await client.post("/chat/completions", json=HI)
    assert r.status_code == 500
    assert "script exhausted" in r.json()["error"]["message"]
    with pytest.raises(AssertionError, match="request #2 found the script exhausted"):
        upstream.check()
    upstream.allow_exhaustion()
    upstream.check()


async def test_a_turn_that_raises_is_a_500_and_fails_the_check(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    upstream, client = scripted
    upstream.script(say_tool_result())  # but the request has no tool result
    r = await client.post("/chat/completions", json=HI)
    assert r.status_code == 500
    with pytest.raises(AssertionError, match="no tool result"):
        upstream.check()


async def test_models_lists_the_one_model(
    scripted: tuple[ScriptedUpstream, httpx.AsyncClient],
) -> None:
    _, client = scripted
    r = await client.get("/models")
    assert [m["id"] for m in r.json()["data"]] == ["scripted"]


def test_it_serves_on_127_0_0_1_in_a_thread() -> None:
    upstream = ScriptedUpstream(say("Over TCP."))
    with upstream.serve() as url:
        assert url.startswith("http://127.0.0.1:")
        r = httpx.post(f"{url}/chat/completions", json=HI)
    assert r.json()["choices"][0]["message"]["content"] == "Over TCP."
    assert upstream.url is None
    upstream.check()
