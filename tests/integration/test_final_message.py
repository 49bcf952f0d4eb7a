"""SPEC §4.2, §4.3, §5.3: the final message, its id and its failures, the same in JSON and SSE."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.conftest import Proxy, ProxyFactory
from tests.integration.counted_store import CountedStore
from tests.integration.test_chat_stream import content, events
from tests.scripted_upstream import Call, Reply, call, calls, keep, say


def streamed(text: str) -> tuple[list[dict[str, Any]], str]:
    """The events of an SSE body, and the content they carry."""
    events = [
        orjson.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    content = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in events if c.get("choices")
    )
    return events, content


@pytest.mark.parametrize("stream", [False, True])
async def test_steps_texts_are_joined_by_a_blank_line_in_json_and_sse(
    proxy: Proxy, stream: bool
) -> None:
    proxy.upstream.script(
        call("get_weather", city="Oslo").replace(content="Let me check."),
        say("It is 4°C in Oslo."),
    )
    r = await proxy.chat(model="weather", stream=stream)
    expected = "Let me check.\n\nIt is 4°C in Oslo."
    run_hex = r.headers["x-loopwarden-run-id"].removeprefix("run_")
    if stream:
        events, content = streamed(r.text)
        assert content == expected
        assert {e["id"] for e in events} == {f"chatcmpl-{run_hex}"}
    else:
        body = r.json()
        assert body["choices"][0]["message"]["content"] == expected
        assert body["id"] == f"chatcmpl-{run_hex}"  # never an upstream step's id


@pytest.mark.parametrize("stream", [False, True])
async def test_a_limit_stop_without_text_states_the_stop(proxy: Proxy, stream: bool) -> None:
    proxy.upstream.script(call("get_weather", city="Oslo"), call("get_weather", city="Lima"))
    r = await proxy.chat(model="weather", stream=stream, loop={"max_steps": 2})
    sentence = "Stopped: the run reached its step limit (2 steps)."
    if stream:
        events, content = streamed(r.text)
        assert content == sentence
        assert events[-1]["loop"]["stop_reason"] == "max_steps"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert r.headers["x-loopwarden-stop-reason"] == "max_steps"
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (sentence, "length")


async def test_a_failure_after_the_first_byte_is_an_error_event_without_choices(
    proxy: Proxy,
) -> None:
    proxy.upstream.script(say("Hello."), say("Hello again."))
    loop = {"tools": ["get_weather"], "terminating_config": {"tool_ids": ["get_weather"]}}
    r = await proxy.chat(model="scripted", stream=True, loop=loop)
    events, content = streamed(r.text)
    assert content.startswith("Hello.")
    last = events[-1]
    assert "choices" not in last
    assert last["error"]["code"] == "max_consecutive_nudges_exceeded"
    assert last["loop"]["stop_reason"] == "nudges_exhausted"
    assert r.text.endswith("data: [DONE]\n\n")


async def test_budget_stops_put_their_condition_on_the_trace(proxy: Proxy) -> None:
    small = {"prompt_tokens": 10, "completion_tokens": 5}
    proxy.upstream.script(keep(call("get_weather", city="Oslo").replace(usage=small)))
    r = await proxy.chat(model="weather", loop={"stop_when": [{"max_tokens_used": 20}]})
    spans = proxy.spans()
    assert r.json()["loop"]["stop_reason"] == "token_budget"
    (run,) = [s for s in spans if s.name.startswith("invoke_agent")]
    (held,) = [e for e in run.events if e.name == "loopwarden.stop_condition.held"]
    assert held.attributes is not None
    assert held.attributes["loopwarden.condition.kind"] == "max_tokens_used"
    assert held.attributes["loopwarden.condition.condition"] == "loop.stop_when[0]"


async def test_an_expression_that_fails_while_evaluated_is_on_the_trace(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    proxy.upstream.script(call("get_weather", city="Oslo"), say("Done."))
    r = await proxy.chat(model="weather", loop={"stop_when": [{"expr": "steps[5].index == 1"}]})
    spans = proxy.spans()
    assert r.json()["loop"]["stop_reason"] == "completed"  # it did not hold
    (run,) = [s for s in spans if s.name.startswith("invoke_agent")]
    (failed,) = [e for e in run.events if e.name == "loopwarden.stop_condition.failed"]
    assert failed.attributes is not None
    assert failed.attributes["loopwarden.condition.condition"] == "loop.stop_when[0]"
    assert "loop.stop_when[0]" in caplog.text


async def test_a_run_report_is_found_by_run_id_and_by_completion_id(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Oslo"), say("4°C"))
    body = (await proxy.chat(model="weather")).json()
    by_run = await proxy.client.get(f"/v1/runs/{body['loop']['run_id']}")
    by_completion = await proxy.client.get(f"/v1/runs/{body['id']}")
    unknown = await proxy.client.get("/v1/runs/run_0000")
    assert by_run.json()["stop_reason"] == "completed"
    assert by_run.json() == by_completion.json()
    assert by_run.json()["steps"] == 2
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found"


async def test_server_calls_of_a_reply_with_client_calls_are_put_back_in_the_history(
    proxy: Proxy,
) -> None:
    proxy.upstream.script(
        calls(call("get_weather", city="Oslo"), call("ask_user", question="Coat?")),
        say("Take a coat."),
    )
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    first = (await proxy.chat(model="weather", tools=[ask_user])).json()
    message = first["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["ask_user"]
    history = [
        {"role": "user", "content": "hi"},
        {k: v for k, v in message.items() if v is not None},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "yes"},
    ]
    second = await proxy.chat(model="weather", tools=[ask_user], messages=history)
    assert second.json()["choices"][0]["message"]["content"] == "Take a coat."
    sent = [m for m in proxy.upstream.bodies[1]["messages"] if m["role"] != "system"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
    names = [c["function"]["name"] for c in sent[1]["tool_calls"]]
    assert names == ["get_weather", "ask_user"]  # the reply as the model gave it
    assert "Oslo" in sent[2]["content"]  # the server call's result, where it ran
    assert sent[3]["content"] == "yes"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_text_of_a_reply_with_server_and_client_calls_is_the_clients_too(
    proxy: Proxy, stream: bool
) -> None:
    """SPEC §5.3: the assistant message with the client calls only, its text as the stream
    sends it (the JSON reply had none); sent back, the history holds the text once."""
    both = calls(call("get_weather", city="Oslo"), call("ask_user", question="Coat?"))
    proxy.upstream.script(replace(both, content="Checking both."), say("Take a coat."))
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    r = await proxy.chat(model="weather", tools=[ask_user], stream=stream)
    if stream:
        chunks = events(r.text)
        text = content(chunks)
        called = [
            c["choices"][0]["delta"].get("tool_calls") for c in chunks[:-1] if c.get("choices")
        ]
        tool_calls = next(c for c in called if c)
        message = {"role": "assistant", "content": text, "tool_calls": tool_calls}
        for call_ in tool_calls:
            call_.pop("index")
    else:
        message = r.json()["choices"][0]["message"]
    assert message["content"] == "Checking both."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["ask_user"]
    history = [
        {"role": "user", "content": "hi"},
        message,
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "yes"},
    ]
    await proxy.chat(model="weather", tools=[ask_user], messages=history)
    sent = [m for m in proxy.upstream.bodies[1]["messages"] if m["role"] != "system"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
    assert sent[1]["content"] == "Checking both."  # once, with both calls
    assert [c["function"]["name"] for c in sent[1]["tool_calls"]] == ["get_weather", "ask_user"]


async def test_earlier_server_steps_of_a_run_that_ends_with_client_calls_are_put_back(
    proxy: Proxy,
) -> None:
    """The client sees only the reply with its own calls; the steps the server ran before it
    come back into the history when the client returns its results, once."""
    proxy.upstream.script(
        call("get_weather", city="Oslo"),
        call("ask_user", question="Coat?"),
        say("Take a coat."),
        say("Still a coat."),
    )
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    first = (await proxy.chat(model="weather", tools=[ask_user])).json()
    message = first["choices"][0]["message"]
    history = [
        {"role": "user", "content": "hi"},
        {k: v for k, v in message.items() if v is not None},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "yes"},
    ]
    await proxy.chat(model="weather", tools=[ask_user], messages=history)
    sent = [m for m in proxy.upstream.bodies[2]["messages"] if m["role"] != "system"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "Oslo" in sent[2]["content"]
    # A history that already holds the server's steps is sent as it is: nothing twice.
    second = (
        await proxy.chat(model="weather", tools=[ask_user], messages=[*sent, say_back()])
    ).json()
    assert second["choices"][0]["message"]["content"] == "Still a coat."
    again = [m for m in proxy.upstream.bodies[3]["messages"] if m["role"] != "system"]
    assert again == [*sent, say_back()]


def say_back() -> dict[str, str]:
    return {"role": "user", "content": "And tomorrow?"}


def mixed(city: str) -> Reply:
    """A reply with a server call and a client call, with the ids some upstreams give every
    conversation."""
    weather = Call("get_weather", {"city": city}, id="call_0")
    return calls(weather, Call("ask_user", {"question": "Coat?"}, id="call_1"))


def answered(asked: list[dict[str, Any]], reply: httpx.Response) -> list[dict[str, Any]]:
    """The history a client sends back: what it asked, the reply, its result for the call."""
    message = reply.json()["choices"][0]["message"]
    call_id = message["tool_calls"][0]["id"]
    result = {"role": "tool", "tool_call_id": call_id, "content": "yes"}
    return [*asked, {k: v for k, v in message.items() if v is not None}, result]


async def test_held_server_calls_go_back_to_their_own_conversation_whatever_the_call_ids(
    proxy: Proxy,
) -> None:
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    proxy.upstream.script(mixed("Oslo"), mixed("Lima"), mixed("Bergen"), say("A."), say("B."))
    alice = [{"role": "user", "content": "Oslo?"}]
    bob = [{"role": "user", "content": "Lima?"}]
    alice_first = await proxy.chat(model="weather", tools=[ask_user], messages=alice)
    bob_first = await proxy.chat(model="weather", tools=[ask_user], messages=bob)
    alice = answered(alice, alice_first)
    alice_again = await proxy.chat(model="weather", tools=[ask_user], messages=alice)
    for history in (answered(alice, alice_again), answered(bob, bob_first)):
        await proxy.chat(model="weather", tools=[ask_user], messages=history)
    to_alice, to_bob = (
        [m for m in body["messages"] if m["role"] != "system"] for body in proxy.upstream.bodies[3:]
    )
    assert [m["role"] for m in to_alice] == ["user", *["assistant", "tool", "tool"] * 2]
    assert ("Oslo" in to_alice[2]["content"], "Bergen" in to_alice[5]["content"]) == (True, True)
    assert [m["role"] for m in to_bob] == ["user", "assistant", "tool", "tool"]
    assert "Lima" in to_bob[2]["content"]


async def test_held_server_calls_go_back_after_the_same_first_question_or_a_trimmed_history(
    proxy: Proxy,
) -> None:
    """Two conversations that begin alike, with the same upstream call ids, each get their
    own server calls back; so does a client that keeps only its latest messages."""
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    proxy.upstream.script(mixed("Oslo"), mixed("Lima"), say("A."), say("B."))
    asked = [
        {"role": "user", "content": "Earlier question."},
        {"role": "assistant", "content": "Earlier answer."},
        {"role": "user", "content": "What should I wear?"},
    ]
    alice = await proxy.chat(model="weather", tools=[ask_user], messages=asked)
    bob = await proxy.chat(model="weather", tools=[ask_user], messages=asked)
    await proxy.chat(model="weather", tools=[ask_user], messages=answered(asked, alice))
    await proxy.chat(model="weather", tools=[ask_user], messages=answered(asked, bob)[2:])
    to_alice, to_bob = (
        [m["content"] for m in body["messages"] if m["role"] == "tool"]
        for body in proxy.upstream.bodies[2:]
    )
    assert "Oslo" in to_alice[0]
    assert to_alice[1] == "yes"
    assert "Lima" in to_bob[0]
    assert to_bob[1] == "yes"


async def test_a_client_call_gets_an_id_of_the_proxys_own_where_the_agent_has_server_tools(
    proxy: Proxy,
) -> None:
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    alone = calls(Call("ask_user", {"question": "Coat?"}, id="call_7"))
    nine = calls(Call("get_weather", {"city": "Oslo"}), Call("ask_user", {}, id="Ab3dE6gH9"))
    proxy.upstream.script(alone, alone, nine)
    ids = []
    for model in ("scripted", "weather", "weather"):
        reply = await proxy.chat(model=model, tools=[ask_user])
        ids.append(reply.json()["choices"][0]["message"]["tool_calls"][0]["id"])
    assert ids[0] == "call_7"  # no server tools: the upstream's own
    assert re.fullmatch(r"call_[0-9a-f]{24}", ids[1])
    assert re.fullmatch(r"[A-Za-z0-9]{9}", ids[2])
    assert ids[2] != "Ab3dE6gH9"


async def test_held_calls_come_back_after_an_earlier_client_call_with_the_same_upstream_id(
    proxy: Proxy,
) -> None:
    """The upstream numbers its calls from `call_0` each turn: the client's first call and the
    server's later one share the id, and the held server call still comes back, once."""
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    first = calls(Call("ask_user", {"question": "Where?"}, id="call_0"))
    second = Reply(
        calls=(
            Call("get_weather", {"city": "Oslo"}, id="call_0"),
            Call("ask_user", {"question": "Coat?"}, id="call_1"),
        )
    )
    proxy.upstream.script(first, second, say("Take a coat."))
    asked = [{"role": "user", "content": "What should I wear?"}]
    history = answered(asked, await proxy.chat(model="weather", tools=[ask_user], messages=asked))
    history += [{"role": "user", "content": "In Oslo."}]
    again = await proxy.chat(model="weather", tools=[ask_user], messages=history)
    await proxy.chat(model="weather", tools=[ask_user], messages=answered(history, again))
    results = [m["content"] for m in proxy.upstream.bodies[2]["messages"] if m["role"] == "tool"]
    assert sum("Oslo" in r for r in results) == 1
    assert results[-1] == "yes"


async def test_the_calls_a_run_held_back_are_kept_as_it_ends_then_its_report(
    proxy_for: ProxyFactory,
) -> None:
    store = CountedStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(
            calls(call("get_weather", city="Oslo"), call("ask_user", question="Coat?"))
        )
        ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
        r = await proxy.chat(model="weather", tools=[ask_user])
    assert r.json()["loop"]["stop_reason"] == "client_tool_call"
    assert store.writes == [(["held"], None), (["run"], None)]


async def test_the_calls_held_back_in_a_history_are_looked_up_in_one_read(
    proxy_for: ProxyFactory,
) -> None:
    store = CountedStore()
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    async with proxy_for(store=store) as proxy:
        for city in ("Oslo", "Lima", "Rome"):
            proxy.upstream.script(
                calls(call("get_weather", city=city), call("ask_user", question="Coat?"))
            )
            r = await proxy.chat(model="weather", tools=[ask_user], messages=history)
            message = r.json()["choices"][0]["message"]
            history.append({k: v for k, v in message.items() if v is not None})
            history.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                            "content": "yes"})  # fmt: skip
        proxy.upstream.script(say("Take a coat."))
        last = await proxy.chat(model="weather", tools=[ask_user], messages=history)
    assert last.json()["choices"][0]["message"]["content"] == "Take a coat."
    assert store.reads_of("held") == [1, 2, 3]  # the first request had nothing to look up
    sent = [m for m in proxy.upstream.bodies[-1]["messages"] if m["role"] == "tool"]
    # The three server calls' results put back, each before its turn's client answer.
    assert [m["content"] == "yes" for m in sent] == [False, True] * 3
    assert all(city in sent[2 * i]["content"] for i, city in enumerate(("Oslo", "Lima", "Rome")))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_finish_reason_stop_after_a_tool_step_gives_no_server_call_to_the_client(
    proxy: Proxy, stream: bool
) -> None:
    """`finish_reason_is: tool_calls` holds after the server's calls ran: the reply carries none
    of them (a client would run a tool it does not have), and states the stop, as the stream
    says it."""
    # Empty text beside the calls, as some upstreams send it.
    proxy.upstream.script(call("get_weather", city="Oslo").replace(content=""))
    loop = {"stop_when": [{"finish_reason_is": "tool_calls"}]}
    r = await proxy.chat(model="weather", stream=stream, loop=loop)
    sentence = "Stopped: the stop condition loop.stop_when[0] held."
    if stream:
        events, content = streamed(r.text)
        assert content == sentence
        assert not [
            e for e in events if e.get("choices") and e["choices"][0]["delta"].get("tool_calls")
        ]
        assert events[-1]["loop"]["stop_reason"] == "finish_reason"
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        message = r.json()["choices"][0]["message"]
        assert r.json()["loop"]["stop_reason"] == "finish_reason"
        assert r.json()["loop"]["tool_calls"] == 1
        assert (message["content"], message.get("tool_calls")) == (sentence, None)
        assert r.json()["choices"][0]["finish_reason"] == "stop"  # no calls to look for


async def test_a_finish_reason_stop_after_a_tool_step_is_no_function_call_item(
    proxy: Proxy,
) -> None:
    """On the Responses API the call that ran is its `mcp_call` item alone (SPEC §12.2)."""
    proxy.upstream.script(call("get_weather", city="Oslo"))
    loop = {"stop_when": [{"finish_reason_is": "tool_calls"}]}
    r = await proxy.client.post(
        "/v1/responses", json={"model": "weather", "input": "Oslo?", "loop": loop}
    )
    assert [item["type"] for item in r.json()["output"]] == ["mcp_call", "message"]


async def test_a_limit_of_one_states_it_in_the_singular(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Oslo"))
    r = await proxy.chat(model="weather", loop={"max_steps": 1})
    content = r.json()["choices"][0]["message"]["content"]
    assert content == "Stopped: the run reached its step limit (1 step)."
