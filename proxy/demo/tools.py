"""Example server tools for the demo (`kind: python`)."""

from __future__ import annotations

WEATHER = {"Paris": 18.0, "Oslo": 4.0, "Lima": 23.0}


def get_weather(city: str) -> dict[str, object]:
    """Current temperature of a city, in degrees Celsius."""
    return {"city": city, "celsius": WEATHER.get(city, 20.0), "sky": "clear"}


def to_fahrenheit(celsius: float) -> str:
    return f"{celsius * 9 / 5 + 32:.1f}°F"


def search_notes(query: str) -> str:
    return f"3 notes mention {query[:40]!r}; none settles it."
