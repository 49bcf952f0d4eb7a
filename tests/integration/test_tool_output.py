"""Tool output is capped (`server.max_tool_output_bytes`, a tool's own `max_output_bytes`): more
is a tool error the model reads (SPEC §5.4), never an HTTP error."""

from __future__ import annotations

import orjson

from tests.bodies import user
from tests.integration.conftest import ProxyFactory
from tests.scripted_upstream import call, say_tool_result
from tests.tools import TOOLS

CAPPED = {
    "server": {"max_tool_output_bytes": 200},
    "tools": {**TOOLS, "get_weather": {**TOOLS["get_weather"], "max_output_bytes": 20}},
    "agents": {"a": {"model": "scripted", "tools": ["search_notes", "get_weather"]}},
}


async def test_an_output_over_the_cap_is_a_tool_error_for_the_model(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(CAPPED) as proxy:
        proxy.upstream.script(
            call("search_notes", query="q" * 150),
            say_tool_result("notes: {}"),
            call("search_notes", query="q" * 300),
            say_tool_result("notes: {}"),
            call("get_weather", city="Oslo"),
            say_tool_result("weather: {}"),
        )
        fits = await proxy.chat(model="a", messages=user("short"))
        too_long = await proxy.chat(model="a", messages=user("long"))
        own_cap = await proxy.chat(model="a", messages=user("weather"))
    assert fits.status_code == 200
    assert "none settles it" in fits.json()["choices"][0]["message"]["content"]
    for response, cap in ((too_long, 200), (own_cap, 20)):
        assert response.status_code == 200
        text = response.json()["choices"][0]["message"]["content"]
        assert f"larger than {cap} bytes" in text
        assert response.json()["loop"]["stop_reason"] == "completed"
    tool_message = proxy.upstream.bodies[3]["messages"][-1]
    assert "error" in orjson.loads(tool_message["content"])
