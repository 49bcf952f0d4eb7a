"""The real `openai` SDK against the proxy under uvicorn (sync, async, streaming)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.bodies import loop_of
from tests.e2e.conftest import ToolServer
from tests.e2e.structured import BOLTS, Stock, looked_then_answered
from tests.scripted_upstream import ScriptedUpstream, call, keep, say, say_tool_result

pytestmark = pytest.mark.e2e


@pytest.fixture
def client(proxy_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=proxy_url, api_key="client-key-not-forwarded", max_retries=0) as c:
        yield c


def test_sync_client_runs_an_http_tool_loop(
    client: OpenAI, upstream: ScriptedUpstream, tool_server: tuple[str, ToolServer]
) -> None:
    upstream.script(call("check_inventory", item="bolts"), say_tool_result("In stock: {}"))
    raw = client.chat.completions.with_raw_response.create(
        model="stock", messages=[{"role": "user", "content": "Bolts?"}]
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == 'In stock: {"item":"bolts","in_stock":7}'
    loop = loop_of(reply)
    assert loop["stop_reason"] == "completed"
    assert (loop["steps"], loop["tool_calls"]) == (2, 1)
    assert raw.headers["x-loopwarden-stop-reason"] == "completed"
    assert reply.usage is not None
    assert reply.usage.total_tokens > 0
    _, server = tool_server
    assert server.calls[-1]["run_id"] == loop["run_id"]


async def test_async_client_terminal_tool(proxy_url: str, upstream: ScriptedUpstream) -> None:
    upstream.script(
        call("get_weather", city="Lima"), call("final_answer", answer="23 °C and clear in Lima.")
    )
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        reply = await client.chat.completions.create(
            model="reporter", messages=[{"role": "user", "content": "Lima?"}]
        )
    assert reply.choices[0].message.content == "23 °C and clear in Lima."
    assert reply.choices[0].finish_reason == "stop"
    assert loop_of(reply)["stop_reason"] == "terminal_tool"


async def test_async_streaming_with_usage(proxy_url: str, upstream: ScriptedUpstream) -> None:
    upstream.script(call("check_inventory", item="nuts"), say_tool_result("In stock: {}"))
    text, finish, loop, usage = "", None, None, None
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        stream = await client.chat.completions.create(
            model="stock",
            messages=[{"role": "user", "content": "Nuts?"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                assert not chunk.choices[0].delta.tool_calls
                finish = chunk.choices[0].finish_reason or finish
                loop = (chunk.model_extra or {}).get("loop", loop)
            if chunk.usage:
                usage = chunk.usage
    assert text == 'In stock: {"item":"nuts","in_stock":7}'
    assert finish == "stop"
    assert loop is not None
    assert loop["stop_reason"] == "completed"
    assert usage is not None
    assert usage.total_tokens > 0


def test_sync_streaming_client_tool_call_then_result(
    client: OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.script(
        call("check_inventory", item="screws"),
        call("ask_user", question="Order more screws?"),
        say_tool_result("The user says: {}"),
    )
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "ask_user",
                "parameters": {"type": "object", "properties": {"question": {"type": "string"}}},
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": "Screws?"}]
    stream = client.chat.completions.create(
        model="stock", messages=messages, tools=tools, stream=True
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += delta.id or ""
            slot["name"] += (delta.function.name or "") if delta.function else ""
            slot["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["ask_user"]
    asked = calls[0]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": asked["id"],
                    "type": "function",
                    "function": {"name": "ask_user", "arguments": asked["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": asked["id"], "content": "yes please"},
    ]
    reply = client.chat.completions.create(model="stock", messages=messages, tools=tools)
    assert json.loads(asked["arguments"]) == {"question": "Order more screws?"}
    assert reply.choices[0].message.content == "The user says: yes please"


def test_budget_stop_through_the_sdk(client: OpenAI, upstream: ScriptedUpstream) -> None:
    upstream.script(keep(call("search_notes", query="Lima")))
    reply = client.chat.completions.create(
        model="researcher", messages=[{"role": "user", "content": "Research Lima."}]
    )
    loop = loop_of(reply)
    assert loop["stop_reason"] == "token_budget"
    assert reply.usage is not None
    assert reply.usage.total_tokens <= 1500
    assert reply.choices[0].finish_reason == "length"


SERVED = {"model": "scripted-2026-01-01", "system_fingerprint": "fp_3f2a", "service_tier": "flex"}


@pytest.mark.parametrize("model", ["scripted", "stock"])  # a pass-through; a run of server tools
def test_a_stream_names_what_served_it_as_the_json_reply_does(
    client: OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.served = dict(SERVED)
    if model == "scripted":
        upstream.script(say("Hello there, how are you?"), say("Hello."))
    else:
        turns = (call("check_inventory", item="nuts"), say_tool_result("In stock: {}"))
        upstream.script(*turns, *turns)
    messages: Any = [{"role": "user", "content": "Hi."}]
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len(chunks) >= 3  # the text (in as many as its reads), the finish, the usage
    for chunk in chunks:
        assert (chunk.model, chunk.system_fingerprint, chunk.service_tier) == tuple(SERVED.values())
    reply = client.chat.completions.create(model=model, messages=messages)
    assert (reply.model, reply.system_fingerprint, reply.service_tier) == tuple(SERVED.values())


def test_a_stream_leaves_out_what_an_upstream_names_at_length(
    client: OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.served = {"model": "m" * 257, "service_tier": "default"}
    upstream.script(say("Hello there."))
    messages: Any = [{"role": "user", "content": "Hi."}]
    chunks = list(client.chat.completions.create(model="scripted", messages=messages, stream=True))
    assert {(c.model, c.system_fingerprint, c.service_tier) for c in chunks} == {
        ("scripted", None, "default")
    }


def test_sdk_sees_openai_errors(client: OpenAI, upstream: ScriptedUpstream) -> None:
    upstream.script(say("Hi."))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="stock",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"loop": {"stop_when": [{"max_cost": -1}]}},
        )
    assert err.value.param == "loop.stop_when[0].max_cost"
    with pytest.raises(openai.UnprocessableEntityError) as failed:
        client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={
                "loop": {
                    "tools": ["final_answer"],
                    "terminating_config": {"tool_ids": ["final_answer"], "consecutive_nudges": 0},
                }
            },
        )
    assert failed.value.code == "max_consecutive_nudges_exceeded"
    assert json.loads(failed.value.response.text)["loop"]["stop_reason"] == "nudges_exhausted"


def test_sdk_sees_a_body_of_too_many_values_refused(client: OpenAI) -> None:
    """A field of 100,001 numbers (its opener and 100,000 commas): over the default
    `max_body_values`, refused before the body is parsed."""
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(
            model="stock",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"padding": [0] * 100_001},
        )
    assert err.value.status_code == 413
    assert err.value.code == "request_too_large"
    assert "more than 100000 JSON values (server.max_body_values)" in err.value.message


def test_models_list(client: OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[:3] == ["stock", "reporter", "researcher"]
    assert "scripted" in ids


def test_models_retrieve(client: OpenAI) -> None:
    """One model as the list shows it; an unknown one is the SDK's NotFoundError."""
    agent = client.models.retrieve("stock")
    assert (agent.id, agent.owned_by) == ("stock", "loopwarden")
    assert client.models.retrieve("scripted").id == "scripted"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"


def test_structured_output_parses_when_a_tool_step_said_something_first(
    client: OpenAI, upstream: ScriptedUpstream
) -> None:
    """A step's text beside its server calls is not the answer: with a JSON format, the reply
    is the last step's JSON alone, whole and streamed."""
    upstream.script(*looked_then_answered(), *looked_then_answered())
    messages: Any = [{"role": "user", "content": "Bolts?"}]
    reply = client.chat.completions.parse(model="stock", messages=messages, response_format=Stock)
    assert reply.choices[0].message.parsed == BOLTS
    with client.chat.completions.stream(
        model="stock", messages=messages, response_format=Stock
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == BOLTS
    assert final.choices[0].message.content == reply.choices[0].message.content
