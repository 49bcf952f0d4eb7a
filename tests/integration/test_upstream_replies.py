"""What an upstream reply says, read faithfully (SPEC §4.4, §5): a reply the proxy cannot read
is a 502 `upstream_error` naming the field, never a 500; what can be repaired is repaired and
logged (repeated tool-call ids, usage no upstream can mean); Retry-After is only a hint."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest

from proxy.upstream.reply import MAX_REPORTED_TOKENS
from tests.bodies import user
from tests.integration.conftest import UPSTREAM, Proxy, ProxyFactory
from tests.integration.test_chat_stream import content, events
from tests.response_events import parse_events
from tests.scripted_upstream import Call, Reply, calls, fail, say, say_tool_result

WEATHER = user("Weather in Oslo and Paris?")


def answering(*bodies: dict[str, Any] | bytes, content_type: str = "application/json") -> Any:
    """A handler for all of the proxy's outgoing HTTP: `bodies`, one a request, with status 200."""
    left = list(bodies)

    def handler(request: httpx.Request) -> httpx.Response:
        body = left.pop(0)
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        stream = httpx.ByteStream(content)  # unread, as a network body is
        return httpx.Response(200, stream=stream, headers={"content-type": content_type})

    return handler


def tool_call(call_id: Any = "c1", name: Any = "get_weather", arguments: Any = "{}") -> Any:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def body_with(choices: Any = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "x", "object": "chat.completion", "model": "scripted"}
    if choices is not None:
        body["choices"] = choices
    body.update(fields)
    return body


def choice(message: Any, finish_reason: Any = "stop") -> list[Any]:
    return [{"index": 0, "message": message, "finish_reason": finish_reason}]


MALFORMED: list[tuple[dict[str, Any], str]] = [
    (body_with(), "choices is not a list with a choice in it"),
    (body_with({"0": {}}), "choices is not a list with a choice in it"),
    (body_with([]), "choices is not a list with a choice in it"),
    (body_with(["text"]), "choices[0] is not an object"),
    (body_with(choice("Hi")), "choices[0].message is not an object"),
    (body_with(choice({"role": "assistant", "content": 42})), "choices[0].message.content is"),
    (
        body_with(choice({"role": "assistant", "content": None, "tool_calls": "all"})),
        "choices[0].message.tool_calls is not a list",
    ),
    (
        body_with(choice({"role": "assistant", "tool_calls": ["get_weather"]})),
        "choices[0].message.tool_calls[0] is not an object",
    ),
    (
        body_with(choice({"role": "assistant", "tool_calls": [{"id": "c1", "function": "f"}]})),
        "choices[0].message.tool_calls[0].function is not an object",
    ),
    (
        body_with(choice({"role": "assistant", "tool_calls": [tool_call(name=7)]})),
        "choices[0].message.tool_calls[0].function.name is not a string",
    ),
    (
        body_with(choice({"role": "assistant", "tool_calls": [tool_call(arguments={"a": 1})]})),
        "choices[0].message.tool_calls[0].function.arguments is not a string",
    ),
    (
        body_with(choice({"role": "assistant", "tool_calls": [tool_call(call_id=["c1"])]})),
        "choices[0].message.tool_calls[0].id is not a string",
    ),
    (
        body_with(choice({"role": "assistant", "content": "Hi"}, finish_reason=1)),
        "choices[0].finish_reason is not a string",
    ),
    (
        body_with(choice({"role": "assistant", "content": "Hi"}, finish_reason=None)),
        "choices[0].finish_reason is missing: the reply may have been cut short",
    ),
    (  # it would go on to the client, the run's record and its span as it came
        body_with(choice({"role": "assistant", "content": "Hi"}, finish_reason="x" * 65)),
        "choices[0].finish_reason is not a string of at most 64 characters",
    ),
    (
        body_with(choice({"role": "assistant", "content": "Hi"}), usage=[1, 2]),
        "usage is not an object",
    ),
]


@pytest.mark.parametrize(("body", "says"), MALFORMED)
async def test_a_malformed_reply_is_a_502_naming_the_field(
    proxy_for: ProxyFactory, body: dict[str, Any], says: str
) -> None:
    async with proxy_for(handler=answering(body)) as proxy:
        r = await proxy.chat(model="weather", messages=WEATHER)
    assert r.status_code == 502
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_error")
    assert error["message"].startswith("upstream main sent a malformed reply: ")
    assert says in error["message"]
    assert r.headers["x-loopwarden-stop-reason"] == "upstream_error"


def sse(*chunks: dict[str, Any] | bytes) -> bytes:
    return b"".join(
        b"data: " + (c if isinstance(c, bytes) else orjson.dumps(c)) + b"\n\n" for c in chunks
    ) + (b"data: [DONE]\n\n")


def chunk(delta: Any = None, **fields: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta if delta is not None else {}, "finish_reason": None}
    return {"id": "x", "object": "chat.completion.chunk", "choices": [choice], **fields}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"id": "x", "choices": {"0": {}}}, "choices of a chunk is not a list"),
        ({"id": "x", "choices": [7]}, "choices[0] is not an object"),
        (chunk("Hi"), "choices[0].delta is not an object"),
        (chunk({"content": ["Hi"]}), "choices[0].delta.content is not a string"),
        (chunk({"tool_calls": {"index": 0}}), "choices[0].delta.tool_calls is not a list"),
        (chunk({"tool_calls": [{"index": "0"}]}), "choices[0].delta.tool_calls[0].index"),
        (
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": {"a": 1}}}]}),
            "choices[0].delta.tool_calls[0].function.arguments is not a string",
        ),
        (chunk({}, usage="lots"), "usage is not an object"),
        (b"[1, 2]", "an event that is not a JSON object"),
    ],
)
async def test_a_malformed_chunk_is_a_502_naming_the_field(
    proxy_for: ProxyFactory, bad: dict[str, Any] | bytes, says: str
) -> None:
    stream = sse(bad, chunk({"content": "Hi"}), chunk({}, finish_reason="stop"))
    async with proxy_for(handler=answering(stream, content_type="text/event-stream")) as proxy:
        r = await proxy.chat(model="scripted", stream=True)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_error"
    assert says in r.json()["error"]["message"]


async def test_a_reply_with_more_tool_calls_than_the_cap_is_a_502(
    proxy_for: ProxyFactory,
) -> None:
    many = calls(*(Call("get_weather", {"city": f"C{i}"}) for i in range(6)))
    overrides = {"upstreams": {"main": {"base_url": UPSTREAM, "max_tool_calls_per_reply": 5}}}
    async with proxy_for(overrides) as proxy:
        proxy.upstream.script(many, many)
        r = await proxy.chat(model="weather", messages=WEATHER)
        streamed = await proxy.chat(model="weather", messages=WEATHER, stream=True)
    assert r.status_code == 502
    # The stream's first events were sound, so it had begun: the failure is its last event.
    assert streamed.status_code == 200
    *_, failure, done = events(streamed.text)
    assert done == "[DONE]"
    for answer in (r.json(), failure):
        error = answer["error"]
        assert error["code"] == "upstream_error"
        assert "more than 5 tool calls in one reply (max_tool_calls_per_reply)" in error["message"]
        assert answer["loop"]["tool_calls"] == 0  # none of them ran


@pytest.mark.parametrize("stream", [False, True])
async def test_repeated_tool_call_ids_get_a_result_each(
    proxy: Proxy, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    twice = calls(
        Call("get_weather", {"city": "Oslo"}, id="call_same"),
        Call("get_weather", {"city": "Paris"}, id="call_same"),
    )
    proxy.upstream.script(twice, say_tool_result("Last: {}"))
    with caplog.at_level(logging.WARNING, logger="proxy.upstream"):
        r = await proxy.chat(model="weather", messages=WEATHER, stream=stream)
    assert r.status_code == 200
    sent = proxy.upstream.bodies[1]["messages"]
    asked = [c["id"] for m in sent if m["role"] == "assistant" for c in m["tool_calls"]]
    results = {m["tool_call_id"]: m["content"] for m in sent if m["role"] == "tool"}
    assert asked[0] == "call_same"
    assert len(set(asked)) == 2
    assert set(results) == set(asked)
    assert '"Oslo"' in results[asked[0]]
    assert '"Paris"' in results[asked[1]]
    assert any("repeated tool call id 'call_same'" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_negative_cost_is_not_believed(
    proxy_for: ProxyFactory, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    loop = {"tools": ["get_weather"], "stop_when": [{"max_cost": 0.5}]}
    lying = {"cost": -1000.0, "prompt_tokens": -5000, "completion_tokens": 10}
    async with proxy_for() as proxy:
        proxy.upstream.script(
            Reply(calls=(Call("get_weather", {"city": "Oslo"}),), usage=lying),
            say("It is 4 degrees.").replace(usage={"cost": -1000.0}),
        )
        with caplog.at_level(logging.WARNING, logger="proxy.upstream"):
            r = await proxy.chat(model="scripted", messages=WEATHER, loop=loop, stream=stream)
        assert r.status_code == 200
        report = events(r.text)[-2]["loop"] if stream else r.json()["loop"]
        assert report["cost_usd"] > 0  # priced from the tokens instead
        if not stream:
            assert r.json()["usage"]["prompt_tokens"] > 0
        cost = proxy.metric("loopwarden_cost_usd_total", agent="none", model="scripted")
        assert cost == pytest.approx(report["cost_usd"])
    assert any("usage.cost = -1000.0" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_token_counts_past_any_reply_s_are_counted_as_the_bound(
    proxy_for: ProxyFactory, path: str, stream: bool
) -> None:
    """2**63 prompt tokens in each of two steps added up past 64 bits: a 500, or a stream cut
    short without an error event, and a cost counter at 3e13 dollars."""
    absurd = {"prompt_tokens": 2**63, "completion_tokens": 2**63, "total_tokens": 2**64 - 1}
    body: dict[str, Any] = {"model": "scripted", "loop": {"tools": ["get_weather"]}}
    body |= {"messages": WEATHER} if path.endswith("completions") else {"input": "Oslo?"}
    if stream:
        body |= {"stream": True}
        if path.endswith("completions"):
            body |= {"stream_options": {"include_usage": True}}
    async with proxy_for() as proxy:
        proxy.upstream.script(
            Reply(calls=(Call("get_weather", {"city": "Oslo"}),), usage=absurd),
            say("It is 4 degrees.").replace(usage=absurd),
        )
        r = await proxy.client.post(path, json=body)
        cost = proxy.metric("loopwarden_cost_usd_total", agent="none", model="scripted")
    assert r.status_code == 200, r.text
    if not stream:
        usage = r.json()["usage"]
    elif path.endswith("completions"):
        assert "error" not in r.text
        usage = [e for e in events(r.text) if isinstance(e, dict) and e.get("usage")][-1]["usage"]
    else:
        assert "response.completed" in r.text, r.text
        [done] = [e for e in parse_events(r.text) if e["type"] == "response.completed"]
        usage = done["response"]["usage"]
    counted = MAX_REPORTED_TOKENS * 2
    assert counted in (usage.get("prompt_tokens"), usage.get("input_tokens"))
    assert 0 < cost < 1e6


@pytest.mark.parametrize("retry_after", ["nan", "-5", "inf", "1e12", "soon", "Wed, 21 Oct 2999"])
async def test_any_retry_after_is_a_bounded_wait(proxy_for: ProxyFactory, retry_after: str) -> None:
    overrides = {
        "upstreams": {"main": {"base_url": UPSTREAM, "max_retries": 1, "max_retry_wait_s": 0.05}}
    }
    slow_down = fail(
        429, "slow down", error_type="rate_limit", headers={"retry-after": retry_after}
    )
    async with proxy_for(overrides) as proxy:
        proxy.upstream.script(slow_down, say("Now then."))
        r = await proxy.chat(model="scripted")
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Now then."
    assert len(proxy.upstream.requests) == 2


async def test_an_error_event_mid_stream_is_relayed_scrubbed(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAIN_KEY", "key-of-the-upstream-42")
    overrides = {"upstreams": {"main": {"base_url": UPSTREAM, "api_key_env": "MAIN_KEY"}}}
    failure = {"error": {"message": "key key-of-the-upstream-42 revoked", "code": "bad_key"}}
    stream = sse(chunk({"content": "Hel"}), failure)
    handler = answering(stream, content_type="text/event-stream")
    async with proxy_for(overrides, handler=handler) as proxy:
        r = await proxy.chat(model="scripted", stream=True)
    assert "key-of-the-upstream-42" not in r.text
    # One read held both events: the text before the error goes out first, as it would have
    # had the error come in a later read.
    assert r.status_code == 200
    *chunks, final, done = events(r.text)
    assert done == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hel"
    assert final["error"]["code"] == "upstream_error"
    assert final["error"]["message"] == "upstream main failed mid-stream: key [redacted] revoked"


@pytest.mark.parametrize(
    ("stream", "says"),
    [
        (  # text, then [DONE]: no finish_reason ever came
            sse(chunk({"content": "The answer is: "}), chunk({"content": "par"})),
            "upstream main's stream ended before the reply was complete (no finish_reason)",
        ),
        (  # OpenAI's usage chunk has no choice: a stream of nothing else is no reply
            sse({"id": "x", "object": "chat.completion.chunk", "choices": []}),
            "upstream main's stream ended before the reply was complete (no finish_reason)",
        ),
        (  # a tool call whose arguments may be cut short: it is not run
            sse(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "function": {"name": "get_weather", "arguments": '{"ci'},
                            }
                        ]
                    }
                )
            ),
            "upstream main's stream ended before the reply was complete (no finish_reason)",
        ),
        (
            sse(chunk({"content": "partial "}))[: -len(b"data: [DONE]\n\n")]
            + b'event: error\ndata: {"message": "overloaded"}\n\n'
            + b"data: [DONE]\n\n",
            "upstream main failed mid-stream: overloaded",
        ),
    ],
)
async def test_a_stream_cut_short_or_failed_is_never_a_completed_run(
    proxy_for: ProxyFactory, stream: bytes, says: str
) -> None:
    handler = answering(stream, content_type="text/event-stream")
    async with proxy_for(handler=handler) as proxy:
        r = await proxy.chat(model="weather", messages=WEATHER, stream=True)
    if r.status_code == 200:  # the answer had begun (its first event was sound)
        *_, failure, done = events(r.text)
        assert done == "[DONE]"
    else:  # the failure came in the read that held its first event
        assert r.status_code == 502
        failure = r.json()
    assert failure["error"]["message"] == says
    assert failure["loop"]["stop_reason"] == "upstream_error"
    assert failure["loop"]["tool_calls"] == 0  # a call cut short is not run


@pytest.mark.parametrize("stream", [False, True])
async def test_the_reply_is_the_choice_of_index_0_whatever_the_order(
    proxy_for: ProxyFactory, stream: bool
) -> None:
    def choice_of(index: int, text: str) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}}

    if stream:
        second, first = chunk({"content": "second"}), chunk({"content": "first"})
        second["choices"][0]["index"] = 1
        done = chunk({}, finish_reason="stop")
        body: dict[str, Any] | bytes = sse(second, first, done)
    else:
        listed = [choice_of(1, "second"), choice_of(0, "first")]
        body = body_with([{**c, "finish_reason": "stop"} for c in listed])
    kind = "text/event-stream" if stream else "application/json"
    async with proxy_for(handler=answering(body, content_type=kind)) as proxy:
        r = await proxy.chat(model="weather", messages=WEATHER, stream=stream)
    text = content(events(r.text)) if stream else r.json()["choices"][0]["message"]["content"]
    assert text == "first"


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/chat"])
async def test_a_reply_nested_deeper_than_the_proxy_writes_is_a_502(
    proxy_for: ProxyFactory, path: str
) -> None:
    """orjson reads 1,024 levels and writes 254: a reply deeper than the proxy takes (a field
    300 levels down in its message) could be neither answered nor stored (a 500)."""
    message = b'{"role":"assistant","content":"Hi","extra":' + deep(300) + b"}"
    raw = b'{"id":"x","choices":[{"index":0,"message":' + message + b',"finish_reason":"stop"}]}'
    body = {"model": "weather", "messages": WEATHER, "input": "hi", "message": "hi"}
    body["context_id"] = "c-deep"
    async with proxy_for(handler=answering(raw)) as proxy:
        r = await proxy.client.post(path, json=_for(path, body))
        stored = await proxy.client.get("/v1/contexts/c-deep")
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_error"
    assert "sent a body nested deeper than 246 levels" in r.json()["error"]["message"]
    assert stored.status_code == 404  # nothing saved


async def test_a_reply_of_more_json_values_than_its_bound_is_a_502_before_it_is_parsed(
    proxy_for: ProxyFactory,
) -> None:
    """A whole reply's values are counted before it is parsed (16 million in 32 MiB held the
    event loop 1.4 s): past `max_response_values` it is a 502, as one past its bytes is."""
    wide = b"[" + b"0," * 5000 + b"0]"
    raw = b'{"id":"x","x":' + wide + b',"choices":[{"index":0,"message":{"role":"assistant",'
    raw += b'"content":"Hi"},"finish_reason":"stop"}]}'
    bounded = {"upstreams": {"main": {"base_url": UPSTREAM, "max_response_values": 4000}}}
    roomy = {"upstreams": {"main": {"base_url": UPSTREAM, "max_response_values": 6000}}}
    async with proxy_for(bounded, handler=answering(raw)) as proxy:
        over = await proxy.chat(model="weather", messages=WEATHER)
    async with proxy_for(roomy, handler=answering(raw)) as proxy:
        within = await proxy.chat(model="weather", messages=WEATHER)
    assert over.status_code == 502, over.text
    assert over.json()["error"]["code"] == "upstream_error"
    assert "more than 4000 JSON values (max_response_values)" in over.json()["error"]["message"]
    assert within.status_code == 200, within.text


async def test_a_streamed_event_of_more_json_values_than_its_bound_fails_the_stream(
    proxy_for: ProxyFactory,
) -> None:
    """An event's values are counted before it is parsed, as a whole reply's are: one event of
    8 MiB of `[],` held the event loop 1.2 s. The text before it goes on; then the error."""
    wide = b'{"id":"x","choices":[],"x":[' + b"0," * 40_000 + b"0]}"
    end = {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    stream = sse(chunk({"role": "assistant", "content": "Hi"}), wide, end)
    bounded = {"upstreams": {"main": {"base_url": UPSTREAM, "max_response_values": 30_000}}}
    roomy = {"upstreams": {"main": {"base_url": UPSTREAM, "max_response_values": 50_000}}}
    async with proxy_for(
        bounded, handler=answering(stream, content_type="text/event-stream")
    ) as proxy:
        over = await proxy.chat(model="weather", messages=WEATHER, stream=True)
    async with proxy_for(
        roomy, handler=answering(stream, content_type="text/event-stream")
    ) as proxy:
        within = await proxy.chat(model="weather", messages=WEATHER, stream=True)
    first, *_, failed, done = events(over.text)
    assert first["choices"][0]["delta"]["content"] == "Hi"
    assert failed["error"]["code"] == "upstream_error"
    assert "an event of more than 30000 JSON values (max_response_values)" in str(failed)
    assert (failed["loop"]["stop_reason"], done) == ("upstream_error", "[DONE]")
    assert events(within.text)[-2]["loop"]["stop_reason"] == "completed"


def _for(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The fields of `body` that `path` takes."""
    fields = {
        "/v1/chat/completions": ("model", "messages"),
        "/v1/responses": ("model", "input"),
        "/chat": ("model", "message", "context_id"),
    }[path]
    return {name: body[name] for name in fields}


async def test_a_streamed_usage_nested_too_deep_fails_the_stream(proxy_for: ProxyFactory) -> None:
    """Usage is the one object of a chunk that goes on as it came: after the stream began, an
    error event (SPEC §4.3) instead of a 500 at its end."""
    usage = b'{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"x":' + deep(300) + b"}"
    usage_chunk = b'{"id":"x","choices":[],"usage":' + usage + b"}"
    stream = sse(chunk({"role": "assistant"}), chunk({}, finish_reason="stop"), usage_chunk)
    async with proxy_for(handler=answering(stream, content_type="text/event-stream")) as proxy:
        r = await proxy.chat(model="scripted", stream=True)
    *_, failed, done = events(r.text)
    assert failed["error"]["code"] == "upstream_error"
    assert "usage nests deeper than 246 levels" in failed["error"]["message"]
    assert (failed["loop"]["stop_reason"], done) == ("upstream_error", "[DONE]")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat"])
async def test_tool_arguments_nested_too_deep_are_a_tool_error(
    proxy_for: ProxyFactory, path: str
) -> None:
    """The model reads the error and goes on; /chat answered a 500 over a saved turn."""
    arguments = '{"city":' + deep(300).decode() + "}"
    first = body_with(
        choice(
            {"role": "assistant", "tool_calls": [tool_call("c1", "get_weather", arguments)]},
            "tool_calls",
        )
    )
    then = body_with(choice({"role": "assistant", "content": "Sorry."}))
    body = {"model": "weather", "messages": WEATHER, "message": "hi", "context_id": "c-args"}
    async with proxy_for(handler=answering(first, then)) as proxy:
        r = await proxy.client.post(path, json=_for(path, body))
    assert r.status_code == 200, r.text
    if path == "/chat":
        [tool] = [m for m in r.json()["generated_messages"] if m.get("tool_input") is not None]
        assert tool["tool_input"] == arguments  # as it came: no answer could hold it parsed
    else:
        assert r.json()["choices"][0]["message"]["content"] == "Sorry."
        assert r.json()["loop"]["tool_calls"] == 1
