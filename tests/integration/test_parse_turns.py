"""Large JSON texts are counted and parsed one at a time in a process (`proxy.parse_turns`): a
request body, a stored conversation a request continues and an upstream's JSON reply each wait
for the parse turn when they are large, while small ones go on; so requests parsing at once
cannot hold the event loop for the sum of their parses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import httpx
import pytest

from proxy.parse_turns import LARGE_TEXT, PAUSE_AFTER, parse_turn
from tests.integration.conftest import Proxy
from tests.integration.test_http1_transport import eventually
from tests.integration.test_responses_state import respond
from tests.scripted_upstream import call, keep, say

LARGE = "x" * LARGE_TEXT


@asynccontextmanager
async def turn_held() -> AsyncIterator[None]:
    """The parse turn, held by a task of its own for the block."""
    taken, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with parse_turn(LARGE_TEXT):
            taken.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await taken.wait()
    try:
        yield
    finally:
        release.set()
        await holder


async def waits_for_the_turn(large: Awaitable[httpx.Response], small: Proxy) -> httpx.Response:
    """`large`'s answer, once it is seen waiting while the turn is held and a small request
    goes on meanwhile."""
    async with turn_held():
        pending = asyncio.ensure_future(large)
        assert (await small.chat(model="scripted")).status_code == 200
        await asyncio.sleep(0.3)  # ample for a parse of LARGE_TEXT that did not wait
        assert not pending.done()
    return await asyncio.wait_for(pending, 10)


async def test_large_parses_take_turns_small_ones_never_wait() -> None:
    order: list[str] = []

    async def parse(name: str, size: int, hold: float) -> None:
        async with parse_turn(size):
            order.append(f"{name} in")
            await asyncio.sleep(hold)
            async with parse_turn(size):  # the holder does not wait for itself
                order.append(f"{name} again")
            order.append(f"{name} out")

    first = asyncio.create_task(parse("first", LARGE_TEXT, 0.05))
    await asyncio.sleep(0)
    second = asyncio.create_task(parse("second", LARGE_TEXT, 0))
    small = asyncio.create_task(parse("small", LARGE_TEXT - 1, 0))
    await asyncio.gather(first, second, small)
    assert order == [
        "first in",
        "small in",
        "small again",
        "small out",
        "first again",
        "first out",
        "second in",
        "second again",
        "second out",
    ]


async def test_a_large_body_waits_for_the_turn(proxy: Proxy) -> None:
    proxy.upstream.script(keep(say("Noted.")))
    large = proxy.chat(model="scripted", messages=[{"role": "user", "content": LARGE}])
    assert (await waits_for_the_turn(large, proxy)).status_code == 200
    assert proxy.upstream.bodies[-1]["messages"][0]["content"] == LARGE


async def test_a_large_stored_conversation_is_read_in_the_turn(proxy: Proxy) -> None:
    proxy.upstream.script(keep(say("Noted.")))
    first = await respond(proxy, model="scripted", input=LARGE)
    assert first.status_code == 200
    small = await respond(proxy, model="scripted", input="Short.")
    continued = {"model": "scripted", "input": "More."}
    large = respond(proxy, **continued, previous_response_id=first.json()["id"])
    async with turn_held():  # a small conversation is read meanwhile
        r = await respond(proxy, **continued, previous_response_id=small.json()["id"])
        assert r.status_code == 200
    r = await waits_for_the_turn(large, proxy)
    assert r.status_code == 200, r.text
    sent = [m["content"] for m in proxy.upstream.bodies[-1]["messages"]]
    assert sent == [LARGE, "Noted.", "More."]


ASK_USER = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_large_upstream_reply_is_parsed_in_the_turn(proxy: Proxy, stream: bool) -> None:
    """A stream's large event too (a call's arguments come in one): 50 streams of one 6 MiB
    event each held the loop 0.5-0.9 s."""
    large_reply = call("ask_user", question=LARGE) if stream else say(LARGE)
    proxy.upstream.script(large_reply, keep(say("Short.")))
    async with turn_held():
        asked = {"tools": [ASK_USER]} if stream else {}
        large = asyncio.create_task(proxy.chat(model="scripted", stream=stream, **asked))
        await eventually(lambda: bool(proxy.upstream.bodies))  # the large reply is its own
        small = await proxy.chat(model="scripted")
        assert small.json()["choices"][0]["message"]["content"] == "Short."
        await asyncio.sleep(0.3)
        assert not large.done()
    r = await asyncio.wait_for(large, 10)
    if stream:
        assert LARGE in r.text
    else:
        assert r.json()["choices"][0]["message"]["content"] == LARGE


@pytest.mark.parametrize(("size", "order"), [
    (PAUSE_AFTER, ["parsed", "other", "went on"]),
    (PAUSE_AFTER - 1, ["parsed", "went on", "other"]),
    (LARGE_TEXT - 1, ["parsed", "went on", "other"]),
])  # fmt: skip
async def test_a_task_goes_on_with_a_long_text_after_the_tasks_waiting_meanwhile(
    size: int, order: list[str]
) -> None:
    """A long parse held every other request; what comes after it (the checks of what it read,
    an answer written) would hold them longer still: they are served first."""
    seen: list[str] = []

    async def parser() -> None:
        async with parse_turn(size):
            seen.append("parsed")
        seen.append("went on")

    async def other() -> None:
        seen.append("other")

    await asyncio.gather(parser(), other())
    assert seen == order
