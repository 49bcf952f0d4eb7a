"""The bench's async server tool: the demo's `get_weather` written `async def`, which runs on
the event loop instead of in one of the tool threads (`server.tool_threads`)."""

from __future__ import annotations

from proxy.demo.tools import get_weather as weather_now


async def get_weather(city: str) -> dict[str, object]:
    """Current temperature of a city, in degrees Celsius."""
    return weather_now(city)
