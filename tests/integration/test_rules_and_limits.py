"""Tool rules (SPEC §8) and tool call limits (SPEC §9) through the HTTP API."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Annotated, Any

import httpx
import pytest
from pydantic import AfterValidator

from proxy.api.wiring import build_services
from proxy.config import ConfigError, parse_config
from proxy.engine import events as ev
from proxy.engine.options import MAX_NAME_CHARS
from proxy.engine.policy import DEFAULT_MAX_STEPS
from proxy.state.memory import MemoryStore
from proxy.state.store import StateStore
from tests.bodies import offered, user
from tests.integration.conftest import BASE_CONFIG, ProxyFactory
from tests.integration.test_chat_stream import content, events
from tests.scripted_upstream import Call, call, calls, keep, say

ASK_USER = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
ALL = ["get_weather", "to_fahrenheit", "search_notes"]
RULED = {
    "agents": {
        "ruled": {
            "model": "scripted",
            "tools": ALL,
            "tool_rules": [
                {"type": "run_first", "tool_name": "get_weather"},
                {
                    "type": "ChildToolRule",
                    "tool_name": "get_weather",
                    "children": ["to_fahrenheit"],
                },
            ],
        }
    }
}


async def test_an_agent_offers_each_step_only_the_allowed_tools(proxy_for: ProxyFactory) -> None:
    async with proxy_for(RULED) as proxy:
        proxy.upstream.script(
            call("get_weather", city="Lima"), call("to_fahrenheit", celsius=23.0), say("Warm.")
        )
        r = await proxy.chat(model="ruled", messages=user("Lima in Fahrenheit?"))
        assert r.status_code == 200
        sent = proxy.upstream.bodies
    assert [offered(b) for b in sent] == [["get_weather"], ["to_fahrenheit"], ALL]
    assert [b.get("tool_choice") for b in sent] == [
        {"type": "function", "function": {"name": "get_weather"}},
        {"type": "function", "function": {"name": "to_fahrenheit"}},
        None,
    ]
    messages = sent[-1]["messages"]
    called = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
    assert called == ["get_weather", "to_fahrenheit"]


async def test_a_client_call_the_rules_do_not_allow_now_is_blocked_and_the_run_goes_on(
    proxy_for: ProxyFactory,
) -> None:
    """A model that ignores `tool_choice` and calls a client tool first: not handed to the
    client, answered with the rules' error; once the rules allow it, it is the client's."""
    async with proxy_for(RULED) as proxy:
        proxy.upstream.script(
            calls(call("ask_user"), call("get_weather", city="Lima")),  # before the first tool
            call("ask_user"),  # after get_weather: its child only
            call("to_fahrenheit", celsius=23.0),
            call("ask_user"),  # allowed
        )
        r = await proxy.chat(model="ruled", tools=[ASK_USER], messages=user("Lima?"))
        sent = proxy.upstream.bodies
    body = r.json()
    assert body["loop"]["stop_reason"] == "client_tool_call"
    calls_given = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls_given] == ["ask_user"]
    results = [m["content"] for m in sent[1]["messages"] if m["role"] == "tool"]
    assert (
        "Tool 'ask_user' is not allowed now by the tool rules. Allowed tools: get_weather"
        in (results[0])
    )
    assert "Lima" in results[1]  # the reply's server call ran
    blocked_again = [m["content"] for m in sent[2]["messages"] if m["role"] == "tool"][-1]
    assert "Allowed tools: to_fahrenheit" in blocked_again


async def test_a_disallowed_call_is_blocked_and_the_model_reads_why(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(RULED) as proxy:
        proxy.upstream.script(
            call("search_notes", query="Lima"),  # not offered: get_weather runs first
            call("get_weather", city="Lima"),
            call("to_fahrenheit", celsius=23.0),
            say("Warm."),
        )
        r = await proxy.chat(
            model="ruled", messages=user("Notes on Lima?"), loop={"include_messages": True}
        )
        blocked = proxy.observer.of(ev.CallBlocked)
    body = r.json()
    assert r.status_code == 200
    assert body["loop"]["stop_reason"] == "completed"
    tool_message = body["loop"]["messages"][1]
    assert json.loads(tool_message["content"]) == {
        "error": "Tool 'search_notes' is not allowed now by the tool rules. "
        "Allowed tools: get_weather."
    }
    assert [b.outcome for b in blocked] == ["blocked_rule"]
    assert body["loop"]["tool_calls"] == 2  # then get_weather and its child


async def test_request_rules_are_added_to_the_agent_s(proxy_for: ProxyFactory) -> None:
    async with proxy_for() as proxy:
        proxy.upstream.script(call("get_weather", city="Oslo"))
        r = await proxy.chat(
            model="weather",
            messages=user("Oslo in Fahrenheit?"),
            loop={"tool_rules": [{"type": "exit_loop", "tool_name": "get_weather"}]},
        )
    body = r.json()
    assert body["loop"]["stop_reason"] == "terminal_tool"
    assert json.loads(body["choices"][0]["message"]["content"])["city"] == "Oslo"


@pytest.mark.parametrize(
    ("rule", "script", "offered_at"),
    [
        # Another child of get_weather: only the child both allow.
        (
            {"type": "constrain_child_tools", "tool_name": "get_weather",
             "children": ["to_fahrenheit", "search_notes"]},
            [call("get_weather", city="Lima"), call("search_notes", query="Lima"), say("Done.")],
            ["get_weather"],
        ),
    ],
)  # fmt: skip
async def test_a_request_s_rules_only_tighten_the_agent_s(
    proxy_for: ProxyFactory, rule: dict[str, Any], script: list[Any], offered_at: list[str]
) -> None:
    """SPEC §4.1: rules of one source join as Letta joins them; the agent's and the request's
    intersect, so a request's rule cannot open what the agent's close."""
    async with proxy_for(RULED) as proxy:
        proxy.upstream.script(*script)
        r = await proxy.chat(model="ruled", messages=user("Lima?"), loop={"tool_rules": [rule]})
        sent = proxy.upstream.bodies
    assert r.status_code == 200
    assert offered(sent[0]) == offered_at
    if len(sent) > 1:
        assert offered(sent[1]) == ["to_fahrenheit"]  # not search_notes, which only one allows
        blocked = [m["content"] for m in sent[2]["messages"] if m["role"] == "tool"][-1]
        assert "Tool 'search_notes' is not allowed now" in blocked


async def test_a_request_s_run_first_with_none_in_common_with_the_agent_s_is_a_400(
    proxy_for: ProxyFactory,
) -> None:
    """The two would leave the first step no tool to call (SPEC §8: rules that cannot be met
    are a 400)."""
    async with proxy_for(RULED) as proxy:
        rule = {"type": "run_first", "tool_name": "search_notes"}
        r = await proxy.chat(model="ruled", messages=user("Lima?"), loop={"tool_rules": [rule]})
        assert proxy.upstream.requests == []
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "loop.tool_rules[0].tool_name"


async def test_a_blocked_call_is_told_the_tools_both_sources_allow(
    proxy_for: ProxyFactory,
) -> None:
    agent = {"model": "scripted", "tools": ALL, "tool_rules": [
        {"type": "run_first", "tool_name": "get_weather"},
        {"type": "run_first", "tool_name": "search_notes"}]}  # fmt: skip
    rules = [
        {"type": "run_first", "tool_name": "search_notes"},
        {"type": "run_first", "tool_name": "to_fahrenheit"},
    ]
    async with proxy_for({"agents": {"two": agent}}) as proxy:
        proxy.upstream.script(call("to_fahrenheit", celsius=3), say("ok"))
        r = await proxy.chat(
            model="two",
            messages=user("hi"),
            loop={"include_messages": True, "tool_rules": rules},
        )
        assert offered(proxy.upstream.bodies[0]) == ["search_notes"]
    told = json.loads(r.json()["loop"]["messages"][1]["content"])["error"]
    assert told.endswith("Allowed tools: search_notes.")


async def test_a_request_s_conditional_rule_does_not_replace_the_agent_s(
    proxy_for: ProxyFactory,
) -> None:
    agent = {
        "model": "scripted",
        "tools": ALL,
        "tool_rules": [
            {
                "type": "conditional",
                "tool_name": "search_notes",
                "child_output_mapping": {"3 notes mention 'x'; none settles it.": "get_weather"},
            }
        ],
    }
    async with proxy_for({"agents": {"cond": agent}}) as proxy:
        proxy.upstream.script(call("search_notes", query="x"), say("Done."))
        await proxy.chat(model="cond", messages=user("x?"), loop={"tool_rules": [
            {"type": "conditional", "tool_name": "search_notes",
             "child_output_mapping": {"nothing": "to_fahrenheit"}}]})  # fmt: skip
        sent = proxy.upstream.bodies
    assert offered(sent[1]) == ["get_weather"]  # the agent's mapping holds


async def test_rules_that_force_a_call_and_allow_none_are_a_400(proxy_for: ProxyFactory) -> None:
    """SPEC §8: an empty intersection is an error on the request, never a step sent with no
    tools (the step went out with `tools: []` and no `tool_choice`)."""
    agent = {
        "model": "scripted",
        "tools": ALL,
        "tool_rules": [
            {
                "type": "constrain_child_tools",
                "tool_name": "search_notes",
                "children": ["get_weather"],
            }
        ],
    }
    async with proxy_for({"agents": {"strict": agent}}) as proxy:
        across = await proxy.chat(model="strict", messages=user("x?"), loop={"tool_rules": [
            {"type": "constrain_child_tools", "tool_name": "search_notes",
             "children": ["to_fahrenheit"]}]})  # fmt: skip
        within = await proxy.chat(model="scripted", messages=user("x?"), loop={
            "tools": ALL,
            "tool_rules": [
                {"type": "constrain_child_tools", "tool_name": "search_notes",
                 "children": ["get_weather"]},
                {"type": "conditional", "tool_name": "search_notes",
                 "child_output_mapping": {"cold": "to_fahrenheit"}},
            ],
        })  # fmt: skip
        assert proxy.upstream.requests == []
    assert across.status_code == 400, across.text
    assert across.json()["error"]["param"] == "loop.tool_rules[0].children"
    assert across.json()["error"]["message"].startswith("once 'search_notes' gives an output")
    assert within.status_code == 400, within.text
    assert within.json()["error"]["param"] == "loop.tool_rules[0].children"
    assert "once 'search_notes' gives the output 'cold'," in within.json()["error"]["message"]


async def test_a_run_a_rule_can_nudge_is_capped_though_it_has_no_server_tools(
    proxy_for: ProxyFactory,
) -> None:
    """A rule on a client tool nudges a model that only talks: every nudge is a step more, so
    the run has the default cap (it had none, and ran until its client left)."""
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    async with proxy_for() as proxy:
        # Without the cap, a run until its client leaves: here, until the script runs out.
        proxy.upstream.script(*[say("Done.")] * DEFAULT_MAX_STEPS)
        r = await proxy.chat(
            model="scripted",
            messages=user("hi"),
            tools=[lookup],
            loop={"tool_rules": [{"type": "required_before_exit", "tool_name": "lookup"}]},
        )
    assert r.status_code == 200, r.text
    assert r.json()["loop"]["stop_reason"] == "max_steps"
    assert r.json()["loop"]["steps"] == DEFAULT_MAX_STEPS
    assert len(proxy.upstream.requests) == DEFAULT_MAX_STEPS


async def test_a_client_tool_required_before_exit_is_met_by_its_result_in_the_turn(
    proxy_for: ProxyFactory,
) -> None:
    """A client tool runs between two runs of a turn: its result in the second run's messages
    meets the rule (it nudged until max_steps); a new user message asks for it again."""
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    loop = {"tool_rules": [{"type": "required_before_exit", "tool_name": "lookup"}]}
    asked = user("Find it.")
    async with proxy_for() as proxy:
        proxy.upstream.script(
            call("lookup", q="it"), say("Found it."), say("Next?"), call("lookup", q="more")
        )
        first = await proxy.chat(model="scripted", messages=asked, tools=[lookup], loop=loop)
        called = first.json()["choices"][0]["message"]
        answered = [
            *asked,
            called,
            {"role": "tool", "tool_call_id": called["tool_calls"][0]["id"], "content": "here"},
        ]
        second = await proxy.chat(model="scripted", messages=answered, tools=[lookup], loop=loop)
        again = [*answered, {"role": "assistant", "content": "Found it."}, *user("And more?")]
        third = await proxy.chat(model="scripted", messages=again, tools=[lookup], loop=loop)
    assert first.json()["loop"]["stop_reason"] == "client_tool_call"
    assert (second.json()["loop"]["stop_reason"], second.json()["loop"]["steps"]) == (
        "completed",
        1,
    )
    # Nudged once: this turn has not called it.
    assert (third.json()["loop"]["stop_reason"], third.json()["loop"]["steps"]) == (
        "client_tool_call",
        2,
    )
    assert "first call 'lookup'" in str(proxy.upstream.bodies[3]["messages"])


REQUIRED_WEATHER = {
    "agents": {
        "checked": {
            "model": "scripted",
            "tools": ["get_weather"],
            "tool_rules": [{"type": "required_before_exit", "tool_name": "get_weather"}],
        }
    }
}


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_server_tool_the_turn_ran_before_a_client_call_meets_required_before_exit(
    proxy_for: ProxyFactory, api: str
) -> None:
    """The first run called the server tool and a client tool in one reply: the proxy ran the
    one, held it back, and put it back when the client answered the other (chat), or kept it
    in the stored conversation (Responses). The second run is not nudged to run it again."""
    both = calls(Call("get_weather", {"city": "Oslo"}), Call("ask_user", {"question": "Coat?"}))
    async with proxy_for(REQUIRED_WEATHER) as proxy:
        proxy.upstream.script(both, keep(say("Take a coat.")))
        if api == "chat":
            asked = user("Oslo?")
            first = await proxy.chat(model="checked", tools=[ASK_USER], messages=asked)
            message = {k: v for k, v in first.json()["choices"][0]["message"].items() if v}
            answer = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"]}
            history = [*asked, message, {**answer, "content": "yes"}]
            second = await proxy.chat(model="checked", tools=[ASK_USER], messages=history)
        else:
            ask = {"type": "function", "name": "ask_user", "parameters": {}}
            body = {"model": "checked", "input": "Oslo?", "tools": [ask]}
            made = (await proxy.client.post("/v1/responses", json=body)).json()
            [call_id] = [i["call_id"] for i in made["output"] if i["type"] == "function_call"]
            output = {"type": "function_call_output", "call_id": call_id, "output": "yes"}
            body = {**body, "input": [output], "previous_response_id": made["id"]}
            second = await proxy.client.post("/v1/responses", json=body)
    assert second.status_code == 200, second.text
    loop = second.json()["loop"]
    assert (loop["stop_reason"], loop["steps"], loop["tool_calls"]) == ("completed", 1, 0)
    assert len(proxy.upstream.requests) == 2


async def test_a_request_cannot_raise_the_default_cap_on_steps(proxy_for: ProxyFactory) -> None:
    """The agent sets no `max_steps`: its cap is the default, and a larger one asked is ignored
    (SPEC §4.1); a smaller one holds."""
    async with proxy_for() as proxy:
        proxy.upstream.script(keep(call("get_weather", city="Lima")))
        larger = await proxy.chat(model="weather", loop={"max_steps": DEFAULT_MAX_STEPS + 15})
        smaller = await proxy.chat(model="weather", loop={"max_steps": 3})
    assert [r.json()["loop"]["stop_reason"] for r in (larger, smaller)] == ["max_steps"] * 2
    assert [r.json()["loop"]["steps"] for r in (larger, smaller)] == [DEFAULT_MAX_STEPS, 3]


async def test_a_request_s_terminating_tools_are_added_to_the_agent_s(
    proxy_for: ProxyFactory,
) -> None:
    """Both end the run: the request's config may not take the agent's terminal tool away."""
    agents = {
        "agents": {
            "term": {
                "model": "scripted",
                "tools": ["get_weather", "to_fahrenheit"],
                "terminating_config": {"tool_ids": ["get_weather"]},
            }
        }
    }
    added = {"terminating_config": {"tool_ids": ["to_fahrenheit"]}}
    async with proxy_for(agents) as proxy:
        proxy.upstream.script(call("get_weather", city="Oslo"), call("to_fahrenheit", celsius=5))
        agent_s = await proxy.chat(model="term", loop=added)
        request_s = await proxy.chat(model="term", loop=added)
    assert [r.status_code for r in (agent_s, request_s)] == [200, 200]
    assert [r.json()["loop"]["stop_reason"] for r in (agent_s, request_s)] == ["terminal_tool"] * 2
    assert [r.json()["loop"]["steps"] for r in (agent_s, request_s)] == [1, 1]


@pytest.mark.parametrize(
    ("loop", "param", "message"),
    [
        (
            {"tool_rules": [{"type": "run_first", "tool_name": "search_notes"}]},
            "loop.tool_rules[0].tool_name",
            "not a tool of this run",
        ),
        (
            {
                "tool_rules": [
                    {
                        "type": "ParentToolRule",
                        "tool_name": "get_weather",
                        "children": ["to_fahrenheit"],
                    },
                    {"type": "run_first", "tool_name": "to_fahrenheit"},
                ]
            },
            "loop.tool_rules[1]",
            "no run_first tool can be called first",
        ),
        (
            {"tool_rules": [{"type": "max_count_per_step", "tool_name": "get_weather"}]},
            "loop.tool_rules[0].max_count_limit",
            "is required",
        ),
        (
            {"tool_call_limits": [{"tool_name": "get_weather", "run_limit": 3, "thread_limit": 1}]},
            "loop.tool_call_limits[0].run_limit",
            "cannot be larger",
        ),
        (
            {
                "tool_call_limits": [
                    {"tool_name": "get_weather", "run_limit": 1, "exit_behavior": "end"}
                ]
            },
            "loop.tool_call_limits[0].exit_behavior",
            "cannot stop other tools",
        ),
        (
            {"tool_call_limits": [{"tool_name": "nope", "run_limit": 1}]},
            "loop.tool_call_limits[0].tool_name",
            "not a server tool",
        ),
    ],
)
async def test_bad_rules_and_limits_are_a_400_with_the_path(
    proxy_for: ProxyFactory, loop: dict[str, Any], param: str, message: str
) -> None:
    async with proxy_for() as proxy:
        r = await proxy.chat(model="weather", loop=loop)
        assert proxy.upstream.requests == []
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("agent", "path"),
    [
        (
            {"tool_rules": [{"type": "run_first", "tool_name": "search_notes"}]},
            "agents.a.tool_rules[0].tool_name",
        ),
        (
            {"tool_rules": [{"type": "later", "tool_name": "get_weather"}]},
            "agents.a.tool_rules[0].type",
        ),
        ({"tool_call_limits": [{"tool_name": "get_weather"}]}, "agents.a.tool_call_limits[0]"),
    ],
)
def test_bad_agent_rules_and_limits_are_start_up_errors(agent: dict[str, Any], path: str) -> None:
    config = dict(BASE_CONFIG, agents={"a": {"model": "m", "tools": ["get_weather"], **agent}})
    with pytest.raises(ConfigError) as err:
        build_services(
            parse_config(config), httpx.AsyncClient(), httpx.AsyncHTTPTransport(), MemoryStore()
        )
    assert [p for p, _ in err.value.problems] == [path]


async def test_a_limit_with_error_is_a_422_with_the_loop_report(proxy_for: ProxyFactory) -> None:
    async with proxy_for() as proxy:
        proxy.upstream.script(keep(call("get_weather", city="Lima")))
        r = await proxy.chat(
            model="weather",
            messages=user("Lima?"),
            loop={"tool_call_limits": [{"run_limit": 2, "exit_behavior": "error"}]},
        )
    assert r.status_code == 422
    body = r.json()
    assert body["error"]["code"] == "tool_call_limit_exceeded"
    assert body["error"]["type"] == "loop_error"
    # Which limit, and its count (it said "the run stopped: tool_call_limit" alone).
    assert body["error"]["message"] == (
        "the run stopped (tool_call_limit): the run reached a tool call limit (run: 2/2) "
        "calling get_weather"
    )
    assert body["loop"]["stop_reason"] == "tool_call_limit"
    assert body["loop"]["tool_calls"] == 2
    assert r.headers["x-should-retry"] == "false"
    assert r.headers["x-loopwarden-stop-reason"] == "tool_call_limit"


async def test_a_request_s_continue_limit_does_not_loosen_the_agent_s_error_limit(
    proxy_for: ProxyFactory,
) -> None:
    """SPEC §4.1: a request's `loop` tightens, never loosens. The agent fails a run at the
    thread's second call; the request's own run limit, reached at the same call, blocked it
    with a message and the run went on (200)."""
    agent = {
        "model": "scripted",
        "tools": ["get_weather"],
        "tool_call_limits": [
            {"tool_name": "get_weather", "thread_limit": 1, "exit_behavior": "error"}
        ],
    }
    loop = {"tool_call_limits": [{"tool_name": "get_weather", "run_limit": 1}]}
    async with proxy_for({"agents": {"strict": agent}}) as proxy:
        proxy.upstream.script(keep(call("get_weather", city="Lima")))
        r = await proxy.chat(model="strict", messages=user("Lima?"), loop=loop)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "tool_call_limit_exceeded"
    assert r.json()["loop"]["stop_details"]["kind"] == "thread_limit"
    assert r.json()["loop"]["tool_calls"] == 1


async def test_a_limit_with_end_stops_with_a_message_stating_it(proxy_for: ProxyFactory) -> None:
    """After the text so far, in the JSON reply as in the stream (SPEC §4.3, §5.3)."""
    looking = replace(call("get_weather", city="Lima"), content="Looking.")
    limits = {"tool_call_limits": [{"run_limit": 3, "exit_behavior": "end"}]}
    stated = "Stopped: the run reached a tool call limit (run: 3/3) calling get_weather."
    async with proxy_for() as proxy:
        proxy.upstream.script(keep(call("get_weather", city="Lima")))
        r = await proxy.chat(model="weather", messages=user("Lima?"), loop=limits)
        proxy.upstream.script(keep(looking))
        with_text = await proxy.chat(model="weather", messages=user("Lima?"), loop=limits)
        streamed = await proxy.chat(
            model="weather", messages=user("Lima?"), loop=limits, stream=True
        )
    body = r.json()
    assert r.status_code == 200
    assert body["loop"]["stop_reason"] == "tool_call_limit"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == stated
    assert body["loop"]["stop_details"]["kind"] == "run_limit"
    text = with_text.json()["choices"][0]["message"]["content"]
    assert text == "Looking.\n\n" * 4 + stated  # three calls ran, the fourth was blocked
    assert content(events(streamed.text)) == text


async def test_thread_limits_count_across_requests_by_header_or_loop_thread_id(
    proxy_for: ProxyFactory,
) -> None:
    limits = {
        "agents": {
            "capped": {
                "model": "scripted",
                "tools": ["get_weather"],
                "tool_call_limits": [{"tool_name": "get_weather", "thread_limit": 3}],
            }
        }
    }
    four_calls = [*[call("get_weather", city="Lima")] * 4, say("Done.")]
    async with proxy_for(limits) as proxy:
        proxy.upstream.script(*four_calls, *four_calls, *four_calls)
        by_loop = await proxy.chat(
            model="capped", messages=user("Lima?"), loop={"thread_id": "t-1"}
        )
        by_header = await proxy.client.post(
            "/v1/chat/completions",
            json={"model": "capped", "messages": user("Lima?")},
            headers={"x-loopwarden-thread-id": "t-1"},
        )
        executed = [by_loop.json()["loop"]["tool_calls"], by_header.json()["loop"]["tool_calls"]]
        fresh = await proxy.chat(model="capped", messages=user("Lima?"), loop={"thread_id": "t-2"})
    assert executed == [3, 0]
    assert fresh.json()["loop"]["tool_calls"] == 3


async def test_a_threads_counts_end_thread_ttl_s_after_its_last_counted_call(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    """A client names any thread it likes: counters kept for good grew every backend by an
    entry a name (45,000 threads: 15 MB on memory; redis hashes without a TTL)."""
    capped = {
        "model": "scripted",
        "tools": ["get_weather"],
        "tool_call_limits": [{"tool_name": "get_weather", "thread_limit": 1}],
    }
    overrides = {"agents": {"capped": capped}, "state": {"thread_ttl_s": 0.5}}
    once = [call("get_weather", city="Lima"), say("Done.")]
    async with proxy_for(overrides, store=backend) as proxy:
        proxy.upstream.script(*once, *once, *once)
        runs = []
        for pause in (0, 0, 1.0):
            await asyncio.sleep(pause)
            r = await proxy.chat(model="capped", messages=user("Lima?"), loop={"thread_id": "t"})
            runs.append(r.json()["loop"]["tool_calls"])
        left = await backend.thread_counts("t")
    assert runs == [1, 0, 1]  # the limit within the thread's life; anew once it ended
    assert left == {"get_weather": 1}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("thread", ["a\x85b", "a\x9b[2Jb", "a\u2066b", "t" * (MAX_NAME_CHARS + 1)])
async def test_a_thread_header_is_checked_as_loop_thread_id_is(
    proxy_for: ProxyFactory, path: str, thread: str
) -> None:
    """A thread's name is stored, logged and put on spans: a header naming one with a control
    character (here C1: NEL, CSI) or a text direction one is refused as the same name in
    `loop.thread_id` is."""
    body = {"model": "weather", "messages": user("hi"), "input": "hi"}
    body.pop("input" if path.endswith("completions") else "messages")
    latin = all(ord(c) < 256 for c in thread)  # a raw C1 byte, as a client may send
    raw = thread.encode("latin-1") if latin else thread.encode()
    async with proxy_for() as proxy:
        sent = await proxy.client.post(path, json=body, headers={"x-loopwarden-thread-id": raw})
        in_loop = await proxy.client.post(path, json={**body, "loop": {"thread_id": thread}})
    assert (sent.status_code, in_loop.status_code) == (400, 400), sent.text
    assert sent.json()["error"]["param"] == "x-loopwarden-thread-id"
    assert in_loop.json()["error"]["param"] == "loop.thread_id"
    assert proxy.upstream.requests == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_header_and_loop_thread_id_naming_two_threads_are_a_400(
    proxy_for: ProxyFactory, path: str
) -> None:
    """One of them was dropped silently (the body's won); the same name twice is one."""
    body = {"model": "weather", "messages": user("hi"), "input": "hi"}
    body.pop("input" if path.endswith("completions") else "messages")
    async with proxy_for() as proxy:
        proxy.upstream.script(say("one thread"))
        two = await proxy.client.post(
            path, json={**body, "loop": {"thread_id": "a"}}, headers={"x-loopwarden-thread-id": "b"}
        )
        one = await proxy.client.post(
            path, json={**body, "loop": {"thread_id": "a"}}, headers={"x-loopwarden-thread-id": "a"}
        )
    assert two.status_code == 400
    assert two.json()["error"]["param"] == "loop.thread_id"
    assert one.status_code == 200, one.text


async def test_a_thread_header_in_utf_8_names_the_thread_loop_thread_id_names(
    proxy_for: ProxyFactory,
) -> None:
    """Header bytes are read as latin-1: UTF-8 sent there (bytes 0x80-0x9f among them) is the
    name it spells, not control characters."""
    limits = {
        "agents": {
            "capped": {
                "model": "scripted",
                "tools": ["get_weather"],
                "tool_call_limits": [{"tool_name": "get_weather", "thread_limit": 1}],
            }
        }
    }
    async with proxy_for(limits) as proxy:
        proxy.upstream.script(call("get_weather", city="Lima"), say("Done."), keep(say("No.")))
        by_loop = await proxy.chat(model="capped", loop={"thread_id": "日本-1"})
        by_header = await proxy.client.post(
            "/v1/chat/completions",
            json={"model": "capped", "messages": user("Lima?")},
            headers={"x-loopwarden-thread-id": "日本-1".encode()},
        )
    assert by_header.status_code == 200, by_header.text
    assert by_loop.json()["loop"]["tool_calls"] == 1
    assert by_header.json()["loop"]["tool_calls"] == 0  # the same thread: its one call is used


async def test_a_call_its_tool_refuses_the_arguments_of_is_not_counted_by_a_limit(
    proxy_for: ProxyFactory,
) -> None:
    """SPEC §9 counts executed calls: a call with bad arguments fails at once, and the call
    made again with good ones is within `run_limit: 1` and the thread's limit."""
    limit = {"tool_name": "get_weather", "run_limit": 1, "thread_limit": 1}
    async with proxy_for() as proxy:
        proxy.upstream.script(
            call("get_weather", town="Lima"),  # no `city`: refused by its schema
            call("get_weather", city="Lima"),
            say("Done."),
        )
        r = await proxy.chat(
            model="weather",
            messages=user("Lima?"),
            loop={"tool_call_limits": [limit], "thread_id": "t-refused", "include_messages": True},
        )
    results = [m["content"] for m in r.json()["loop"]["messages"] if m["role"] == "tool"]
    assert "invalid arguments at city" in results[0]
    assert '"city":"Lima"' in results[1].replace(" ", "")  # it ran: the limit held it free


ASK_OTHER = {"type": "function", "function": {"name": "ask_other", "parameters": {}}}
CHILD_ASK_USER = {
    "tool_rules": [
        {"type": "constrain_child_tools", "tool_name": "get_weather", "children": ["ask_user"]}
    ]
}


async def test_of_two_client_calls_the_one_the_rules_block_is_answered_the_other_handed_over(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for() as proxy:
        proxy.upstream.script(
            call("get_weather", city="Lima"),
            calls(call("ask_other"), call("ask_user")),  # only ask_user follows get_weather
            say("Asked."),
        )
        tools = [ASK_USER, ASK_OTHER]
        first = await proxy.chat(
            model="weather", tools=tools, messages=user("Lima?"), loop=CHILD_ASK_USER
        )
        handed = first.json()["choices"][0]["message"]
        answer = {"role": "tool", "tool_call_id": handed["tool_calls"][0]["id"], "content": "yes"}
        history = [*user("Lima?"), handed, answer]
        second = await proxy.chat(model="weather", tools=tools, messages=history)
        sent = proxy.upstream.bodies[2]["messages"]
    assert first.json()["loop"]["stop_reason"] == "client_tool_call"
    assert [c["function"]["name"] for c in handed["tool_calls"]] == ["ask_user"]
    assert second.json()["choices"][0]["message"]["content"] == "Asked."
    replied = [m for m in sent if m.get("tool_calls")][-1]  # the reply as it came, put back
    assert [c["function"]["name"] for c in replied["tool_calls"]] == ["ask_other", "ask_user"]
    results = [m["content"] for m in sent if m["role"] == "tool"][-2:]
    assert "Tool 'ask_other' is not allowed now by the tool rules" in results[0]
    assert results[1] == "yes"


async def test_a_client_call_after_the_server_call_the_rules_ask_for_first_is_handed_over(
    proxy_for: ProxyFactory,
) -> None:
    """Each call is reviewed at its place in the reply: after `run_first`'s tool, in the same
    reply, a client call is allowed."""
    async with proxy_for() as proxy:
        proxy.upstream.script(calls(call("get_weather", city="Lima"), call("ask_user")))
        r = await proxy.chat(
            model="weather",
            tools=[ASK_USER],
            messages=user("Lima?"),
            loop={"tool_rules": [{"type": "run_first", "tool_name": "get_weather"}]},
        )
    assert r.json()["loop"]["stop_reason"] == "client_tool_call"
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == [
        "ask_user"
    ]


CHECKS: list[str] = []


def _counted(value: str) -> str:
    CHECKS.append(value)
    return value


def counted_lookup(query: Annotated[str, AfterValidator(_counted)]) -> str:
    return f"found {query}"


async def test_a_call_s_arguments_are_checked_once(proxy_for: ProxyFactory) -> None:
    """Checked before the limits reserve anything, and not again as the call runs."""
    CHECKS.clear()
    here = "tests.integration.test_rules_and_limits:counted_lookup"
    config = {
        "tools": {"lookup": {"kind": "python", "callable": here}},
        "agents": {"a": {"model": "scripted", "tools": ["lookup"]}},
    }
    async with proxy_for(config) as proxy:
        proxy.upstream.script(
            calls(call("lookup", query="x"), call("lookup", query="y")), say("ok")
        )
        limits = {"tool_call_limits": [{"tool_name": "lookup", "run_limit": 5}]}
        await proxy.chat(model="a", messages=user("go"), loop=limits)
    assert CHECKS == ["x", "y"]
