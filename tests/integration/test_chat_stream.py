"""SPEC §4.3: streaming runs the same loop."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.bodies import user
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import call, fail, say, say_tool_result


def events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def content(chunks: list[Any]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if isinstance(c, dict) and c.get("choices")
    )


async def test_stream_of_a_tool_loop(proxy: Proxy) -> None:
    proxy.upstream.script(
        call("get_weather", city="Paris"), say_tool_result("Here is what I found: {}")
    )
    r = await proxy.chat(model="weather", stream=True, messages=user("Weather in Paris?"))
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    assert len({c["id"] for c in data}) == 1
    assert len({c["created"] for c in data}) == 1
    assert content(data) == 'Here is what I found: {"city":"Paris","celsius":18.0,"sky":"clear"}'
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in data if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in data if c["choices"]]
    assert [f for f in finishes if f] == ["stop"]
    assert data[-1]["loop"]["stop_reason"] == "completed"
    assert data[-1]["loop"]["steps"] == 2
    assert all("usage" not in c for c in data)
    assert all(sent["stream"] is True for sent in proxy.upstream.bodies)
    assert all(sent["stream_options"] == {"include_usage": True} for sent in proxy.upstream.bodies)


async def test_usage_chunk_when_asked(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Paris"), say("Sunny."))
    r = await proxy.chat(
        model="weather",
        stream=True,
        stream_options={"include_usage": True},
        messages=user("Weather in Paris?"),
    )
    data = events(r.text)[:-1]
    last = data[-1]
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > 0
    assert data[-2]["loop"]["steps"] == 2


async def test_terminal_output_arrives_as_content(proxy: Proxy) -> None:
    proxy.upstream.script(call("final_answer", answer="Hello!"))
    r = await proxy.chat(
        model="scripted",
        stream=True,
        messages=user("Say hello."),
        loop={"tools": ["final_answer"]},
    )
    data = events(r.text)[:-1]
    assert content(data) == "Hello!"
    assert data[-1]["choices"][0]["finish_reason"] == "stop"
    assert data[-1]["loop"]["stop_reason"] == "terminal_tool"


async def test_client_tool_calls_are_streamed_as_tool_call_deltas(proxy: Proxy) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "ask_user",
            "parameters": {"type": "object", "properties": {"question": {"type": "string"}}},
        },
    }
    proxy.upstream.script(
        call("get_weather", city="Oslo"), call("ask_user", question="Pack an umbrella?")
    )
    r = await proxy.chat(
        model="scripted",
        stream=True,
        tools=[tool],
        messages=user("Check Oslo, then ask me."),
        loop={"tools": ["get_weather"]},
    )
    data = events(r.text)[:-1]
    deltas = [c["choices"][0]["delta"] for c in data if c["choices"]]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["ask_user"]
    assert calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"question": "Pack an umbrella?"}
    assert data[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # No text at all, not even an empty one (a client would keep an empty text part).
    assert deltas[0] == {"role": "assistant", "content": None}
    assert all(d.get("content") is None for d in deltas)


async def test_loop_events_mark_progress(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Paris"), say("Sunny."))
    r = await proxy.chat(
        model="weather",
        stream=True,
        messages=user("Weather in Paris?"),
        loop={"include_loop_events": True},
    )
    kinds = [c["loop_event"]["type"] for c in events(r.text)[:-1] if "loop_event" in c]
    assert kinds == ["step_started", "tool_call", "tool_result", "step_started"]


async def test_keepalive_comments_while_a_tool_runs(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"server": {"keepalive_interval_s": 0.1}}) as proxy:
        proxy.upstream.script(call("sleep", seconds=0.35), say_tool_result("Done: {}"))
        r = await proxy.chat(
            model="scripted", stream=True, messages=user("Wait a bit."), loop={"tools": ["sleep"]}
        )
    assert r.text.count(": keep-alive\n\n") >= 2
    assert content(events(r.text)[:-1]) == "Done: slept 0.35s"


async def test_a_failure_before_the_first_byte_is_a_plain_error(proxy_for: ProxyFactory) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with proxy_for(handler=refuse) as proxy:
        r = await proxy.chat(model="scripted", stream=True)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"


async def test_a_failure_after_the_first_byte_is_an_error_chunk(proxy: Proxy) -> None:
    proxy.upstream.script(
        call("get_weather", city="Oslo").replace(content="Let me check."), fail(500, "boom")
    )
    r = await proxy.chat(model="weather", stream=True, messages=user("Weather in Oslo?"))
    assert r.status_code == 200
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    assert content(chunks[:-1]) == "Let me check."
    assert chunks[-2]["error"]["code"] == "upstream_error"
    assert chunks[-2]["loop"]["stop_reason"] == "upstream_error"


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


async def test_a_client_call_after_a_server_step_has_the_text_the_stream_said(
    proxy: Proxy,
) -> None:
    """The JSON reply's text is every step's, as the stream's (it was the last step's alone:
    None here, where the stream said "Step one.")."""
    step_one = call("get_weather", city="Paris").replace(content="Step one.")
    replies = []
    for stream in (False, True):
        proxy.upstream.script(step_one, call("lookup", q="x"))
        r = await proxy.chat(model="weather", tools=[LOOKUP], stream=stream)
        replies.append(r)
    body, streamed = replies[0].json(), events(replies[1].text)
    assert body["loop"]["stop_reason"] == "client_tool_call"
    assert body["choices"][0]["message"]["content"] == "Step one."
    assert content(streamed) == "Step one."


async def test_a_refusal_reaches_a_stream_and_is_no_structured_document(proxy: Proxy) -> None:
    """A stream dropped the upstream's `refusal` (the SDKs' stream helpers gave none), and with
    a `response_format` the document was an earlier step's text."""
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    step_one = call("get_weather", city="Paris").replace(content="Let me check.")
    refused = say("").replace(content=None, refusal="I can't help with that.")
    replies = []
    for stream in (False, True):
        proxy.upstream.script(step_one, refused)
        replies.append(await proxy.chat(model="weather", response_format=schema, stream=stream))
    message = replies[0].json()["choices"][0]["message"]
    assert (message["content"], message["refusal"]) == (None, "I can't help with that.")
    chunks = [c for c in events(replies[1].text) if isinstance(c, dict) and c.get("choices")]
    assert content(chunks) == ""
    refusals = [c["choices"][0]["delta"].get("refusal") for c in chunks]
    assert [r for r in refusals if r] == ["I can't help with that."]


async def test_logprobs_are_the_reply_s_when_the_run_s_text_is_its_alone(proxy: Proxy) -> None:
    """A loop's JSON reply dropped them (null) even for one step; a stream's chunks carry none
    (every chunk said null): asked for, that is a 400."""
    probs = {
        "content": [{"token": "Sun", "logprob": -0.1, "bytes": [83, 117, 110], "top_logprobs": []}]
    }
    proxy.upstream.script(say("Sun").replace(logprobs=probs))
    one = await proxy.chat(model="weather", logprobs=True)
    looking = call("get_weather", city="Paris").replace(content="Looking.")
    proxy.upstream.script(looking, say("Sun").replace(logprobs=probs))
    two = await proxy.chat(model="weather", logprobs=True)
    streamed = await proxy.chat(model="weather", logprobs=True, stream=True)
    assert one.json()["choices"][0]["logprobs"] == probs
    assert two.json()["choices"][0]["message"]["content"] == "Looking.\n\nSun"
    assert two.json()["choices"][0]["logprobs"] is None  # the first step's are not kept
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_limit_that_ends_a_structured_run_leaves_its_document_alone(
    proxy: Proxy, stream: bool
) -> None:
    """A tool call limit's `end` put its sentence after the model's JSON document: no SDK's
    `parse()` could read it. The stop is in the `loop` report and the header."""
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    proxy.upstream.script(
        call("get_weather", city="Paris").replace(content='{"n": 1}'),
        call("get_weather", city="Lima").replace(content='{"n": 2}'),
    )
    limits = [{"run_limit": 1, "exit_behavior": "end"}]
    r = await proxy.chat(
        model="weather", response_format=schema, stream=stream, loop={"tool_call_limits": limits}
    )
    if stream:
        text = content([c for c in events(r.text) if isinstance(c, dict) and c.get("choices")])
    else:
        text = r.json()["choices"][0]["message"]["content"]
        assert r.headers["x-loopwarden-stop-reason"] == "tool_call_limit"
    assert json.loads(text) == {"n": 2}
