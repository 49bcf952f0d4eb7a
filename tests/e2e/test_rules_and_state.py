"""Tool rules, tool call limits, thread state and stored contexts across real processes: the
`openai` SDK as the client, proxies under uvicorn, a real redis-server and sqlite files."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI

from tests.bodies import loop_of, offered
from tests.e2e.conftest import ToolServer, config_file, proxy_process
from tests.scripted_upstream import ScriptedUpstream, call, each_run, keep, say, say_tool_result
from tests.tools import TOOLS

pytestmark = pytest.mark.e2e

INVENTORY_LIMIT = 7


def write_config(folder: Path, upstream: str, tools_url: str, state: dict[str, Any]) -> Path:
    config = {
        "upstreams": {"scripted": {"base_url": upstream, "max_retries": 0}},
        "default_upstream": "scripted",
        "tools": {
            "check_inventory": {
                "kind": "http",
                "url": f"{tools_url}/inventory",
                "parameters": {"type": "object", "properties": {"item": {"type": "string"}}},
            },
            **TOOLS,
        },
        "agents": {
            "ruled": {
                "model": "scripted",
                "tools": ["get_weather", "to_fahrenheit", "search_notes"],
                "tool_rules": [
                    {"type": "InitToolRule", "tool_name": "get_weather"},
                    {
                        "type": "ChildToolRule",
                        "tool_name": "get_weather",
                        "children": ["to_fahrenheit"],
                    },
                    {
                        "type": "MaxCountPerStepToolRule",
                        "tool_name": "search_notes",
                        "max_count_limit": 1,
                    },
                ],
            },
            "stock": {
                "model": "scripted",
                "tools": ["check_inventory"],
                "max_steps": 4,
                "tool_call_limits": [
                    {"tool_name": "check_inventory", "thread_limit": INVENTORY_LIMIT}
                ],
            },
            "weather": {"model": "scripted", "tools": ["get_weather", "final_answer"]},
        },
        "state": state,
    }
    return config_file(folder, config)


@pytest.fixture(scope="module")
def redis_proxies(
    upstream_url: str,
    tool_server: tuple[str, ToolServer],
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str]]:
    """Two proxy processes sharing one redis-server."""
    state = {"backend": "redis", "url_env": "LW_REDIS", "key_prefix": "e2e:"}
    path = write_config(tmp_path_factory.mktemp("redis-e2e"), upstream_url, tool_server[0], state)
    env = {"LW_REDIS": redis_url}
    with proxy_process(path, env) as first, proxy_process(path, env) as second:
        yield first, second


def sdk(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_rules_shape_what_the_model_is_offered_at_each_step(
    redis_proxies: tuple[str, str], upstream: ScriptedUpstream
) -> None:
    upstream.script(
        call("get_weather", city="Lima"),
        call("to_fahrenheit", celsius=23.0),
        call("search_notes", query="Lima"),
        say("Warm, and the notes agree."),
    )
    with sdk(redis_proxies[0]) as client:
        reply = client.chat.completions.create(
            model="ruled", messages=[{"role": "user", "content": "Lima?"}]
        )
    steps = upstream.bodies
    assert [offered(s) for s in steps] == [
        ["get_weather"],
        ["to_fahrenheit"],
        ["get_weather", "to_fahrenheit", "search_notes"],
        ["get_weather", "to_fahrenheit"],  # search_notes used up (max_count_per_step)
    ]
    assert steps[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert steps[1]["tool_choice"] == {"type": "function", "function": {"name": "to_fahrenheit"}}
    assert "tool_choice" not in steps[2]
    assert loop_of(reply)["stop_reason"] == "completed"
    assert loop_of(reply)["tool_calls"] == 3


def test_a_disallowed_call_is_blocked_and_the_run_goes_on(
    redis_proxies: tuple[str, str], upstream: ScriptedUpstream
) -> None:
    upstream.script(
        call("to_fahrenheit", celsius=20.0),  # not offered: get_weather runs first
        call("get_weather", city="Lima"),
        call("to_fahrenheit", celsius=23.0),
        say("73.4°F in Lima."),
    )
    with sdk(redis_proxies[1]) as client:
        reply = client.chat.completions.create(
            model="ruled",
            messages=[{"role": "user", "content": "Lima in Fahrenheit?"}],
            extra_body={"loop": {"include_messages": True}},
        )
    loop = loop_of(reply)
    error = json.loads(loop["messages"][1]["content"])["error"]
    assert error == (
        "Tool 'to_fahrenheit' is not allowed now by the tool rules. Allowed tools: get_weather."
    )
    assert loop["stop_reason"] == "completed"


def test_limit_behaviours_through_the_sdk(
    redis_proxies: tuple[str, str], upstream: ScriptedUpstream
) -> None:
    upstream.script(keep(call("get_weather", city="Oslo")))
    with sdk(redis_proxies[0]) as client:
        with pytest.raises(openai.UnprocessableEntityError) as err:
            client.chat.completions.create(
                model="weather",
                messages=[{"role": "user", "content": "Oslo?"}],
                extra_body={
                    "loop": {"tool_call_limits": [{"run_limit": 2, "exit_behavior": "error"}]}
                },
            )
        ended = client.chat.completions.create(
            model="weather",
            messages=[{"role": "user", "content": "Oslo?"}],
            extra_body={"loop": {"tool_call_limits": [{"run_limit": 2, "exit_behavior": "end"}]}},
        )
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="weather",
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"loop": {"tool_rules": [{"type": "run_first", "tool_name": "x"}]}},
            )
    assert err.value.code == "tool_call_limit_exceeded"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert ended.choices[0].message.content == (
        "Stopped: the run reached a tool call limit (run: 2/2) calling get_weather."
    )
    assert loop_of(ended)["stop_reason"] == "tool_call_limit"
    assert bad.value.param == "loop.tool_rules[0].tool_name"


def test_two_processes_on_one_redis_never_pass_a_thread_limit(
    redis_proxies: tuple[str, str],
    tool_server: tuple[str, ToolServer],
    upstream: ScriptedUpstream,
) -> None:
    upstream.script(keep(call("check_inventory", item="bolts")))
    thread = f"mp-{secrets.token_hex(4)}"
    clients = [sdk(base) for base in redis_proxies]

    def one_run(i: int) -> int:
        reply = clients[i % 2].chat.completions.create(
            model="stock",
            messages=[{"role": "user", "content": f"Bolts #{i}?"}],
            extra_headers={"x-loopwarden-thread-id": thread},
        )
        return int(loop_of(reply)["tool_calls"])

    with ThreadPoolExecutor(max_workers=16) as pool:
        executed = list(pool.map(one_run, range(24)))
    for client in clients:
        client.close()
    served = [c for c in tool_server[1].calls if c["thread_id"] == thread]
    assert sum(executed) == INVENTORY_LIMIT
    assert len(served) == INVENTORY_LIMIT


def test_contexts_are_shared_between_processes(
    redis_proxies: tuple[str, str], upstream: ScriptedUpstream
) -> None:
    upstream.script(call("get_weather", city="Lima"), say("Warm in Lima."), say("You are welcome."))
    first, second = redis_proxies
    cid = f"ctx-{secrets.token_hex(4)}"
    created = httpx.post(
        f"{first}/chat", json={"context_id": cid, "agent": "weather", "message": "Lima?"}
    )
    followed = httpx.post(f"{second}/chat", json={"context_id": cid, "message": "thanks"})
    stored = httpx.get(f"{second}/v1/contexts/{cid}").json()
    assert created.status_code == 200
    assert created.json()["generated_messages"][1]["tool_name"] == "get_weather"
    assert followed.json()["response"] == "You are welcome."
    # The second process sent the model the history the first one saved.
    sent = [m["role"] for m in upstream.bodies[-1]["messages"] if m["role"] != "system"]
    assert sent == ["user", "assistant", "tool", "assistant", "user"]
    assert [m["role"] for m in stored["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert httpx.delete(f"{first}/v1/contexts/{cid}").json()["deleted"] is True
    assert httpx.get(f"{second}/v1/contexts/{cid}").status_code == 404


def test_redis_losing_the_proxy_s_data_is_counted_for_the_alerts(
    redis_proxies: tuple[str, str], redis_url: str
) -> None:
    """Redis restarted empty, flushed or evicting: thread limits count again from zero. Each
    process that finds it counts it in `loopwarden_state_data_lost_total` (an alert reads it),
    besides its log line; `/readyz` stays 200, redis itself being fine."""
    base = redis_proxies[0]
    assert httpx.get(f"{base}/readyz").status_code == 200  # the epoch read
    before = lost_count(base)
    admin = redis.Redis.from_url(redis_url)
    admin.delete("e2e:epoch")  # (as a flush would drop it, with every other key)
    admin.close()
    assert httpx.get(f"{base}/readyz").status_code == 200
    assert lost_count(base) == before + 1


def lost_count(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("loopwarden_state_data_lost_total "):
            return float(line.split()[1])
    raise AssertionError("no loopwarden_state_data_lost_total")


def test_sqlite_thread_counts_survive_a_restart(
    upstream_url: str,
    upstream: ScriptedUpstream,
    tool_server: tuple[str, ToolServer],
    tmp_path: Path,
) -> None:
    upstream.script(keep(call("check_inventory", item="bolts")))
    state = {"backend": "sqlite", "path": str(tmp_path / "state.db")}
    path = write_config(tmp_path, upstream_url, tool_server[0], state)
    thread = f"restart-{secrets.token_hex(4)}"
    counts = []
    for _ in range(2):
        with proxy_process(path) as base, sdk(base) as client:
            reply = client.chat.completions.create(
                model="stock",
                messages=[{"role": "user", "content": "Bolts?"}],
                extra_body={"loop": {"thread_id": thread}},
            )
            counts.append(loop_of(reply)["tool_calls"])
    assert counts == [4, INVENTORY_LIMIT - 4]


def test_concurrent_runs_on_one_context_wait_for_each_other_across_processes(
    redis_proxies: tuple[str, str], upstream: ScriptedUpstream
) -> None:
    upstream.script(
        say("Ready."),
        keep(each_run(call("get_weather", city="Oslo"), then=say_tool_result("Found: {}"))),
    )
    cid = f"busy-{secrets.token_hex(4)}"
    started = httpx.post(
        f"{redis_proxies[0]}/chat", json={"context_id": cid, "agent": "weather", "message": "start"}
    )
    assert started.status_code == 200, started.text

    def one(i: int) -> int:
        body = {"context_id": cid, "message": f"Oslo #{i}?"}
        return httpx.post(f"{redis_proxies[i % 2]}/chat", json=body, timeout=30).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(one, range(8)))
    stored = httpx.get(f"{redis_proxies[1]}/v1/contexts/{cid}").json()
    assert statuses == [200] * 8
    roles = [m["role"] for m in stored["messages"]]
    assert roles == ["user", "assistant"] + ["user", "assistant", "tool", "assistant"] * 8
