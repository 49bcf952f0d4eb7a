"""The OpenAI Agents SDK with `OpenAIChatCompletionsModel` pointed at the proxy."""

from __future__ import annotations

import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

pytestmark = pytest.mark.e2e


async def test_agent_with_server_tools_and_a_client_function_tool(proxy_url: str) -> None:
    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def ask_user(question: str) -> str:
        """Ask the user a question."""
        asked.append(question)
        return "the user approves"

    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        model = OpenAIChatCompletionsModel(model="stock", openai_client=client)
        agent = Agent(name="clerk", instructions="Be brief.", model=model, tools=[ask_user])
        result = await Runner.run(agent, "check_inventory of washers, then ask_user")
    assert asked
    assert set(asked) == {"check_inventory of washers, then ask_user"}
    assert "Here is what I found" in result.final_output


async def test_agent_streamed_run(proxy_url: str) -> None:
    set_tracing_disabled(True)
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        model = OpenAIChatCompletionsModel(model="reporter", openai_client=client)
        agent = Agent(name="reporter", model=model)
        result = Runner.run_streamed(agent, "get_weather in Oslo then final_answer")
        async for _ in result.stream_events():
            pass
    assert result.final_output == (
        'Here is what I found: {"city":"Oslo","celsius":4.0,"sky":"clear"}'
    )
