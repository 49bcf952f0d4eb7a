"""Tool rules (SPEC §8) where they meet tool call limits (SPEC §9), their own nudges, and the
runs of one turn that a client's tools part: no rule takes every step of a run."""

from __future__ import annotations

from typing import Any

from tests.bodies import offered, user
from tests.integration.conftest import ProxyFactory
from tests.scripted_upstream import Body, Reply, call, calls, keep, say

ASK = {"type": "function", "function": {"name": "ask_user", "parameters": {"type": "object"}}}
AGENTS = {"agents": {"one": {"model": "scripted", "tools": ["get_weather", "search_notes"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def obeying(body: Body) -> Reply:
    """A model that calls what `tool_choice` forces, and else answers."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return call(choice["function"]["name"], city="Oslo")
    return say("Answered.")


async def test_a_forced_call_a_thread_limit_blocks_is_not_forced_again(
    proxy_for: ProxyFactory,
) -> None:
    """`run_first` forced a tool whose thread had spent its calls: every step, to `max_steps`
    (25 upstream calls a run, once a thread reached its limit). Once the limit blocked it, the
    rule stands aside: the run's later steps are offered the agent's tools (they were offered
    none, every later run of the thread)."""
    loop = {
        "thread_id": "spent",
        "tool_rules": [{"type": "run_first", "tool_name": "get_weather"}],
        "tool_call_limits": [{"tool_name": "get_weather", "thread_limit": 1}],
    }
    async with proxy_for(AGENTS) as proxy:
        proxy.upstream.script(keep(obeying))
        first = await proxy.chat(model="one", messages=user("Weather?"), loop=loop)
        before = len(proxy.upstream.bodies)
        second = await proxy.chat(model="one", messages=user("Again?"), loop=loop)
        sent = proxy.upstream.bodies[before:]
    assert (first.json()["loop"]["tool_calls"], first.json()["loop"]["stop_reason"]) == (
        1,
        "completed",
    )
    report = second.json()["loop"]
    assert (report["stop_reason"], report["steps"]) == ("completed", 2)
    assert [b.get("tool_choice") for b in sent] == [FORCED, None]  # the rule, then the limit
    assert "Tool call limit exceeded" in sent[1]["messages"][-1]["content"]
    assert offered(sent[0]) == ["get_weather"]
    assert offered(sent[1]) == ["get_weather", "search_notes"]


async def test_a_tool_required_before_exit_that_a_limit_blocks_does_not_hold_the_end(
    proxy_for: ProxyFactory,
) -> None:
    loop = {
        "tool_rules": [{"type": "required_before_exit", "tool_name": "get_weather"}],
        "tool_call_limits": [{"tool_name": "get_weather", "run_limit": 0}],
    }

    def model(body: Body) -> Reply:
        told = body["messages"][-1]
        nudged = told["role"] == "system" and "first call" in told["content"]
        return call("get_weather", city="Oslo") if nudged else say("Answered.")

    async with proxy_for(AGENTS) as proxy:
        proxy.upstream.script(keep(model))
        r = await proxy.chat(model="one", messages=user("Weather?"), loop=loop)
        upstream_calls = len(proxy.upstream.bodies)
    report = r.json()["loop"]
    assert report["stop_reason"] == "completed"
    assert upstream_calls == 3  # answered, nudged to call it, the call blocked: answered


async def test_continue_loop_nudges_once_after_each_call_of_its_tool(
    proxy_for: ProxyFactory,
) -> None:
    """A model that answered after the tool was told to go on at every step, to `max_steps`,
    its answer in the reply as many times."""
    loop = {"tool_rules": [{"type": "continue_loop", "tool_name": "get_weather"}]}
    async with proxy_for(AGENTS) as proxy:
        proxy.upstream.script(
            call("get_weather", city="Oslo"),
            say("Cold."),
            call("get_weather", city="Rome"),
            keep(say("Warm.")),
        )
        r = await proxy.chat(model="one", messages=user("Weather?"), loop=loop)
        nudges = proxy.metric("loopwarden_nudges_total", agent="one")
        upstream_calls = len(proxy.upstream.bodies)
    report = r.json()["loop"]
    assert (report["stop_reason"], upstream_calls, nudges) == ("completed", 5, 2)
    assert r.json()["choices"][0]["message"]["content"] == "Cold.\n\nWarm.\n\nWarm."


def answered(first: dict[str, Any], output: str = "yes") -> list[dict[str, Any]]:
    """The conversation after a run that handed the client its call: the call answered."""
    message = first["choices"][0]["message"]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": output} for c in message["tool_calls"]
    ]
    return [*user("Weather?"), message, *results]


async def test_run_first_holds_for_the_turn_not_again_after_a_client_tool(
    proxy_for: ProxyFactory,
) -> None:
    loop = {"tool_rules": [{"type": "run_first", "tool_name": "get_weather"}]}
    async with proxy_for(AGENTS) as proxy:
        proxy.upstream.script(calls(call("get_weather", city="Oslo"), call("ask_user")))
        first = await proxy.chat(model="one", tools=[ASK], messages=user("Weather?"), loop=loop)
        proxy.upstream.script(say("Done."))
        second = await proxy.chat(
            model="one", tools=[ASK], messages=answered(first.json()), loop=loop
        )
        sent = proxy.upstream.bodies
    assert sent[0].get("tool_choice") == FORCED
    assert second.json()["choices"][0]["message"]["content"] == "Done."
    assert sent[1].get("tool_choice") is None  # the turn ran it: no call forced again
    assert offered(sent[1]) == ["get_weather", "search_notes", "ask_user"]


async def test_a_rule_on_a_client_tool_holds_for_the_run_after_it(
    proxy_for: ProxyFactory,
) -> None:
    rule = {"type": "constrain_child_tools", "tool_name": "ask_user", "children": ["search_notes"]}
    loop = {"tool_rules": [rule]}
    async with proxy_for(AGENTS) as proxy:
        proxy.upstream.script(call("ask_user"))
        first = await proxy.chat(model="one", tools=[ASK], messages=user("Weather?"), loop=loop)
        proxy.upstream.script(call("search_notes", query="oslo"), say("Done."))
        await proxy.chat(model="one", tools=[ASK], messages=answered(first.json()), loop=loop)
        after = proxy.upstream.bodies[1]
    assert offered(after) == ["search_notes"]
    assert after["tool_choice"] == {"type": "function", "function": {"name": "search_notes"}}


async def test_the_model_is_told_only_of_server_tools_whose_output_ends_the_run(
    proxy_for: ProxyFactory,
) -> None:
    """An `exit_loop` rule on a client tool told the model its output would be the reply: the
    client's call ends the run, its output unseen by the proxy."""
    rules = [
        {"type": "exit_loop", "tool_name": "ask_user"},
        {"type": "exit_loop", "tool_name": "search_notes"},
    ]
    async with proxy_for(AGENTS) as proxy:
        proxy.upstream.script(call("ask_user"))
        r = await proxy.chat(
            model="one", tools=[ASK], messages=user("Hi"), loop={"tool_rules": rules}
        )
        system = proxy.upstream.bodies[0]["messages"][0]
    assert r.json()["loop"]["stop_reason"] == "client_tool_call"
    assert system == {
        "role": "system",
        "content": "Calling `search_notes` ends your turn; its output is your reply.",
    }


async def test_run_first_holds_again_in_a_run_no_client_tool_parted_from_the_one_before(
    proxy_for: ProxyFactory,
) -> None:
    """`/chat/invoke` after a run that used tools, and a history whose turn used tools and
    ends with the model's text and an instruction: new runs, which `run_first` holds for."""
    ruled = {
        **AGENTS["agents"]["one"],
        "tool_rules": [{"type": "run_first", "tool_name": "get_weather"}],
    }
    history = [
        *user("Oslo?"),
        {"role": "assistant", "content": None, "tool_calls": [ask_call("c1", "search_notes")]},
        {"role": "tool", "tool_call_id": "c1", "content": "nothing"},
        {"role": "assistant", "content": "No notes."},
        {"role": "system", "content": "Now check the weather."},
    ]
    async with proxy_for({"agents": {"ruled": ruled}}) as proxy:
        proxy.upstream.script(keep(obeying))
        started = await proxy.client.post(
            "/chat", json={"context_id": "c", "agent": "ruled", "message": "Oslo?"}
        )
        before = len(proxy.upstream.bodies)
        invoked = await proxy.client.post("/chat/invoke", json={"context_id": "c"})
        again = proxy.upstream.bodies[before]
        before = len(proxy.upstream.bodies)
        await proxy.chat(model="ruled", messages=history)
        resent = proxy.upstream.bodies[before]
    assert (started.status_code, invoked.status_code) == (200, 200)
    assert proxy.upstream.bodies[0]["tool_choice"] == FORCED
    assert again["tool_choice"] == FORCED
    assert resent["tool_choice"] == FORCED


async def test_a_forced_choice_leaves_out_the_tools_a_limit_blocks(
    proxy_for: ProxyFactory,
) -> None:
    """Two `run_first` tools, one blocked by a limit: `required` over both let a model pick the
    blocked one at every step, to `max_steps`."""
    loop = {
        "tool_rules": [
            {"type": "run_first", "tool_name": "get_weather"},
            {"type": "run_first", "tool_name": "search_notes"},
        ],
        "tool_call_limits": [{"tool_name": "get_weather", "run_limit": 0}],
    }

    def picking_weather(body: Body) -> Reply:
        choice = body.get("tool_choice")
        if choice == "required":
            return call("get_weather", city="Oslo")
        if isinstance(choice, dict):
            return call(choice["function"]["name"], query="Oslo")
        return say("Answered.")

    async with proxy_for(AGENTS) as proxy:
        proxy.upstream.script(keep(picking_weather))
        r = await proxy.chat(model="one", messages=user("Weather?"), loop=loop)
        sent = proxy.upstream.bodies
    choices = [b.get("tool_choice") for b in sent]
    assert choices == ["required", {"type": "function", "function": {"name": "search_notes"}}, None]
    assert offered(sent[1]) == ["search_notes"]
    assert r.json()["loop"]["stop_reason"] == "completed"


def ask_call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
