"""The conversation of a chain of stored responses, kept in parts (SPEC §12.4), through the HTTP
API on every state backend: whole upstream every turn, in few reads, bounded before its parts
are read, and read by no key but its own; and kept alike when each turn sends it whole again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import pytest
from openai.types.responses import ResponseOutputMessage

from proxy.api import input_items, stored_conversation, stored_reads
from proxy.api.fingerprint_records import FINGERPRINT_RECORD
from proxy.api.response_store import AHEAD_BYTES, continued_records
from proxy.api.stored_conversation import TAIL_RECORD
from proxy.state.memory import MemoryStore
from proxy.state.store import Record, StateStore
from tests.bodies import tool_results
from tests.integration.conftest import Proxy, ProxyFactory
from tests.integration.counted_store import CountedStore
from tests.integration.test_key_scopes import AGENTS, key, keyed
from tests.integration.test_responses_state import LIMITED, respond
from tests.response_events import checked, parse_events
from tests.scripted_upstream import Call, Reply, call, keep, say, say_tool_result


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


async def resend(
    proxy: Proxy,
    turns: int,
    items: list[dict[str, Any]] | None = None,
    size: int = 500,
    as_key: str | None = None,
    whole: bool = False,
    model: str = "scripted",
) -> tuple[list[str], list[dict[str, Any]]]:
    """Turns that each send the whole conversation again, the earlier answers as references to
    their output items (as the AI SDK does), or `whole`, after `items`: the responses, and the
    items the next turn would send before its own message."""
    ids: list[str] = []
    items = list(items or [])
    done = sum(item.get("role") == "user" for item in items)
    for n in range(done, done + turns):
        items.append({"role": "user", "content": f"{n}:" + "x" * size})
        r = await respond(proxy, as_key, model=model, input=items)
        assert r.status_code == 200, r.text
        output = r.json()["output"]
        items += output if whole else [{"type": "item_reference", "id": i["id"]} for i in output]
        ids.append(r.json()["id"])
    return ids, items


def sent_texts(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"]]


async def test_a_conversation_sent_whole_again_is_stored_in_parts_on_every_backend(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    """Known by the fingerprint of the response its last reference names: no conversation is
    read, and a continuation by id sends the whole of it."""
    async with proxy_for(store=backend) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids, _ = await resend(proxy, 40)
        assert len(proxy.upstream.bodies[-1]["messages"]) == 79
        tail = await backend.get_record(TAIL_RECORD, ids[-1])
        assert tail is not None
        assert len(orjson.loads(tail.partition(b"\n")[0])) > 1
        r = await respond(proxy, model="scripted", input="On.", previous_response_id=ids[-1])
        assert r.status_code == 200, r.text
        texts = [f"{n}:" + "x" * 500 for n in range(40)]
        assert sent_texts(proxy.upstream.bodies[-1]) == [
            *(text for pair in zip(texts, ["Noted."] * 40, strict=True) for text in pair),
            "On.",
        ]


async def test_a_resent_turn_reads_the_response_it_names_last_and_its_parts(
    proxy_for: ProxyFactory,
) -> None:
    """Its items begin with that response's request's and output: none of the responses the
    earlier references name is read; the parts it names are kept as long as its tail."""
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids, items = await resend(proxy, 28)
        store.clear()
        (last,), _ = await resend(proxy, 1, items)
        assert len(proxy.upstream.bodies[-1]["messages"]) == 57
        tail = await MemoryStore.get_record(store, TAIL_RECORD, last)
    assert tail is not None
    named = stored_conversation.named_parts(last, tail)[0]
    assert len(named) > 1
    fingerprint = [(FINGERPRINT_RECORD, ids[-1])]
    continued = [(kind, ids[-1]) for kind in ("outputs", "conversation", TAIL_RECORD)]
    assert store.reads == [fingerprint, continued, [part.record for part in named]]
    assert store.kept == [[part.record for part in named]]  # kept as long as the tail


async def test_a_resent_conversation_names_more_responses_than_a_request_may_read(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each turn continues the one before: it reads one response, whatever the references to
    earlier ones; a turn that does not continue one reads what it names, within the bound."""
    monkeypatch.setattr(stored_reads, "MAX_STORED_READS", 5)
    async with proxy_for() as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        _, items = await resend(proxy, 12)
        assert len(proxy.upstream.bodies[-1]["messages"]) == 23
        edited = [{**items[0], "content": "0:" + "y" * 500}, *items[1:]]
        refused = await respond(proxy, model="scripted", input=edited)
    assert refused.status_code == 400, refused.text
    assert "at most 5 stored responses" in refused.json()["error"]["message"]


@pytest.mark.parametrize("whole", [False, True], ids=["references", "items"])
async def test_a_conversation_sent_again_is_one_thread_as_a_chain_is(
    proxy_for: ProxyFactory, whole: bool
) -> None:
    """Its tool call limits span its turns (`thread_limit`), as a chain continued by id does,
    and a turn whose conversation begins with it though its items do not (a message sent with
    an id of its own now) too; a turn that does not continue it begins a thread of its own."""
    async with proxy_for({"agents": AGENTS}) as proxy:
        weather = (call("get_weather", city="Lima"), say("Sunny."))
        proxy.upstream.script(*weather * 4)
        (first,), items = await resend(proxy, 1, model="capped", whole=whole)
        (second,), _ = await resend(proxy, 1, items, model="capped", whole=whole)
        assert LIMITED in tool_results(proxy.upstream.bodies[3])[-1]
        named = [{**items[0], "id": "u-0"}, *items[1:]]
        await resend(proxy, 1, named, model="capped", whole=whole)
        assert LIMITED in tool_results(proxy.upstream.bodies[5])[-1]
        edited = [{**items[0], "content": "0:" + "y" * 500}, *items[1:]]
        await resend(proxy, 1, edited, model="capped", whole=whole)
        assert LIMITED not in tool_results(proxy.upstream.bodies[7])[-1]
    threads = [
        span.attributes.get("gen_ai.conversation.id")
        for span in proxy.spans()
        if span.name.startswith("invoke_agent") and span.attributes
    ]
    assert threads[:3] == [first, first, first]
    assert threads[3] not in (first, second)


async def test_a_conversation_resent_changed_is_stored_as_it_was_sent(
    proxy_for: ProxyFactory,
) -> None:
    """An earlier message edited (same size), or the references stopping at an earlier turn
    (a fork): the conversation stored is the one sent, whole or continuing that turn's."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        _, items = await resend(proxy, 30)
        edited = [{**items[0], "content": "0:" + "y" * 500}, *items[1:]]
        (changed,), _ = await resend(proxy, 1, edited)
        assert await store.get_record(TAIL_RECORD, changed) is None
        fork_items = items[: 2 * 11]  # through turn 10's answer
        (fork,), _ = await resend(proxy, 1, fork_items)
        assert await store.get_record(TAIL_RECORD, fork) is not None
        for response_id, first, turns in ((changed, "y", 31), (fork, "x", 12)):
            r = await respond(
                proxy, model="scripted", input="On.", previous_response_id=response_id
            )
            assert r.status_code == 200, r.text
            sent = sent_texts(proxy.upstream.bodies[-1])
            assert len(sent) == 2 * turns + 1
            assert sent[0] == "0:" + first * 500
            assert sent[-3] == f"{turns - 1}:" + "x" * 500


async def test_a_resent_conversation_whose_part_is_deleted_goes_on_as_sent(
    proxy_for: ProxyFactory,
) -> None:
    """A part its fingerprint names is deleted, and a turn sends the deleted response's answer
    in full (not by reference): the whole conversation goes upstream, and the response, whose
    write finds that part gone, keeps it whole: it is continued by id, whole."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids, items = await resend(proxy, 28)
        tail = await store.get_record(TAIL_RECORD, ids[-1])
        assert tail is not None
        named = orjson.loads(tail.partition(b"\n")[0])[0][0]
        assert (await proxy.client.delete(f"/v1/responses/{named}")).status_code == 200
        answer = {"role": "assistant", "content": "Noted."}
        owned = {"msg_" + named.removeprefix("resp_")}
        items = [answer if item.get("id") in owned else item for item in items]
        (last,), _ = await resend(proxy, 1, items)
        assert len(proxy.upstream.bodies[-1]["messages"]) == 57
        sent = proxy.upstream.bodies[-1]["messages"]
        assert (await proxy.client.get(f"/v1/responses/{last}")).status_code == 200
        r = await respond(proxy, model="scripted", input="On.", previous_response_id=last)
        assert r.status_code == 200, r.text
        again = [
            *sent,
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "On."},
        ]
        assert proxy.upstream.bodies[-1]["messages"] == again


async def test_a_turn_whose_items_after_its_last_reference_are_not_the_rest_is_stored_as_sent(
    proxy_for: ProxyFactory,
) -> None:
    """Its messages begin with the conversation of the response it names last, but through
    other items (that response's own input item named after a message sent again): its input
    items are listed as they were sent."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        (first,), items = await resend(proxy, 1)
        sent = [
            *items[:1],
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "1:"},
        ]
        sent.append({"type": "item_reference", "id": "in_" + first.removeprefix("resp_") + "_0"})
        r = await respond(proxy, model="scripted", input=sent)
        assert r.status_code == 200, r.text
        assert len(proxy.upstream.bodies[-1]["messages"]) == 4
        listed = await proxy.client.get(f"/v1/responses/{r.json()['id']}/input_items?order=asc")
    assert [item["type"] for item in listed.json()["data"]] == ["message"] * 4
    assert await store.get_record(stored_conversation.CONVERSATION_RECORD, r.json()["id"])


async def test_another_key_s_items_sent_whole_are_stored_as_sent(proxy_for: ProxyFactory) -> None:
    """Their response's fingerprint is not read for another key (nor its parts named)."""
    store = CountedStore()
    async with proxy_for(keyed(key("a"), key("b")), store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        _, items = await resend(proxy, 28, as_key="a", whole=True)
        store.clear()
        (theirs,), _ = await resend(proxy, 1, items, as_key="b", whole=True)
        (ours,), _ = await resend(proxy, 1, items, as_key="a", whole=True)
        whole = stored_conversation.CONVERSATION_RECORD
        for response_id, kind in ((theirs, whole), (ours, TAIL_RECORD)):
            assert await MemoryStore.get_record(store, kind, response_id) is not None
    assert store.kept[0] == []


async def test_a_stored_output_over_the_read_ahead_is_read_when_a_turn_continues_it(
    proxy_for: ProxyFactory,
) -> None:
    """Its items sent whole, after the items its request sent: the output is read whole (and
    charged) to be compared, and the conversation through it read on its own."""
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(say("y" * (AHEAD_BYTES + 1)), keep(say("Noted.")))
        (first,), items = await resend(proxy, 1, whole=True)
        store.clear()
        (second,), _ = await resend(proxy, 1, items, whole=True)
        assert store.read > AHEAD_BYTES
        inputs = await MemoryStore.get_record(store, "input", second)
    assert inputs is not None
    assert orjson.loads(inputs)["previous"] == first
    kinds = [[kind for kind, _ in pairs] for pairs in store.reads[:3]]
    conversation = ["conversation", TAIL_RECORD]
    assert kinds == [[FINGERPRINT_RECORD], ["outputs", *conversation], conversation]


@pytest.mark.parametrize("whole", [False, True], ids=["references", "items"])
async def test_a_resent_conversation_with_server_calls_continues_each_turn(
    proxy_for: ProxyFactory, whole: bool
) -> None:
    """A server call's `mcp_call` item, sent back, makes the call and result it stands for
    under the item's id: the fingerprint names the call so, so the next turn begins with the
    stored conversation (each call paired with its result, whichever id it goes by)."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        weather = (call("get_weather", city="Lima"), say_tool_result(), say("Noted."))
        proxy.upstream.script(*weather, *weather, *weather, say("Done."))
        ids, _ = await resend(proxy, 6, model="weather", whole=whole, size=2_000)
        inputs = [await store.get_record("input", response_id) for response_id in ids]
        assert [orjson.loads(i or b"{}")["previous"] for i in inputs] == [None, *ids[:-1]]
        assert await store.get_record(TAIL_RECORD, ids[-1]) is not None  # continued
        r = await respond(proxy, model="weather", input="On.", previous_response_id=ids[-1])
        assert r.status_code == 200, r.text
    sent = proxy.upstream.bodies[-1]["messages"]
    calls = [c["id"] for m in sent for c in m.get("tool_calls") or ()]
    assert len(calls) == 3
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == calls


async def test_a_turn_not_continuing_an_agent_s_conversation_still_begins_with_it(
    proxy_for: ProxyFactory,
) -> None:
    """After turns that continued the responses they named (their conversations read from the
    stored parts, server calls under the upstream's ids), a turn whose items are not the
    earlier turn's (a message's own id left out now), though its messages are, is stored as
    that conversation's continuation: no whole copy."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(weather_each_turn))
        first = {"role": "user", "content": "0:" + "x" * 600, "id": "u-0"}
        ids, items = await resend(proxy, 7, [first], model="weather", whole=True, size=600)
        inputs = [await store.get_record("input", response_id) for response_id in ids]
        assert [orjson.loads(i or b"{}")["previous"] for i in inputs] == [None, *ids[:-1]]
        unnamed = [{"role": "user", "content": first["content"]}, *items[1:]]
        (last,), _ = await resend(proxy, 1, unnamed, model="weather", whole=True, size=600)
        assert await store.get_record(stored_conversation.CONVERSATION_RECORD, last) is None
        assert await store.get_record(TAIL_RECORD, last) is not None


def weather_each_turn(body: dict[str, Any]) -> Reply:
    """A call of `get_weather` each turn, answered with its result."""
    if body["messages"][-1]["role"] == "tool":
        return say_tool_result()(body)
    return call("get_weather", city="Lima")


def openai_like(request: httpx.Request) -> httpx.Response:
    """An upstream that answers as api.openai.com does: its message holds more than the output
    items give back (`refusal`, `annotations`)."""
    message = {"role": "assistant", "content": "Noted.", "refusal": None, "annotations": []}
    choice = {"index": 0, "finish_reason": "stop", "logprobs": None, "message": message}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "model": "scripted"}
    return httpx.Response(200, json={**body, "choices": [choice], "usage": usage})


@pytest.mark.parametrize("whole", [False, True], ids=["references", "items"])
async def test_an_upstream_s_fuller_messages_are_continued_as_their_items_give_them(
    proxy_for: ProxyFactory, whole: bool
) -> None:
    store = MemoryStore()
    async with proxy_for(store=store, handler=openai_like) as proxy:
        ids, _ = await resend(proxy, 20, whole=whole)
        tail = await store.get_record(TAIL_RECORD, ids[-1])
        assert tail is not None
        assert tail.endswith(b'"refusal":null,"annotations":[]}]')  # stored as it came


@pytest.mark.parametrize("failing", ["get_record", "get_records"])
async def test_a_turn_whose_reads_fail_is_stored_as_it_was_sent(
    proxy_for: ProxyFactory, failing: str
) -> None:
    """The backend fails the fingerprint's read (`get_record`): the turn is stored whole, as
    when there is none; or the continuation's read after it (`get_records`): its input items
    are stored whole, its conversation still known by the fingerprint. The request is
    answered all the same."""
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        _, items = await resend(proxy, 28, whole=True)
        store.failing = {failing}
        (last,), _ = await resend(proxy, 1, items, whole=True)
        store.failing = set()
        inputs = await store.get_record("input", last)
        assert inputs is not None
        assert orjson.loads(inputs)["previous"] is None
        whole = await store.get_record(stored_conversation.CONVERSATION_RECORD, last)
        assert (whole is not None) is (failing == "get_record")
        r = await respond(proxy, model="scripted", input="On.", previous_response_id=last)
        assert r.status_code == 200, r.text
        assert len(proxy.upstream.bodies[-1]["messages"]) == 2 * 29 + 1


async def test_a_resent_turn_s_input_items_are_listed_as_it_sent_them(
    proxy_for: ProxyFactory,
) -> None:
    """Items that make the same messages as the earlier turn's (a system message for a
    developer one, no id for a given one, a hosted call left out) are its own, not that turn's:
    its input items are stored whole; its conversation continues the earlier turn's."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        first = [
            {"role": "developer", "content": "Be brief."},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {"role": "user", "content": "a" * 5_000, "id": "u-first"},
        ]
        made = (await respond(proxy, model="scripted", input=first)).json()
        second = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "a" * 5_000},
            {"type": "item_reference", "id": made["output"][0]["id"]},
            {"role": "user", "content": "c"},
        ]
        again = (await respond(proxy, model="scripted", input=second)).json()
        listed = await proxy.client.get(f"/v1/responses/{again['id']}/input_items?order=asc")
        assert await store.get_record(TAIL_RECORD, again["id"]) is not None
    assert [(i["type"], i.get("role")) for i in listed.json()["data"]] == [
        ("message", "system"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]


async def test_a_resent_conversation_s_input_chain_is_bounded(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing walks at most MAX_CHAIN input records: the turn past it starts a new chain,
    its input items stored whole."""
    monkeypatch.setattr(input_items, "MAX_CHAIN", 4)
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids, _ = await resend(proxy, 10, whole=True)
        inputs = [await store.get_record("input", response_id) for response_id in ids]
        previous = [orjson.loads(record or b"{}")["previous"] for record in inputs]
        assert previous == [None, *ids[:3], None, *ids[4:7], None, ids[8]]
        listed = await proxy.client.get(f"/v1/responses/{ids[-1]}/input_items?order=asc&limit=100")
    assert listed.status_code == 200, listed.text
    assert len(listed.json()["data"]) == 19


ASK = {
    "type": "function",
    "name": "ask_user",
    "parameters": {"type": "object", "properties": {"question": {"type": "string"}}},
}


@pytest.mark.parametrize("whole", [False, True], ids=["references", "items"])
async def test_a_server_call_then_a_client_call_sent_back_go_upstream_as_two_steps(
    proxy_for: ProxyFactory, whole: bool
) -> None:
    """`[mcp_call, function_call]` sent back after the request's own items continues that
    response: the upstream is sent the two steps the model made (the items alone would read as
    one step of two calls), and a continuation by id sends that request's messages, the reply,
    and what follows."""
    async with proxy_for() as proxy:
        proxy.upstream.script(
            call("get_weather", city="Lima"), call("ask_user", question="Go?"), say("Done.")
        )
        items: list[dict[str, Any]] = [{"role": "user", "content": "Lima?"}]
        made = (await respond(proxy, model="weather", input=items, tools=[ASK])).json()
        output = made["output"]
        assert [item["type"] for item in output] == ["mcp_call", "function_call"]
        items += output if whole else [{"type": "item_reference", "id": i["id"]} for i in output]
        items.append(
            {"type": "function_call_output", "call_id": output[1]["call_id"], "output": "yes"}
        )
        first = proxy.upstream.bodies[-1]["messages"]  # the client call's step
        done = await respond(proxy, model="weather", input=items, tools=[ASK])
        assert done.status_code == 200, done.text
        sent = proxy.upstream.bodies[-1]["messages"]
        assert sent[: len(first)] == first
        assert [m["role"] for m in sent[len(first) :]] == ["assistant", "tool"]
        proxy.upstream.script(say("On it."))
        r = await respond(
            proxy, model="weather", input="On.", previous_response_id=done.json()["id"], tools=[ASK]
        )
        assert r.status_code == 200, r.text
    assert proxy.upstream.bodies[-1]["messages"] == [
        *sent,
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "On."},
    ]


@pytest.mark.parametrize("parallel", [False, True], ids=["two steps", "one step"])
async def test_server_calls_sent_back_without_storing_go_upstream_as_the_steps_they_were(
    proxy_for: ProxyFactory, parallel: bool
) -> None:
    """With `store: false` (the Agents SDK's `to_input_list()`), `[mcp_call, function_call]`
    sent back was read as one step of two calls: a server call then a client call were sent
    upstream as one assistant message (a model that counts its steps called the client's tool
    again). The calls held back with the client's call put the steps back as they were: two,
    or one of two parallel calls."""
    ask = Call("ask_user", {"question": "Go?"})
    weather = Call("get_weather", {"city": "Lima"})
    async with proxy_for() as proxy:
        if parallel:
            proxy.upstream.script(Reply(calls=(weather, ask)), say("Done."))
        else:
            proxy.upstream.script(Reply(calls=(weather,)), Reply(calls=(ask,)), say("Done."))
        items: list[dict[str, Any]] = [{"role": "user", "content": "Lima?"}]
        made = await respond(proxy, model="weather", input=items, tools=[ASK], store=False)
        output = made.json()["output"]
        assert [item["type"] for item in output] == ["mcp_call", "function_call"]
        asked = proxy.upstream.bodies[-1]["messages"]  # through the client call's step, as run
        items += output
        items.append(
            {"type": "function_call_output", "call_id": output[1]["call_id"], "output": "yes"}
        )
        done = await respond(proxy, model="weather", input=items, tools=[ASK], store=False)
        assert done.status_code == 200, done.text
    sent = proxy.upstream.bodies[-1]["messages"]
    steps = [[c["function"]["name"] for c in m["tool_calls"]] for m in sent if m.get("tool_calls")]
    assert steps == ([["get_weather", "ask_user"]] if parallel else [["get_weather"], ["ask_user"]])
    after = ["assistant", "tool", "tool"] if parallel else ["assistant", "tool"]
    assert [m["role"] for m in sent] == [m["role"] for m in asked] + after
    assert sent[-1] == {"role": "tool", "tool_call_id": output[1]["call_id"], "content": "yes"}


async def test_an_earlier_run_s_steps_stay_when_a_later_one_s_are_put_back(
    proxy_for: ProxyFactory,
) -> None:
    """Two runs of one turn, each a server call then a client call, the same server call both
    times, sent back without storing: putting the second run's steps back dropped the first
    run's server step too (it matched by name and arguments)."""
    weather = Call("get_weather", {"city": "Lima"})
    asks = [Call("ask_user", {"question": q}) for q in ("Go?", "Sure?")]
    async with proxy_for() as proxy:
        proxy.upstream.script(
            Reply(calls=(weather,)),
            Reply(calls=(asks[0],)),
            Reply(calls=(weather,)),
            Reply(calls=(asks[1],)),
            say("Done."),
        )
        items: list[dict[str, Any]] = [{"role": "user", "content": "Lima?"}]
        for _ in asks:
            made = await respond(proxy, model="weather", input=items, tools=[ASK], store=False)
            output = made.json()["output"]
            assert [item["type"] for item in output] == ["mcp_call", "function_call"]
            items += output
            items.append(
                {"type": "function_call_output", "call_id": output[1]["call_id"], "output": "yes"}
            )
        asked = proxy.upstream.bodies[-1]["messages"]  # the second run, as it ran
        done = await respond(proxy, model="weather", input=items, tools=[ASK], store=False)
        assert done.status_code == 200, done.text
    sent = proxy.upstream.bodies[-1]["messages"]
    steps = [[c["function"]["name"] for c in m["tool_calls"]] for m in sent if m.get("tool_calls")]
    assert steps == [["get_weather"], ["ask_user"], ["get_weather"], ["ask_user"]]
    assert sent[: len(asked)] == asked


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
async def test_a_client_call_sent_back_whole_without_its_id_continues_its_response(
    proxy_for: ProxyFactory, streamed: bool
) -> None:
    """The AI SDK sends a client call back whole, without its `id` and `status`, and the text
    that came with it by reference, in the order the response listed them (a JSON response:
    the call first; a stream: the text first): that response is continued, and the upstream
    is sent its message (text and call) before the call's output."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        asked = Reply(content="Let me ask.", calls=(Call("ask_user", {"question": "Go?"}),))
        proxy.upstream.script(say("Hello."), asked, say("Done."))
        items: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
        first = (await respond(proxy, model="scripted", input=items, tools=[ASK])).json()
        items += [{"type": "item_reference", "id": item["id"]} for item in first["output"]]
        items.append({"role": "user", "content": "Go on?"})
        body = {"model": "scripted", "input": items, "tools": [ASK], "stream": streamed}
        r = await proxy.client.post("/v1/responses", json=body)
        made = checked(parse_events(r.text)) if streamed else r.json()
        kinds = [item["type"] for item in made["output"]]
        assert kinds == (["message", "function_call"] if streamed else ["function_call", "message"])
        for item in made["output"]:
            if item["type"] == "function_call":
                fields = ("type", "call_id", "name", "arguments")
                items.append({field: item[field] for field in fields})
                call_id = item["call_id"]
            else:
                items.append({"type": "item_reference", "id": item["id"]})
        items.append({"type": "function_call_output", "call_id": call_id, "output": "yes"})
        done = await respond(proxy, model="scripted", input=items, tools=[ASK])
        assert done.status_code == 200, done.text
        inputs = await store.get_record("input", done.json()["id"])
    assert inputs is not None
    assert orjson.loads(inputs)["previous"] == made["id"]
    sent = proxy.upstream.bodies[-1]["messages"]
    assert [(m["role"], m.get("content")) for m in sent[-3:]] == [
        ("user", "Go on?"),
        ("assistant", "Let me ask."),
        ("tool", "yes"),
    ]
    assert sent[-2]["tool_calls"][0]["id"] == call_id


@pytest.mark.parametrize("earlier", [0, 1], ids=["first-turn", "later-turn"])
async def test_a_response_that_only_calls_a_client_tool_is_continued_by_its_call(
    proxy_for: ProxyFactory, earlier: int
) -> None:
    """Its call sent back whole without its item's id is the only item naming it: the call's
    id names it (a record of its own, in the key's namespace), so the turn that answers the
    call continues it and is sent the message the model made; deleting it drops that record."""
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(*[say("Hello.")] * earlier, call("ask_user", question="Go?"))
        _, items = await resend(proxy, earlier, model="scripted")
        items.append({"role": "user", "content": "Go on?"})
        asked = await respond(proxy, model="scripted", input=items, tools=[ASK])
        (called,) = asked.json()["output"]
        step = proxy.upstream.bodies[-1]["messages"]
        items.append({key: called[key] for key in ("type", "call_id", "name", "arguments")})
        items.append({"type": "function_call_output", "call_id": called["call_id"], "output": "y"})
        proxy.upstream.script(say("Done."))
        store.clear()
        done = await respond(proxy, model="scripted", input=items, tools=[ASK])
        assert done.status_code == 200, done.text
        inputs = await MemoryStore.get_record(store, "input", done.json()["id"])
        assert inputs is not None
        assert orjson.loads(inputs)["previous"] == asked.json()["id"]
        assert store.reads[0] == [("call", called["call_id"])]
        sent = proxy.upstream.bodies[-1]["messages"]
        assert sent[: len(step)] == step
        assert sent[len(step) :][0]["tool_calls"][0]["id"] == called["call_id"]
        store.clear()
        proxy.upstream.script(say("Done."))
        unstored = await respond(proxy, model="scripted", input=items, tools=[ASK], store=False)
        assert unstored.status_code == 200, unstored.text
        assert "call" not in {kind for pairs in store.reads for kind, _ in pairs}
        await proxy.client.delete(f"/v1/responses/{asked.json()['id']}")
        assert await MemoryStore.get_record(store, "call", called["call_id"]) is None


async def test_a_call_id_names_a_response_of_the_key_that_made_it(
    proxy_for: ProxyFactory,
) -> None:
    """Two keys whose upstream gave their calls one id: each key's call names its own
    response (a record in each key's namespace), and never the other's."""
    store = MemoryStore()
    async with proxy_for(keyed(key("a"), key("b")), store=store) as proxy:
        same = Reply(calls=(Call("ask_user", {"question": "Go?"}, id="call_same"),))
        proxy.upstream.script(same, same, keep(say("Done.")))
        items: list[dict[str, Any]] = [{"role": "user", "content": "Go?"}]
        asked = {}
        for name in ("a", "b"):
            r = await respond(proxy, name, model="scripted", input=items, tools=[ASK])
            asked[name] = r.json()["id"]
        (called,) = r.json()["output"]
        items.append({key: called[key] for key in ("type", "call_id", "name", "arguments")})
        items.append({"type": "function_call_output", "call_id": "call_same", "output": "y"})
        previous = {}
        for name in ("a", "b"):
            r = await respond(proxy, name, model="scripted", input=items, tools=[ASK])
            assert r.status_code == 200, r.text
            inputs = await store.get_record("input", r.json()["id"])
            previous[name] = orjson.loads(inputs or b"{}")["previous"]
    assert previous == asked


async def test_items_sent_back_as_an_sdk_dumps_them_continue_the_input_chain(
    proxy_for: ProxyFactory,
) -> None:
    """`model_dump()` of the openai SDK's items gives every field it knows, null or not: the
    same items, so the turn's input record continues the chain."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        (first,), items = await resend(proxy, 1, whole=True)
        dumped = [
            *items[:1],
            *(ResponseOutputMessage.model_validate(item).model_dump() for item in items[1:]),
        ]
        assert None in dumped[1].values()  # `phase`, which the proxy does not give
        (second,), _ = await resend(proxy, 1, dumped, whole=True)
        inputs = await store.get_record("input", second)
    assert inputs is not None
    assert orjson.loads(inputs)["previous"] == first


async def test_a_chain_continued_by_id_sends_the_upstream_s_own_call_ids(
    proxy_for: ProxyFactory,
) -> None:
    """An upstream that takes only ids of its own form (Mistral: nine letters and digits) is
    sent back the ids it gave, not those of the items that showed its calls."""
    async with proxy_for() as proxy:
        mistral = Reply(calls=(Call("get_weather", {"city": "Lima"}, id="aB3dE5fG7"),))
        proxy.upstream.script(mistral, say("Sunny."), say("Bye."))
        first = await respond(proxy, model="weather", input="Lima?")
        assert first.status_code == 200, first.text
        step = proxy.upstream.bodies[-1]["messages"]
        then = await respond(
            proxy, model="weather", input="Thanks", previous_response_id=first.json()["id"]
        )
        assert then.status_code == 200, then.text
    assert proxy.upstream.bodies[-1]["messages"][: len(step)] == step


async def test_a_fingerprint_left_by_a_delete_of_the_version_before_leaves_no_gap(
    proxy_for: ProxyFactory,
) -> None:
    """That version's delete drops the response's other records: its items sent whole again
    make a turn that does not continue it (its outputs are gone) but whose conversation begins
    with its conversation's messages, as sent: continued by id, it is whole (a part found gone
    by the write would be kept whole)."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids, items = await resend(proxy, 28, whole=True)
        older = ["conversation", TAIL_RECORD, "input", "outputs", "response"]
        await store.delete_records([(kind, ids[-1]) for kind in older])
        (last,), _ = await resend(proxy, 1, items, whole=True)
        inputs = await store.get_record("input", last)
        assert inputs is not None
        assert orjson.loads(inputs)["previous"] is None
        r = await respond(proxy, model="scripted", input="On.", previous_response_id=last)
        assert r.status_code == 200, r.text
        assert len(proxy.upstream.bodies[-1]["messages"]) == 2 * 29 + 1


class PartGoneBeforeTheWrite(MemoryStore):
    """A part named by a write is deleted just before it (expired, or its response deleted,
    between the read of the conversation and the write of its continuation), while `armed`."""

    armed = True

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        if keep and self.armed:
            await self.delete_records(keep[:1])
        return await super().put_records(records, ttl_s, keep_thread, keep)


async def test_a_continuation_whose_part_goes_before_its_write_keeps_its_conversation_whole(
    proxy_for: ProxyFactory,
) -> None:
    store = PartGoneBeforeTheWrite()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        ids = await chain(proxy, 30)
        last = ids[-1]
        assert await store.get_record(stored_conversation.CONVERSATION_RECORD, last) is not None
        r = await respond(proxy, model="scripted", input="On.", previous_response_id=last)
        assert r.status_code == 200, r.text
    sent = proxy.upstream.bodies[-1]["messages"]
    assert [m["content"] for m in sent[::2]] == [f"{n}:" + "x" * 500 for n in range(30)] + ["On."]


@pytest.mark.parametrize("how", ["resent", "previous_response_id"])
async def test_a_response_kept_whole_beside_its_tail_is_continued_from_the_whole(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Its first write left a tail record: a continuation whose read-ahead holds the
    conversation record but not the tail reads the whole one."""
    store = PartGoneBeforeTheWrite()
    store.armed = False
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(keep(say("Noted.")))
        _, items = await resend(proxy, 29, whole=True)
        store.armed = True
        (last,), items = await resend(proxy, 1, items, whole=True)
        store.armed = False
        records = {kind: await store.get_record(kind, last) for kind in (*KINDS, "response")}
        whole, tail = records["conversation"], records[TAIL_RECORD]
        assert whole is not None
        assert tail is not None
        ahead = sum(len(records[kind] or b"") for kind in ("outputs", "conversation"))
        if how == "previous_response_id":
            ahead += len(records["response"] or b"")
        monkeypatch.setattr(stored_reads, "AHEAD_BYTES", ahead + len(tail) // 2)
        if how == "resent":
            r = await respond(
                proxy, model="scripted", input=[*items, {"role": "user", "content": "On."}]
            )
        else:
            r = await respond(proxy, model="scripted", input="On.", previous_response_id=last)
        assert r.status_code == 200, r.text
    sent = proxy.upstream.bodies[-1]["messages"]
    assert [m["content"] for m in sent[::2]] == [f"{n}:" + "x" * 500 for n in range(30)] + ["On."]


KINDS = ("outputs", stored_conversation.CONVERSATION_RECORD, TAIL_RECORD)
