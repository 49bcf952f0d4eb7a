"""The real `openai` SDK against the proxy under uvicorn (sync, async, streaming)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import ToolServer

pytestmark = pytest.mark.e2e


@pytest.fixture
def client(proxy_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=proxy_url, api_key="client-key-not-forwarded", max_retries=0) as c:
        yield c


def loop_of(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    return dict(extra["loop"])


def test_sync_client_runs_an_http_tool_loop(
    client: OpenAI, tool_server: tuple[str, ToolServer]
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="stock",
        messages=[{"role": "user", "content": "check_inventory for bolts"}],
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == (
        'Here is what I found: {"item":"check_inventory for bolts","in_stock":7}'
    )
    loop = loop_of(reply)
    assert loop["stop_reason"] == "completed"
    assert (loop["steps"], loop["tool_calls"]) == (2, 1)
    assert raw.headers["x-loopwarden-stop-reason"] == "completed"
    assert reply.usage is not None
    assert reply.usage.total_tokens > 0
    _, server = tool_server
    assert server.calls[-1]["run_id"] == loop["run_id"]


async def test_async_client_terminal_tool(proxy_url: str) -> None:
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        reply = await client.chat.completions.create(
            model="reporter",
            messages=[{"role": "user", "content": "get_weather in Lima then final_answer"}],
        )
    assert reply.choices[0].message.content == (
        'Here is what I found: {"city":"Lima","celsius":23.0,"sky":"clear"}'
    )
    assert reply.choices[0].finish_reason == "stop"
    assert loop_of(reply)["stop_reason"] == "terminal_tool"


async def test_async_streaming_with_usage(proxy_url: str) -> None:
    text, finish, loop, usage = "", None, None, None
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        stream = await client.chat.completions.create(
            model="stock",
            messages=[{"role": "user", "content": "check_inventory for nuts"}],
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
    assert text == 'Here is what I found: {"item":"check_inventory for nuts","in_stock":7}'
    assert finish == "stop"
    assert loop is not None
    assert loop["stop_reason"] == "completed"
    assert usage is not None
    assert usage.total_tokens > 0


def test_sync_streaming_client_tool_call_then_result(client: OpenAI) -> None:
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "ask_user",
                "parameters": {"type": "object", "properties": {"question": {"type": "string"}}},
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": "check_inventory of screws, then ask_user"}]
    stream = client.chat.completions.create(
        model="stock", messages=messages, tools=tools, stream=True
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += call.id or ""
            slot["name"] += (call.function.name or "") if call.function else ""
            slot["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["ask_user"]
    call = calls[0]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "ask_user", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "yes please"},
    ]
    messages[0] = {"role": "user", "content": "now ask_user"}
    reply = client.chat.completions.create(model="stock", messages=messages, tools=tools)
    assert reply.choices[0].message.content == "Here is what I found: yes please"


def test_budget_stop_through_the_sdk(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model="researcher",
        messages=[{"role": "user", "content": "keep calling search_notes"}],
    )
    loop = loop_of(reply)
    assert loop["stop_reason"] == "token_budget"
    assert reply.usage is not None
    assert reply.usage.total_tokens <= 1500
    assert reply.choices[0].finish_reason == "length"


def test_sdk_sees_openai_errors(client: OpenAI) -> None:
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


def test_models_list(client: OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[:3] == ["stock", "reporter", "researcher"]
    assert "scripted" in ids
