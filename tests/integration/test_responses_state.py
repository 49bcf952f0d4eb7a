"""Stored responses on every state backend, owned by the key that created them; a chain of
responses is one thread for tool call limits, across proxies sharing a redis (SPEC §12.4)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.api import stored_reads
from proxy.api.response_body import response_id as response_id_of
from proxy.api.response_store import continued_records
from proxy.errors import StateUnavailable
from proxy.state.memory import MemoryStore
from proxy.state.store import Record, StateStore
from tests.bodies import tool_results
from tests.integration.conftest import Proxy, ProxyFactory, state
from tests.integration.counted_store import CountedStore
from tests.integration.test_key_scopes import AGENTS, key, keyed
from tests.records import delete_record, put_record
from tests.response_events import parse_events
from tests.scripted_upstream import Call, Reply, call, keep, say

LIMITED = "Tool call limit exceeded"


async def respond(proxy: Proxy, as_key: str | None = None, **body: Any) -> httpx.Response:
    body.setdefault("input", "Lima?")
    headers = {"authorization": f"Bearer sk-{as_key}"} if as_key else {}
    return await proxy.client.post("/v1/responses", json=body, headers=headers)


async def test_stored_responses_on_every_backend(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    async with proxy_for(store=backend) as proxy:
        proxy.upstream.script(say("One."), say("Two."))
        first = (await respond(proxy, model="scripted")).json()
        second = (await respond(proxy, model="scripted", previous_response_id=first["id"])).json()
        assert second["output"][0]["content"][0]["text"] == "Two."
        assert [m["role"] for m in proxy.upstream.bodies[1]["messages"]] == [
            "user",
            "assistant",
            "user",
        ]
        got = await proxy.client.get(f"/v1/responses/{first['id']}")
        assert got.json() == first
        assert (await proxy.client.delete(f"/v1/responses/{first['id']}")).status_code == 200
        assert (await proxy.client.get(f"/v1/responses/{first['id']}")).status_code == 404
        assert (await proxy.client.delete(f"/v1/responses/{first['id']}")).status_code == 404
        assert await backend.get_record("conversation", first["id"]) is None
        assert await backend.get_record("conversation", second["id"]) is not None


async def test_a_run_is_found_for_run_ttl_s_when_its_response_is_kept_less(
    proxy_for: ProxyFactory,
) -> None:
    """`GET /v1/runs/{id}` answers for `run_ttl_s` (SPEC §4.2), also when the stored response
    that holds its report ends before: the run then keeps a record of its own."""
    config = {"state": {"backend": "memory", "response_ttl_s": 0.3, "run_ttl_s": 3600}}
    async with proxy_for(config) as proxy:
        proxy.upstream.script(keep(say("One.")))
        made = (await respond(proxy, model="scripted")).json()
        run_id = made["loop"]["run_id"]
        await asyncio.sleep(0.5)
        assert (await proxy.client.get(f"/v1/responses/{made['id']}")).status_code == 404
        found = await proxy.client.get(f"/v1/runs/{run_id}")
        assert found.status_code == 200
        assert found.json()["run_id"] == run_id
        assert (await proxy.client.get(f"/v1/runs/{made['id']}")).json() == found.json()


async def test_deleting_a_response_drops_its_records_in_one_call(
    proxy_for: ProxyFactory,
) -> None:
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("One.")))
        made = (await respond(proxy, model="scripted")).json()
        kinds = {kind for (kind, key) in store._records if key == made["id"]}
        assert kinds == {"conversation", "input", "outputs", "fingerprint", "response"}
        assert (await proxy.client.delete(f"/v1/responses/{made['id']}")).status_code == 200
    [deleted] = store.deletes
    assert {kind for kind, _ in deleted} >= kinds
    assert {key for _, key in deleted} == {made["id"]}
    assert not [key for (_, key) in store._records if key == made["id"]]


async def test_a_stored_response_belongs_to_its_key(proxy_for: ProxyFactory) -> None:
    config = {**keyed(key("a"), key("b")), "server": {"max_body_bytes": 65536}}
    async with proxy_for(config) as proxy:
        proxy.upstream.script(keep(say("Mine.")))
        mine = (await respond(proxy, "a", model="weather")).json()
        half = (await respond(proxy, "a", model="weather", input="x" * 40_000)).json()
        large = (
            await respond(
                proxy, "a", model="weather", input="y" * 40_000, previous_response_id=half["id"]
            )
        ).json()
        own_over = await respond(proxy, "a", model="weather", previous_response_id=large["id"])
        assert own_over.status_code == 413
        # Over the bound for its own key; for another, it does not exist at all.
        r = await respond(proxy, "b", model="weather", previous_response_id=large["id"])
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
        headers = {"authorization": "Bearer sk-b"}
        for method in ("GET", "DELETE"):
            r = await proxy.client.request(method, f"/v1/responses/{mine['id']}", headers=headers)
            assert r.status_code == 404
        r = await respond(proxy, "b", model="weather", previous_response_id=mine["id"])
        assert r.status_code == 404
        assert r.json()["error"]["param"] == "previous_response_id"
        reference = [{"type": "item_reference", "id": mine["output"][0]["id"]}]
        r = await respond(proxy, "b", model="weather", input=reference)
        assert r.status_code == 404
        assert (
            await proxy.client.get(f"/v1/runs/{mine['id']}", headers=headers)
        ).status_code == 404
        own = await proxy.client.get(
            f"/v1/responses/{mine['id']}", headers={"authorization": "Bearer sk-a"}
        )
        assert own.status_code == 200
        assert (
            await respond(proxy, "a", model="weather", previous_response_id=mine["id"])
        ).status_code == 200


async def test_a_chain_of_responses_is_one_thread(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"agents": AGENTS}) as proxy:
        proxy.upstream.script(
            call("get_weather", city="Lima"),
            say("Sunny."),
            call("get_weather", city="Lima"),
            say("Still sunny."),
            call("get_weather", city="Lima"),
            say("Fresh."),
        )
        first = (await respond(proxy, model="capped")).json()
        assert first["output"][0]["status"] == "completed"
        second = (
            await respond(proxy, model="capped", input="Again?", previous_response_id=first["id"])
        ).json()
        assert second["loop"]["tool_calls"] == 0  # the chain's one call was used
        assert LIMITED in tool_results(proxy.upstream.bodies[3])[-1]
        other = (await respond(proxy, model="capped")).json()  # a new chain, a new thread
        assert other["loop"]["tool_calls"] == 1
        thread_ids = {
            s.attributes.get("gen_ai.conversation.id")
            for s in proxy.spans()
            if s.name.startswith("invoke_agent") and s.attributes
        }
        assert thread_ids == {first["id"], other["id"]}


async def test_a_chain_is_one_thread_across_two_proxies_on_one_redis(
    proxy_for: ProxyFactory, tmp_path: Path, redis_url: str
) -> None:
    prefix = f"shared-{secrets.token_hex(4)}:"
    one, two = (
        state("redis", tmp_path, redis_url, prefix),
        state("redis", tmp_path, redis_url, prefix),
    )
    config = keyed(key("a"))
    try:
        async with proxy_for(config, store=one) as a, proxy_for(config, store=two) as b:
            a.upstream.script(
                call("get_weather", city="Lima"),
                say("Sunny."),
                call("get_weather", city="Lima"),
                say("Still sunny."),
            )
            first = (await respond(a, "a", model="capped")).json()
            assert first["loop"]["tool_calls"] == 1
            second = await respond(b, "a", model="capped", previous_response_id=first["id"])
            assert second.status_code == 200, second.text
            assert second.json()["loop"]["tool_calls"] == 0
            assert LIMITED in tool_results(a.upstream.bodies[3])[-1]
            assert (await two.thread_counts(f"a/{first['id']}")) == {"get_weather": 1}
    finally:
        await one.close()
        await two.close()


async def test_loop_thread_id_names_the_thread_instead(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"agents": AGENTS}) as proxy:
        proxy.upstream.script(
            call("get_weather", city="Lima"),
            say("Sunny."),
            call("get_weather", city="Lima"),
            say("x"),
        )
        await respond(proxy, model="capped", loop={"thread_id": "t-9"})
        second = (await respond(proxy, model="capped", loop={"thread_id": "t-9"})).json()
        assert second["loop"]["tool_calls"] == 0


def assert_continuation_refused(r: httpx.Response, says: str) -> None:
    """A 413 for the stored response a request continues, saying which bound it is over."""
    assert r.status_code == 413
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("request_too_large", "previous_response_id")
    assert says in error["message"]


async def test_a_conversation_continued_by_reference_is_bounded_as_a_body_is(
    proxy_for: ProxyFactory,
) -> None:
    """Each body of the chain is under `max_body_values`, the conversation they make is not:
    it would go upstream as one body, and is refused before its record is parsed."""
    async with proxy_for({"server": {"max_body_values": 1000}}) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        said = [{"role": "user", "content": "x"}]
        first = await respond(proxy, model="scripted", input=said * 150)
        second = await respond(
            proxy, model="scripted", input=said * 50, previous_response_id=first.json()["id"]
        )
        assert second.status_code == 200
        r = await respond(proxy, model="scripted", previous_response_id=second.json()["id"])
    assert_continuation_refused(r, "holds more than 1000 JSON values (server.max_body_values)")
    assert len(proxy.upstream.requests) == 2


async def test_a_conversation_continued_by_reference_is_bounded_in_bytes_as_a_body_is(
    proxy_for: ProxyFactory,
) -> None:
    """Each body of the chain is under `max_body_bytes`, the conversation two of them make is
    not: a chain cannot grow the bodies sent upstream, nor the records stored, without end."""
    async with proxy_for({"server": {"max_body_bytes": 65536}}) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        first = await respond(proxy, model="scripted", input="x" * 40_000)
        second = await respond(
            proxy, model="scripted", input="y" * 40_000, previous_response_id=first.json()["id"]
        )
        assert second.status_code == 200
        r = await respond(proxy, model="scripted", previous_response_id=second.json()["id"])
    assert_continuation_refused(r, "is larger than 65536 bytes (server.max_body_bytes)")
    assert len(proxy.upstream.requests) == 2


async def stored_items(proxy: Proxy, count: int, **body: Any) -> list[dict[str, str]]:
    """References to the messages of `count` new stored responses."""
    made = [await respond(proxy, model="scripted", **body) for _ in range(count)]
    return [{"type": "item_reference", "id": r.json()["output"][0]["id"]} for r in made]


async def test_the_responses_a_request_names_are_read_together(proxy_for: ProxyFactory) -> None:
    """The AI SDK names an item of every earlier response of its conversation: a long one names
    hundreds, which are read in a few reads, not one each."""
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Stored.")))
        references = await stored_items(proxy, 150)
        store.clear()
        read = await respond(proxy, model="scripted", input=[*references, *references[:3]])
    assert read.status_code == 200, read.text
    assert store.reads_of("outputs") == [100, 50]
    assert store.reads_of("response") == []
    assert len(proxy.upstream.bodies[-1]["messages"]) == 150  # each named item once


async def test_a_response_continued_is_read_with_its_conversation_in_one_read(
    proxy_for: ProxyFactory,
) -> None:
    """What the Agents SDK and Codex send every turn: one read of the state backend."""
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        first = (await respond(proxy, model="scripted", input="Remember 7.")).json()
        store.clear()
        again = await respond(proxy, model="scripted", previous_response_id=first["id"])
    assert again.status_code == 200
    assert store.reads == [continued_records(first["id"])]
    assert proxy.upstream.bodies[-1]["messages"][0]["content"] == "Remember 7."


async def test_a_request_reads_at_most_max_stored_reads_responses(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stored_reads, "MAX_STORED_READS", 8)
    async with proxy_for() as proxy:
        proxy.upstream.script(keep(say("Stored.")))
        references = await stored_items(proxy, 9)
        read = await respond(proxy, model="scripted", input=references[:8])
        over = await respond(proxy, model="scripted", input=references)
    assert read.status_code == 200
    assert (over.status_code, over.json()["error"]["param"]) == (400, "input[8].id")
    assert "at most 8 stored responses" in over.json()["error"]["message"]
    assert "previousResponseId" in over.json()["error"]["message"]


async def test_the_records_a_request_reads_are_bounded_in_bytes(proxy_for: ProxyFactory) -> None:
    """Four request bodies of records: 256 KiB here."""
    async with proxy_for({"server": {"max_body_bytes": 65536}}) as proxy:
        proxy.upstream.script(keep(say("x" * 40_000)))
        references = await stored_items(proxy, 7)
        read = await respond(proxy, model="scripted", input=references[:6])
        over = await respond(proxy, model="scripted", input=references)
    assert read.status_code == 200
    error = over.json()["error"]
    assert (over.status_code, error["code"], error["param"]) == (
        413,
        "request_too_large",
        "input[6].id",
    )
    assert "hold more than 262144 bytes (4 x server.max_body_bytes)" in error["message"]


async def test_the_records_a_request_reads_are_bounded_in_values(proxy_for: ProxyFactory) -> None:
    """Input items may carry fields the proxy keeps but never reads: 40 small bodies of them
    stored, then one request naming them all (a 2 KB body) read 40 records of 900 values each
    (with the default bounds: 220 such records, 21 M values, 0.7-0.9 s of the event loop)."""
    bounds = {"server": {"max_body_values": 1_000}}
    padded = {"role": "user", "content": "hi", "x": [0] * 900}
    async with proxy_for(bounds) as proxy:
        proxy.upstream.script(keep(say("Ok.")))
        made = [(await respond(proxy, model="scripted", input=[padded])).json() for _ in range(5)]
        references = [{"type": "item_reference", "id": f"in_{m['id'][5:]}_0"} for m in made]
        within = await respond(proxy, model="scripted", input=references[:4])
        over = await respond(proxy, model="scripted", input=references)
    assert within.status_code == 200, within.text
    error = over.json()["error"]
    assert (over.status_code, error["code"], error["param"]) == (
        413,
        "request_too_large",
        "input[4].id",
    )
    assert "hold more than 4000 values (4 x server.max_body_values)" in error["message"]


async def test_commas_and_colons_in_a_stored_text_are_no_values(proxy_for: ProxyFactory) -> None:
    """The values' first count takes every delimiter, those inside strings too: a record over
    the budget by that count is counted exactly before it is refused."""
    bounds = {"server": {"max_body_values": 1_000}}
    async with proxy_for(bounds) as proxy:
        proxy.upstream.script(say("a:b," * 3_000), say("Ok."), say("Ok."))  # 6,000 in its text
        made = (await respond(proxy, model="scripted")).json()
        message = next(item for item in made["output"] if item["type"] == "message")
        by_id = await respond(proxy, model="scripted", previous_response_id=made["id"])
        reference = [{"type": "item_reference", "id": message["id"]}]
        by_reference = await respond(proxy, model="scripted", input=reference)
    assert by_id.status_code == 200, by_id.text
    assert by_reference.status_code == 200, by_reference.text


async def test_an_item_reference_reads_the_outputs_not_what_the_response_echoes(
    proxy_for: ProxyFactory,
) -> None:
    """A response echoes its request's `tools` and `instructions`: the AI SDK names every
    earlier response of a conversation, and would read (and be charged) them at every turn."""
    store = CountedStore()
    config = {"server": {"max_body_bytes": 65536}}
    async with proxy_for(config, store=store) as proxy:
        proxy.upstream.script(keep(say("Stored.")))
        references = await stored_items(proxy, 20, instructions="x" * 40_000)
        store.clear()
        read = await respond(proxy, model="scripted", input=references)
    assert read.status_code == 200, read.text
    assert store.reads_of("outputs") == [20]
    assert store.read < 20 * 1_000  # twenty outputs, none of the 800 KB of instructions


async def test_a_response_s_output_items_are_stored_once(proxy_for: ProxyFactory) -> None:
    """In its outputs record: its response record holds them as `null`, and `GET` gives them
    whole."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("x" * 40_000)))
        made = (await respond(proxy, model="scripted")).json()
        response = await store.get_record("response", made["id"])
        outputs = await store.get_record("outputs", made["id"])
        got = (await proxy.client.get(f"/v1/responses/{made['id']}")).json()
    assert response is not None
    assert outputs is not None
    assert len(response) < 5_000 < 40_000 < len(outputs)
    assert orjson.loads(response)["response"]["output"] is None
    assert got == made


async def test_the_output_items_of_a_continued_response_are_charged_to_the_budget(
    proxy_for: ProxyFactory,
) -> None:
    """Before they are parsed, as when they were in its response record: 45 KB of them and
    five referenced 44 KB outputs are over four 64 KiB bodies."""
    async with proxy_for({"server": {"max_body_bytes": 65536}}) as proxy:
        proxy.upstream.script(keep(say("x" * 44_000)))
        references = await stored_items(proxy, 5)
        previous = (await respond(proxy, model="scripted", input="y" * 1_000)).json()
        over = await respond(
            proxy, model="scripted", input=references, previous_response_id=previous["id"]
        )
    assert (over.status_code, over.json()["error"]["param"]) == (413, "input[4].id")


async def test_a_response_whose_outputs_record_is_gone_is_gone(proxy_for: ProxyFactory) -> None:
    """Not one with no output items: GET and a continuation are 404s."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Stored.")))
        made = (await respond(proxy, model="scripted")).json()
        await delete_record(store, "outputs", made["id"])
        got = await proxy.client.get(f"/v1/responses/{made['id']}")
        again = await respond(proxy, model="scripted", previous_response_id=made["id"])
    assert got.status_code == 404
    assert (again.status_code, again.json()["error"]["param"]) == (404, "previous_response_id")


async def test_an_item_of_a_response_stored_without_an_outputs_record_is_read(
    proxy_for: ProxyFactory,
) -> None:
    """As a version before outputs had a record of their own stored it: its response record is
    read instead, in a second read of the chunk."""
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Stored.")))
        references = await stored_items(proxy, 4)
        for reference in references[1:3]:
            response_id = "resp_" + reference["id"][4:].split("_")[0]
            earlier = orjson.loads(await store.get_record("response", response_id) or b"")
            earlier["response"] = (await proxy.client.get(f"/v1/responses/{response_id}")).json()
            await put_record(store, "response", response_id, orjson.dumps(earlier), 60)
            await delete_record(store, "outputs", response_id)
        store.clear()
        read = await respond(proxy, model="scripted", input=references)
    assert read.status_code == 200, read.text
    assert store.reads_of("outputs") == [4]
    assert store.reads_of("response") == [2]
    assert [m["content"] for m in proxy.upstream.bodies[-1]["messages"]] == ["Stored."] * 4


async def test_reading_a_stored_response_does_not_read_the_conversation_through_it(
    proxy_for: ProxyFactory,
) -> None:
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        first = (await respond(proxy, model="scripted", input="x" * 100_000)).json()
        store.clear()
        assert (await proxy.client.get(f"/v1/responses/{first['id']}")).json() == first
        assert (await proxy.client.get(f"/v1/runs/{first['id']}")).status_code == 200
        reference = [{"type": "item_reference", "id": first["output"][0]["id"]}]
        assert (await respond(proxy, model="scripted", input=reference)).status_code == 200
        assert store.read < 10_000  # three reads of the response, none of its 100 KB input
        store.clear()
        continued = await respond(proxy, model="scripted", previous_response_id=first["id"])
        assert continued.status_code == 200
        assert store.read > 100_000


async def test_a_stored_response_and_its_chain_s_thread_are_one_write(
    proxy_for: ProxyFactory,
) -> None:
    """One round trip on redis, one commit on sqlite, whatever the chain counts."""
    store = CountedStore()
    async with proxy_for({"agents": AGENTS}, store=store) as proxy:
        proxy.upstream.script(call("get_weather", city="Lima"), say("Sunny."), say("Again."))
        first = (await respond(proxy, model="capped")).json()
        again = await respond(proxy, model="capped", previous_response_id=first["id"])
        assert again.status_code == 200
    kinds = ["conversation", "input", "outputs", "response"]  # the response last: it names them
    # The first, made without previous_response_id, also keeps its fingerprint.
    made = [*kinds[:3], "fingerprint", kinds[3]]
    assert store.writes == [(made, first["id"]), (kinds, first["id"])]


async def test_what_a_request_reads_of_the_responses_it_names_stays_within_its_budget(
    proxy_for: ProxyFactory,
) -> None:
    """The records are read together, but only as many bytes of them as the budget has left
    (the state backend looks at their sizes first): not every record the request names, as
    large as each may be, before the first is parsed."""
    store = CountedStore()
    async with proxy_for({"server": {"max_body_bytes": 65536}}, store=store) as proxy:
        proxy.upstream.script(keep(say("x" * 40_000)))
        references = await stored_items(proxy, 20)
        store.clear()
        over = await respond(proxy, model="scripted", input=references)
        assert (over.status_code, over.json()["error"]["param"]) == (413, "input[6].id")
        assert store.read < 4 * 65536 + 50_000  # the budget and one record, not 20 records
        store.clear()
        unknown = [{"type": "item_reference", "id": "msg_0123456789abcdef01234567_0"}]
        first_unknown = await respond(proxy, model="scripted", input=unknown + references)
        assert first_unknown.status_code == 404
        assert store.read < 4 * 65536 + 50_000


async def test_another_key_continuing_a_response_reads_nothing_of_its_conversation(
    proxy_for: ProxyFactory,
) -> None:
    """It gets the 404 of an unknown id, and is sent none of a conversation larger than what is
    read with the response (AHEAD_BYTES): how long its read takes tells it no more
    than that; the key that made it continues it in two reads."""
    store = CountedStore()
    async with proxy_for(keyed(key("a"), key("b")), store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        made = await respond(proxy, "a", model="scripted", input="x" * 300_000)
        store.clear()
        other = await respond(proxy, "b", model="scripted", previous_response_id=made.json()["id"])
        assert (other.status_code, other.json()["error"]["param"]) == (404, "previous_response_id")
        assert store.read < 10_000  # the response's record, not its 300 KB conversation
        again = await respond(proxy, "a", model="scripted", previous_response_id=made.json()["id"])
        assert again.status_code == 200
        assert proxy.upstream.bodies[-1]["messages"][0]["content"] == "x" * 300_000


async def test_an_item_of_a_response_too_large_to_continue_may_still_be_referenced(
    proxy_for: ProxyFactory,
) -> None:
    """Only the item goes upstream, not the conversation the response ended."""
    async with proxy_for({"server": {"max_body_bytes": 65536}}) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        half = (await respond(proxy, model="scripted", input="x" * 40_000)).json()
        large = await respond(
            proxy, model="scripted", input="y" * 40_000, previous_response_id=half["id"]
        )
        reference = [{"type": "item_reference", "id": large.json()["output"][0]["id"]}]
        r = await respond(proxy, model="scripted", input=reference)
        over = await respond(proxy, model="scripted", previous_response_id=large.json()["id"])
    assert r.status_code == 200
    assert [m["content"] for m in proxy.upstream.bodies[-1]["messages"]] == ["Noted."]
    assert_continuation_refused(over, "is larger than 65536 bytes (server.max_body_bytes)")


async def test_a_response_stored_as_one_record_is_read_and_continued(
    proxy_for: ProxyFactory,
) -> None:
    """As an earlier version stored it: the conversation in the response's own record."""
    store = MemoryStore()
    response = {"id": "resp_0a1b", "object": "response", "status": "completed", "output": []}
    earlier = {
        "response": response,
        "messages": [
            {"role": "user", "content": "Lima?"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "thread": "resp_0a1b",
        "owner": "scripted",
        "key": None,
    }
    await put_record(store, "response", "resp_0a1b", orjson.dumps(earlier), 60)
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(say("Still sunny."))
        assert (await proxy.client.get("/v1/responses/resp_0a1b")).json() == response
        r = await respond(proxy, model="scripted", previous_response_id="resp_0a1b", input="Now?")
        assert r.status_code == 200
    sent = proxy.upstream.bodies[0]["messages"]
    assert [m["content"] for m in sent] == ["Lima?", "Sunny.", "Now?"]


async def test_a_response_whose_conversation_is_gone_is_not_continued(
    proxy_for: ProxyFactory,
) -> None:
    """Deleted or expired between the reads of its two records: a 404, not a continuation
    that goes upstream without the conversation."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(say("Sunny."))
        first = (await respond(proxy, model="scripted")).json()
        await delete_record(store, "conversation", first["id"])
        r = await respond(proxy, model="scripted", previous_response_id=first["id"])
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"
    assert "the conversation through stored response" in r.json()["error"]["message"]
    assert len(proxy.upstream.requests) == 1


async def test_an_item_the_stored_conversation_holds_is_refused_as_openai_refuses_it(
    proxy: Proxy,
) -> None:
    """What the AI SDK sends when given the whole history with `previousResponseId`: items the
    chain holds already, which the model would see twice. OpenAI answers 400 "Duplicate item
    found"; so does the proxy, naming the item."""
    function = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    proxy.upstream.script(call("lookup", order="A1"), say("Shipped."))
    first = (await respond(proxy, model="scripted", input="A1?", tools=[function])).json()
    fc = first["output"][0]
    answer = {"type": "function_call_output", "call_id": fc["call_id"], "output": "in transit"}
    second = await respond(
        proxy, model="scripted", input=[answer], tools=[function], previous_response_id=first["id"]
    )
    assert second.status_code == 200
    whole_call = {k: fc[k] for k in ("type", "call_id", "name", "arguments")}
    for previous, given, param in [
        (first["id"], [{"type": "item_reference", "id": fc["id"]}, answer], "input[0].id"),
        (first["id"], [whole_call, answer], "input[0].call_id"),
        (second.json()["id"], [answer], "input[0].call_id"),
    ]:
        r = await respond(
            proxy, model="scripted", input=given, tools=[function], previous_response_id=previous
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["message"].startswith("Duplicate item found")
    assert len(proxy.upstream.requests) == 2  # none of them went upstream


async def test_a_chains_own_thread_ends_when_the_chain_can_no_longer_be_continued(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    """Its counters last `state.response_ttl_s` past the chain's last stored response (only the
    chain reaches them); a thread a client names is kept for good (SPEC §9)."""
    config = {"agents": AGENTS, "state": {"backend": "memory", "response_ttl_s": 2}}
    async with proxy_for(config, store=backend) as proxy:
        weather = call("get_weather", city="Lima")
        proxy.upstream.script(weather, say("Sunny."), weather, say("Named."), say("Still."))
        first = (await respond(proxy, model="capped")).json()
        await respond(proxy, model="capped", loop={"thread_id": "named"})
        assert await backend.thread_counts(first["id"]) == {"get_weather": 1}
        await asyncio.sleep(1.2)
        # Continued by a model without limits: nothing counted, but the chain lives on, and its
        # thread with it.
        second = await respond(proxy, model="scripted", previous_response_id=first["id"])
        assert second.status_code == 200
        await asyncio.sleep(1.2)
        assert await backend.thread_counts(first["id"]) == {"get_weather": 1}
        await asyncio.sleep(1.4)
        assert await backend.thread_counts(first["id"]) == {}
        assert await backend.thread_counts("named") != {}


async def test_a_reply_of_more_client_calls_than_one_write_takes_is_stored_and_deleted(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    """128 client calls (`max_tool_calls_per_reply`): a record each, that the turn answering
    one finds its response by, more than one write of the backend takes (100)."""
    function = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    many = Reply(calls=tuple(Call("lookup", {"q": n}, id=f"call_{n}") for n in range(128)))
    async with proxy_for(store=backend) as proxy:
        proxy.upstream.script(many)
        made = await respond(proxy, model="scripted", tools=[function])
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        calls = [("call", f"call_{n}") for n in range(128)]
        kept = [v for at in (0, 64) for v in await backend.get_records(calls[at : at + 64])]
        got = await proxy.client.get(f"/v1/responses/{response_id}")
        deleted = await proxy.client.delete(f"/v1/responses/{response_id}")
        gone = await proxy.client.get(f"/v1/responses/{response_id}")
        left = [v for at in (0, 64) for v in await backend.get_records(calls[at : at + 64])]
    assert [item["call_id"] for item in made.json()["output"]] == [c for _, c in calls]
    assert {orjson.loads(v or b"{}").get("response") for v in kept} == {response_id}
    assert got.json() == made.json()
    assert (deleted.status_code, gone.status_code) == (200, 404)
    assert left == [None] * 128


async def test_an_upstream_that_gives_every_turn_the_same_call_id_is_answered_each_turn(
    proxy: Proxy,
) -> None:
    """An output answers its call's last turn: `call_0` answered once may be called again."""
    function = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    same = Reply(calls=(Call("lookup", {"q": 1}, id="call_0"),))
    proxy.upstream.script(same, same, say("Done."))
    previous = None
    for turn in range(3):
        given = "q?"
        if previous is not None:
            call_id = previous["output"][0]["call_id"]
            given = [{"type": "function_call_output", "call_id": call_id, "output": f"r{turn}"}]
        r = await respond(
            proxy,
            model="scripted",
            input=given,
            tools=[function],
            previous_response_id=previous and previous["id"],
        )
        assert r.status_code == 200, r.text
        previous = r.json()
    assert previous is not None
    assert previous["output"][0]["content"][0]["text"] == "Done."


class ChainsNotKept(MemoryStore):
    """A backend that fails the writes that keep a chain's thread: a chain's stored responses
    (the thread is kept in the write of the response's records)."""

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        if keep_thread is not None:
            raise StateUnavailable("the state backend is unreachable")
        return await super().put_records(records, ttl_s, keep=keep)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_response_that_cannot_be_stored_fails_its_run_state_unavailable(
    proxy_for: ProxyFactory, stream: bool
) -> None:
    """It was answered 200 (`response.completed`) with `store: true`, and then not found: not
    by `previous_response_id`, not by `GET`. Its run ends `state_unavailable`, as a `/chat` run
    whose save fails does, on every surface; its tool ran: not to be sent again."""
    store = ChainsNotKept()
    async with proxy_for({"agents": AGENTS}, store=store) as proxy:
        proxy.upstream.script(call("get_weather", city="Lima"), say("Sunny."))
        first = await respond(proxy, model="capped", stream=stream)
        if stream:
            events = parse_events(first.text)
            assert [e["type"] for e in events][-1] == "response.failed"
            failed = events[-1]["response"]
            assert failed["error"]["code"] == "state_unavailable"
            assert failed["loop"]["stop_reason"] == "state_unavailable"
            response_id = failed["id"]
        else:
            assert first.status_code == 503, first.text
            assert first.headers["x-should-retry"] == "false"
            assert first.headers["x-loopwarden-stop-reason"] == "state_unavailable"
            assert first.json()["error"]["code"] == "state_unavailable"
            assert first.json()["loop"]["stop_reason"] == "state_unavailable"
            response_id = response_id_of(first.headers["x-loopwarden-run-id"])
            # What ran and what the model said, as a stream's `response.failed` shows them.
            shown = first.json()["response"]
            assert (shown["id"], shown["status"]) == (response_id, "failed")
            mcp, message = shown["output"]
            assert (mcp["type"], mcp["name"], mcp["status"]) == (
                "mcp_call",
                "get_weather",
                "completed",
            )
            assert message["content"][0]["text"] == "Sunny."
        again = await respond(proxy, model="capped", previous_response_id=response_id)
        assert (again.status_code, again.json()["error"]["param"]) == (
            404,
            "previous_response_id",
        )
        scraped = (await proxy.client.get("/metrics")).text
    assert 'stop_reason="state_unavailable"' in scraped
    # Nothing of it was written: not the response, not its conversation or input items.
    assert await store.get_record("response", response_id) is None
    assert await store.get_record("conversation", response_id) is None
    assert await store.get_record("input", response_id) is None
