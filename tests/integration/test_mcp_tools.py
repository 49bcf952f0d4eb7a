"""MCP tool sources (SPEC §13): the tools of a real MCP server (a stdio child of the proxy, written
with the `mcp` package's server API) run in the loop like any server tool: agents name the entry
or single tools, rules and limits count the exposed names, faults are tool errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.config.tools import digest_name, function_name
from proxy.demo.runner import free_port
from proxy.tools import mcp_source
from proxy.tools.mcp_asked import MAX_ASKED
from proxy.tools.registry import SourcesUnavailable
from tests.bodies import offered, user
from tests.e2e.conftest import wait_healthy
from tests.integration.conftest import Proxy, ProxyFactory
from tests.mcp_config import NOISY, http_entry, http_server_args, stdio_entry
from tests.scripted_upstream import Reply, call, calls, say, say_tool_result

AGENTS = {
    "mcp": {"model": "scripted", "tools": ["srv"]},  # the entry: every tool it exposes
    "picked": {"model": "scripted", "tools": ["t_echo", "get_weather"]},
}


def config(**entry: Any) -> dict[str, Any]:
    return {"tools": {"srv": stdio_entry(**entry)}, "agents": AGENTS}


def tool_messages(proxy: Proxy, request: int) -> list[str]:
    return [m["content"] for m in proxy.upstream.bodies[request]["messages"] if m["role"] == "tool"]


async def test_an_agent_naming_the_entry_runs_its_tools(proxy_for: ProxyFactory) -> None:
    async with proxy_for(config(exclude=["die"])) as proxy:
        proxy.upstream.script(
            calls(call("t_echo", text="hi"), call("t_forecast", city="Oslo"), call("t_huge")),
            say_tool_result("done: {}"),
        )
        response = await proxy.chat(model="mcp", messages=user("go"))
        metric = proxy.metric("loopwarden_tool_calls_total", tool="t_echo", outcome="ok")
    assert response.status_code == 200, response.text
    assert response.json()["loop"]["tool_calls"] == 3
    offers = offered(proxy.upstream.bodies[0])
    assert {"t_echo", "t_grow"} <= set(offers)
    assert "t_die" not in offers  # excluded
    echo = next(t for t in proxy.upstream.bodies[0]["tools"] if t["function"]["name"] == "t_echo")
    assert echo["function"]["parameters"]["required"] == ["text"]  # the server's inputSchema
    # Text parts as they are; structured content as compact JSON.
    assert tool_messages(proxy, 1) == [
        "echo: hi",
        '{"city":"Oslo","celsius":21.5}',
        '{"values":[1180591620717411303424]}',  # past 64 bits, as JSON has it
    ]
    assert metric == 1.0  # labelled by the exposed name


async def test_spans_carry_mcp_attributes_and_the_call_carries_their_context(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(config()) as proxy:
        proxy.upstream.script(call("t_trace_context"), say_tool_result())
        response = await proxy.chat(model="mcp", messages=user("trace"))
    assert response.status_code == 200
    span = next(s for s in proxy.spans() if s.name == "execute_tool t_trace_context")
    attributes = dict(span.attributes or {})
    assert attributes["mcp.method.name"] == "tools/call"
    assert attributes["network.transport"] == "pipe"
    assert attributes["loopwarden.tool.outcome"] == "ok"
    context = span.get_span_context()
    assert context is not None
    traceparent = tool_messages(proxy, 1)[0]
    assert traceparent.split("-")[1:3] == [f"{context.trace_id:032x}", f"{context.span_id:016x}"]


async def test_faults_are_tool_errors_and_the_session_goes_on(proxy_for: ProxyFactory) -> None:
    async with proxy_for(config(timeout_s=0.5)) as proxy:
        proxy.upstream.script(
            call("t_fail", message="no such issue"),
            call("t_nap", seconds=3),
            call("t_picture"),
            call("t_echo", text="still here"),
            say("ok"),
        )
        response = await proxy.chat(model="mcp", messages=user("faults"))
        timeouts = proxy.metric("loopwarden_tool_calls_total", tool="t_nap", outcome="timeout")
        errors = proxy.metric("loopwarden_tool_calls_total", tool="t_fail", outcome="error")
    assert response.status_code == 200
    failed, napped, picture, echoed = tool_messages(proxy, 4)
    assert "no such issue" in orjson.loads(failed)["error"]  # isError
    assert "timed out after 0.5s" in orjson.loads(napped)["error"]
    assert picture == "[image content not shown]"
    assert echoed == "echo: still here"  # a timeout leaves the session up
    assert (timeouts, errors) == (1.0, 1.0)


async def test_a_stdio_child_that_dies_mid_call_is_a_tool_error_and_is_restarted(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(config()) as proxy:
        proxy.upstream.script(call("t_pid"), say_tool_result(), call("t_die"), say("died"))
        first = await proxy.chat(model="mcp", messages=user("pid"))
        died = await proxy.chat(model="mcp", messages=user("die"))
        source = proxy_source(proxy)
        await wait_for(lambda: source.connected)
        proxy.upstream.script(call("t_pid"), say_tool_result())
        after = await proxy.chat(model="mcp", messages=user("pid again"))
    assert died.status_code == 200
    error = orjson.loads(tool_messages(proxy, 3)[0])["error"]
    assert "dropped the call" in error
    old_pid = first.json()["choices"][0]["message"]["content"]
    new_pid = after.json()["choices"][0]["message"]["content"]
    assert old_pid.isdigit()
    assert new_pid.isdigit()
    assert old_pid != new_pid


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("quota exceeded for this tool", -32600),
        ("your OAuth session has expired", -32600),
        ("rate limited, try later", -32000),
    ],
)
async def test_a_call_refused_with_an_invalid_request_error_leaves_the_session_up(
    proxy_for: ProxyFactory, message: str, code: int
) -> None:
    """-32600 is also what the SDK makes of a session the server no longer knows (over HTTP),
    and -32000 of a connection that closed, but a server may answer one call with either,
    whatever it says: only that call fails (a stdio server was restarted, the calls beside it
    failed)."""
    async with proxy_for(config()) as proxy:
        proxy.upstream.script(
            call("t_pid"),
            say_tool_result(),
            call("t_refuse", message=message, code=code),
            say("refused"),
            call("t_pid"),
            say_tool_result(),
        )
        first = await proxy.chat(model="mcp", messages=user("pid"))
        refused = await proxy.chat(model="mcp", messages=user("refuse"))
        after = await proxy.chat(model="mcp", messages=user("pid again"))
    assert refused.status_code == 200
    error = orjson.loads(tool_messages(proxy, 3)[0])["error"]
    assert f"refused the call: {message}" in error
    assert first.json()["choices"][0]["message"]["content"].isdigit()
    assert (
        after.json()["choices"][0]["message"]["content"]
        == (first.json()["choices"][0]["message"]["content"])
    )  # the same child: its session was not taken for dropped


@pytest.mark.parametrize("junk", [False, True], ids=["notifications", "junk"])
async def test_a_stdio_server_sending_lines_without_end_is_ended(
    proxy_for: ProxyFactory, junk: bool
) -> None:
    """A stdio child's lines other than answers come at most 1,000 a second after a burst of
    10,000: notifications (or lines that are no message) without end held a core, and the
    answer after them came past its timeout."""
    noisy = {"kind": "mcp", "command": [sys.executable, str(NOISY)], "timeout_s": 5}
    agents = {"noise": {"model": "scripted", "tools": ["noisy"]}}
    async with proxy_for({"tools": {"noisy": noisy}, "agents": agents}) as proxy:
        proxy.upstream.script(call("noise", lines=40_000, junk=junk), say("noisy"))
        started = time.monotonic()
        await proxy.chat(model="noise", messages=user("noise"))
        took = time.monotonic() - started
    (told,) = tool_messages(proxy, 1)
    assert "the server sent more than 1000 messages a second" in told, told
    assert took < 5  # not its timeout_s


async def test_a_stdio_child_s_answers_are_not_bounded_in_rate(proxy_for: ProxyFactory) -> None:
    """Its answers are the calls': counted with its other lines, they capped a stdio source
    at a few hundred calls a second (1,500 at once: 300 failed, the session ended). A server
    answering 40,000 times at once (all but the first dropped) keeps its session."""
    noisy = {"kind": "mcp", "command": [sys.executable, str(NOISY)], "timeout_s": 5}
    agents = {"noise": {"model": "scripted", "tools": ["noisy"]}}
    async with proxy_for({"tools": {"noisy": noisy}, "agents": agents}) as proxy:
        proxy.upstream.script(
            call("noise", lines=40_000, answers=True),
            call("noise", lines=0),  # answered after the others: all read by then
            say("ok"),
        )
        answered = await proxy.chat(model="noise", messages=user("answers"))
        source = proxy_registry(proxy).sources["noisy"]
        assert source.connected
    assert answered.status_code == 200
    assert tool_messages(proxy, 2) == ["done", "done"]


async def test_a_source_still_connecting_is_cancelled_at_shutdown_and_its_child_stopped(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    """A child hanging in `initialize` held the shutdown CLOSE_TIMEOUT_S, and could outlive
    the proxy: a source still connecting is cancelled at once, its child stopped."""
    pid_file = tmp_path / "pid"
    command = [sys.executable, str(NOISY), "hang", str(pid_file)]
    hanging = {"kind": "mcp", "command": command, "connect_timeout_s": 1.5}
    agents = {"noise": {"model": "scripted", "tools": ["noisy"]}}
    async with proxy_for({"tools": {"noisy": hanging}, "agents": agents}) as proxy:
        source = proxy_registry(proxy).sources["noisy"]
        await wait_for(lambda: source.state == "disconnected")  # its first try timed out
        pid_file.unlink()
        await wait_for(lambda: source.state == "connecting")  # and it tries again
        await wait_for(pid_file.exists)  # its second child
        pid = int(pid_file.read_text())
        started = time.monotonic()
    took = time.monotonic() - started
    assert took < mcp_source.CLOSE_TIMEOUT_S / 2, took  # the child's stop: a few seconds at most
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_a_server_s_long_error_is_told_cut_and_without_control_characters(
    proxy_for: ProxyFactory,
) -> None:
    """12 MB of a server's error message was kept, looked through for secrets on the event
    loop at each call (1.6 s), and logged and shown in `/readyz` whole, escapes and all."""
    secret = "postgres://admin:Sup3rSecretPassw0rd@db:5432/x"
    message = "\x1b[31mred\x1b[0m\n" + "a" * 990 + f" {secret} " + "a b " * 200_000
    async with proxy_for(config()) as proxy:
        proxy.upstream.script(call("t_refuse", message=message, code=-32000), say("refused"))
        refused = await proxy.chat(model="mcp", messages=user("refuse"))
    assert refused.status_code == 200
    error = orjson.loads(tool_messages(proxy, 1)[0])["error"]
    assert "refused the call: \ufffd[31mred\ufffd[0m\ufffdaaa" in error
    assert "postgres://[redacted" in error  # looked for before the cut
    assert "Sup3r" not in error
    assert error.endswith("…")
    assert len(error) < 1200


async def test_an_answer_the_client_cannot_read_fails_its_call_at_once(
    proxy_for: ProxyFactory,
) -> None:
    """Over stdio a line the SDK cannot parse was dropped: its call waited for its timeout."""
    async with proxy_for(config(timeout_s=30)) as proxy:
        proxy.upstream.script(
            call("t_deep", levels=250), say("unread"), call("t_pid"), say_tool_result()
        )
        started = time.monotonic()
        unread = await proxy.chat(model="mcp", messages=user("deep"))
        waited = time.monotonic() - started
        after = await proxy.chat(model="mcp", messages=user("pid"))
        errors = proxy.metric("loopwarden_tool_calls_total", tool="t_deep", outcome="error")
    assert unread.status_code == 200
    assert waited < 15  # not the call's 30 s
    error = orjson.loads(tool_messages(proxy, 1)[0])["error"]
    assert "the server's answer could not be read" in error
    assert errors == 1
    assert after.json()["choices"][0]["message"]["content"].isdigit()  # the session goes on


async def test_a_stdio_message_over_the_bound_ends_its_session_and_fails_the_call(
    proxy_for: ProxyFactory,
) -> None:
    """A message is read up to `max_message_bytes` (64 KiB here): a longer one is never read
    whole; the call fails at once with the reason and the child is started again."""
    async with proxy_for(config(max_message_bytes=65536, max_output_bytes=1 << 20)) as proxy:
        proxy.upstream.script(
            calls(call("t_large", kib=60), call("t_pid")),
            say_tool_result(),
            call("t_large", kib=100),
            say("too large"),
        )
        under = await proxy.chat(model="mcp", messages=user("60 KiB"))
        over = await proxy.chat(model="mcp", messages=user("100 KiB"))
        source = proxy_source(proxy)
        await wait_for(lambda: source.connected)
        proxy.upstream.script(call("t_pid"), say_tool_result())
        after = await proxy.chat(model="mcp", messages=user("pid again"))
    assert (under.status_code, over.status_code) == (200, 200)
    large, pid = tool_messages(proxy, 1)
    assert large == "x" * 60 * 1024
    error = orjson.loads(tool_messages(proxy, 3)[0])["error"]
    assert "dropped the call: the server sent a message larger than 65536 bytes" in error
    assert "(max_message_bytes)" in error
    assert after.json()["choices"][0]["message"]["content"] != pid  # a new child


async def test_a_tool_list_over_the_bound_is_why_the_source_is_not_connected(
    proxy_for: ProxyFactory,
) -> None:
    entry = stdio_entry(required=False, max_message_bytes=65536, connect_timeout_s=10)
    entry["command"] = [*entry["command"], "wordy"]
    async with proxy_for({"tools": {"srv": entry}, "agents": AGENTS}) as proxy:
        ready = await proxy.client.get("/readyz")
    (missing,) = ready.json()["mcp_missing"]
    assert (
        missing["error"] == "the server sent a message larger than 65536 bytes (max_message_bytes)"
    )


async def test_a_tool_list_over_the_bound_when_listed_again_is_why_the_session_ended(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    entry = stdio_entry(max_message_bytes=65536)
    async with proxy_for({"tools": {"srv": entry}, "agents": AGENTS}) as proxy:
        source = proxy_source(proxy)
        proxy.upstream.script(call("t_grow", kib=100), say("grown"))
        await proxy.chat(model="mcp", messages=user("grow"))
        await wait_for(lambda: "disconnected" in caplog.text)
    (line,) = [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()]
    assert line == (
        f"{source.located()} disconnected: the server sent a message larger than 65536 bytes "
        "(max_message_bytes); reconnecting"
    )


async def test_a_message_over_the_body_values_bound_ends_a_stdio_session(
    proxy_for: ProxyFactory,
) -> None:
    """A message's JSON values are counted before it is parsed, against the bound on a request
    body's (1,000 here; the structured content of 400 numbers is about 420 values)."""
    overrides = {**config(), "server": {"max_body_values": 1000}}
    async with proxy_for(overrides) as proxy:
        proxy.upstream.script(
            call("t_numbers", count=400), say("400"), call("t_numbers", count=1200), say("1200")
        )
        under = await proxy.chat(model="mcp", messages=user("400 numbers"))
        over = await proxy.chat(model="mcp", messages=user("1,200 numbers"))
    assert (under.status_code, over.status_code) == (200, 200)
    assert orjson.loads(tool_messages(proxy, 1)[0]) == {"values": [0] * 400}
    error = orjson.loads(tool_messages(proxy, 3)[0])["error"]
    assert "dropped the call: the server sent a message holding more than 1000 JSON values" in error
    assert "(server.max_body_values)" in error


async def test_rules_limits_and_terminal_tools_name_the_exposed_tools(
    proxy_for: ProxyFactory,
) -> None:
    agent = {
        "model": "scripted",
        "tools": ["srv"],
        "tool_rules": [{"type": "run_first", "tool_name": "t_echo"}],
        "tool_call_limits": [{"tool_name": "t_echo", "run_limit": 1}],
    }
    overrides = config(terminal=["forecast"])
    overrides["agents"] = {"ruled": agent}
    async with proxy_for(overrides) as proxy:
        proxy.upstream.script(
            call("t_echo", text="one"),
            call("t_echo", text="two"),
            call("t_forecast", city="Lima"),
        )
        response = await proxy.chat(model="ruled", messages=user("go"), stream=True)
        blocked = proxy.metric(
            "loopwarden_tool_calls_total", tool="t_echo", outcome="blocked_limit"
        )
    assert response.status_code == 200
    assert proxy.upstream.bodies[0]["tool_choice"] == {
        "type": "function",
        "function": {"name": "t_echo"},
    }
    assert "Tool call limit exceeded" in tool_messages(proxy, 2)[-1]
    assert blocked == 1.0
    chunks = [
        orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")
    ]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.endswith('{"city":"Lima","celsius":21.5}')  # the terminal tool's output
    assert chunks[-1]["loop"]["stop_reason"] == "terminal_tool"


async def test_a_changed_tool_list_is_read_again_without_a_restart(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(config()) as proxy:
        proxy.upstream.script(call("t_grow"), say("grown"))
        await proxy.chat(model="mcp", messages=user("grow"))
        source = proxy_source(proxy)
        await wait_for(lambda: any(t.name == "extra" for t in source.tools))
        proxy.upstream.script(call("t_extra", note="new"), say_tool_result())
        response = await proxy.chat(model="mcp", messages=user("use the new one"))
    assert "t_extra" in offered(proxy.upstream.bodies[2])
    assert response.json()["choices"][0]["message"]["content"] == "extra: new"


async def test_a_changed_list_read_too_slowly_keeps_the_session_and_the_tools_as_listed(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The list's read again takes longer than `connect_timeout_s`: it is given up, and the
    session goes on (it ended, and failed the call in flight)."""
    # 3 s: a child's start on a busy machine (1 s was missed under CI's load), and less than
    # the 5 s its lists after the first take; the nap outlasts the list given up.
    entry = stdio_entry(connect_timeout_s=3)
    entry["command"] = [*entry["command"], "slow-relist"]
    async with proxy_for({"tools": {"srv": entry}, "agents": AGENTS}) as proxy:
        source = proxy_source(proxy)
        proxy.upstream.script(
            call("t_nap", seconds=4), call("t_grow"), say("grown"), say_tool_result()
        )
        napping = asyncio.ensure_future(proxy.chat(model="mcp", messages=user("nap")))
        await wait_for(lambda: len(proxy.upstream.bodies) == 1)
        await asyncio.sleep(0.3)  # the nap under way
        await proxy.chat(model="mcp", messages=user("grow"))
        await wait_for(lambda: "could not be read again" in caplog.text)
        napped = await napping
        assert source.connected
    assert napped.json()["choices"][0]["message"]["content"] == "slept 4s"
    assert "the tools stay as last listed" in caplog.text


async def test_tool_lists_changed_in_a_burst_are_read_at_most_once_a_second(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.tools.mcp_source")
    async with proxy_for(config()) as proxy:
        proxy.upstream.script(calls(*[call("t_grow") for _ in range(8)]), say("grown"))
        started = time.monotonic()
        await proxy.chat(model="mcp", messages=user("grow, eight times"))
        source = proxy_source(proxy)
        await wait_for(lambda: any(t.name == "extra" for t in source.tools))
        await asyncio.sleep(max(0.0, started + 1.5 - time.monotonic()))
    lists = caplog.text.count("changed its tools")
    assert 1 <= lists <= 2  # eight changes announced: one read, and one for those after it


async def test_a_name_no_model_api_takes_is_exposed_as_a_function_name(
    proxy_for: ProxyFactory,
) -> None:
    """MCP names may hold dots and slashes (`github.get_issue`); OpenAI refuses such function
    names with a 400, failing every run of the agent."""
    async with proxy_for(config(prefix="t.", include=["echo", "pid"])) as proxy:
        proxy.upstream.script(call("t_echo", text="hi"), say_tool_result())
        r = await proxy.chat(model="mcp", messages=user("echo"))
    assert offered(proxy.upstream.bodies[0]) == ["t_echo", "t_pid"]
    assert r.json()["choices"][0]["message"]["content"] == "echo: hi"


@pytest.mark.parametrize("prefix", ["", "gh_", "gh."])
async def test_a_name_made_of_another_never_takes_a_name_a_tool_has(
    proxy_for: ProxyFactory, prefix: str
) -> None:
    """`x.y` would be offered as `x_y`, which the server's own `x_y` is: it is offered under a
    name with its digest, whichever the server lists first, however the prefix is written; a
    config may name either, by the name offered."""
    entry = stdio_entry(include=["x.y", "x_y"], prefix=prefix)
    entry["command"] = [*entry["command"], "dotted"]
    own, made = function_name(f"{prefix}x_y"), digest_name(f"{prefix}x.y")
    agents = {"mcp": {"model": "scripted", "tools": [own, made]}}
    async with proxy_for({"tools": {"srv": entry}, "agents": agents}) as proxy:
        proxy.upstream.script(calls(call(own), call(made)), say_tool_result())
        r = await proxy.chat(model="mcp", messages=user("both"))
    assert r.status_code == 200, r.text
    assert sorted(offered(proxy.upstream.bodies[0])) == sorted([own, made])
    assert made.startswith(f"{own}_")
    assert tool_messages(proxy, 1) == ["plain", "dotted"]


async def test_loop_tools_may_name_the_entry(proxy_for: ProxyFactory) -> None:
    async with proxy_for(config()) as proxy:
        proxy.upstream.script(call("t_echo", text="x"), say_tool_result())
        response = await proxy.chat(model="scripted", messages=user("x"), loop={"tools": ["srv"]})
    assert response.json()["choices"][0]["message"]["content"] == "echo: x"


async def test_a_required_source_that_cannot_connect_stops_start_up(
    proxy_for: ProxyFactory,
) -> None:
    broken = {"kind": "mcp", "command": [sys.executable, "-c", "pass"], "required": True}
    with pytest.raises(SourcesUnavailable, match=r"tools\.gone: required MCP server 'gone'"):
        async with proxy_for({"tools": {"gone": broken}}):
            pass


async def test_an_optional_source_missing_is_named_by_readyz(proxy_for: ProxyFactory) -> None:
    missing = {"kind": "mcp", "command": [sys.executable, "-c", "pass"], "prefix": "m_"}
    agents = {"uses": {"model": "scripted", "tools": ["m_lookup", "get_weather"]}}
    async with proxy_for({"tools": {"gone": missing}, "agents": agents}) as proxy:
        ready = await proxy.client.get("/readyz")
        proxy.upstream.script(call("m_lookup"), say_tool_result())
        response = await proxy.chat(model="uses", messages=user("look up"))
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert [m["source"] for m in ready.json()["mcp_missing"]] == ["gone"]
    assert response.status_code == 200  # the agent compiled with a stand-in for m_lookup
    assert "is not connected" in orjson.loads(tool_messages(proxy, 1)[0])["error"]


async def test_what_the_model_reads_of_a_source_holds_no_token_of_its_url(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A token in the URL's path or query (as hosted MCP servers give them) reached the model in
    the stand-in's description and in every tool error; the log names the host alone."""
    url = f"http://127.0.0.1:{free_port()}/s/PATHTOKEN1234567890/mcp?api_key=QUERYTOKEN1234567890"
    entry = {"kind": "mcp", "url": url, "prefix": "h_", "connect_timeout_s": 1}
    agents = {"uses": {"model": "scripted", "tools": ["h_search"]}}
    async with proxy_for({"tools": {"hosted": entry}, "agents": agents}) as proxy:
        proxy.upstream.script(call("h_search"), say_tool_result())
        await proxy.chat(model="uses", messages=user("search"))
    offered_tools = orjson.dumps(proxy.upstream.bodies[0]["tools"]).decode()
    error = orjson.loads(tool_messages(proxy, 1)[0])["error"]
    assert "MCP server 'hosted' is not connected: " in error
    for told in (offered_tools, error, caplog.text):
        assert "TOKEN1234567890" not in told
    assert "MCP server 'hosted' (http://127.0.0.1:" in caplog.text


async def test_a_name_the_server_does_not_expose_stops_start_up(proxy_for: ProxyFactory) -> None:
    overrides = config()
    overrides["agents"] = {"typo": {"model": "scripted", "tools": ["t_ecoh"]}}
    with pytest.raises(SourcesUnavailable, match=r"names 't_ecoh'.*does not expose"):
        async with proxy_for(overrides):
            pass


@pytest.mark.parametrize("required", [False, True])
async def test_a_source_listing_more_tools_than_its_bound_starts_without_the_rest(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture, required: bool
) -> None:
    """What a server lists is its own: tools left out are logged, never a reason not to start
    (a list arriving later was only logged, so a pod restarted with it stayed down)."""
    async with proxy_for(
        config(include=["echo", "pid", "nap"], max_tools=2, required=required)
    ) as proxy:
        assert proxy_registry(proxy).groups["srv"] == ("t_echo", "t_nap")  # as listed
        proxy.upstream.script(call("t_echo", text="hi"), say_tool_result())
        r = await proxy.chat(model="mcp", messages=user("echo"))
    assert r.json()["choices"][0]["message"]["content"] == "echo: hi"
    assert "more than max_tools (2) tools; 't_pid' and later ones are left out" in caplog.text


async def test_two_sources_exposing_one_name_stop_start_up(proxy_for: ProxyFactory) -> None:
    tools = {"one": stdio_entry(include=["echo"]), "two": stdio_entry(include=["echo"])}
    # (Named as a tool of the one that connected first: it had the name.)
    with pytest.raises(
        SourcesUnavailable, match=r"'t_echo' is also a tool of MCP server '(one|two)'"
    ):
        async with proxy_for({"tools": tools}):
            pass


async def test_a_tool_a_server_adds_never_takes_a_name_another_server_has(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A clash that appears later leaves the newcomer out, whichever source the config names
    first: the calls of `t_extra` stay with the server that had it (a server adding a tool
    could take another's, and the arguments meant for it)."""
    first = stdio_entry(include=["grow", "extra"])  # adds `extra` when `grow` is called
    other = {**stdio_entry(include=["extra"]), "command": [*stdio_entry()["command"], "extra"]}
    agents = {"both": {"model": "scripted", "tools": ["first", "other"]}}
    async with proxy_for({"tools": {"first": first, "other": other}, "agents": agents}) as proxy:
        proxy.upstream.script(call("t_grow"), say("grown"))
        await proxy.chat(model="both", messages=user("grow"))
        grown = proxy_registry(proxy).sources["first"]
        await wait_for(lambda: any(t.name == "extra" for t in grown.tools))
        await wait_for(lambda: "'t_extra' is also a tool" in caplog.text)
        proxy.upstream.script(call("t_extra", note="hi"), say_tool_result())
        response = await proxy.chat(model="both", messages=user("extra"))
    assert response.json()["choices"][0]["message"]["content"] == "extra of the other: hi"
    assert "tools.first: 't_extra' is also a tool of MCP server 'other'" in caplog.text


async def test_a_tool_list_is_read_no_further_than_its_bound(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server listing hundreds of thousands of tools held the event loop minutes: a walk
    reads MAX_LISTED_TOOLS of them (10,000) and no more."""
    monkeypatch.setattr(mcp_source, "MAX_LISTED_TOOLS", 2)
    async with proxy_for(config()) as proxy:
        assert len(proxy_source(proxy).tools) == 2
        assert len(proxy_registry(proxy).groups["srv"]) == 2
    assert "lists more than 2 tools: the rest are not read" in caplog.text


def proxy_registry(proxy: Proxy) -> Any:
    app = proxy.client._transport.app  # type: ignore[attr-defined]
    return app.services().registry


def proxy_source(proxy: Proxy) -> Any:
    return proxy_registry(proxy).sources["srv"]


async def wait_for(condition: Any, timeout_s: float = 20) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s:g}s")


async def test_a_required_source_that_drops_makes_readyz_fail(proxy_for: ProxyFactory) -> None:
    async with proxy_for(config(required=True)) as proxy:
        assert (await proxy.client.get("/readyz")).status_code == 200
        proxy.upstream.script(call("t_die"), say("died"))
        await proxy.chat(model="mcp", messages=user("die"))
        dropped = await proxy.client.get("/readyz")
        await wait_for(lambda: proxy_source(proxy).connected)
        back = await proxy.client.get("/readyz")
    assert dropped.status_code == 503
    assert dropped.json()["detail"] == "MCP servers not connected: srv"
    assert dropped.json()["mcp_missing"][0]["required"] is True
    assert back.json() == {"status": "ready"}


@contextlib.contextmanager
def serving_mcp(legacy: bool, *options: str) -> Iterator[str]:
    """The tests' MCP server over streamable HTTP; `legacy`: of the handshake era (it gives
    session ids and answers calls with event streams), else of the 2026 era (JSON answers)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, *http_server_args(port, legacy, *options)])
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    with serving_mcp(legacy=True) as url:
        yield url


async def test_http_sources_send_headers_name_their_session_and_follow_list_changes(
    proxy_for: ProxyFactory, http_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MCP_TEST_TOKEN", "Bearer sesame")
    headers = {"Authorization": "MCP_TEST_TOKEN"}
    entry = http_entry(http_server, prefix="t_", headers_env=headers)
    overrides = {"tools": {"srv": entry}, "agents": AGENTS}
    async with proxy_for(overrides) as proxy:
        proxy.upstream.script(call("t_authorization"), say_tool_result(), call("t_grow"), say("."))
        response = await proxy.chat(model="mcp", messages=user("http"))
        source = proxy_source(proxy)
        session = source.session_id
        await proxy.chat(model="mcp", messages=user("grow"))
        # A handshake-era server says so with `notifications/tools/list_changed`.
        await wait_for(lambda: "t_extra" in proxy_registry(proxy).tools)
    assert response.json()["choices"][0]["message"]["content"] == "Bearer sesame"
    span = next(s for s in proxy.spans() if s.name == "execute_tool t_authorization")
    attributes = dict(span.attributes or {})
    assert session
    assert attributes["mcp.session.id"] == session
    assert attributes["server.address"] == "127.0.0.1"
    assert attributes["server.port"] == int(http_server.rsplit(":", 1)[1].split("/")[0])


@pytest.mark.parametrize(
    ("legacy", "options", "refusal"),
    [
        (True, (), "SSE stream failed: the server sent a message larger than 65536 bytes (max_"),
        (False, (), "the server sent a message larger than 65536 bytes (max_message_bytes)"),
        (False, ("gzip",), "the server sent a message larger than 65536 bytes"),
    ],
)
async def test_an_http_answer_over_the_bound_fails_its_call(
    proxy_for: ProxyFactory, legacy: bool, options: tuple[str, ...], refusal: str
) -> None:
    """Both ways a server answers a call, an event stream and a JSON body, are bounded by
    `max_message_bytes`; in bytes as they are parsed, so a server that would compress its
    answers (100 KiB of `x` are 0.2 KiB as gzip) is asked not to."""
    with serving_mcp(legacy, *options) as url:
        entry = http_entry(url, prefix="t_", max_message_bytes=65536, max_output_bytes=1 << 20)
        async with proxy_for({"tools": {"srv": entry}, "agents": AGENTS}) as proxy:
            proxy.upstream.script(
                calls(call("t_large", kib=60), call("t_large", kib=100)),
                say("one of two"),
            )
            response = await proxy.chat(model="mcp", messages=user("60 and 100 KiB"))
    assert response.status_code == 200
    under, over = tool_messages(proxy, 1)
    assert under == "x" * 60 * 1024
    assert refusal in orjson.loads(over)["error"]


async def test_an_answer_compressed_unasked_is_refused(proxy_for: ProxyFactory) -> None:
    """A server that compresses whatever it is asked would pass the byte bound with an answer
    that decodes to far more: its answers are refused unread."""
    with serving_mcp(False, "gzip-always") as url:
        entry = http_entry(url, prefix="t_", required=False)
        async with proxy_for({"tools": {"srv": entry}, "agents": AGENTS}) as proxy:
            ready = await proxy.client.get("/readyz")
    (missing,) = ready.json()["mcp_missing"]
    assert missing["source"] == "srv"
    assert "answer encoded with gzip (content-encoding), not asked for" in missing["error"]


async def test_a_json_answer_over_the_body_values_bound_fails_its_call(
    proxy_for: ProxyFactory,
) -> None:
    """A 2026-era server's JSON answer is counted before it is parsed; the session goes on."""
    with serving_mcp(legacy=False) as url:
        entry = http_entry(url, prefix="t_")
        overrides = {"tools": {"srv": entry}, "agents": AGENTS, "server": {"max_body_values": 1000}}
        async with proxy_for(overrides) as proxy:
            proxy.upstream.script(
                calls(call("t_numbers", count=1200), call("t_echo", text="still here")),
                say("one of two"),
            )
            response = await proxy.chat(model="mcp", messages=user("1,200 numbers"))
    assert response.status_code == 200
    over, echoed = tool_messages(proxy, 1)
    error = orjson.loads(over)["error"]
    assert "refused the call: Failed to parse JSON response: the server sent a message " in error
    assert "holding more than 1000 JSON values (server.max_body_values)" in error
    assert echoed == "echo: still here"


async def test_an_event_over_the_body_values_bound_fails_its_call(proxy_for: ProxyFactory) -> None:
    """A handshake-era server's event is counted before the SDK parses it: that call fails,
    the session goes on."""
    with serving_mcp(legacy=True) as url:
        entry = http_entry(url, prefix="t_")
        overrides = {"tools": {"srv": entry}, "agents": AGENTS, "server": {"max_body_values": 1000}}
        async with proxy_for(overrides) as proxy:
            proxy.upstream.script(call("t_numbers", count=1200), say("over"))
            response = await proxy.chat(model="mcp", messages=user("1,200 numbers"))
            session = proxy_source(proxy).session_id
            proxy.upstream.script(call("t_numbers", count=900), say("under"))
            again = await proxy.chat(model="mcp", messages=user("900 numbers"))
            assert proxy_source(proxy).session_id == session
    assert (response.status_code, again.status_code) == (200, 200)
    error = orjson.loads(tool_messages(proxy, 1)[0])["error"]
    assert "refused the call: SSE stream failed: the server sent a message holding more " in error
    assert error.endswith("than 1000 JSON values (server.max_body_values)")
    assert orjson.loads(tool_messages(proxy, 3)[0])["values"] == [0] * 900


async def test_structured_content_is_checked_off_the_event_loop_within_bounds(
    proxy_for: ProxyFactory,
) -> None:
    """A result's check against an output schema pattern that the SDK's `re` takes 2^28 tries
    for, on the event loop, runs in a thread within the schema checks' bounds (with `regex`,
    which finds it at once): `/healthz` is answered meanwhile."""
    with serving_mcp(True, "patterned") as url:
        overrides = {"tools": {"srv": http_entry(url, prefix="t_")}, "agents": AGENTS}
        async with proxy_for(overrides) as proxy:
            proxy.upstream.script(call("t_word", length=28), say("checked"))
            started = time.monotonic()
            run = asyncio.ensure_future(proxy.chat(model="mcp", messages=user("a word")))
            await asyncio.sleep(0.05)
            health = await asyncio.wait_for(proxy.client.get("/healthz"), 1)
            response = await asyncio.wait_for(run, 10)
            took = time.monotonic() - started
    assert (health.status_code, response.status_code) == (200, 200)
    assert tool_messages(proxy, 1) == ['{"word":"' + "a" * 28 + 'b"}']
    assert took < 5


ASKING = str(Path(__file__).parents[1] / "mcp_asking_server.py")


@pytest.mark.parametrize(
    ("method", "mode"),
    [
        ("roots/list", ""),
        ("sampling/createMessage", ""),
        ("ping", ""),
        ("roots/list", "cancelling"),
        ("roots/list", "one-id"),
    ],
)
async def test_a_server_asking_more_than_it_reads_holds_a_few_of_its_requests(
    proxy_for: ProxyFactory, method: str, mode: str
) -> None:
    """Each request a server sends the client waits in a task of its own until its answer is
    written: a server that asks 20,000 times and reads none of the answers made 20,000 tasks
    (60,000: 928 MB; that many messages at once now end its session). Past a few unanswered,
    its requests are dropped; its call goes on. A cancel of a request whose answer is being
    written ends no task (the SDK writes it all the same: cancelling each batch made 46,586
    tasks), nor is a request with an id in flight admitted again."""
    command = [sys.executable, ASKING, method, mode]
    entry = {"kind": "mcp", "command": command, "timeout_s": 5}
    agents = {"asking": {"model": "scripted", "tools": ["ask"]}}
    async with proxy_for({"tools": {"srv": entry}, "agents": agents}) as proxy:
        before = len(asyncio.all_tasks())
        # Within the burst of messages a stdio child may send (STDIO_BURST: more end the
        # session): each batch of 16 cancelled is 2 messages a request.
        count = 4_000 if mode else 9_000
        proxy.upstream.script(call("ask", count=count), say_tool_result())
        asked = await proxy.chat(model="asking", messages=user("ask"))
        await asyncio.sleep(0.2)  # the requests after the answer, if any, are read by now
        held = len(asyncio.all_tasks()) - before
    assert asked.json()["choices"][0]["message"]["content"] == f"asked {count}"
    assert held <= 2 * MAX_ASKED


async def test_a_listed_tool_s_schemas_are_checked_as_the_list_is_read(
    proxy_for: ProxyFactory,
) -> None:
    """Checked as the registry built each tool, they held the event loop (20 tools of ~4,850
    values: 3.4 s): the source checks what it may expose as it reads its list, in a thread."""
    async with proxy_for(config(exclude=["large"])) as proxy:
        source = proxy_source(proxy)
        echo = proxy_registry(proxy).tools["t_echo"]
    checked = source.schemas
    assert "large" not in checked  # left out by the config: not checked
    assert {"echo", "forecast", "numbers"} <= set(checked)
    assert echo.spec.definition["function"]["parameters"] == checked["echo"].parameters
    assert checked["forecast"].output is not None  # its results are checked against it


@contextlib.asynccontextmanager
async def hostile_source(
    proxy_for: ProxyFactory, *options: str, **entry: Any
) -> AsyncIterator[Proxy]:
    """The proxy with the tests' handshake-era server answering as `hostile` says (tools
    `t_endless`, `t_weird`, `t_loop`, `t_tally`, `t_echo`)."""
    with serving_mcp(True, "hostile", *options) as url:
        source = http_entry(url, prefix="t_", **entry)
        async with proxy_for({"tools": {"srv": source}, "agents": AGENTS}) as proxy:
            yield proxy


async def tally(proxy: Proxy, what: str) -> int:
    """What the hostile server saw, asked through the proxy."""
    proxy.upstream.script(call("t_tally", what=what), say_tool_result())
    await proxy.chat(model="mcp", messages=user(what))
    (told,) = tool_messages(proxy, len(proxy.upstream.bodies) - 1)
    return int(orjson.loads(told)["result"])


async def test_a_timed_out_call_s_answer_stream_ends_with_its_time(
    proxy_for: ProxyFactory,
) -> None:
    """The SDK gives up a handshake-era server's call with a `notifications/cancelled` and
    read on: a server ignoring it kept the call's event stream going (ten of them: 96 % of a
    core). The exchange ends with the call's time (and a second)."""
    async with hostile_source(proxy_for, timeout_s=1, connect_timeout_s=1) as proxy:
        proxy.upstream.script(call("t_endless"), say_tool_result())
        await proxy.chat(model="mcp", messages=user("endless"))
        (timed_out,) = tool_messages(proxy, 1)
        await asyncio.sleep(2.5)  # the exchange's end: 2 s after the call began
        open_streams = await tally(proxy, "streams")
    assert "timed out after 1s" in timed_out
    assert open_streams == 0


async def test_a_stream_flooding_events_ends_its_call(proxy_for: ProxyFactory) -> None:
    async with hostile_source(proxy_for) as proxy:
        proxy.upstream.script(call("t_endless", every_s=0), say_tool_result())
        started = time.monotonic()
        await proxy.chat(model="mcp", messages=user("flood"))
        took = time.monotonic() - started
        (flooded,) = tool_messages(proxy, 1)
        echoed = await tally(proxy, "streams")
    assert "the server sent more than 200 messages a second" in flooded
    assert took < 4  # not its timeout_s (5 s)
    assert echoed == 0


async def test_an_answer_that_is_not_mcp_is_told_in_a_line(proxy_for: ProxyFactory) -> None:
    """pydantic's text of 5,000 invalid parts was 66 KB of the model's context."""
    async with hostile_source(proxy_for) as proxy:
        proxy.upstream.script(call("t_weird"), say_tool_result())
        await proxy.chat(model="mcp", messages=user("weird"))
    (weird,) = tool_messages(proxy, 1)
    error = orjson.loads(weird)["error"]
    assert "answered: not a valid MCP" in error
    assert "more)" in error
    assert len(error) < 600


async def test_a_redirect_to_itself_sends_the_call_a_few_times_at_most(
    proxy_for: ProxyFactory,
) -> None:
    """Each redirect sends the call again: a loop sent a tool call 21 times."""
    async with hostile_source(proxy_for) as proxy:
        proxy.upstream.script(call("t_loop"), say_tool_result())
        await proxy.chat(model="mcp", messages=user("loop"))
        sent = await tally(proxy, "posts")
    assert "Redirect" in tool_messages(proxy, 1)[0]
    assert sent == 3  # the call and two redirects


async def test_the_event_stream_is_opened_at_most_once_a_second(proxy_for: ProxyFactory) -> None:
    """A server's `retry: 0` had the SDK open it again at once: 10,000 times in 10 s."""
    async with hostile_source(proxy_for, "retry-0") as proxy:
        began = time.monotonic()
        await asyncio.sleep(2.5)
        opened = await tally(proxy, "gets")
        took = time.monotonic() - began
    assert 1 <= opened <= took + 2  # (the first went before `began`)


async def echoed_after_a_timeout(
    proxy_for: ProxyFactory, options: tuple[str, ...], first: Reply, pause_s: float
) -> tuple[str, str, bool]:
    """A hostile source (1 s calls and connects) asked `first`, which times out, then, after
    `pause_s`, `t_echo`: the first's tool message, the echo's, and whether one session
    answered both."""
    async with hostile_source(proxy_for, *options, timeout_s=1, connect_timeout_s=1) as proxy:
        source = proxy_source(proxy)
        session = source.session_id
        proxy.upstream.script(first, say_tool_result())
        await proxy.chat(model="mcp", messages=user("first"))
        await asyncio.sleep(pause_s)
        proxy.upstream.script(call("t_echo", text="again"), say_tool_result())
        await proxy.chat(model="mcp", messages=user("echo"))
    (timed_out,) = tool_messages(proxy, 1)
    (echoed,) = tool_messages(proxy, 3)
    return timed_out, echoed, source.session_id == session


async def test_a_notification_never_acknowledged_holds_the_session_a_moment_only(
    proxy_for: ProxyFactory,
) -> None:
    """The SDK sends a session's notifications one after another, each awaited: a cancel the
    server never acknowledged held every later message of the session (its calls timed out)
    for the 300 s read timeout. Past `connect_timeout_s`, it is given up, and the session goes
    on."""
    timed_out, echoed, one_session = await echoed_after_a_timeout(
        proxy_for,
        ("mute-cancels",),
        call("t_endless", every_s=0.5),
        1.2,  # cancel never taken
    )
    assert "timed out after 1s" in timed_out
    assert echoed == "echo: again"
    assert one_session


async def test_a_session_that_ends_at_once_is_made_anew_later_each_time(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    """A server dropping each session as soon as it began had one made (its tools listed and
    checked) every half second: only a session that lasted waits the first delay again."""
    starts = tmp_path / "starts"
    brief = str(Path(__file__).parents[1] / "mcp_brief_server.py")
    entry = {"kind": "mcp", "command": [sys.executable, brief, str(starts)], "required": False}
    async with proxy_for({"tools": {"srv": entry}}):
        await asyncio.sleep(6)
    # started at about 0 s, then after waits of 0.5, 1, 2 and 4 s (each half a second: 7 to 12)
    assert 1 <= len(starts.read_text().splitlines()) <= 4


async def test_a_call_whose_answer_never_begins_is_given_up_alone(
    proxy_for: ProxyFactory,
) -> None:
    """A handshake-era server answering in JSON sends its headers with the result: a call
    past its time was given up by an error that ended the whole session (every call beside
    it: `Connection closed`)."""
    timed_out, echoed, one_session = await echoed_after_a_timeout(
        proxy_for,
        (),
        call("t_held", seconds=6),
        1.5,  # given up 2 s after the call began
    )
    assert "timed out after 1s" in timed_out
    assert echoed == "echo: again"
    assert one_session


async def test_a_timed_out_call_s_answer_resumed_ends_with_its_time(
    proxy_for: ProxyFactory,
) -> None:
    """The SDK resumes an answer stream that ended before its answer with a GET naming the
    last event's id: no deadline bounded those, and a server kept each going for the
    session's life (about 100 filled the session's pool)."""
    async with hostile_source(proxy_for, timeout_s=1, connect_timeout_s=1) as proxy:
        proxy.upstream.script(call("t_resumable"), say_tool_result())
        await proxy.chat(model="mcp", messages=user("resumable"))
        (timed_out,) = tool_messages(proxy, 1)
        await asyncio.sleep(2.5)  # the exchange's end: 2 s after the call began
        open_streams = await tally(proxy, "streams")
        resumed = await tally(proxy, "gets")
    assert "timed out after 1s" in timed_out
    assert resumed >= 1  # (the session's own event stream too)
    assert open_streams == 0
