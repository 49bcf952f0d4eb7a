"""SPEC §4.4: bad input, auth, upstream failures — OpenAI-shaped, never a 500."""

from __future__ import annotations

import gzip
import logging
from typing import Any

import httpx
import orjson
import pytest
from openai import AsyncOpenAI, BadRequestError

from proxy.json_values import MAX_DEPTH as MAX_JSON_DEPTH
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import Failure, call, fail, keep, say

USER = [{"role": "user", "content": "hi"}]


def nested(kind: str, depth: int) -> dict[str, Any]:
    condition: dict[str, Any] = {"step_count_is": 1}
    for _ in range(depth):
        condition = {kind: condition if kind == "not" else [condition]}
    return condition


def expr(source: str) -> dict[str, Any]:
    return {"model": "scripted", "messages": USER, "loop": {"stop_when": [{"expr": source}]}}


def stop_id(name: str) -> dict[str, Any]:
    """A stop condition named `name`: its id is stored, logged and put on spans."""
    return {"step_count_is": 3, "id": name}


def comprehensions(depth: int) -> str:
    """`depth` nested `exists` over the run's steps: exponential to evaluate."""
    body = "true"
    for level in range(depth):
        body = f"steps.exists(s{level}, {body})"
    return body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER}, "model"),
        ({"model": "scripted"}, "messages"),
        (
            {"model": "scripted", "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
        ({"model": "scripted", "messages": USER, "stream": "yes"}, "stream"),
        ({"model": "scripted", "messages": USER, "tool_choice": 5}, "tool_choice"),
        ({"model": "scripted", "messages": USER, "stream": True, "n": 2}, "n"),
        ({"model": "scripted", "messages": USER, "n": 3, "loop": {"max_steps": 3}}, "n"),
        (
            {
                "model": "scripted",
                "messages": USER,
                "n": 3,
                "loop": {"stop_when": [{"max_tokens_used": 60}]},
            },
            "n",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(513)],
            },
            "tools",
        ),
        # Bounded before it is validated: 49,000 bad values held the event loop 200 ms.
        ({"model": "scripted", "messages": USER, "loop": {f"k{i}": 1 for i in range(300)}}, "loop"),
        (
            {
                "model": "scripted",
                "messages": USER,
                "loop": {
                    "tool_rules": [
                        {
                            "type": "conditional",
                            "tool_name": "t",
                            "child_output_mapping": {f"k{i}": 1 for i in range(257)},
                        }
                    ]
                },
            },
            "loop.tool_rules[0].child_output_mapping",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "loop": {
                    "stop_when": [
                        {"any": [{"max_steps": i} for i in range(100)]} for _ in range(200)
                    ]
                },
            },
            "loop",
        ),
        ({"model": "scripted", "messages": USER, "tool_choice": ""}, "tool_choice"),
        ({"model": "weather", "messages": USER, "tool_choice": {"name": "f"}}, "tool_choice"),
        (
            {"model": "scripted", "messages": USER, "tool_choice": {"type": "function"}},
            "tool_choice.function.name",
        ),
        (  # a tool none of the run's tools: the upstream's 400 came back mid-run
            {
                "model": "weather",
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "tool_choice": {"type": "custom", "custom": {"name": "f"}},
            },
            "tool_choice.custom.name",
        ),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": [1, 2]}]},
            "messages[0].content[0]",
        ),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages[0].content[0]",
        ),
        (
            {"model": "scripted", "messages": USER, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        (
            {"model": "scripted", "messages": USER, "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (  # as the Responses API's names: a megabyte of it went on to the upstream
            {
                "model": "scripted",
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f" * 1_000_000}}],
            },
            "tools[0].function.name",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            },
            "tools[0].function.parameters",
        ),
        ({"model": "scripted", "messages": USER, "loop": []}, "loop"),
        ({"model": "scripted", "messages": USER, "loop": {"bogus": 1}}, "loop.bogus"),
        ({"model": "scripted", "messages": USER, "loop": {"max_steps": -1}}, "loop.max_steps"),
        (  # past what sqlite stores: a 500 when the thread's count was reserved
            {
                "model": "weather",
                "messages": USER,
                "loop": {"tool_call_limits": [{"thread_limit": 2**63}]},
            },
            "loop.tool_call_limits[0].thread_limit",
        ),
        ({"model": "scripted", "messages": USER, "loop": {"tools": ["nope"]}}, "loop.tools[0]"),
        ({"model": "scripted", "messages": USER, "loop": {"agent": "nope"}}, "loop.agent"),
        (
            {"model": "scripted", "messages": USER, "loop": {"stop_when": [{"max_cost": "1"}]}},
            "loop.stop_when[0].max_cost",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "loop": {"stop_when": [{"any": [{"step_count_is": 1}, {"expr": "size("}]}]},
            },
            "loop.stop_when[0].any[1].expr",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "loop": {"stop_when": [{"has_tool_call": "get_weather"}]},
            },
            "loop.stop_when[0].has_tool_call",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "loop": {"stop_when": [{"webhook": "undefined"}]},
            },
            "loop.stop_when[0].webhook",
        ),
        (
            {
                "model": "scripted",
                "messages": USER,
                "loop": {"terminating_config": {"tool_ids": ["final_answer"]}},
            },
            "loop.terminating_config.tool_ids[0]",
        ),
        (
            {
                "model": "weather",
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "get_weather"}}],
            },
            "tools[0].function.name",
        ),
        ({"model": "weather", "messages": USER, "n": 2}, "n"),
        ({"model": "weather", "messages": USER, "functions": [{"name": "f"}]}, "functions"),
        (
            {"model": "scripted", "messages": USER, "loop": {}, "function_call": "auto"},
            "function_call",
        ),
        (
            {"model": "scripted", "messages": USER, "loop": {"tool_rules": [{"type": "x"}]}},
            "loop.tool_rules[0].type",
        ),
        # Hostile input: every size and depth is bounded before the work (issue: hostile input).
        ({"model": "m" * 7_000_000, "messages": USER}, "model"),
        (
            {"model": "scripted", "messages": USER, "loop": {"thread_id": "t" * 257}},
            "loop.thread_id",
        ),
        (
            {"model": "scripted", "messages": USER, "loop": {"thread_id": "a\nb\x00"}},
            "loop.thread_id",
        ),
        (
            {"model": "scripted", "messages": USER, "loop": {"tools": ["get_weather"] * 4097}},
            "loop.tools",
        ),
        (
            {"model": "scripted", "messages": USER, "loop": {"stop_when": [stop_id("x" * 257)]}},
            "loop.stop_when[0].id",
        ),
        (
            {"model": "scripted", "messages": USER, "loop": {"stop_when": [stop_id("a\u202eb")]}},
            "loop.stop_when[0].id",
        ),
        (
            {"model": "scripted", "messages": USER, "loop": {"stop_when": [nested("not", 100)]}},
            "loop.stop_when",
        ),
        (
            {"model": "scripted", "messages": USER, "loop": {"stop_when": [nested("any", 60)]}},
            "loop.stop_when",
        ),
        (expr("+".join(["1"] * 50_000) + " > 0"), "loop.stop_when[0].expr"),
        (expr("+".join(["1"] * 15_000) + " > 0"), "loop.stop_when[0].expr"),
        (expr("usage" + ".b" * 20_000 + " > 0"), "loop.stop_when[0].expr"),
        (expr("(" * 500 + "true" + ")" * 500), "loop.stop_when[0].expr"),
        (expr(comprehensions(8)), "loop.stop_when[0].expr"),
        (expr("'a'.matches('(\\\\w{50}){10}')"), "loop.stop_when[0].expr"),  # ~160 ms to compile
        (
            {"model": "scripted", "messages": [{"role": {"a": 1}, "content": "x"}]},
            "messages[0].role",
        ),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": {"a": 1}}]},
            "messages[0].content",
        ),
        (
            {"model": "scripted", "messages": [{"role": "assistant", "tool_calls": [1]}]},
            "messages[0].tool_calls[0]",
        ),
        (
            {
                "model": "scripted",
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": 1}}]}
                ],
            },
            "messages[0].tool_calls[0].function.name",
        ),
    ],
)
async def test_bad_input_is_a_400_naming_the_field_and_calls_no_upstream(
    proxy: Proxy, body: dict[str, Any], param: str
) -> None:
    r = await proxy.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    assert proxy.upstream.requests == []


async def test_an_error_echoes_at_most_a_bounded_part_of_what_the_client_sent(
    proxy: Proxy,
) -> None:
    key = "k" * 4_000_000
    r = await proxy.client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": USER, "loop": {key: 1}}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"].startswith("loop.kkk")
    assert error["param"] == "loop." + "k" * 250 + "…"  # (cut at 256 in all)
    assert len(r.content) < 3_000


async def test_malformed_json_is_a_400(proxy: Proxy) -> None:
    r = await proxy.client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


async def test_a_tool_choice_naming_a_server_tool_goes_upstream(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Paris"), say("Sunny."))
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = await proxy.chat(model="weather", messages=USER, tool_choice=choice)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Sunny."
    assert proxy.upstream.bodies[0]["tool_choice"] == choice


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/chat"])
async def test_a_compressed_body_is_a_415_naming_its_encoding(proxy: Proxy, path: str) -> None:
    """Read as plain, a gzip body was "not valid JSON": the client learns what to change."""
    body = gzip.compress(orjson.dumps({"model": "scripted", "messages": USER, "input": "hi"}))
    r = await proxy.client.post(path, content=body, headers={"content-encoding": "gzip"})
    assert r.status_code == 415
    error = r.json()["error"]
    assert error["code"] == "unsupported_content_encoding"
    assert error["param"] == "content-encoding"
    assert "'gzip'" in error["message"]


async def test_an_identity_encoded_body_is_read(proxy: Proxy) -> None:
    proxy.upstream.script(say("hello"))
    r = await proxy.client.post(
        "/v1/chat/completions",
        content=orjson.dumps({"model": "scripted", "messages": USER}),
        headers={"content-encoding": "Identity"},
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "hello"


async def test_a_body_over_the_limit_is_a_413(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"server": {"max_body_bytes": 2048}}) as proxy:
        r = await proxy.chat(model="scripted", messages=[{"role": "user", "content": "x" * 4096}])
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/chat"])
async def test_a_body_with_more_values_than_the_limit_is_a_413_before_it_is_parsed(
    proxy_for: ProxyFactory, path: str
) -> None:
    """Counted before parsing: this body is not even JSON (it never ends), and still gets the
    413, not the 400 of a parse."""
    hostile = b'{"model": "scripted", "messages": [' + b"[]," * 1001
    async with proxy_for({"server": {"max_body_values": 2000}}) as proxy:
        r = await proxy.client.post(path, content=hostile)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large"
    assert error["message"] == "the body holds more than 2000 JSON values (server.max_body_values)"


async def test_a_long_body_of_few_values_is_served(proxy_for: ProxyFactory) -> None:
    """Delimiters inside strings are not values: 30 KB of punctuated text is two of them."""
    text = "commas, colons: [brackets] {braces}, " * 800
    async with proxy_for({"server": {"max_body_values": 1000}}) as proxy:
        proxy.upstream.script(say("Read."))
        r = await proxy.chat(model="scripted", messages=[{"role": "user", "content": text}])
        many = await proxy.chat(model="scripted", messages=[{"role": "user"}] * 400)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Read."
    assert proxy.upstream.bodies[0]["messages"][0]["content"] == text
    assert many.status_code == 413  # 400 messages: 1 + 399 + 2 * 400 delimiters, and the body's


async def test_cost_condition_on_a_model_without_price_is_refused(proxy: Proxy) -> None:
    r = await proxy.chat(model="unpriced-model-x", loop={"stop_when": [{"max_cost": 1}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unknown_model_price"
    assert proxy.upstream.requests == []


async def test_proxy_keys(proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_KEY", "sk-team")
    auth = {"keys": [{"name": "team", "key_env": "TEAM_KEY", "agents": ["weather"]}]}
    async with proxy_for({"auth": auth}) as proxy:
        proxy.upstream.script(say("Hi."))
        missing = await proxy.chat(model="weather")
        wrong = await proxy.client.post(
            "/v1/chat/completions",
            json={"model": "weather", "messages": USER},
            headers={"authorization": "Bearer sk-wrong"},
        )
        denied = await proxy.client.post(
            "/v1/chat/completions",
            json={"model": "scripted", "messages": USER},
            headers={"authorization": "Bearer sk-team"},
        )
        allowed = await proxy.client.post(
            "/v1/chat/completions",
            json={"model": "weather", "messages": USER},
            headers={"authorization": "Bearer sk-team"},
        )
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert missing.json()["error"]["type"] == "authentication_error"
    assert denied.status_code == 403
    assert allowed.status_code == 200
    assert proxy.upstream.authorizations == [None]  # the proxy key never goes upstream


async def test_keys_from_a_secrets_file_work_without_its_last_line_break(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes secret made from a file keeps the file's line break: no key has one."""
    monkeypatch.setenv("TEAM_KEY", "sk-team\n")
    monkeypatch.setenv("UP_KEY", " sk-upstream\r\n")
    auth = {"keys": [{"name": "team", "key_env": "TEAM_KEY"}]}
    upstreams = {"main": {"base_url": "http://upstream.test/v1", "api_key_env": "UP_KEY"}}
    async with proxy_for({"auth": auth, "upstreams": upstreams}) as proxy:
        proxy.upstream.script(say("Hi."))
        r = await proxy.client.post(
            "/v1/chat/completions",
            json={"model": "scripted", "messages": USER},
            headers={"authorization": "Bearer sk-team"},
        )
    assert r.status_code == 200
    assert proxy.upstream.authorizations == ["Bearer sk-upstream"]


async def test_upstream_key_comes_from_the_config(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UP_KEY", "sk-upstream")
    upstreams = {
        "main": {"base_url": "http://upstream.test/v1", "api_key_env": "UP_KEY"},
        "own": {"base_url": "http://upstream.test/v1", "forward_client_key": True},
    }
    models = {"via-own": {"upstream": "own", "model": "scripted"}}
    async with proxy_for({"upstreams": upstreams, "models": models}) as proxy:
        proxy.upstream.script(say("Hi."), say("Hi again."))
        headers = {"authorization": "Bearer sk-client"}
        body = {"model": "scripted", "messages": USER}
        await proxy.client.post("/v1/chat/completions", json=body, headers=headers)
        body["model"] = "via-own"
        await proxy.client.post("/v1/chat/completions", json=body, headers=headers)
    assert proxy.upstream.authorizations == ["Bearer sk-upstream", "Bearer sk-client"]


RETRIED = {"upstreams": {"main": {"base_url": "http://upstream.test/v1", "max_retries": 2}}}


def slow_down(status: int) -> Failure:
    return fail(status, "slow down", error_type="rate_limit", headers={"retry-after": "0"})


async def test_upstream_errors_are_relayed_after_retries(proxy_for: ProxyFactory) -> None:
    async with proxy_for(RETRIED) as proxy:
        proxy.upstream.script(slow_down(429), slow_down(429), slow_down(429))
        r = await proxy.chat(model="scripted")
    assert r.status_code == 429
    assert r.json()["error"]["message"] == "slow down"
    assert r.headers["x-loopwarden-stop-reason"] == "upstream_error"
    assert len(proxy.upstream.requests) == 3


RATE_LIMITED = {
    "retry-after": "7",
    "retry-after-ms": "6500",
    "x-ratelimit-remaining-requests": "0",
    "x-ratelimit-reset-requests": "6.5s",
}
NOT_RETRIED = {"upstreams": {"main": {"base_url": "http://upstream.test/v1", "max_retries": 0}}}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/chat/completions", {"messages": USER, "stream": True}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/responses", {"input": "hi", "stream": True}),
    ],
)
async def test_an_upstream_refusal_keeps_the_headers_a_clients_retry_reads(
    proxy_for: ProxyFactory, path: str, body: dict[str, Any]
) -> None:
    """The OpenAI SDKs wait as `retry-after-ms`/`retry-after` say before they try again."""
    headers = {**RATE_LIMITED, "set-cookie": "upstream=1", "x-request-id": "req_up"}
    async with proxy_for(NOT_RETRIED) as proxy:
        proxy.upstream.script(fail(429, "slow down", error_type="rate_limit", headers=headers))
        r = await proxy.client.post(path, json={"model": "scripted", **body})
    assert r.status_code == 429
    assert {name: r.headers.get(name) for name in RATE_LIMITED} == RATE_LIMITED
    assert "set-cookie" not in r.headers
    assert r.headers["x-loopwarden-stop-reason"] == "upstream_error"


async def test_a_refusal_after_a_tool_ran_says_not_to_retry_and_when_to_nothing(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(NOT_RETRIED) as proxy:
        proxy.upstream.script(
            call("get_weather", city="Paris"),
            fail(429, "slow down", error_type="rate_limit", headers=RATE_LIMITED),
        )
        r = await proxy.chat(model="weather")
    assert (r.status_code, r.headers["x-should-retry"]) == (502, "false")
    assert not RATE_LIMITED.keys() & r.headers.keys()


async def test_a_client_error_is_not_retried(proxy_for: ProxyFactory) -> None:
    async with proxy_for(RETRIED) as proxy:
        proxy.upstream.script(slow_down(400), say("A retry would have got this."))
        r = await proxy.chat(model="scripted")
    assert (r.status_code, len(proxy.upstream.requests)) == (400, 1)


async def test_unreachable_upstream_is_a_502(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The client reads the failure's name; the operator's log what it said, at most a line a
    second with a count of the rest (nothing was logged)."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused: no one listens", request=request)

    async with proxy_for(handler=refuse) as proxy:
        r = await proxy.chat(model="scripted")
        for _ in range(20):
            await proxy.chat(model="scripted")
    told = [m.getMessage() for m in caplog.records if m.name == "proxy.upstream.client"]
    assert told[0] == "upstream main failed: ConnectError: refused: no one listens"
    assert len(told) < 10  # 21 requests, each tried 3 times
    assert r.status_code == 502
    assert r.json()["error"] == {
        "message": "upstream main unreachable: ConnectError",
        "type": "server_error",
        "param": None,
        "code": "upstream_unavailable",
    }


async def test_upstream_timeout_is_a_504(proxy_for: ProxyFactory) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    async with proxy_for(handler=slow) as proxy:
        r = await proxy.chat(model="scripted")
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"


async def test_errors_after_a_tool_ran_say_do_not_retry(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    proxy.upstream.script(call("get_weather", city="Oslo"), fail(500, "boom"))
    with caplog.at_level(logging.WARNING, logger="proxy.upstream.client"):
        r = await proxy.chat(model="weather", messages=USER)
    assert "upstream main answered HTTP 500" in caplog.messages
    assert r.status_code == 502
    assert r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "upstream_error"
    assert r.json()["loop"]["tool_calls"] == 1


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 255, 600])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_body_nested_deeper_than_can_be_sent_on_is_a_400(
    proxy: Proxy, depth: int, stream: bool
) -> None:
    """orjson reads 1,024 levels but writes 254: such a body failed every run with a 500."""
    deep = '{"a":' * depth + "1" + "}" * depth  # in the body: a level more
    body = '{"model": "weather", "stream": %s, "messages": [{"role": "user", "content": "x"}], '
    body = body % ("true" if stream else "false") + '"metadata": ' + deep + "}"
    r = await proxy.client.post("/v1/chat/completions", content=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"the body nests deeper than {MAX_JSON_DEPTH} levels"
    assert proxy.upstream.requests == []


# Responses bodies whose deepest part the proxy writes deeper than it came: a function tool's
# `parameters` (under `function` for the upstream), echoed settings (in stream events and the
# stored record). "@" is where the nesting goes.
DEEPENED = [
    {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "x": "@"}}]},
    {"tools": [{"type": "web_search", "x": "@"}], "stream": True},
    {"reasoning": {"x": "@"}, "stream": True},
    {"reasoning": {"x": "@"}},
    {"text": {"format": {"type": "json_schema", "name": "s", "schema": {"x": "@"}}}},
    {"tool_choice": {"type": "web_search", "x": "@"}},
]


def nested_to(template: dict[str, Any], depth: int) -> bytes:
    """`template` as a body nested `depth` levels deep in all, the nesting where "@" is."""
    raw = orjson.dumps({"model": "scripted", "input": "hi", **template}).decode()
    around = raw.count("{") + raw.count("[")  # each bracket of the template holds the "@"
    inside = depth - around
    return raw.replace('"@"', "[" * inside + "]" * inside).encode()


@pytest.mark.parametrize("template", DEEPENED)
async def test_a_body_as_deep_as_the_proxy_takes_is_written_wherever_it_goes(
    proxy: Proxy, template: dict[str, Any]
) -> None:
    """At the bound it answers whole, streamed to its end and stored; a level more is a 400
    (there was no room for the levels the proxy adds: a 500, or a stream cut off, after the
    upstream was paid)."""
    proxy.upstream.script(keep(say("Fine.")))
    at = await proxy.client.post("/v1/responses", content=nested_to(template, MAX_JSON_DEPTH))
    over = await proxy.client.post("/v1/responses", content=nested_to(template, MAX_JSON_DEPTH + 1))
    assert at.status_code == 200, at.text
    if template.get("stream"):
        assert '"type":"response.completed"' in at.text
    else:
        stored = await proxy.client.get(f"/v1/responses/{at.json()['id']}")
        assert stored.json() == at.json()
    assert over.status_code == 400
    assert over.json()["error"]["message"] == f"the body nests deeper than {MAX_JSON_DEPTH} levels"
    assert len(proxy.upstream.requests) == 1


async def test_the_process_survives_garbage(proxy: Proxy) -> None:
    for content in (b"", b"null", b"[]", b'{"model": 1}', b"\xff\xfe"):
        r = await proxy.client.post("/v1/chat/completions", content=content)
        assert r.status_code == 400
    proxy.upstream.script(say("Still here."))
    assert (await proxy.chat(model="scripted")).status_code == 200


@pytest.mark.parametrize(
    "path", ["/v1/runs/{}", "/v1/contexts/{}", "/nothing/{}", "/v1/responses/{}"]
)
async def test_a_long_id_is_not_echoed_whole_in_a_404(proxy_for: ProxyFactory, path: str) -> None:
    """An id of 60 KB (within the request head's bound) is named by its first characters."""
    async with proxy_for() as proxy:
        r = await proxy.client.get(path.format("r" * 60_000))
    assert r.status_code == 404
    assert r.json()["error"]["message"].count("r") < 400
    assert len(r.content) < 1_000


@pytest.mark.parametrize(("method", "path"), [("PUT", "/responses/{}"), ("POST", "/models/{}")])
async def test_a_long_path_is_not_echoed_whole_in_a_405(
    proxy_for: ProxyFactory, method: str, path: str
) -> None:
    async with proxy_for() as proxy:
        r = await proxy.client.request(method, path.format("r" * 60_000))
    assert r.status_code == 405
    assert len(r.content) < 1_000


def refuse(param: str) -> Failure:
    """An upstream's 400 about a part of the request it was sent, as OpenAI words it."""
    return fail(
        400, f"Invalid '{param}': bad value.", error_type="invalid_request_error", param=param
    )


CLIENT_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
PROMPTED = {
    "upstreams": NOT_RETRIED["upstreams"],
    "agents": {
        "clerk": {"model": "scripted", "tools": ["get_weather"], "system_prompt": "Be brief."}
    },
}


@pytest.mark.parametrize(
    ("sent", "named"),
    [
        ("messages[2].content[0].image_url", "messages[1].content[0].image_url"),
        ("messages.[1]", "messages.[0]"),  # another upstream's way of writing it
        ("messages[0].content", None),  # the agent's system prompt: not the client's
        ("messages[9]", None),  # no such message was sent
        ("tools[1].function.parameters", "tools[0].function.parameters"),
        ("tools[0].function.name", None),  # the server's own tool
        ("temperature", "temperature"),  # a field sent as the client sent it
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_s_refusal_names_the_part_of_the_client_s_own_request(
    proxy_for: ProxyFactory, sent: str, named: str | None, stream: bool
) -> None:
    """The agent's system prompt comes first upstream, and its server tools before the
    client's: the index the upstream names is the client's, or none."""
    async with proxy_for(PROMPTED) as proxy:
        proxy.upstream.script(refuse(sent))
        client = AsyncOpenAI(
            base_url="http://proxy.test/v1", api_key="sk", http_client=proxy.client, max_retries=0
        )
        messages: Any = [
            {"role": "user", "content": "Look."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        ]
        with pytest.raises(BadRequestError) as refused:
            await client.chat.completions.create(
                model="clerk",
                messages=messages,
                tools=[CLIENT_TOOL],
                temperature=0.5,
                stream=stream,
            )
    assert refused.value.param == named
    sent_request = proxy.upstream.bodies[0]
    assert sent_request["messages"][1:] == messages  # the system prompt came first
    assert [t["function"]["name"] for t in sent_request["tools"]] == ["get_weather", "lookup"]
    said = f"{sent} (of the request sent upstream)" if named is None else named
    if named != sent:  # the message names it so too
        assert refused.value.message == f"Error code: 400 - Invalid '{said}': bad value."


async def test_a_responses_refusal_names_no_message_and_the_client_s_tool_as_it_named_it(
    proxy_for: ProxyFactory,
) -> None:
    """A Responses request sent no `messages`; its tools are named in its own layout."""
    async with proxy_for(PROMPTED) as proxy:
        proxy.upstream.script(refuse("tools[2].function.parameters"), refuse("messages[1].content"))
        client = AsyncOpenAI(
            base_url="http://proxy.test/v1", api_key="sk", http_client=proxy.client, max_retries=0
        )
        tools: Any = [
            {"type": "web_search"},  # a hosted tool, left out
            {"type": "function", "name": "lookup", "parameters": {}},
            {"type": "function", "name": "note", "parameters": {}},
        ]
        params = []
        for _ in range(2):
            with pytest.raises(BadRequestError) as refused:
                await client.responses.create(model="clerk", input="Look.", tools=tools)
            params.append(refused.value.param)
    assert params == ["tools[2].parameters", None]


async def test_a_null_functions_field_is_no_use_of_the_functions_api(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Oslo"), say("Mild."))
    r = await proxy.chat(model="weather", functions=None, function_call=None)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Mild."
    assert r.json()["loop"]["tool_calls"] == 1  # the loop ran the server tool
    assert [m["role"] for m in proxy.upstream.bodies[1]["messages"]][-2:] == ["assistant", "tool"]


async def test_the_functions_api_is_relayed_when_no_loop_runs(proxy: Proxy) -> None:
    """`functions` is refused only where the proxy would run the calls' loop."""
    proxy.upstream.script(say("Relayed."))
    functions = [{"name": "lookup", "parameters": {"type": "object"}}]
    r = await proxy.chat(model="scripted", functions=functions, function_call="auto")
    assert r.status_code == 200
    assert proxy.upstream.bodies[0]["functions"] == functions


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "x"),
        ("top_p", []),
        ("presence_penalty", True),
        ("seed", "x"),
        ("seed", 1.5),
        ("top_logprobs", "3"),
        ("logprobs", "x"),
        ("parallel_tool_calls", "x"),
        ("store", 1),
        ("user", 5),
        ("response_format", 5),
        ("metadata", 5),
        ("logit_bias", []),
        ("modalities", "text"),
        ("stop", 5),
        ("stop", ["a", 5]),
    ],
)
async def test_an_openai_field_of_the_wrong_type_is_a_400_not_forwarded(
    proxy: Proxy, field: str, value: Any
) -> None:
    """They went to the upstream as they came: a lenient one took them silently."""
    body = {"model": "scripted", "messages": USER, field: value}
    r = await proxy.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert proxy.upstream.requests == []


async def test_openai_fields_of_the_right_type_or_null_go_upstream(proxy: Proxy) -> None:
    proxy.upstream.script(say("ok"))
    fields = {"temperature": 0, "top_p": 0.5, "seed": 7, "stop": ["x"], "user": "u",
              "logit_bias": {"50256": -100}, "metadata": {"a": "b"}, "store": None}  # fmt: skip
    r = await proxy.client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": USER, **fields}
    )
    assert r.status_code == 200, r.text
    sent = proxy.upstream.bodies[0]
    assert {k: sent.get(k) for k in fields if k != "store"} == {
        k: v for k, v in fields.items() if k != "store"
    }


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "tool_call_id": "c" * 300, "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "tool", "tool_call_id": "c\u202e", "content": "x"}, "messages[0].tool_call_id"),
        (
            {"role": "assistant", "tool_calls": [
                {"id": "i" * 300, "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]},
            "messages[0].tool_calls[0].id",
        ),
        (
            {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f\u0000", "arguments": "{}"}}
            ]},
            "messages[0].tool_calls[0].function.name",
        ),
    ],
)  # fmt: skip
async def test_ids_and_names_of_earlier_calls_are_bounded_as_the_responses_api_s(
    proxy: Proxy, message: dict[str, Any], param: str
) -> None:
    body = {"model": "scripted", "messages": [message, *USER]}
    r = await proxy.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert proxy.upstream.requests == []
