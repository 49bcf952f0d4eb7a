"""The OpenAI Agents SDK with `OpenAIChatCompletionsModel` pointed at the proxy."""

from __future__ import annotations

import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from tests.e2e.structured import BOLTS, Stock, looked_then_answered
from tests.scripted_upstream import ScriptedUpstream, call, say_tool_result

pytestmark = pytest.mark.e2e


async def test_agent_with_server_tools_and_a_client_function_tool(
    proxy_url: str, upstream: ScriptedUpstream
) -> None:
    set_tracing_disabled(True)
    upstream.script(
        call("check_inventory", item="washers"),
        call("ask_user", question="Order more washers?"),
        say_tool_result("The user says: {}"),
    )
    asked: list[str] = []

    @function_tool
    def ask_user(question: str) -> str:
        """Ask the user a question."""
        asked.append(question)
        return "the user approves"

    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        model = OpenAIChatCompletionsModel(model="stock", openai_client=client)
        agent = Agent(name="clerk", instructions="Be brief.", model=model, tools=[ask_user])
        result = await Runner.run(agent, "Washers?")
    assert asked == ["Order more washers?"]
    assert result.final_output == "The user says: the user approves"


async def test_agent_streamed_run(proxy_url: str, upstream: ScriptedUpstream) -> None:
    set_tracing_disabled(True)
    upstream.script(
        call("get_weather", city="Oslo"), call("final_answer", answer="4 °C and clear in Oslo.")
    )
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        model = OpenAIChatCompletionsModel(model="reporter", openai_client=client)
        agent = Agent(name="reporter", model=model)
        result = Runner.run_streamed(agent, "Oslo?")
        async for _ in result.stream_events():
            pass
    assert result.final_output == "4 °C and clear in Oslo."


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agent_with_an_output_type_gets_the_answer_after_its_server_tools(
    proxy_url: str, upstream: ScriptedUpstream, streamed: bool
) -> None:
    set_tracing_disabled(True)
    upstream.script(*looked_then_answered())
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        model = OpenAIChatCompletionsModel(model="stock", openai_client=client)
        agent = Agent(name="clerk", model=model, output_type=Stock)
        if streamed:
            result = Runner.run_streamed(agent, "Bolts?")
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "Bolts?")
    assert result.final_output == BOLTS
