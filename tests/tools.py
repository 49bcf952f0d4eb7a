"""The tests' server tools (`kind: python`), and the `tools:` config section that names them
with the demo's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


def search_notes(query: str) -> str:
    """The demo's, without its cut of the query: an output as long as a test makes it."""
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


def broken(reason: str) -> str:
    """Always fails, saying `reason`."""
    raise ValueError(reason)


def _python(name: str, module: str = "tests.tools") -> dict[str, Any]:
    return {"kind": "python", "callable": f"{module}:{name}"}


TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _python("get_weather", "proxy.demo.tools"),
    "to_fahrenheit": _python("to_fahrenheit", "proxy.demo.tools"),
    "search_notes": _python("search_notes"),
    "sleep": _python("sleep"),
    "meet": _python("meet"),
    "broken": _python("broken"),
    "final_answer": {"kind": "builtin"},
}
