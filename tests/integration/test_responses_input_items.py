"""`GET /v1/responses/{id}/input_items` (SPEC §12.4): the items used to generate a stored
response, across its chain, a page at a time, on every state backend."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.api.input_items import _segments
from proxy.api.read_budget import ReadBudget
from proxy.api.response_store import ResponseStore, StoredInput
from proxy.errors import InvalidRequest
from proxy.state.memory import MemoryStore
from proxy.state.store import StateStore
from tests.integration.conftest import Proxy, ProxyFactory
from tests.integration.test_key_scopes import key, keyed
from tests.records import put_record
from tests.scripted_upstream import call, keep, say

FUNCTION = {
    "type": "function",
    "name": "lookup_order",
    "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
}


async def respond(proxy: Proxy, **body: Any) -> dict[str, Any]:
    body.setdefault("model", "scripted")
    r = await proxy.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def listed(proxy: Proxy, response_id: str, **query: Any) -> httpx.Response:
    return await proxy.client.get(f"/v1/responses/{response_id}/input_items", params=query)


async def chain(proxy: Proxy) -> tuple[dict[str, Any], dict[str, Any]]:
    """A response that called a client tool, and one that answered the call and asked more."""
    proxy.upstream.script(call("lookup_order", order="A1"), say("Shipped."))
    first = await respond(proxy, input="Where is A1?", tools=[FUNCTION])
    answer = {"type": "function_call_output", "call_id": first["output"][0]["call_id"]}
    second = await respond(
        proxy,
        previous_response_id=first["id"],
        tools=[FUNCTION],
        input=[
            {**answer, "output": "in transit"},
            {"role": "user", "content": [{"type": "input_text", "text": "When?"}], "id": "mine"},
        ],
    )
    return first, second


async def test_the_items_of_a_chain_on_every_backend(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    async with proxy_for(store=backend) as proxy:
        first, second = await chain(proxy)
        hex_of = {r["id"]: r["id"].removeprefix("resp_") for r in (first, second)}
        r = await listed(proxy, second["id"], order="asc")
        assert r.status_code == 200
        page = r.json()
        assert (page["object"], page["has_more"]) == ("list", False)
        # The first response's input, its output (the client call), then the second's input.
        assert page["data"] == [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Where is A1?"}],
                "id": f"in_{hex_of[first['id']]}_0",
                "status": "completed",
            },
            first["output"][0],
            {
                "type": "function_call_output",
                "call_id": first["output"][0]["call_id"],
                "output": "in transit",
                "id": f"in_{hex_of[second['id']]}_0",
            },
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "When?"}],
                "id": "mine",
                "type": "message",
                "status": "completed",
            },
        ]
        assert (page["first_id"], page["last_id"]) == (page["data"][0]["id"], "mine")
        newest = (await listed(proxy, second["id"])).json()  # `desc` by default
        assert newest["data"] == page["data"][::-1]
        own = (await listed(proxy, first["id"])).json()
        assert own["data"] == page["data"][:1]


async def test_pages_follow_after_in_either_order(proxy: Proxy) -> None:
    _, second = await chain(proxy)
    whole = (await listed(proxy, second["id"], order="asc", limit=100)).json()["data"]
    assert len(whole) == 4
    for order, expected in (("asc", whole), ("desc", whole[::-1])):
        seen: list[dict[str, Any]] = []
        after = None
        while True:
            query = {"order": order, "limit": 3} | ({"after": after} if after else {})
            page = (await listed(proxy, second["id"], **query)).json()
            seen += page["data"]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == expected
        assert len(page["data"]) == 1  # a page of 3, then the last one


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"limit": "²"}, "limit"),
        ({"limit": "9" * 5000}, "limit"),
        ({"limit": "00200"}, "limit"),
        ({"limit": "0001" + "0" * 5000}, "limit"),
        ({"limit": "000"}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "in_nothing_0"}, "after"),
    ],
)
async def test_a_bad_query_is_a_400_naming_it(
    proxy: Proxy, query: dict[str, Any], param: str
) -> None:
    proxy.upstream.script(say("Hi."))
    first = await respond(proxy, input="hi")
    r = await listed(proxy, first["id"], **query)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


async def test_other_fields_of_the_query_are_accepted(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hi."))
    first = await respond(proxy, input="hi")
    r = await proxy.client.get(
        f"/v1/responses/{first['id']}/input_items?include[]=message.input_image.image_url"
    )
    assert r.status_code == 200
    assert [item["content"] for item in r.json()["data"]] == [
        [{"type": "input_text", "text": "hi"}]
    ]


async def test_only_the_key_that_made_it_lists_a_response(proxy_for: ProxyFactory) -> None:
    async with proxy_for(keyed(key("a"), key("b"))) as proxy:
        proxy.upstream.script(keep(say("Mine.")))
        headers = {"authorization": "Bearer sk-a"}
        r = await proxy.client.post(
            "/v1/responses", json={"model": "weather", "input": "hi"}, headers=headers
        )
        path = f"/v1/responses/{r.json()['id']}/input_items"
        assert (await proxy.client.get(path, headers=headers)).status_code == 200
        other = await proxy.client.get(path, headers={"authorization": "Bearer sk-b"})
        assert (other.status_code, other.json()["error"]["code"]) == (404, "not_found")


async def test_a_deleted_response_ends_the_chain_it_began(proxy: Proxy) -> None:
    first, second = await chain(proxy)
    assert (await proxy.client.delete(f"/v1/responses/{first['id']}")).status_code == 200
    assert (await listed(proxy, first["id"])).status_code == 404
    left = (await listed(proxy, second["id"], order="asc")).json()["data"]
    # Its input is gone; its output, which the second one continued, is not.
    assert [item["type"] for item in left] == ["function_call", "function_call_output", "message"]


async def test_an_id_given_twice_is_listed_once_and_pages_end(proxy: Proxy) -> None:
    """Each id is listed once, where it came last, so that a page's last id says where the
    next one begins."""
    proxy.upstream.script(say("Fine."))
    twice = [{"role": "user", "content": text, "id": "twice"} for text in ("a", "b")]
    again = await respond(proxy, input=[{"role": "user", "content": "first"}, *twice])
    items = (await listed(proxy, again["id"], order="asc")).json()["data"]
    assert [item["content"][0]["text"] for item in items] == ["first", "b"]
    ids = [item["id"] for item in items]
    for order in ("asc", "desc"):
        seen: list[str] = []
        after = None
        for _ in range(10):
            query = {"order": order, "limit": 1} | ({"after": after} if after else {})
            page = (await listed(proxy, again["id"], **query)).json()
            seen += [item["id"] for item in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == (ids if order == "asc" else ids[::-1])


async def test_a_request_of_many_small_items_is_listed(proxy_for: ProxyFactory) -> None:
    """Items are kept as they were given (their ids and parts are made as they are listed),
    so a request that fits a body fits the listing's bound."""
    async with proxy_for({"server": {"max_body_bytes": 65536}}) as proxy:
        proxy.upstream.script(say("Ok."))
        small = [{"role": "user", "content": "a"}] * 1900  # ~60 KB, 4.4 times that listed
        stored = await respond(proxy, input=small)
        r = await listed(proxy, stored["id"], limit=100)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["id"] == f"in_{stored['id'].removeprefix('resp_')}_1899"


async def test_a_chain_of_long_instructions_and_many_tools_is_listed(
    proxy_for: ProxyFactory,
) -> None:
    """What bounds a listing is its items, not what each response repeats of its request."""
    async with proxy_for({"server": {"max_body_bytes": 65536}}) as proxy:
        proxy.upstream.script(keep(say("Ok.")))
        tools = [{**FUNCTION, "name": f"tool_{i}", "description": "d" * 1000} for i in range(12)]
        previous = None
        for i in range(20):
            body = {"input": f"turn {i}", "instructions": "i" * 5000, "tools": tools}
            previous = (await respond(proxy, previous_response_id=previous, **body))["id"]
        assert previous is not None
        r = await listed(proxy, previous, order="asc", limit=100)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 20 + 19  # every input, every output but the last


async def test_an_unstored_response_has_no_input_items(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hi."))
    unstored = await respond(proxy, input="hi", store=False)
    assert (await listed(proxy, unstored["id"])).status_code == 404


async def test_an_input_item_may_be_referenced(proxy: Proxy) -> None:
    first, _ = await chain(proxy)
    question = f"in_{first['id'].removeprefix('resp_')}_0"
    proxy.upstream.script(say("Again."))
    await respond(proxy, input=[{"type": "item_reference", "id": question}])
    question_sent = {"role": "user", "content": [{"type": "text", "text": "Where is A1?"}]}
    assert proxy.upstream.bodies[-1]["messages"] == [question_sent]
    missing = await proxy.client.post(
        "/v1/responses",
        json={"model": "scripted", "input": [{"type": "item_reference", "id": question + "9"}]},
    )
    assert (missing.status_code, missing.json()["error"]["param"]) == (404, "input[0].id")


async def _stored_chain(length: int, item_bytes: int) -> ResponseStore:
    """A chain of `length` responses' input records written straight to a store, each with one
    input item of about `item_bytes` and no output."""
    store = ResponseStore(MemoryStore(), 60)
    previous = None
    for i in range(length):
        response_id = f"resp_{i}"
        item = {"type": "message", "id": f"in_{i}_0", "content": "x" * item_bytes}
        record = StoredInput(previous, [item]).dumps()
        await put_record(store.store, "input", response_id, record, 60)
        previous = response_id
    return store


async def test_the_walk_is_bounded_in_responses_bytes_and_values() -> None:
    store = await _stored_chain(6, 100)
    ample = ReadBudget(10_000, 10_000)
    walked = [s async for s in _segments(store, "resp_5", ample, max_chain=6)]
    assert [s[0][0] for s in walked[::2]] == [f"in_{i}_0" for i in range(5, -1, -1)]
    with pytest.raises(InvalidRequest, match="more than 5 responses"):
        _ = [s async for s in _segments(store, "resp_5", ReadBudget(10_000, 10_000), 5)]
    with pytest.raises(InvalidRequest, match="more than 500 bytes"):
        _ = [s async for s in _segments(store, "resp_5", ReadBudget(500, 10_000), 6)]
    with pytest.raises(InvalidRequest, match="more than 30 values"):
        _ = [s async for s in _segments(store, "resp_5", ReadBudget(10_000, 30), 6)]
