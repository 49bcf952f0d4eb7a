"""Chat Completions in JSON mode through the ASGI app."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx
from starlette.types import Message

from proxy.conditions import WEBHOOK_ANSWER_BYTES
from proxy.engine import events as ev
from tests.bodies import user
from tests.direct_asgi import body_then_stay, post_scope
from tests.faulty_upstream import delta
from tests.integration.conftest import Proxy, ProxyFactory
from tests.integration.test_chat_stream import content, events
from tests.scripted_upstream import call, fail, keep, say, say_tool_result

WEATHER = "What is the weather in Paris in Fahrenheit?"


async def test_pass_through_relays_the_body_and_adds_the_loop_report(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hello from upstream."))
    r = await proxy.chat(model="scripted", temperature=0.2)
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Hello from upstream."
    run_hex = body["loop"]["run_id"].removeprefix("run_")
    assert body["id"] == f"chatcmpl-{run_hex}"  # the run's id, not the upstream's (SPEC §4.2)
    assert body["loop"]["stop_reason"] == "completed"
    assert r.headers["x-loopwarden-stop-reason"] == "completed"
    assert r.headers["x-loopwarden-run-id"] == body["loop"]["run_id"]
    sent = proxy.upstream.bodies
    assert len(sent) == 1
    assert sent[0]["temperature"] == 0.2
    assert "loop" not in sent[0]
    assert "tools" not in sent[0]


async def test_an_agent_runs_the_tool_loop(proxy: Proxy) -> None:
    proxy.upstream.script(
        call("get_weather", city="Paris"),
        call("to_fahrenheit", celsius=18.0),
        say_tool_result("It is {} in Paris."),
    )
    r = await proxy.chat(model="weather", messages=user(WEATHER))
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "It is 64.4°F in Paris."
    assert body["loop"]["steps"] == 3
    assert body["loop"]["tool_calls"] == 2
    sent = proxy.upstream.bodies
    assert [m["role"] for m in sent[2]["messages"]][-4:] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    prompt = sum(1 for _ in sent)
    assert prompt == 3
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["loop"]["cost_usd"] > 0
    assert len(proxy.observer.of(ev.ToolExecuted)) == 2


async def test_loop_on_any_model_adds_server_tools_and_returns_messages(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", city="Oslo"), say("Clear in Oslo."))
    r = await proxy.chat(
        model="scripted",
        messages=user("Weather in Oslo?"),
        loop={"tools": ["get_weather"], "include_messages": True},
    )
    loop = r.json()["loop"]
    assert loop["stop_reason"] == "completed"
    roles = [m["role"] for m in loop["messages"]]
    assert roles == ["assistant", "tool", "assistant"]
    assert json.loads(loop["messages"][1]["content"])["city"] == "Oslo"


async def test_terminal_tool_by_id_in_terminating_config(proxy_for: ProxyFactory) -> None:
    tools = {"done": {"kind": "builtin", "builtin": "complete_task", "id": "tool-123"}}
    async with proxy_for({"tools": tools}) as proxy:
        proxy.upstream.script(say("Hello."), call("done", result="Said hello."))
        r = await proxy.chat(
            model="scripted",
            messages=user("hello"),
            loop={"tools": ["tool-123"], "terminating_config": {"tool_ids": ["tool-123"]}},
        )
    body = r.json()
    assert body["loop"]["stop_reason"] == "terminal_tool"
    assert body["choices"][0]["message"]["content"] == "Task completed: Said hello."
    nudge = proxy.upstream.bodies[1]["messages"][-1]
    assert nudge["role"] == "system"
    assert "terminating tools" in nudge["content"]


async def test_nudges_exhausted_is_a_422_with_the_loop_report(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hello."))
    r = await proxy.chat(
        model="scripted",
        loop={
            "tools": ["final_answer"],
            "terminating_config": {"tool_ids": ["final_answer"], "consecutive_nudges": 0},
        },
    )
    assert r.status_code == 422
    body = r.json()
    assert body["error"]["code"] == "max_consecutive_nudges_exceeded"
    assert body["error"]["type"] == "loop_error"
    assert body["error"]["message"] == (
        "the run stopped (nudges_exhausted): the model answered without calling a terminating "
        "tool after 0 nudges (consecutive_nudges)"
    )
    assert body["loop"]["stop_reason"] == "nudges_exhausted"
    assert r.headers["x-loopwarden-stop-reason"] == "nudges_exhausted"


async def test_max_invocations_is_a_422(proxy: Proxy) -> None:
    proxy.upstream.script(keep(call("search_notes", query="Lima")))
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={
            "tools": ["search_notes", "final_answer"],
            "terminating_config": {"tool_ids": ["final_answer"], "max_invocations": 2},
        },
    )
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "max_invocations_exceeded"
    assert r.json()["error"]["message"] == (
        "the run stopped (max_invocations): the run reached its limit of model calls "
        "(max_invocations: 2)"
    )
    assert r.headers["x-should-retry"] == "false"
    assert len(proxy.upstream.requests) == 2


async def test_token_budget_holds_through_http(proxy: Proxy) -> None:
    proxy.upstream.script(keep(call("search_notes", query="Lima")))
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={"tools": ["search_notes"], "stop_when": [{"max_tokens_used": 900}]},
    )
    body = r.json()
    assert body["loop"]["stop_reason"] == "token_budget"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] <= 900
    assert all("max_completion_tokens" in sent for sent in proxy.upstream.bodies)


async def test_a_budget_keeps_the_client_s_own_max_tokens(proxy: Proxy) -> None:
    """A budget's cap went out as `max_completion_tokens` beside the client's `max_tokens`:
    above the client's own cap (an upstream reading the newer field gave a longer reply), and
    the two at once, which OpenAI refuses."""
    proxy.upstream.script(call("search_notes", query="Lima"), say("x" * 3000))
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        max_tokens=10,
        loop={"tools": ["search_notes"], "stop_when": [{"max_tokens_used": 900}]},
    )
    body = r.json()
    assert body["usage"]["completion_tokens"] <= 10 + 10  # each step cut at 10
    assert body["loop"]["stop_reason"] == "completed"  # the client's cap: no budget's doing
    assert body["choices"][0]["finish_reason"] == "length"
    for sent in proxy.upstream.bodies:
        assert sent["max_tokens"] == 10
        assert "max_completion_tokens" not in sent


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ({"max_completion_tokens": 100, "max_tokens": 200}, {"max_completion_tokens": 100}),
        ({"max_completion_tokens": 300, "max_tokens": 200}, {"max_completion_tokens": 200}),
        ({"max_tokens": None}, {"max_completion_tokens": "the budget's"}),
        ({"max_tokens": 40}, {"max_tokens": 40}),
        ({}, {"max_completion_tokens": "the budget's"}),
    ],
)
async def test_one_token_cap_goes_upstream_in_the_field_the_client_chose(
    proxy: Proxy, given: dict[str, Any], sent: dict[str, Any]
) -> None:
    """The newer field when the client sent it (models that refuse `max_tokens` take it), the
    older one when it sent that alone: never both, which OpenAI refuses."""
    proxy.upstream.script(say("Hi."))
    budget = {"stop_when": [{"max_tokens_used": 1000}]}
    r = await proxy.chat(model="scripted", messages=user("Hi"), loop=budget, **given)
    assert r.status_code == 200, r.text
    (body,) = proxy.upstream.bodies
    caps = {k: v for k, v in body.items() if k.startswith("max_")}
    assert caps.keys() == sent.keys()
    for field, value in sent.items():
        assert caps[field] == value if isinstance(value, int) else 900 < caps[field] < 1000


async def test_cost_budget_holds_with_config_prices(proxy: Proxy) -> None:
    proxy.upstream.script(keep(call("search_notes", query="Lima")))
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={"tools": ["search_notes"], "stop_when": [{"max_cost": 0.002}], "max_steps": 50},
    )
    loop = r.json()["loop"]
    assert loop["stop_reason"] == "cost_budget"
    assert loop["cost_usd"] <= 0.002
    assert loop["stop_details"]["threshold"] == 0.002


async def test_final_answer_after_a_limit_stop(proxy: Proxy) -> None:
    proxy.upstream.script(
        call("search_notes", query="Lima"),
        call("search_notes", query="Lima"),
        say_tool_result("Here is what I found: {}"),
    )
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={"tools": ["search_notes"], "max_steps": 2, "final_answer": True},
    )
    body = r.json()
    assert body["loop"]["stop_reason"] == "max_steps"
    assert body["loop"]["stop_details"]["final_answer"] is True
    assert body["choices"][0]["message"]["content"] == (
        "Here is what I found: 3 notes mention 'Lima'; none settles it."
    )
    assert len(proxy.upstream.requests) == 3
    assert proxy.upstream.bodies[-1]["tool_choice"] == "none"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_final_answer_that_calls_a_tool_anyway_states_the_stop(
    proxy: Proxy, stream: bool
) -> None:
    """The content of a 200 reply is never empty (SPEC §5.3): the call made to answer says
    nothing, and its tool call is not run."""
    proxy.upstream.script(
        call("search_notes", query="Lima"),
        call("search_notes", query="Lima"),
        call("search_notes", query="Paris"),
    )
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={"tools": ["search_notes"], "max_steps": 2, "final_answer": True},
        stream=stream,
    )
    sentence = "Stopped: the run reached its step limit (2 steps)."
    if stream:
        chunks = events(r.text)
        assert content(chunks) == sentence
        loop = chunks[-2]["loop"]
    else:
        message = r.json()["choices"][0]["message"]
        assert (message["content"], message.get("tool_calls")) == (sentence, None)
        loop = r.json()["loop"]
    assert (loop["stop_reason"], loop["tool_calls"]) == ("max_steps", 2)


async def test_a_final_answer_is_capped_by_what_the_budget_has_left(proxy: Proxy) -> None:
    """SPEC §6.2: the totals never pass `max_tokens_used`, the final answer's included."""
    proxy.upstream.script(
        call("search_notes", query="Lima").replace(
            usage={"prompt_tokens": 40, "completion_tokens": 10}
        ),
        say("A long final answer " * 50),
    )
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={
            "tools": ["search_notes"], "max_steps": 1, "final_answer": True,
            "stop_when": [{"max_tokens_used": 400}],
        },
    )  # fmt: skip
    body = r.json()
    assert body["loop"]["stop_details"]["final_answer"] is True
    cap = proxy.upstream.bodies[-1]["max_completion_tokens"]
    assert 0 < cap < 400 - 50
    # (the scripted upstream rounds its messages' and tools' tokens up apart: one more at most)
    assert body["usage"]["total_tokens"] <= 401


async def test_no_final_answer_past_a_budget_the_run_has_spent(proxy_for: ProxyFactory) -> None:
    """An agent's budget holds whatever the request asks: `loop.final_answer` cannot buy the
    call the budget stopped."""
    agents = {"capped": {"model": "scripted", "tools": ["search_notes"], "stop_when": [
        {"max_tokens_used": 120}]}}  # fmt: skip
    async with proxy_for({"agents": agents}) as proxy:
        proxy.upstream.script(
            call("search_notes", query="Lima").replace(
                content="Looking.", usage={"prompt_tokens": 90, "completion_tokens": 20}
            )
        )
        r = await proxy.chat(model="capped", loop={"final_answer": True})
    body = r.json()
    assert body["loop"]["stop_reason"] == "token_budget"
    assert body["loop"]["stop_details"]["final_answer"] is False
    assert body["choices"][0]["message"]["content"] == "Looking."
    assert len(proxy.upstream.requests) == 1


async def test_no_final_answer_past_max_invocations(proxy: Proxy) -> None:
    """SPEC §7.2: no more than `max_invocations` upstream calls, the final answer's included."""
    proxy.upstream.script(call("search_notes", query="Lima"), say("Hmm."))
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={
            "tools": ["search_notes", "final_answer"], "max_steps": 2, "final_answer": True,
            "terminating_config": {
                "tool_ids": ["final_answer"], "max_invocations": 2, "consecutive_nudges": 5},
        },
    )  # fmt: skip
    assert r.json()["loop"]["stop_details"]["final_answer"] is False
    assert len(proxy.upstream.requests) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_final_answer_that_fails_leaves_the_limit_stop_and_its_text(
    proxy: Proxy, stream: bool
) -> None:
    """The run's stop is the limit's: an upstream failing the call for the answer leaves the
    text so far as the answer, not a 502."""
    proxy.upstream.script(
        call("search_notes", query="Lima").replace(content="Lima has 3 notes."),
        fail(500, "the answer's call failed"),
    )
    r = await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={"tools": ["search_notes"], "max_steps": 1, "final_answer": True},
        stream=stream,
    )
    assert r.status_code == 200
    if stream:
        chunks = events(r.text)
        text, loop = content(chunks), chunks[-2]["loop"]
    else:
        text, loop = r.json()["choices"][0]["message"]["content"], r.json()["loop"]
    assert text == "Lima has 3 notes."
    assert loop["stop_reason"] == "max_steps"
    assert loop["stop_details"]["final_answer"] is False


async def slow_to_answer(request: httpx.Request) -> httpx.Response:
    """An upstream that calls `sleep` for a second, then takes 30 s over a tool-free answer."""
    body = json.loads(request.content)
    message: dict[str, object] = {"role": "assistant", "content": "Late."}
    if body.get("tool_choice") == "none":
        await asyncio.sleep(30)
    else:
        arguments = json.dumps({"seconds": 1.0})
        function = {"name": "sleep", "arguments": arguments}
        called = [{"id": "c1", "type": "function", "function": function}]
        message = {"role": "assistant", "content": None, "tool_calls": called}
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    reply = {"id": "x", "object": "chat.completion", "created": 1, "model": "scripted",
             "choices": [choice], "usage": usage}  # fmt: skip
    return httpx.Response(200, json=reply)


async def test_a_final_answer_ends_within_the_time_budget(proxy_for: ProxyFactory) -> None:
    agents = {"s": {"model": "scripted", "tools": ["sleep"]}}
    async with proxy_for({"agents": agents}, handler=slow_to_answer) as proxy:
        started = time.monotonic()
        r = await proxy.chat(model="s", loop={"stop_when": [{"max_duration_s": 0.3}],
                                              "final_answer": True})  # fmt: skip
        took = time.monotonic() - started
    assert r.json()["loop"]["stop_reason"] == "time_budget"
    assert r.json()["loop"]["stop_details"]["final_answer"] is False
    assert took < 10  # the answer's call waits 30 s


def sse_answer(*parts: bytes, cut: bool = False) -> httpx.Response:
    """A streamed answer of `parts`; `cut`: the connection is reset after them."""

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part
        if cut:
            raise httpx.ReadError("connection reset mid-stream")

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def cut_final_answer() -> Callable[[httpx.Request], Awaitable[httpx.Response]]:
    """An upstream that calls get_weather with some text, then cuts its final answer short:
    in a stream after some text, else with a 500."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("tool_choice") != "none":
            function = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
            call = {"index": 0, "id": "call_1", "type": "function", "function": function}
            if not body.get("stream"):
                message = {"role": "assistant", "content": "Checking.", "tool_calls": [call]}
                choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
                return httpx.Response(200, json={"choices": [choice], "model": "scripted"})
            return sse_answer(
                delta("Checking."),
                delta(tool_calls=[call]),
                delta(finish_reason="tool_calls"),
                b"data: [DONE]\n\n",
            )
        if not body.get("stream"):
            return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}})
        return sse_answer(delta("PARTIAL ANSW"), cut=True)

    return handler


async def test_a_final_answer_cut_after_some_of_it_was_streamed_fails_the_stream(
    proxy_for: ProxyFactory,
) -> None:
    """The client saw part of the answer: the run failed there, as any step cut mid-stream."""
    async with proxy_for(handler=cut_final_answer()) as proxy:
        r = await proxy.chat(
            model="weather", stream=True, loop={"max_steps": 1, "final_answer": True}
        )
    chunks = events(r.text)
    assert content(chunks) == "Checking.\n\nPARTIAL ANSW"
    assert chunks[-2]["loop"]["stop_reason"] == "upstream_error"  # before [DONE]
    assert "error" in chunks[-2]


async def test_a_final_answer_that_failed_leaves_no_directive_in_the_messages(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(handler=cut_final_answer()) as proxy:
        r = await proxy.chat(
            model="weather",
            loop={"max_steps": 1, "final_answer": True, "include_messages": True},
        )
    loop = r.json()["loop"]
    assert (loop["stop_reason"], loop["stop_details"]["final_answer"]) == ("max_steps", False)
    assert [m["role"] for m in loop["messages"]] == ["assistant", "tool"]


async def test_a_client_that_leaves_during_the_final_answer_cancels_the_run(
    proxy_for: ProxyFactory,
) -> None:
    """Its stream's writes fail: the run was cancelled, not a limit stop answered."""
    parts = [delta(f"Part {i}. ") for i in range(20)]
    final = sse_answer(*parts, delta(finish_reason="stop"), b"data: [DONE]\n\n")
    first = cut_final_answer()

    async def handler(request: httpx.Request) -> httpx.Response:
        return (
            final
            if json.loads(request.content).get("tool_choice") == "none"
            else (await first(request))
        )

    async def send(message: Message) -> None:
        if b"Part 1." in message.get("body", b""):
            raise OSError("broken pipe")

    body = {"model": "weather", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "loop": {"max_steps": 1, "final_answer": True}}  # fmt: skip
    async with proxy_for(handler=handler) as proxy:
        app = proxy.client._transport.app  # type: ignore[attr-defined]
        scope = post_scope("/v1/chat/completions")
        await asyncio.wait_for(app(scope, body_then_stay(json.dumps(body).encode()), send), 10)
        [finished] = proxy.observer.of(ev.RunFinished)
    assert finished.stop.reason.value == "cancelled"


async def test_client_tools_come_back_to_the_client(proxy: Proxy) -> None:
    client_tool = {
        "type": "function",
        "function": {"name": "ask_user", "parameters": {"type": "object", "properties": {}}},
    }
    proxy.upstream.script(
        call("get_weather", city="Lima"),
        call("ask_user"),
        say_tool_result("The user said: {}"),
    )
    r = await proxy.chat(
        model="scripted",
        messages=user("Check Lima, then ask me."),
        tools=[client_tool],
        loop={"tools": ["get_weather"]},
    )
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["ask_user"]
    assert body["loop"]["stop_reason"] == "client_tool_call"
    call_id = choice["message"]["tool_calls"][0]["id"]
    follow_up = [
        {"role": "user", "content": "Ask me."},
        choice["message"],
        {"role": "tool", "tool_call_id": call_id, "content": "the user says thanks"},
    ]
    r2 = await proxy.chat(
        model="scripted", messages=follow_up, tools=[client_tool], loop={"tools": ["get_weather"]}
    )
    assert r2.json()["loop"]["stop_reason"] == "completed"
    assert r2.json()["choices"][0]["message"]["content"] == "The user said: the user says thanks"


async def test_http_tool_gets_the_call_and_its_errors_reach_the_model(
    proxy_for: ProxyFactory, router: respx.MockRouter
) -> None:
    route = router.post("http://tools.test/lookup").mock(
        side_effect=[httpx.Response(200, json={"hits": 2}), httpx.Response(503, text="down")]
    )
    tools = {
        "lookup": {
            "kind": "http",
            "url": "http://tools.test/lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        }
    }
    async with proxy_for({"tools": tools}) as proxy:
        proxy.upstream.script(keep(call("lookup", q="Lima notes")))
        r = await proxy.chat(
            model="scripted",
            messages=user("Look up Lima."),
            loop={
                "tools": ["lookup"],
                "max_steps": 2,
                "include_messages": True,
                "thread_id": "t-1",
            },
        )
    posted = json.loads(route.calls[0].request.content)
    assert posted["name"] == "lookup"
    assert posted["arguments"] == {"q": "Lima notes"}
    assert posted["thread_id"] == "t-1"
    assert posted["run_id"] == r.json()["loop"]["run_id"]
    tool_messages = [m for m in r.json()["loop"]["messages"] if m["role"] == "tool"]
    assert tool_messages[0]["content"] == '{"hits":2}'
    assert "HTTP 503" in json.loads(tool_messages[1]["content"])["error"]


async def test_webhook_condition_stops_the_run(
    proxy_for: ProxyFactory, router: respx.MockRouter
) -> None:
    hook = router.post("http://checks.test/stop").mock(
        side_effect=[
            httpx.Response(200, json={"stop": False}),
            httpx.Response(200, json={"stop": True}),
        ]
    )
    conditions = {"enough": {"kind": "webhook", "url": "http://checks.test/stop"}}
    async with proxy_for({"conditions": conditions}) as proxy:
        proxy.upstream.script(keep(call("search_notes", query="Lima")))
        r = await proxy.chat(
            model="scripted",
            messages=user("Research Lima."),
            loop={"tools": ["search_notes"], "stop_when": [{"webhook": "enough"}]},
        )
    loop = r.json()["loop"]
    assert loop["stop_reason"] == "custom_condition"
    assert loop["steps"] == 2
    assert json.loads(hook.calls[0].request.content)["steps"][0]["index"] == 1


async def test_a_webhook_answer_over_64_kib_is_a_check_that_fails(
    proxy_for: ProxyFactory, router: respx.MockRouter, caplog: pytest.LogCaptureFixture
) -> None:
    padded = {"stop": True, "note": "x" * WEBHOOK_ANSWER_BYTES}
    router.post("http://checks.test/stop").mock(
        side_effect=[httpx.Response(200, json=padded), httpx.Response(200, json={"stop": True})]
    )
    conditions = {"enough": {"kind": "webhook", "url": "http://checks.test/stop"}}
    async with proxy_for({"conditions": conditions}) as proxy:
        proxy.upstream.script(keep(call("search_notes", query="Lima")))
        r = await proxy.chat(
            model="scripted",
            messages=user("Research Lima."),
            loop={"tools": ["search_notes"], "stop_when": [{"webhook": "enough"}]},
        )
    assert (r.json()["loop"]["stop_reason"], r.json()["loop"]["steps"]) == ("custom_condition", 2)
    assert f"its answer is larger than {WEBHOOK_ANSWER_BYTES} bytes" in caplog.text


async def test_a_webhook_that_trickles_its_answer_is_cut_at_its_timeout(
    proxy_for: ProxyFactory, router: respx.MockRouter
) -> None:
    """`timeout_s` bounds the whole check, not each read: a byte every 0.1 s is no answer."""

    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(100):
            await asyncio.sleep(0.1)
            yield b" "

    router.post("http://checks.test/stop").mock(
        side_effect=[
            httpx.Response(200, content=trickle()),
            httpx.Response(200, json={"stop": True}),
        ]
    )
    conditions = {"enough": {"kind": "webhook", "url": "http://checks.test/stop", "timeout_s": 0.5}}
    async with proxy_for({"conditions": conditions}) as proxy:
        proxy.upstream.script(keep(call("search_notes", query="Lima")))
        started = time.monotonic()
        r = await proxy.chat(
            model="scripted",
            messages=user("Research Lima."),
            loop={"tools": ["search_notes"], "stop_when": [{"webhook": "enough"}]},
        )
        took = time.monotonic() - started
    assert (r.json()["loop"]["stop_reason"], r.json()["loop"]["steps"]) == ("custom_condition", 2)
    assert took < 5  # the trickle alone takes 10 s


async def test_models_lists_agents_aliases_and_upstream_models(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"models": {"fast": {"model": "scripted"}}}) as proxy:
        r = await proxy.client.get("/v1/models")
    ids = [m["id"] for m in r.json()["data"]]
    assert ids == ["weather", "fast", "scripted"]


async def test_health_and_readiness(proxy: Proxy) -> None:
    assert (await proxy.client.get("/healthz")).json() == {"status": "ok"}
    assert (await proxy.client.get("/readyz")).status_code == 200
    r = await proxy.client.get("/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("model", ["a\n\x1b[31m", "gpt\u202e4o"])
async def test_a_model_name_with_control_or_direction_characters_is_refused(
    proxy: Proxy, path: str, model: str
) -> None:
    """A model's name goes upstream, into the log and onto spans: one holding a terminal's
    escape or a direction override was taken (and echoed)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    body.pop("input" if path.endswith("completions") else "messages")
    r = await proxy.client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"
    assert proxy.upstream.requests == []
