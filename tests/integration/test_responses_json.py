"""`POST /v1/responses` in JSON mode through the ASGI app (SPEC §12.1, §12.2)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx

from proxy.engine import events as ev
from tests.bodies import offered
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import call, calls, fail, say, say_tool_result

WEATHER = "What is the weather in Paris in Fahrenheit?"
FUNCTION = {
    "type": "function",
    "name": "lookup_order",
    "description": "Find an order.",
    "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
}


async def respond(proxy: Proxy, **body: Any) -> httpx.Response:
    body.setdefault("input", "hi")
    return await proxy.client.post("/v1/responses", json=body)


def text_of(body: dict[str, Any]) -> str:
    """What the SDKs' `output_text` gives: the text of every output_text part."""
    return "".join(
        part["text"]
        for item in body["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


async def test_pass_through_answers_with_a_response_object(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hello from upstream."))
    r = await respond(
        proxy,
        model="scripted",
        input="Say hello.",
        instructions="Be brief.",
        temperature=0.2,
        max_output_tokens=100,
        metadata={"ticket": "42"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    run_hex = body["loop"]["run_id"].removeprefix("run_")
    assert body["id"] == f"resp_{run_hex}"
    assert body["object"] == "response"
    assert body["status"] == "completed"
    assert text_of(body) == "Hello from upstream."
    assert [i["type"] for i in body["output"]] == ["message"]
    assert body["metadata"] == {"ticket": "42"}
    assert body["instructions"] == "Be brief."
    assert body["store"] is True
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert r.headers["x-loopwarden-stop-reason"] == "completed"
    assert r.headers["x-loopwarden-run-id"] == body["loop"]["run_id"]
    sent = proxy.upstream.bodies[0]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello."},
    ]
    assert sent["temperature"] == 0.2
    assert sent["max_completion_tokens"] == 100
    for key in ("metadata", "store", "input", "instructions"):
        assert key not in sent


async def test_the_path_without_v1_is_the_same_route(proxy: Proxy) -> None:
    proxy.upstream.script(say("ok"))
    r = await proxy.client.post("/responses", json={"model": "scripted", "input": "hi"})
    assert r.status_code == 200
    assert r.json()["object"] == "response"


async def test_server_calls_are_mcp_call_items_and_usage_sums_every_step(proxy: Proxy) -> None:
    proxy.upstream.script(
        call("get_weather", city="Paris").replace(usage=usage(10, 2, cached=4)),
        call("to_fahrenheit", celsius=18.0).replace(usage=usage(20, 3, written=6)),
        say("It is 64.4°F in Paris.").replace(usage=usage(30, 5, reasoning=1)),
    )
    r = await respond(proxy, model="weather", input=WEATHER)
    body = r.json()
    assert [i["type"] for i in body["output"]] == ["mcp_call", "mcp_call", "message"]
    first, second, _ = body["output"]
    assert first["server_label"] == "loopwarden"
    assert first["name"] == "get_weather"
    assert json.loads(first["arguments"]) == {"city": "Paris"}
    assert first["status"] == "completed"
    assert first["error"] is None
    assert "18" in first["output"]
    assert second["name"] == "to_fahrenheit"
    assert text_of(body) == "It is 64.4°F in Paris."
    assert len({i["id"] for i in body["output"]}) == 3
    assert (body["loop"]["steps"], body["loop"]["tool_calls"]) == (3, 2)
    assert body["usage"] == {
        "input_tokens": 60,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 6},
        "output_tokens": 10,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 70,
    }
    assert len(proxy.observer.of(ev.ToolExecuted)) == 2


def usage(
    prompt: int, completion: int, cached: int = 0, reasoning: int = 0, written: int = 0
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


async def test_a_failed_server_call_is_an_mcp_call_with_an_error(proxy: Proxy) -> None:
    proxy.upstream.script(call("get_weather", town="Paris"), say("I could not look it up."))
    body = (await respond(proxy, model="weather", input=WEATHER)).json()
    failed = body["output"][0]
    assert failed["type"] == "mcp_call"
    assert failed["status"] == "failed"
    assert failed["output"] is None
    assert failed["error"]["type"] == "mcp_tool_execution_error"
    assert failed["error"]["message"]


async def test_client_function_tools_round_trip_with_the_full_input(proxy: Proxy) -> None:
    proxy.upstream.script(call("lookup_order", order="A-1"), say_tool_result("Order status: {}"))
    first = (await respond(proxy, model="scripted", input="Where is A-1?", tools=[FUNCTION])).json()
    assert first["status"] == "completed"
    assert first["loop"]["stop_reason"] == "client_tool_call"
    [fc] = first["output"]
    assert fc["type"] == "function_call"
    assert fc["name"] == "lookup_order"
    assert json.loads(fc["arguments"]) == {"order": "A-1"}
    assert proxy.upstream.bodies[0]["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "lookup_order",
                "description": "Find an order.",
                "parameters": FUNCTION["parameters"],
            },
        }
    ]
    again = [
        {"role": "user", "content": "Where is A-1?"},
        fc,
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "shipped"},
    ]
    second = (
        await respond(proxy, model="scripted", input=again, tools=[FUNCTION], store=False)
    ).json()
    assert text_of(second) == "Order status: shipped"
    sent = proxy.upstream.bodies[1]["messages"]
    assert sent[1]["role"] == "assistant"
    assert sent[1]["tool_calls"][0]["id"] == fc["call_id"]
    assert sent[2] == {"role": "tool", "tool_call_id": fc["call_id"], "content": "shipped"}


async def test_previous_response_id_continues_the_stored_conversation(proxy: Proxy) -> None:
    proxy.upstream.script(
        call("lookup_order", order="A-1"), say_tool_result("Order status: {}"), say("Bye.")
    )
    first = (await respond(proxy, model="scripted", input="Where is A-1?", tools=[FUNCTION])).json()
    [fc] = first["output"]
    output = {"type": "function_call_output", "call_id": fc["call_id"], "output": "shipped"}
    second = (
        await respond(
            proxy,
            model="scripted",
            input=[output],
            tools=[FUNCTION],
            previous_response_id=first["id"],
        )
    ).json()
    assert text_of(second) == "Order status: shipped"
    assert second["previous_response_id"] == first["id"]
    third = (
        await respond(proxy, model="scripted", input="Thanks", previous_response_id=second["id"])
    ).json()
    assert text_of(third) == "Bye."
    roles = [m["role"] for m in proxy.upstream.bodies[2]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]


async def test_a_turn_that_leaves_a_client_call_unanswered_is_a_400(proxy: Proxy) -> None:
    """As OpenAI answers: the upstream was sent a call without its output (a strict one refused
    it, a lenient one took it)."""
    proxy.upstream.script(
        calls(call("lookup_order", order="A-1"), call("lookup_order", order="B-2"))
    )
    first = (await respond(proxy, model="scripted", input="Where?", tools=[FUNCTION])).json()
    one, two = first["output"]
    answered = {"type": "function_call_output", "call_id": one["call_id"], "output": "shipped"}
    for turn in ([answered], "Never mind."):
        r = await respond(
            proxy, model="scripted", input=turn, tools=[FUNCTION], previous_response_id=first["id"]
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "input"
        missing = two["call_id"] if turn != "Never mind." else one["call_id"]
        assert error["message"] == f"No tool output found for function call {missing}."
    assert len(proxy.upstream.requests) == 1


async def test_a_stored_turn_resent_whole_without_its_call_s_output_is_a_400(
    proxy: Proxy,
) -> None:
    proxy.upstream.script(call("lookup_order", order="A-1"))
    asked = [{"role": "user", "content": "Where?"}]
    first = (await respond(proxy, model="scripted", input=asked, tools=[FUNCTION])).json()
    [fc] = first["output"]
    again = [*asked, fc, {"role": "user", "content": "Never mind."}]
    r = await respond(proxy, model="scripted", input=again, tools=[FUNCTION])
    assert r.status_code == 400, r.text
    assert (
        r.json()["error"]["message"] == f"No tool output found for function call {fc['call_id']}."
    )
    assert len(proxy.upstream.requests) == 1


async def test_a_turn_sent_whole_whose_calls_all_have_outputs_is_taken(proxy: Proxy) -> None:
    """Every call answered, however the items lie: a server call then text beside a client call
    (its output after the text, once made messages), and text between two calls of one turn
    with both outputs after them. A check of the messages made of the items refused both."""
    looking = replace(call("lookup_order", order="A-1"), content="Let me look.")
    proxy.upstream.script(call("get_weather", city="Paris"), looking, say("Done."), say("Both."))
    first = (
        await respond(proxy, model="weather", input="Paris?", tools=[FUNCTION], store=False)
    ).json()
    assert [i["type"] for i in first["output"]] == ["mcp_call", "function_call", "message"]
    fc = first["output"][1]
    again = [
        {"role": "user", "content": "Paris?"},
        *first["output"],
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "shipped"},
    ]
    whole = await respond(proxy, model="weather", input=again, tools=[FUNCTION], store=False)
    assert whole.status_code == 200, whole.text
    between = [
        {"role": "user", "content": "Two orders?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "A:"}],
        },
        {"type": "function_call", "call_id": "c-a", "name": "lookup_order", "arguments": "{}"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "B:"}],
        },
        {"type": "function_call", "call_id": "c-b", "name": "lookup_order", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c-a", "output": "shipped"},
        {"type": "function_call_output", "call_id": "c-b", "output": "lost"},
    ]
    both = await respond(proxy, model="scripted", input=between, tools=[FUNCTION], store=False)
    assert both.status_code == 200, both.text


async def test_a_chain_with_server_calls_sends_them_back_once(proxy: Proxy) -> None:
    proxy.upstream.script(
        call("get_weather", city="Paris"), say_tool_result("It is {}."), say("Yes.")
    )
    first = (await respond(proxy, model="weather", input="Paris?")).json()
    await respond(proxy, model="weather", input="Sure?", previous_response_id=first["id"])
    sent = proxy.upstream.bodies[2]["messages"]
    assert [m["role"] for m in sent][-5:] == ["user", "assistant", "tool", "assistant", "user"]


async def test_the_full_input_with_mcp_call_items_is_the_history_the_model_saw(
    proxy: Proxy,
) -> None:
    proxy.upstream.script(
        call("get_weather", city="Paris"), say_tool_result("It is {}."), say("Yes.")
    )
    first = (await respond(proxy, model="weather", input="Paris?", store=False)).json()
    again = [
        {"role": "user", "content": "Paris?"},
        *first["output"],
        {"role": "user", "content": "Sure?"},
    ]
    r = await respond(proxy, model="weather", input=again, store=False)
    assert r.status_code == 200, r.text
    sent = proxy.upstream.bodies[2]["messages"]
    assert [m["role"] for m in sent][-5:] == ["user", "assistant", "tool", "assistant", "user"]
    assistant, tool = sent[-4], sent[-3]
    assert assistant["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert tool["content"] == first["output"][0]["output"]


async def test_custom_tools_round_trip_as_custom_tool_call_items(proxy: Proxy) -> None:
    patch = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
    proxy.upstream.script(call("apply_patch", input="*** Begin Patch"), say("Applied."))
    first = (await respond(proxy, model="scripted", input="Patch it", tools=[patch])).json()
    [item] = first["output"]
    assert item["type"] == "custom_tool_call"
    assert item["name"] == "apply_patch"
    assert item["input"] == "*** Begin Patch"
    upstream_tool = proxy.upstream.bodies[0]["tools"][0]["function"]
    assert upstream_tool["parameters"]["properties"] == {"input": {"type": "string"}}
    output = {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "done"}
    again = [{"role": "user", "content": "Patch it"}, item, output]
    second = (await respond(proxy, model="scripted", input=again, tools=[patch])).json()
    assert text_of(second) == "Applied."
    sent = proxy.upstream.bodies[1]["messages"]
    assert json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]) == {
        "input": "*** Begin Patch"
    }


async def test_namespace_tools_are_flat_upstream_and_named_as_the_client_did(proxy: Proxy) -> None:
    crm = {
        "type": "namespace",
        "name": "crm",
        "description": "The CRM.",
        "tools": [{"type": "function", "name": "find", "parameters": {"type": "object"}}],
    }
    proxy.upstream.script(call("crm__find", q="x"))
    body = (await respond(proxy, model="scripted", tools=[crm])).json()
    assert offered(proxy.upstream.bodies[0]) == ["crm__find"]
    [item] = body["output"]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "find", "crm")


async def test_hosted_tools_are_not_sent_upstream_and_are_reported(proxy: Proxy) -> None:
    proxy.upstream.script(say("ok"))
    tools = [{"type": "web_search"}, FUNCTION]
    body = (await respond(proxy, model="scripted", tools=tools)).json()
    assert body["loop"]["ignored_tools"] == ["web_search"]
    assert offered(proxy.upstream.bodies[0]) == ["lookup_order"]
    assert body["tools"] == tools


async def test_a_hosted_tool_s_secrets_are_neither_echoed_nor_stored(proxy: Proxy) -> None:
    """As OpenAI keeps none of them: a client sends them again with every request."""
    proxy.upstream.script(say("ok"))
    hosted = {"type": "mcp", "server_label": "gh", "server_url": "https://mcp.example/mcp"}
    mcp = {**hosted, "authorization": "ghp_SECRET", "headers": {"Authorization": "Bearer S"}}
    made = await respond(proxy, model="scripted", tools=[mcp, FUNCTION])
    again = await proxy.client.get(f"/v1/responses/{made.json()['id']}")
    for body in (made.json(), again.json()):
        assert body["tools"] == [hosted, FUNCTION]
    assert "SECRET" not in made.text + again.text


async def test_field_mapping_to_chat_completions(proxy: Proxy) -> None:
    proxy.upstream.script(say("{}"))
    schema = {"type": "object", "properties": {}}
    await respond(
        proxy,
        model="scripted",
        input=[
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Look:"},
                    {"type": "input_image", "image_url": "https://x.test/a.png", "detail": "low"},
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "zzz"},
        ],
        text={
            "format": {"type": "json_schema", "name": "out", "schema": schema},
            "verbosity": "low",
        },
        reasoning={"effort": "low", "summary": "auto"},
        tool_choice={"type": "function", "name": "lookup_order"},
        tools=[FUNCTION],
        parallel_tool_calls=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        truncation="auto",
        user="u-1",
        max_tool_calls=3,
    )
    sent = proxy.upstream.bodies[0]
    assert sent["messages"] == [
        {"role": "system", "content": "Rules."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {
                    "type": "image_url",
                    "image_url": {"url": "https://x.test/a.png", "detail": "low"},
                },
            ],
        },
    ]
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema},
    }
    assert sent["verbosity"] == "low"
    assert sent["reasoning_effort"] == "low"
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "lookup_order"}}
    assert sent["parallel_tool_calls"] is False
    assert sent["prompt_cache_key"] == "k"
    assert sent["user"] == "u-1"
    for key in ("include", "truncation", "reasoning", "text", "max_tool_calls"):
        assert key not in sent


async def test_allowed_tools_go_upstream_as_chat_completions_allowed_tools(proxy: Proxy) -> None:
    """The tools listed are the ones the model may call, server tools among them: the list was
    dropped (only the mode went on), so a server tool left out could run."""
    proxy.upstream.script(say("Fine."))
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [
            {"type": "function", "name": "lookup_order"},
            {"type": "function", "name": "get_weather"},
            {"type": "web_search"},
        ],
    }
    r = await respond(proxy, model="weather", input="Hi", tools=[FUNCTION], tool_choice=choice)
    assert r.json()["tool_choice"] == choice  # echoed as sent
    assert proxy.upstream.bodies[0]["tool_choice"] == {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [
                {"type": "function", "function": {"name": "lookup_order"}},
                {"type": "function", "function": {"name": "get_weather"}},
            ],
        },
    }
    # Hosted tools alone (the proxy's own label among them: its server tools): the mode.
    proxy.upstream.script(say("Fine."))
    hosted = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "mcp", "server_label": "loopwarden"}],
    }
    await respond(proxy, model="weather", input="Hi", tool_choice=hosted)
    assert proxy.upstream.bodies[1]["tool_choice"] == "required"


async def test_max_tool_calls_limits_the_server_calls_of_a_run(proxy: Proxy) -> None:
    proxy.upstream.script(
        calls(call("get_weather", city="Paris"), call("get_weather", city="Lima")),
        say("Done."),
    )
    body = (await respond(proxy, model="weather", input="Both?", max_tool_calls=1)).json()
    assert body["loop"]["tool_calls"] == 1
    assert [i["type"] for i in body["output"]] == ["mcp_call", "message"]
    results = [m for m in proxy.upstream.bodies[1]["messages"] if m["role"] == "tool"]
    assert "Tool call limit exceeded" in results[1]["content"]


async def test_cut_at_the_clients_max_output_tokens_is_incomplete(proxy: Proxy) -> None:
    proxy.upstream.script(say("A long answer that goes on and on and on."))
    body = (await respond(proxy, model="scripted", max_output_tokens=2)).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    (message,) = body["output"]
    assert message["status"] == "incomplete"  # as OpenAI marks the item cut short


async def test_an_upstream_that_stops_for_length_below_the_clients_cap_is_not_incomplete(
    proxy: Proxy,
) -> None:
    """Its context window ran out, say: not the client's `max_output_tokens`."""
    own_limit = say("Cut by the model's own limit.", finish_reason="length")
    proxy.upstream.script(own_limit.replace(usage={"completion_tokens": 501}))
    body = (await respond(proxy, model="scripted", max_output_tokens=1000)).json()
    assert (body["status"], body["incomplete_details"]) == ("completed", None)
    assert body["output"][0]["status"] == "completed"


async def test_stored_responses_are_read_and_deleted(proxy: Proxy) -> None:
    proxy.upstream.script(say("Kept."))
    body = (await respond(proxy, model="scripted")).json()
    got = await proxy.client.get(f"/v1/responses/{body['id']}")
    assert got.status_code == 200
    assert got.json() == body
    report = await proxy.client.get(f"/v1/runs/{body['id']}")
    assert report.json()["stop_reason"] == "completed"
    gone = await proxy.client.delete(f"/v1/responses/{body['id']}")
    assert gone.json() == {"id": body["id"], "object": "response", "deleted": True}
    assert (await proxy.client.get(f"/v1/responses/{body['id']}")).status_code == 404
    again = await respond(proxy, model="scripted", previous_response_id=body["id"])
    assert again.status_code == 404
    assert again.json()["error"]["param"] == "previous_response_id"


async def test_store_false_keeps_nothing(proxy: Proxy) -> None:
    proxy.upstream.script(say("Not kept."))
    body = (await respond(proxy, model="scripted", store=False)).json()
    assert body["store"] is False
    assert (await proxy.client.get(f"/v1/responses/{body['id']}")).status_code == 404


async def test_item_references_read_stored_items(proxy: Proxy) -> None:
    proxy.upstream.script(call("lookup_order", order="A-1"), say("Shipped."))
    first = (await respond(proxy, model="scripted", input="A-1?", tools=[FUNCTION])).json()
    [fc] = first["output"]
    again = [
        {"role": "user", "content": "A-1?"},
        {"type": "item_reference", "id": fc["id"]},
        {"id": fc["id"]},  # a reference's `type` is optional
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "shipped"},
    ]
    r = await respond(proxy, model="scripted", input=again, tools=[FUNCTION])
    assert r.status_code == 200, r.text
    roles = [m["role"] for m in proxy.upstream.bodies[1]["messages"]]
    assert roles == ["user", "assistant", "tool"]
    missing = await respond(
        proxy, model="scripted", input=[{"type": "item_reference", "id": "msg_nope"}]
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "input[0].id"


async def test_a_loop_failure_is_a_422_with_the_loop_report(proxy_for: ProxyFactory) -> None:
    async with proxy_for() as proxy:
        proxy.upstream.script(call("get_weather", city="Paris"), call("get_weather", city="Rome"))
        loop = {"tool_call_limits": [{"run_limit": 1, "exit_behavior": "error"}]}
        r = await respond(proxy, model="weather", loop=loop)
        assert r.status_code == 422
        assert r.json()["error"]["code"] == "tool_call_limit_exceeded"
        assert r.json()["loop"]["stop_reason"] == "tool_call_limit"
        assert r.headers["x-should-retry"] == "false"
        response_id = "resp_" + r.json()["loop"]["run_id"].removeprefix("run_")
        assert (await proxy.client.get(f"/v1/responses/{response_id}")).status_code == 404


async def test_a_run_that_fails_after_its_tools_ran_shows_what_ran_in_its_error(
    proxy: Proxy,
) -> None:
    """A stream's `response.failed` carries the server calls and the text: a JSON client got
    the `loop` report alone, its tools having acted."""
    proxy.upstream.script(
        replace(call("get_weather", city="Oslo"), content="Looking."), fail(500, "down")
    )
    r = await respond(proxy, model="weather", input="Oslo?")
    assert r.status_code == 502, r.text
    assert r.headers["x-should-retry"] == "false"
    shown = r.json()["response"]
    assert (shown["status"], shown["error"]["code"]) == ("failed", "upstream_error")
    mcp, message = shown["output"]
    assert (mcp["type"], mcp["status"]) == ("mcp_call", "completed")
    assert "Oslo" in mcp["output"]
    assert (message["status"], message["content"][0]["text"]) == ("incomplete", "Looking.")
    assert "loop" not in shown  # the body's own `loop` has the report (and any messages) once
