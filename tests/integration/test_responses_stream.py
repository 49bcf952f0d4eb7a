"""`POST /v1/responses` with `stream: true`: the event stream of SPEC §12.3."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import httpx
import pytest
from starlette.types import Message

from proxy.engine import events as ev
from proxy.telemetry.http import CUT_ON_PURPOSE
from tests.direct_asgi import body_then_stay, post_scope
from tests.integration.conftest import Proxy, ProxyFactory
from tests.response_events import checked, parse_events, stream_text
from tests.scripted_upstream import call, calls, fail, say, say_tool_result

FUNCTION = {
    "type": "function",
    "name": "lookup_order",
    "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
}


async def stream(proxy: Proxy, **body: Any) -> httpx.Response:
    body.setdefault("input", "hi")
    return await proxy.client.post("/v1/responses", json={**body, "stream": True})


async def test_a_streamed_tool_loop(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Paris"), say_tool_result("Found: {}"))
    r = await stream(proxy, model="weather", input="Paris?")
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-loopwarden-run-id"]
    events = parse_events(r.text)
    final = checked(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.mcp_call.in_progress",
        "response.mcp_call.completed",
    ]
    assert kinds[-1] == "response.completed"
    mcp, message = final["output"]
    assert (mcp["type"], mcp["name"], mcp["status"]) == ("mcp_call", "get_weather", "completed")
    assert message["content"][0]["text"] == stream_text(events)
    assert stream_text(events).startswith("Found: {")
    assert final["status"] == "completed"
    assert final["loop"]["stop_reason"] == "completed"
    assert final["usage"]["total_tokens"] > 0
    assert all(sent["stream"] is True for sent in proxy.upstream.bodies)


async def test_text_around_server_calls_is_a_message_item_before_and_one_after(
    proxy: Proxy,
) -> None:
    """One item open at a time: the message is done before the server call is added, and
    the text after the call is a message of its own, its step's text alone (the blank line
    between the steps ends the one before). Every message's text, in order, is the final
    text."""
    proxy.upstream.script(
        replace(call("get_weather", city="Paris"), content="Looking."), say_tool_result("Found: {}")
    )
    events = parse_events((await stream(proxy, model="weather", input="Paris?")).text)
    final = checked(events)
    first, mcp, second = final["output"]
    assert (first["type"], mcp["type"], second["type"]) == ("message", "mcp_call", "message")
    assert first["id"] != second["id"]
    texts = [item["content"][0]["text"] for item in (first, second)]
    assert texts[0] == "Looking.\n\n"
    assert texts[1].startswith("Found: {")
    assert "".join(texts) == stream_text(events)
    stored = (await proxy.client.get(f"/v1/responses/{final['id']}")).json()
    assert [i["id"] for i in stored["output"]] == [first["id"], mcp["id"], second["id"]]


async def test_a_streamed_client_call_and_custom_call(proxy: Proxy) -> None:
    patch = {"type": "custom", "name": "apply_patch"}
    proxy.upstream.script(
        call("lookup_order", order="A-1"), call("apply_patch", input="*** Begin Patch")
    )
    first = checked(parse_events((await stream(proxy, model="scripted", tools=[FUNCTION])).text))
    [fc] = first["output"]
    assert (fc["type"], json.loads(fc["arguments"])) == ("function_call", {"order": "A-1"})
    assert first["loop"]["stop_reason"] == "client_tool_call"
    events = parse_events((await stream(proxy, model="scripted", tools=[patch])).text)
    kinds = [e["type"] for e in events]
    assert "response.custom_tool_call_input.delta" in kinds
    [ctc] = checked(events)["output"]
    assert (ctc["type"], ctc["input"]) == ("custom_tool_call", "*** Begin Patch")


async def test_keep_alives_while_tools_run(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"server": {"keepalive_interval_s": 0.05}}) as proxy:
        proxy.upstream.script(call("sleep", seconds=0.3), say("Rested."))
        r = await stream(proxy, model="scripted", loop={"tools": ["sleep"]})
        assert ": keep-alive\n\n" in r.text
        assert checked(parse_events(r.text))["status"] == "completed"


async def test_a_message_cut_at_the_clients_max_output_tokens_is_incomplete(
    proxy: Proxy,
) -> None:
    proxy.upstream.script(say("A long answer that goes on and on and on."))
    events = parse_events((await stream(proxy, model="scripted", max_output_tokens=2)).text)
    final = checked(events)
    assert (events[-1]["type"], final["status"]) == ("response.incomplete", "incomplete")
    (message,) = final["output"]
    assert message["status"] == "incomplete"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [message]


@pytest.mark.parametrize("stopped", [False, True])
async def test_server_calls_run_side_by_side_are_shown_one_after_another(
    proxy_for: ProxyFactory, stopped: bool
) -> None:
    """With `parallel_tool_calls` the calls run at once; their items are open one at a time,
    in the order the calls started, however their ends come (a time budget ending two)."""
    loop: dict[str, Any] = {"tools": ["sleep", "get_weather"], "parallel_tool_calls": True}
    if stopped:
        loop["stop_when"] = [{"max_duration_s": 0.3}]
    async with proxy_for() as proxy:
        proxy.upstream.script(
            calls(
                call("sleep", seconds=0.2 if not stopped else 5),
                call("get_weather", city="Oslo"),
                call("sleep", seconds=0.1 if not stopped else 5),
            ),
            say("All three."),
        )
        r = await stream(proxy, model="scripted", loop=loop)
    events = parse_events(r.text)
    final = checked(events)  # one item open at a time
    names = [(i["name"], i["status"]) for i in final["output"] if i["type"] == "mcp_call"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    # Each added as it began (one that ended while another was shown was added `completed`).
    assert [(i["status"], i["output"], i["error"]) for i in added if i["type"] == "mcp_call"] == [
        ("in_progress", None, None)
    ] * 3
    ends = {  # (a call cut short by the stop was done without its `failed` event)
        e["item_id"]: e["type"].rpartition(".")[2]
        for e in events
        if e["type"] in ("response.mcp_call.completed", "response.mcp_call.failed")
    }
    outcomes = [ends[i["id"]] for i in final["output"] if i["type"] == "mcp_call"]
    assert outcomes == (["failed", "completed", "failed"] if stopped else ["completed"] * 3)
    if stopped:
        assert final["loop"]["stop_reason"] == "time_budget"
        assert names == [
            ("sleep", "incomplete"),
            ("get_weather", "completed"),
            ("sleep", "incomplete"),
        ]
    else:
        assert names == [
            ("sleep", "completed"),
            ("get_weather", "completed"),
            ("sleep", "completed"),
        ]


async def test_an_upstream_failure_after_a_tool_ran_is_response_failed(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Paris"), fail(500, "down"))
    r = await stream(proxy, model="weather")
    assert r.status_code == 200
    events = parse_events(r.text)
    final = checked(events)
    assert events[-1]["type"] == "response.failed"
    assert final["status"] == "failed"
    assert final["error"]["code"] == "upstream_error"
    assert final["loop"]["stop_reason"] == "upstream_error"
    assert [i["type"] for i in final["output"]] == ["mcp_call"]
    assert (await proxy.client.get(f"/v1/responses/{final['id']}")).status_code == 404


async def test_a_failure_after_text_keeps_the_text_streamed_in_the_failed_response(
    proxy: Proxy,
) -> None:
    proxy.upstream.script(replace(call("get_weather", city="Paris"), content="Looking."), fail(500))
    events = parse_events((await stream(proxy, model="weather")).text)
    final = checked(events)  # every item added is done, at its index
    assert events[-1]["type"] == "response.failed"
    message, mcp = final["output"]  # the message ended with the break a next step begins with
    assert (message["content"][0]["text"], mcp["type"]) == ("Looking.\n\n", "mcp_call")


async def test_an_upstream_failure_before_any_output_keeps_its_status(proxy: Proxy) -> None:
    proxy.upstream.script(fail(429, "slow down", error_type="rate_limit_error"))
    r = await stream(proxy, model="scripted")
    assert r.status_code == 429
    assert r.json()["error"]["message"] == "slow down"


async def test_a_stream_continues_a_stored_one(proxy: Proxy) -> None:
    proxy.upstream.script(say("First."), say("Second."))
    first = checked(parse_events((await stream(proxy, model="scripted")).text))
    second = checked(
        parse_events((await stream(proxy, model="scripted", previous_response_id=first["id"])).text)
    )
    assert second["output"][0]["content"][0]["text"] == "Second."
    roles = [m["role"] for m in proxy.upstream.bodies[1]["messages"]]
    assert roles == ["user", "assistant", "user"]


async def test_server_calls_can_be_left_out_of_the_output(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"server": {"responses_server_calls": "omit"}}) as proxy:
        proxy.upstream.script(
            call("get_weather", city="Paris"),
            say_tool_result("Found: {}"),
            call("get_weather", city="Rome"),
            say_tool_result("Found: {}"),
        )
        body = (
            await proxy.client.post("/v1/responses", json={"model": "weather", "input": "hi"})
        ).json()
        assert [i["type"] for i in body["output"]] == ["message"]
        final = checked(parse_events((await stream(proxy, model="weather")).text))
        assert [i["type"] for i in final["output"]] == ["message"]


async def test_left_out_server_calls_are_restored_from_the_held_calls(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for({"server": {"responses_server_calls": "omit"}}) as proxy:
        proxy.upstream.script(
            calls(call("get_weather", city="Paris"), call("lookup_order", order="A-1")),
            say("Done."),
        )
        first = (
            await proxy.client.post(
                "/v1/responses",
                json={"model": "weather", "input": "Go", "tools": [FUNCTION], "store": False},
            )
        ).json()
        [fc] = first["output"]
        assert fc["type"] == "function_call"
        again = [
            {"role": "user", "content": "Go"},
            fc,
            {"type": "function_call_output", "call_id": fc["call_id"], "output": "shipped"},
        ]
        r = await proxy.client.post(
            "/v1/responses",
            json={"model": "weather", "input": again, "tools": [FUNCTION], "store": False},
        )
        assert r.status_code == 200, r.text
        sent = proxy.upstream.bodies[1]["messages"]
        names = [c["function"]["name"] for c in sent[1]["tool_calls"]]
        assert names == ["get_weather", "lookup_order"]
        assert [m["role"] for m in sent[2:]] == ["tool", "tool"]


@pytest.mark.parametrize("shown", ["mcp_call", "omit"])
async def test_a_chain_keeps_a_reply_of_server_and_client_calls_as_the_model_gave_it(
    proxy_for: ProxyFactory, shown: str
) -> None:
    """Continued by `previous_response_id`, the history is the one a client that sends it all
    back gets: the reply's calls in one message, then the results (SPEC §5.1.6)."""
    async with proxy_for({"server": {"responses_server_calls": shown}}) as proxy:
        proxy.upstream.script(
            calls(call("get_weather", city="Paris"), call("lookup_order", order="A-1")),
            say("Done."),
        )
        body = {"model": "weather", "input": "Go", "tools": [FUNCTION]}
        first = (await proxy.client.post("/v1/responses", json=body)).json()
        fc = next(i for i in first["output"] if i["type"] == "function_call")
        output = {"type": "function_call_output", "call_id": fc["call_id"], "output": "shipped"}
        chained = {**body, "input": [output], "previous_response_id": first["id"]}
        r = await proxy.client.post("/v1/responses", json=chained)
        assert r.status_code == 200, r.text
        sent = proxy.upstream.bodies[1]["messages"]
        assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
        names = [c["function"]["name"] for c in sent[1]["tool_calls"]]
        assert names == ["get_weather", "lookup_order"]
        assert "Paris" in sent[2]["content"]
        assert (sent[3]["tool_call_id"], sent[3]["content"]) == (fc["call_id"], "shipped")


@pytest.mark.parametrize("takes_the_rest", [True, False])
async def test_a_time_budget_due_while_a_slow_reader_takes_a_long_event_ends_the_run_so(
    proxy_for: ProxyFactory, takes_the_rest: bool
) -> None:
    """Its deadline cancelled the write between two slices: the stream was cut, and the run
    told as `cancelled` (its client never left). The write ends its events, then the run its
    stream, `time_budget`; a reader that does not take the rest within 3 s has the stream cut
    there, the run ending `time_budget` all the same."""
    bodies: list[bytes] = []
    ended = asyncio.Event()

    async def send(message: Message) -> None:  # a slow reader: its second body waits
        if message["type"] != "http.response.body":
            return
        if len(bodies) == 1:
            await asyncio.sleep(0.5 if takes_the_rest else 3.5)
        bodies.append(message["body"])
        if not message.get("more_body", False):
            ended.set()

    async with proxy_for({"server": {"max_tool_output_bytes": 8 << 20}}) as proxy:
        proxy.upstream.script(call("search_notes", query="x" * 1_500_000), say("done"))
        body = {
            "model": "scripted",
            "input": "go",
            "stream": True,
            "loop": {"tools": ["search_notes"], "stop_when": [{"max_duration_s": 0.2}]},
        }
        app = proxy.client._transport.app  # type: ignore[attr-defined]
        received = body_then_stay(json.dumps(body).encode())
        await asyncio.wait_for(app(post_scope("/v1/responses"), received, send), 20)
        [finished] = proxy.observer.of(ev.RunFinished)
    assert finished.stop.reason.value == "time_budget"
    if not takes_the_rest:
        assert not ended.is_set()  # cut: nothing after the slices sent
        return
    assert ended.is_set()
    events = parse_events(b"".join(bodies).decode())
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["loop"]["stop_reason"] == "time_budget"


@pytest.mark.parametrize("parallel", [False, True])
async def test_a_stream_the_proxy_cut_is_told_to_the_server_as_cut_on_purpose(
    proxy_for: ProxyFactory, parallel: bool
) -> None:
    """Cut in a parallel call's task (its own context), it was not: the server logged "ASGI
    callable returned without completing response" and the span was not failed `cut_short`."""
    bodies: list[bytes] = []

    async def send(message: Message) -> None:
        if message["type"] != "http.response.body":
            return
        if len(bodies) == 1:
            await asyncio.sleep(3.5)  # the rest not taken within 3 s
        bodies.append(message["body"])

    async with proxy_for({"server": {"max_tool_output_bytes": 8 << 20}}) as proxy:
        big = call("search_notes", query="x" * 1_500_000)
        reply = calls(big, call("search_notes", query="y")) if parallel else big
        proxy.upstream.script(reply, say("done"))
        loop = {"tools": ["search_notes"], "parallel_tool_calls": parallel,
                "stop_when": [{"max_duration_s": 0.2}]}  # fmt: skip
        body = {"model": "scripted", "input": "go", "stream": True, "loop": loop}
        app = proxy.client._transport.app  # type: ignore[attr-defined]
        received = body_then_stay(json.dumps(body).encode())

        async def served() -> bool:  # as the server's request task: its context after the app
            await app(post_scope("/v1/responses"), received, send)
            return CUT_ON_PURPOSE.get()

        told = await asyncio.wait_for(served(), 20)
        [finished] = proxy.observer.of(ev.RunFinished)
    assert finished.stop.reason.value == "time_budget"
    assert told
