"""What real clients rely on (SPEC §4.2, §4.3, §5.3): a 200 reply is never empty, a failure after
the first byte raises in the SDK, and the completion id is the run's in JSON and SSE."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI, OpenAI

from tests.scripted_upstream import ScriptedUpstream, call, keep, say

pytestmark = pytest.mark.e2e

STEP_LIMIT = {"tools": ["search_notes"], "max_steps": 2}
KEEP_GOING = "Research Lima."
STATED = "Stopped: the run reached its step limit (2 steps)."


async def test_the_agents_sdk_gets_a_stated_stop_instead_of_an_empty_reply(
    proxy_url: str, upstream: ScriptedUpstream
) -> None:
    set_tracing_disabled(True)
    upstream.script(keep(call("search_notes", query="Lima")))
    async with AsyncOpenAI(base_url=proxy_url, api_key="x") as client:
        model = OpenAIChatCompletionsModel(model="scripted", openai_client=client)
        settings = ModelSettings(extra_body={"loop": STEP_LIMIT})
        agent = Agent(name="searcher", model=model, model_settings=settings)
        result = await Runner.run(agent, KEEP_GOING)
    assert result.final_output == STATED


def test_the_openai_sdk_reads_the_stated_stop_in_json_and_sse(
    proxy_url: str, upstream: ScriptedUpstream
) -> None:
    upstream.script(keep(call("search_notes", query="Lima")))
    messages: Any = [{"role": "user", "content": KEEP_GOING}]
    with OpenAI(base_url=proxy_url, api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="scripted", messages=messages, extra_body={"loop": STEP_LIMIT}
        )
        chunks = list(
            client.chat.completions.create(
                model="scripted", messages=messages, stream=True, extra_body={"loop": STEP_LIMIT}
            )
        )
    assert reply.choices[0].message.content == STATED
    assert reply.choices[0].finish_reason == "length"
    run_hex = (reply.model_extra or {})["loop"]["run_id"].removeprefix("run_")
    assert reply.id == f"chatcmpl-{run_hex}"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == STATED
    assert len({c.id for c in chunks}) == 1
    stream_hex = (chunks[-1].model_extra or {})["loop"]["run_id"].removeprefix("run_")
    assert chunks[0].id == f"chatcmpl-{stream_hex}"


def test_a_failure_after_the_first_byte_raises_in_the_openai_sdk(
    proxy_url: str, upstream: ScriptedUpstream
) -> None:
    upstream.script(say("Hello."))
    loop = {
        "tools": ["final_answer", "search_notes"],
        "terminating_config": {"tool_ids": ["search_notes"], "consecutive_nudges": 0},
    }
    seen: list[str] = []
    with OpenAI(base_url=proxy_url, api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": "Just say hello."}],
            stream=True,
            extra_body={"loop": loop},
        )

        def drain() -> None:
            for chunk in stream:
                seen.extend(c.delta.content or "" for c in chunk.choices)

        with pytest.raises(openai.APIError) as err:
            drain()
    assert "".join(seen) == "Hello."  # the first step reached the client
    assert "nudges_exhausted" in str(err.value)
