"""The conversation of a chain of stored responses, kept in parts (SPEC §12.4), through the HTTP
API on every state backend: whole upstream every turn, in few reads, bounded before its parts
are read, and read by no key but its own."""

from __future__ import annotations

import orjson
import pytest

from proxy.api import stored_conversation
from proxy.api.response_store import continued_records
from proxy.api.stored_conversation import TAIL_RECORD
from proxy.state.memory import MemoryStore
from proxy.state.store import StateStore
from tests.integration.conftest import Proxy, ProxyFactory
from tests.integration.counted_store import CountedStore
from tests.integration.test_key_scopes import key, keyed
from tests.integration.test_responses_state import respond
from tests.scripted_upstream import keep, say


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of a few KB, so that a chain of short turns has several."""
    monkeypatch.setattr(stored_conversation, "WHOLE_BYTES", 4096)
    monkeypatch.setattr(stored_conversation, "MIN_PART_BYTES", 1024)


async def chain(proxy: Proxy, turns: int, size: int = 500, as_key: str | None = None) -> list[str]:
    ids: list[str] = []
    for n in range(turns):
        previous = {"previous_response_id": ids[-1]} if ids else {}
        text = f"{n}:" + "x" * size
        r = await respond(proxy, as_key, model="scripted", input=text, **previous)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    return ids


async def test_a_chain_in_parts_goes_upstream_whole_on_every_backend(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    async with proxy_for(store=backend) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids = await chain(proxy, 40)
        for body in proxy.upstream.bodies[1:]:
            sent = [m["content"] for m in body["messages"]]
            turns = len(sent) // 2 + 1
            assert sent[::2] == [f"{n}:" + "x" * 500 for n in range(turns)]
            assert sent[1::2] == ["Noted."] * (turns - 1)
        tail = await backend.get_record(TAIL_RECORD, ids[-1])
        assert tail is not None
        assert len(orjson.loads(tail.partition(b"\n")[0])) > 1


async def test_a_continuation_reads_the_response_then_the_parts_together(
    proxy_for: ProxyFactory,
) -> None:
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids = await chain(proxy, 30)
        store.clear()
        r = await respond(proxy, model="scripted", input="More.", previous_response_id=ids[-1])
    assert r.status_code == 200
    conversation_reads = [pairs for pairs in store.reads if pairs[0][0] != "held"]
    assert len(conversation_reads) == 2
    named = conversation_reads[1]
    assert 1 < len(named) < stored_conversation.MAX_PARTS
    (kept,) = [pairs for pairs in store.kept if pairs]  # the new tail keeps them as long
    assert set(named) <= {*kept, (TAIL_RECORD, ids[-1])}


async def test_a_conversation_in_parts_over_the_body_bound_is_refused_before_they_are_read(
    proxy_for: ProxyFactory,
) -> None:
    store = CountedStore()
    async with proxy_for({"server": {"max_body_bytes": 24_000}}, store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids = await chain(proxy, 30)
        for _ in range(20):  # on until the conversation is over the bound
            store.clear()
            previous = ids[-1]
            over = await respond(
                proxy, model="scripted", input="y" * 500, previous_response_id=previous
            )
            if over.status_code != 200:
                break
            ids.append(over.json()["id"])
    assert await MemoryStore.get_record(store, TAIL_RECORD, ids[-1]) is not None
    assert over.status_code == 413
    assert over.json()["error"]["param"] == "previous_response_id"
    assert "server.max_body_bytes" in over.json()["error"]["message"]
    # One read: its response and its tail, none of the parts it names.
    assert store.reads == [continued_records(ids[-1])]


async def test_another_key_reads_none_of_the_parts(proxy_for: ProxyFactory) -> None:
    store = CountedStore()
    async with proxy_for(keyed(key("a"), key("b")), store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids = await chain(proxy, 30, as_key="a")
        store.clear()
        r = await respond(proxy, "b", model="weather", previous_response_id=ids[-1])
    assert (r.status_code, r.json()["error"]["param"]) == (404, "previous_response_id")
    assert [pairs[0][0] for pairs in store.reads] == ["response"]


async def test_a_conversation_in_parts_holding_too_many_values_is_refused(
    proxy_for: ProxyFactory,
) -> None:
    """Counted over the parts together, as over a body (each part alone holds fewer)."""
    store = MemoryStore()
    async with proxy_for({"server": {"max_body_values": 1000}}, store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        many = [{"role": "user", "content": [{"type": "input_text", "text": "x" * 40}] * 30}]
        ids: list[str] = []
        r = None
        for _ in range(30):
            previous = {"previous_response_id": ids[-1]} if ids else {}
            r = await respond(proxy, model="scripted", input=many, **previous)
            if r.status_code != 200:
                break
            ids.append(r.json()["id"])
    assert r is not None
    assert r.status_code == 413, r.text
    assert r.json()["error"]["param"] == "previous_response_id"
    assert "server.max_body_values" in r.json()["error"]["message"]
    assert await store.get_record(TAIL_RECORD, ids[-1]) is not None
