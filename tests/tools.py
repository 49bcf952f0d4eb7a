"""The tests' server tools (`kind: python`), and the `tools:` config section that names them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

WEATHER = {"Paris": 18.0, "Oslo": 4.0, "Lima": 23.0}


def get_weather(city: str) -> dict[str, object]:
    """Current temperature of a city, in degrees Celsius."""
    return {"city": city, "celsius": WEATHER.get(city, 20.0), "sky": "clear"}


def to_fahrenheit(celsius: float) -> str:
    return f"{celsius * 9 / 5 + 32:.1f}°F"


def search_notes(query: str) -> str:
    return f"3 notes mention {query!r}; none settles it."


async def sleep(seconds: float) -> str:
    """Answers after `seconds`: a tool that is still running when the test needs one."""
    await asyncio.sleep(seconds)
    return f"slept {seconds:g}s"


@dataclass
class _Gathering:
    barrier: asyncio.Barrier
    inside: int = 0
    most: int = 0


_gatherings: dict[str, _Gathering] = {}


async def meet(group: str, parties: int, timeout_s: float) -> str:
    """Waits until `parties` calls of `group` are inside at once, or `timeout_s`; says how many
    were inside at once at most. Calls run one after the other each say "1 of N"."""
    gathering = _gatherings.setdefault(group, _Gathering(asyncio.Barrier(parties)))
    gathering.inside += 1
    gathering.most = max(gathering.most, gathering.inside)
    try:
        async with asyncio.timeout(timeout_s):
            await gathering.barrier.wait()
    except TimeoutError:
        pass
    finally:
        gathering.inside -= 1
        if gathering.inside == 0:
            del _gatherings[group]
    return f"{gathering.most} of {parties} inside at once"


def _python(name: str) -> dict[str, Any]:
    return {"kind": "python", "callable": f"tests.tools:{name}"}


TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _python("get_weather"),
    "to_fahrenheit": _python("to_fahrenheit"),
    "search_notes": _python("search_notes"),
    "sleep": _python("sleep"),
    "meet": _python("meet"),
    "final_answer": {"kind": "builtin"},
}
