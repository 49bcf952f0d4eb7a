"""The real `openai` SDK's Responses API against the proxy under uvicorn: sync, async,
`stream=True` and the `responses.stream()` helper (SPEC §12)."""

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
from tests.scripted_upstream import Call, Reply, ScriptedUpstream, call, say, say_tool_result

pytestmark = pytest.mark.e2e

LOOKUP = {
    "type": "function",
    "name": "lookup_order",
    "description": "Find an order.",
    "parameters": {
        "type": "object",
        "properties": {"order": {"type": "string"}},
        "required": ["order"],
    },
}


@pytest.fixture
def client(proxy_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=proxy_url, api_key="client-key-not-forwarded", max_retries=0) as c:
        yield c


def types(response: Any) -> list[str]:
    return [item.type for item in response.output]


def test_sync_create_runs_the_server_tool_loop(
    client: OpenAI, upstream: ScriptedUpstream, tool_server: tuple[str, ToolServer]
) -> None:
    upstream.script(call("check_inventory", item="bolts"), say_tool_result("In stock: {}"))
    raw = client.responses.with_raw_response.create(model="stock", input="Bolts?")
    response = raw.parse()
    assert response.output_text == 'In stock: {"item":"bolts","in_stock":7}'
    assert types(response) == ["mcp_call", "message"]
    mcp = response.output[0]
    assert mcp.type == "mcp_call"
    assert (mcp.name, mcp.server_label) == ("check_inventory", "loopwarden")
    assert json.loads(mcp.arguments) == {"item": "bolts"}
    assert response.status == "completed"
    assert response.usage is not None
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    loop = loop_of(response)
    assert (loop["stop_reason"], loop["steps"], loop["tool_calls"]) == ("completed", 2, 1)
    assert raw.headers["x-loopwarden-stop-reason"] == "completed"
    _, server = tool_server
    assert server.calls[-1]["run_id"] == loop["run_id"]
    again = client.responses.retrieve(response.id)
    assert again.output_text == response.output_text
    with pytest.raises(openai.BadRequestError) as refused:  # (it iterated no event)
        client.responses.retrieve(response.id, stream=True)
    assert refused.value.param == "stream"
    run = client.get(f"/runs/{response.id}", cast_to=object)
    assert isinstance(run, dict)
    assert run["stop_reason"] == "completed"


def test_sync_client_tools_with_previous_response_id(
    client: OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.script(call("lookup_order", order="A-1"), say_tool_result("Order: {}"))
    first = client.responses.create(model="scripted", input="Where is A-1?", tools=[LOOKUP])  # type: ignore[list-item]
    [fc] = first.output
    assert fc.type == "function_call"
    assert json.loads(fc.arguments) == {"order": "A-1"}
    second = client.responses.create(
        model="scripted",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "shipped"}],
        tools=[LOOKUP],  # type: ignore[list-item]
    )
    assert second.output_text == "Order: shipped"
    # The items used to generate it, page by page as the SDK follows them (1 per page).
    listed = list(client.responses.input_items.list(second.id, limit=1, order="asc"))
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].id == fc.id
    assert listed[2].call_id == fc.call_id  # type: ignore[union-attr]
    newest = client.responses.input_items.list(second.id)
    assert [item.id for item in newest.data] == [item.id for item in reversed(listed)]
    assert newest.has_more is False
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


async def test_async_create_with_a_terminal_tool(
    proxy_url: str, upstream: ScriptedUpstream
) -> None:
    upstream.script(
        call("get_weather", city="Lima"), call("final_answer", answer="23 °C and clear in Lima.")
    )
    async with AsyncOpenAI(base_url=proxy_url, api_key="x", max_retries=0) as client:
        response = await client.responses.create(model="reporter", input="Lima?", store=False)
    assert response.output_text == "23 °C and clear in Lima."
    assert types(response) == ["mcp_call", "mcp_call", "message"]
    assert loop_of(response)["stop_reason"] == "terminal_tool"


async def test_async_stream_true(proxy_url: str, upstream: ScriptedUpstream) -> None:
    upstream.script(call("check_inventory", item="nuts"), say_tool_result("In stock: {}"))
    async with AsyncOpenAI(base_url=proxy_url, api_key="x", max_retries=0) as client:
        stream = await client.responses.create(model="stock", input="Nuts?", stream=True)
        seen: list[str] = []
        text = ""
        final = None
        async for event in stream:
            seen.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                final = event.response
    assert seen[0] == "response.created"
    assert "response.mcp_call.completed" in seen
    assert text == 'In stock: {"item":"nuts","in_stock":7}'
    assert final is not None
    assert final.output_text == text
    assert loop_of(final)["stop_reason"] == "completed"


def test_the_stream_helper(client: OpenAI, upstream: ScriptedUpstream) -> None:
    upstream.script(call("lookup_order", order="B-2"))
    with client.responses.stream(model="scripted", input="B-2?", tools=[LOOKUP]) as stream:  # type: ignore[list-item]
        arguments = ""
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments = event.snapshot
        final = stream.get_final_response()
    assert json.loads(arguments) == {"order": "B-2"}
    [fc] = final.output
    assert fc.type == "function_call"
    assert fc.name == "lookup_order"


def test_the_stream_helper_with_server_tools(client: OpenAI, upstream: ScriptedUpstream) -> None:
    upstream.script(call("check_inventory", item="gears"), say_tool_result("Gears: {}"))
    with client.responses.stream(model="stock", input="Gears?") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(texts)
    assert types(final) == ["mcp_call", "message"]


def test_a_loop_failure_raises_with_the_loop_report(
    client: OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.script(say("Hi."))
    loop = {
        "tools": ["final_answer"],
        "terminating_config": {"tool_ids": ["final_answer"], "consecutive_nudges": 0},
    }
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.responses.create(model="scripted", input="hi", extra_body={"loop": loop})
    assert caught.value.code == "max_consecutive_nudges_exceeded"


def test_a_failure_in_a_stream_raises(client: OpenAI, upstream: ScriptedUpstream) -> None:
    upstream.script(say("Hi."))
    loop = {
        "tools": ["final_answer"],
        "terminating_config": {"tool_ids": ["final_answer"], "consecutive_nudges": 0},
    }
    with client.responses.stream(model="scripted", input="hi", extra_body={"loop": loop}) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.failed"


def test_structured_output_parses_when_a_tool_step_said_something_first(
    client: OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.script(*looked_then_answered(), *looked_then_answered())
    response = client.responses.parse(model="stock", input="Bolts?", text_format=Stock)
    assert response.output_parsed == BOLTS
    assert types(response) == ["mcp_call", "message"]
    with client.responses.stream(model="stock", input="Bolts?", text_format=Stock) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == BOLTS
    assert types(final) == ["mcp_call", "message"]


def test_a_refusal_is_a_message_of_its_own_in_json_and_in_streams(
    client: OpenAI, upstream: ScriptedUpstream
) -> None:
    """The model's refusal came to nothing: `completed`, an empty `output`."""
    refused = say("").replace(content=None, refusal="I can't help with that.")
    upstream.script(refused, refused)
    response = client.responses.create(model="scripted", input="Help?")
    assert response.status == "completed"
    (message,) = response.output
    assert message.type == "message"
    assert [(part.type, getattr(part, "refusal", None)) for part in message.content] == [
        ("refusal", "I can't help with that.")
    ]
    with client.responses.stream(model="scripted", input="Help?") as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[-7:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output[0].model_dump() == message.model_dump() | {"id": final.output[0].id}
    kept = client.responses.retrieve(final.id)
    assert [item.model_dump() for item in kept.output] == [final.output[0].model_dump()]


ASK = {
    "type": "function",
    "name": "ask_user",
    "description": "Ask the user.",
    "parameters": {
        "type": "object",
        "properties": {"question": {"type": "string"}},
        "required": ["question"],
    },
}


def history_problems(messages: list[dict[str, Any]]) -> list[str]:
    """What OpenAI refuses in a Chat Completions history (a message other than a tool result
    between calls and their results, a result of no call), or what makes the model read a
    call or a text twice."""
    problems, pending, seen = [], set(), set()
    for message in messages:
        if message["role"] == "tool":
            if message["tool_call_id"] not in pending:
                problems.append(f"a result of no call: {message['tool_call_id']}")
            pending.discard(message["tool_call_id"])
            continue
        if pending:
            problems.append(f"a {message['role']} message before the results of {pending}")
        calls = message.get("tool_calls") or []
        pending = {c["id"] for c in calls}
        said = [(message["role"], (message.get("content") or "").strip())]
        for key in [(c["function"]["name"], c["function"]["arguments"]) for c in calls] + said:
            if key in seen and key[1]:
                problems.append(f"twice: {key}")
            seen.add(key)
    return problems


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("layout", ["whole", "without mcp_call"])
def test_a_history_sent_back_whole_without_storing_reaches_the_model_once_and_valid(
    client: OpenAI,
    upstream: ScriptedUpstream,
    tool_server: tuple[str, ToolServer],
    stream: bool,
    layout: str,
) -> None:
    """`store=False` and the SDK's `input += response.output` (as the Agents SDK and Codex
    do): a server call, then a client call, each after a text. Sent back whole, the JSON
    layout put its text between the calls and their results (OpenAI: 400), the stream's had
    the server call twice; without the `mcp_call` items (Codex) the first text was twice."""
    upstream.script(
        Reply(content="Checking.", calls=(Call("check_inventory", {"item": "bolts"}),)),
        Reply(content="Asking.", calls=(Call("ask_user", {"question": "ok?"}),)),
        say_tool_result("Answer: {}"),
    )
    history: list[Any] = [{"role": "user", "content": "How many bolts?"}]
    if stream:
        with client.responses.stream(
            model="stock",
            input=history,
            tools=[ASK],
            store=False,  # type: ignore[list-item]
        ) as events:
            first = events.get_final_response()
    else:
        first = client.responses.create(model="stock", input=history, tools=[ASK], store=False)  # type: ignore[list-item]
    output = [o for o in first.output if layout == "whole" or o.type != "mcp_call"]
    history += [o.model_dump(exclude_none=True) for o in output]
    asked = [o.call_id for o in first.output if o.type == "function_call"]
    history += [{"type": "function_call_output", "call_id": c, "output": "yes"} for c in asked]
    second = client.responses.create(model="stock", input=history, tools=[ASK], store=False)  # type: ignore[list-item]
    assert second.output_text == "Answer: yes"
    messages = upstream.bodies[-1]["messages"]
    assert history_problems(messages) == []
    said = [m.get("content") for m in messages if m["role"] == "assistant"]
    assert any("Checking." in (s or "") for s in said)  # each step's text reaches it once
    assert any("Asking." in (s or "") for s in said)
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results == ['{"item":"bolts","in_stock":7}', "yes"]  # each call's result, once
