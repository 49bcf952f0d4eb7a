"""The OpenAI Agents SDK with its default model (`OpenAIResponsesModel`, the Responses API) and
its default client pointed at the proxy: `Runner.run` and `Runner.run_streamed`, agents with
server tools and a client function tool. The SDK shows each server call as a `ToolCallItem` of
an `McpCall`, does not run it, and sends it back in the `input` of its next request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from agents import (
    Agent,
    FunctionTool,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from openai.types.responses.response_output_item import McpCall

from tests.bodies import tool_results
from tests.e2e.conftest import ToolServer
from tests.scripted_upstream import ScriptedUpstream, call, say, say_tool_result

pytestmark = pytest.mark.e2e

STOCK = '{"item":"washers","in_stock":7}'  # what the tool server answers check_inventory


@pytest.fixture(autouse=True)
async def default_client(proxy_url: str) -> AsyncIterator[AsyncOpenAI]:
    """The SDK's default client, at the proxy, as a user sets it up."""
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=proxy_url, api_key="sk-e2e")
    set_default_openai_client(client, use_for_tracing=False)
    yield client
    await client.close()


@pytest.fixture
def inventory(tool_server: tuple[str, ToolServer]) -> ToolServer:
    """The tool server behind `check_inventory`, with no calls recorded."""
    _, server = tool_server
    server.calls.clear()
    return server


def ask_user_tool(asked: list[str]) -> FunctionTool:
    @function_tool
    def ask_user(question: str) -> str:
        """Ask the user a question."""
        asked.append(question)
        return "the user approves"

    return ask_user


def raw_items(result: RunResult | RunResultStreaming) -> list[tuple[str, str]]:
    """(item type, raw item type) of the run's new items."""
    found: list[tuple[str, str]] = []
    for item in result.new_items:
        raw: Any = item.raw_item
        found.append((item.type, raw["type"] if isinstance(raw, dict) else raw.type))
    return found


def mcp_calls(result: RunResult | RunResultStreaming) -> list[McpCall]:
    return [item.raw_item for item in result.new_items if isinstance(item.raw_item, McpCall)]


CLIENT_TOOL_ITEMS = [
    ("tool_call_item", "mcp_call"),
    ("tool_call_item", "function_call"),
    ("tool_call_output_item", "function_call_output"),
    ("message_output_item", "message"),
]


async def test_runner_run_with_server_tools_and_a_client_function_tool(
    upstream: ScriptedUpstream, inventory: ToolServer
) -> None:
    """The server call comes back as an `mcp_call` next to the client's `function_call`; the SDK
    runs only its own tool, then sends the `mcp_call` back in its next `input`: the model sees
    each result once and the server tool does not run again. A later turn, built from
    `to_input_list()`, sends it back once more."""
    upstream.script(
        call("check_inventory", item="washers"),
        call("ask_user", question="Order more washers?"),
        say_tool_result("The user says: {}"),
        say("Ordered."),
    )
    asked: list[str] = []
    agent = Agent(
        name="clerk", instructions="Be brief.", model="stock", tools=[ask_user_tool(asked)]
    )
    result = await Runner.run(agent, "Washers?")
    assert asked == ["Order more washers?"]
    assert result.final_output == "The user says: the user approves"
    assert raw_items(result) == CLIENT_TOOL_ITEMS
    [server_call] = mcp_calls(result)
    assert (server_call.name, server_call.server_label) == ("check_inventory", "loopwarden")
    assert (server_call.output, server_call.error) == (STOCK, None)
    assert len(inventory.calls) == 1
    results = tool_results(upstream.bodies[-1])
    assert results.count(STOCK) == 1
    assert results[-1] == "the user approves"

    later = await Runner.run(agent, [*result.to_input_list(), {"role": "user", "content": "Go."}])
    assert later.final_output == "Ordered."
    assert tool_results(upstream.bodies[-1]).count(STOCK) == 1
    assert len(inventory.calls) == 1


async def test_runner_run_streamed_with_server_tools(upstream: ScriptedUpstream) -> None:
    upstream.script(
        call("get_weather", city="Oslo"), call("final_answer", answer="4 °C and clear in Oslo.")
    )
    agent = Agent(name="reporter", model="reporter")
    result = Runner.run_streamed(agent, "Oslo?")
    raw: list[tuple[str, int]] = []
    named: list[str] = []
    async for event in result.stream_events():
        if event.type == "raw_response_event":
            raw.append((event.data.type, event.data.sequence_number))
        elif event.type == "run_item_stream_event":
            named.append(event.name)
    assert result.final_output == "4 °C and clear in Oslo."
    types = [t for t, _ in raw]
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    assert "response.mcp_call.completed" in types
    numbers = [n for _, n in raw]
    assert numbers == sorted(set(numbers))
    assert "get_weather" in [c.name for c in mcp_calls(result)]
    assert named[-1] == "message_output_created"
    assert "function_call" not in [t for _, t in raw_items(result)]


async def test_runner_run_streamed_answers_the_last_steps_text_as_it_is(
    upstream: ScriptedUpstream,
) -> None:
    """The SDK answers with the last message item's text: the step after a server call says it
    without the blank line that parts it from the step before."""
    upstream.script(
        replace(call("get_weather", city="Oslo"), content="Checking."),
        say("4 °C and clear in Oslo."),
    )
    agent = Agent(name="reporter", model="reporter")
    result = Runner.run_streamed(agent, "Oslo?")
    async for _ in result.stream_events():
        pass
    assert result.final_output == "4 °C and clear in Oslo."
    texts = [
        part.text
        for item in result.new_items
        if isinstance(item.raw_item, ResponseOutputMessage)
        for part in item.raw_item.content
        if isinstance(part, ResponseOutputText)
    ]
    assert "".join(texts) == "Checking.\n\n4 °C and clear in Oslo."


async def test_runner_run_streamed_with_a_client_function_tool(
    upstream: ScriptedUpstream, inventory: ToolServer
) -> None:
    upstream.script(
        call("check_inventory", item="washers"),
        call("ask_user", question="Order more washers?"),
        say_tool_result("The user says: {}"),
    )
    asked: list[str] = []
    agent = Agent(name="clerk", model="stock", tools=[ask_user_tool(asked)])
    result = Runner.run_streamed(agent, "Washers?")
    named = [e.name async for e in result.stream_events() if e.type == "run_item_stream_event"]
    assert asked == ["Order more washers?"]
    assert result.final_output == "The user says: the user approves"
    assert raw_items(result) == CLIENT_TOOL_ITEMS
    assert named == ["tool_called", "tool_called", "tool_output", "message_output_created"]
    assert isinstance(result.new_items[1].raw_item, ResponseFunctionToolCall)
    assert len(inventory.calls) == 1
    assert tool_results(upstream.bodies[-1]).count(STOCK) == 1


async def test_a_failed_server_call_is_an_mcp_call_with_an_error(
    upstream: ScriptedUpstream,
) -> None:
    """A server call that fails is an `mcp_call` whose `error` the SDK can parse and send back
    (a plain string would make pydantic warn when the SDK dumps it) on the next turn."""
    upstream.script(call("search_notes"), say("No notes."), say("Still none."))
    agent = Agent(name="researcher", model="researcher")
    result = await Runner.run(agent, "Tides?")
    assert result.final_output == "No notes."
    [failed] = mcp_calls(result)
    assert failed.name == "search_notes"
    assert failed.error is not None
    assert failed.output is None
    errors = tool_results(upstream.bodies[-1])

    later = await Runner.run(agent, [*result.to_input_list(), {"role": "user", "content": "And?"}])
    assert later.final_output == "Still none."
    assert tool_results(upstream.bodies[-1]) == errors


async def test_runs_chained_by_previous_response_id(
    upstream: ScriptedUpstream, inventory: ToolServer
) -> None:
    """With `auto_previous_response_id` the SDK sends only the new items and the previous
    response's id (the proxy's stored conversation), and a later turn continues from
    `last_response_id`: the model sees the whole conversation, each result once."""
    upstream.script(
        call("check_inventory", item="washers"),
        call("ask_user", question="Order more washers?"),
        say_tool_result("The user says: {}"),
        say("Ordered."),
    )
    asked: list[str] = []
    agent = Agent(name="clerk", model="stock", tools=[ask_user_tool(asked)])
    result = await Runner.run(agent, "Washers?", auto_previous_response_id=True)
    assert asked == ["Order more washers?"]
    assert result.final_output == "The user says: the user approves"
    results = tool_results(upstream.bodies[-1])
    assert results.count(STOCK) == 1
    assert results[-1] == "the user approves"

    later = await Runner.run(agent, "Go.", previous_response_id=result.last_response_id)
    assert later.final_output == "Ordered."
    messages = upstream.bodies[-1]["messages"]
    assert "Washers?" in str(messages[1]["content"])
    assert "The user says: the user approves" in [m.get("content") for m in messages]
    assert tool_results(upstream.bodies[-1]).count(STOCK) == 1
    assert len(inventory.calls) == 1
