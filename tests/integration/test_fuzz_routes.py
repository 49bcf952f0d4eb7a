"""Any body on any route gets a 2xx or an OpenAI-shaped 4xx: never a 5xx, never a dropped
connection (hypothesis, bounded by a fixed number of examples per route)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import keep, say

EXAMPLES = 150

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def near(*choices: Any) -> st.SearchStrategy[Any]:
    """One of `choices` (values the route understands) or any JSON value."""
    return st.sampled_from(choices) | json_values


messages = st.lists(
    st.fixed_dictionaries(
        {"role": near("user", "assistant", "system", "tool"), "content": near("hi", "")},
        optional={
            "tool_calls": json_values,
            "tool_call_id": json_values,
            "name": json_values,
        },
    )
    | json_values,
    max_size=3,
)
conditions = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "max_steps": json_values,
            "max_tokens_used": near(10, 0, -1),
            "max_cost": near(0.01, -1.0),
            "max_duration_s": near(1, 0),
            "step_count_is": near(1, 0),
            "has_tool_call": near("get_weather", ["x"]),
            "expr": near("size(steps) > 1", "usage.total_tokens > 10", "1 +", "x"),
            "any": json_values,
            "not": json_values,
        },
    )
    | json_values,
    max_size=3,
)
loops = st.fixed_dictionaries(
    {},
    optional={
        "agent": near("weather", "nope"),
        "tools": near(["get_weather"], ["nope"], []),
        "stop_when": conditions,
        "terminating_config": near({"tool_ids": ["get_weather"]}, {}),
        "tool_rules": near([{"type": "run_first", "tool_name": "get_weather"}], [{}]),
        "tool_call_limits": near([{"run_limit": 1}], [{"thread_limit": 1}]),
        "max_steps": near(1, 0, -1, 10**30),
        "final_answer": json_values,
        "thread_id": near("t-1", "", "a/b"),
        "parallel_tool_calls": json_values,
        "include_messages": json_values,
        "include_loop_events": json_values,
    },
)
chat_bodies = st.fixed_dictionaries(
    {"model": near("weather", "scripted", ""), "messages": messages},
    optional={
        "stream": json_values,
        "loop": loops | json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "stream_options": near({"include_usage": True}),
        "max_completion_tokens": near(5, 0, -1),
        "max_tokens": near(5, 0),
        "n": near(1, 2),
    },
)
context_bodies = st.fixed_dictionaries(
    {},
    optional={
        "context_id": near("c-1", "", "a/b"),
        "model": near("weather", "scripted"),
        "agent": near("weather"),
        "message": near("hi", {"role": "user", "content": "hi"}),
        "messages": messages,
        "content": near("hi"),
        "loop": loops | json_values,
    },
)
items = st.lists(
    st.fixed_dictionaries(
        {"type": near("message", "function_call", "function_call_output", "item_reference")},
        optional={
            "role": near("user", "assistant", "developer", "system"),
            "content": near(
                "hi", [{"type": "input_text", "text": "hi"}], [{"type": "input_image"}]
            ),
            "call_id": near("c1", ""),
            "name": near("get_weather", "f"),
            "arguments": near("{}", "{"),
            "output": near("ok", [{"type": "input_text", "text": "ok"}]),
            "id": near("msg_x", "fc_abc_0", "resp_x"),
        },
    )
    | json_values,
    max_size=3,
)
response_tools = st.lists(
    st.fixed_dictionaries(
        {"type": near("function", "custom", "namespace", "web_search")},
        optional={
            "name": near("f", "get_weather", ""),
            "parameters": json_values,
            "tools": json_values,
            "format": json_values,
        },
    )
    | json_values,
    max_size=3,
)
responses_bodies = st.fixed_dictionaries(
    {"model": near("weather", "scripted", ""), "input": near("hi") | items},
    optional={
        "stream": json_values,
        "store": json_values,
        "loop": loops | json_values,
        "tools": response_tools | json_values,
        "tool_choice": near("auto", {"type": "function", "name": "f"}, {"type": "allowed_tools"}),
        "instructions": near("Be brief."),
        "previous_response_id": near("resp_x", ""),
        "max_output_tokens": near(5, 0, -1),
        "max_tool_calls": near(1, 0),
        "text": near({"format": {"type": "json_schema", "name": "x"}}, {"verbosity": 1}),
        "reasoning": near({"effort": "low"}, {"summary": 1}),
        "metadata": near({"a": "b"}, {"a": 1}),
        "background": json_values,
        "conversation": json_values,
        "include": json_values,
    },
)
raw_bodies = st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode())

ROUTES: dict[str, st.SearchStrategy[Any]] = {
    "/v1/chat/completions": chat_bodies,
    "/chat/completions": chat_bodies,
    "/chat": context_bodies,
    "/chat/invoke": context_bodies,
    "/chat/add-ai-message": context_bodies,
    "/v1/responses": responses_bodies,
    "/responses": responses_bodies,
    "/v1/embeddings": json_values,  # relayed to the upstream
}


@pytest.fixture
def looping(proxy_for: ProxyFactory) -> Iterator[tuple[asyncio.AbstractEventLoop, Proxy]]:
    """A proxy whose upstream always answers, on an event loop of the test's own (hypothesis
    drives plain functions)."""
    loop = asyncio.new_event_loop()
    factory = proxy_for()
    proxy = loop.run_until_complete(factory.__aenter__())
    proxy.upstream.script(keep(say("ok")))
    try:
        yield loop, proxy
    finally:
        loop.run_until_complete(factory.__aexit__(None, None, None))
        loop.close()


def assert_answered(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str)
        assert error["message"]
        assert set(error) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_any_body_gets_a_2xx_or_an_openai_shaped_4xx(
    looping: tuple[asyncio.AbstractEventLoop, Proxy], path: str
) -> None:
    loop, proxy = looping

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        database=None,
    )
    @given(body=ROUTES[path] | raw_bodies)
    def check(body: Any) -> None:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        response = loop.run_until_complete(
            proxy.client.post(path, content=content, headers=headers)
        )
        assert_answered(response)

    check()


@pytest.mark.parametrize(
    ("method", "route"),
    [(m, r) for m in ("GET", "DELETE") for r in ("/v1/contexts/", "/v1/runs/", "/v1/responses/")]
    + [("GET", "/v1/models/")],
)
def test_any_id_in_a_path_gets_a_2xx_or_an_openai_shaped_4xx(
    looping: tuple[asyncio.AbstractEventLoop, Proxy], method: str, route: str
) -> None:
    loop, proxy = looping

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
        database=None,
    )
    @given(key=st.text(max_size=40))
    def check(key: str) -> None:
        url = httpx.URL("http://proxy.test" + route).copy_with(
            raw_path=(route + quote(key)).encode()
        )
        response = loop.run_until_complete(proxy.client.request(method, url))
        assert_answered(response)

    check()


def test_any_listing_of_input_items_gets_a_2xx_or_an_openai_shaped_4xx(
    looping: tuple[asyncio.AbstractEventLoop, Proxy],
) -> None:
    """Any id, and any query (`limit`, `order`, `after`, `include` and others, repeated, in any
    encoding) of a stored chain's listing."""
    loop, proxy = looping
    chain: list[str] = []
    for turn in range(3):
        body = {"model": "scripted", "input": [{"role": "user", "content": f"turn {turn}"}]}
        if chain:
            body["previous_response_id"] = chain[-1]
        chain.append(
            loop.run_until_complete(proxy.client.post("/v1/responses", json=body)).json()["id"]
        )
    names = st.sampled_from(["limit", "order", "after", "include", "include[]", "x"])
    values = st.text(max_size=12) | st.sampled_from(["0", "1", "100", "101", "asc", "desc"])

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
        database=None,
    )
    @given(
        key=st.sampled_from(chain) | st.text(max_size=40),
        query=st.lists(st.tuples(names, values), max_size=4),
    )
    def check(key: str, query: list[tuple[str, str]]) -> None:
        raw = "&".join(f"{quote(name)}={quote(value)}" for name, value in query)
        path = f"/v1/responses/{quote(key, safe='')}/input_items"
        url = httpx.URL("http://proxy.test").copy_with(raw_path=f"{path}?{raw}".encode())
        response = loop.run_until_complete(proxy.client.get(url))
        assert_answered(response)
        if response.status_code == 200:
            page = response.json()
            ids = [item["id"] for item in page["data"]]
            assert len(ids) == len(set(ids))
            assert (page["first_id"], page["last_id"]) == (
                (ids[0], ids[-1]) if ids else (None, None)
            )

    check()
