"""Proxy keys through the real `openai` SDK against the proxy under uvicorn: the tools a key may
add, the threads it owns, and `/metrics` behind a key."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.bodies import loop_of, user
from tests.e2e.conftest import ToolServer, config_file, proxy_process
from tests.scripted_upstream import ScriptedUpstream, call, each_run, keep, say_tool_result
from tests.tools import TOOLS

pytestmark = pytest.mark.e2e

SECRETS = {"ALPHA_KEY": "sk-alpha", "BETA_KEY": "sk-beta", "PROM_KEY": "sk-prom"}


@pytest.fixture(scope="module")
def keyed_proxy(
    upstream_url: str,
    tool_server: tuple[str, ToolServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A proxy with three keys: two teams on the `stock` agent, and a metrics scraper."""
    folder = Path(tmp_path_factory.mktemp("keys-e2e"))
    config = {
        "auth": {
            "keys": [
                {"name": "alpha", "key_env": "ALPHA_KEY", "agents": ["stock"]},
                {"name": "beta", "key_env": "BETA_KEY", "agents": ["stock"]},
                {"name": "prometheus", "key_env": "PROM_KEY", "agents": [], "metrics": True},
            ],
            "metrics_key": True,
        },
        "upstreams": {"scripted": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "scripted",
        "tools": {
            "check_inventory": {"kind": "http", "url": f"{tool_server[0]}/inventory"},
            **TOOLS,
        },
        "agents": {
            "stock": {
                "model": "scripted",
                "tools": ["check_inventory"],
                "tool_call_limits": [{"tool_name": "check_inventory", "thread_limit": 1}],
            },
            "weather": {"model": "scripted", "tools": ["get_weather"]},
        },
        "state": {"backend": "sqlite", "path": str(folder / "state.db")},
    }
    with proxy_process(config_file(folder, config), SECRETS) as base:
        yield base


def sdk(base: str, secret: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=secret, max_retries=0)


def test_a_key_may_not_add_a_tool_of_an_agent_it_may_not_use(
    keyed_proxy: str, upstream: ScriptedUpstream
) -> None:
    with sdk(keyed_proxy, "sk-alpha") as client:
        with pytest.raises(openai.PermissionDeniedError) as forbidden:
            client.chat.completions.create(
                model="stock", messages=user("Hi"), extra_body={"loop": {"tools": ["get_weather"]}}
            )
        with pytest.raises(openai.PermissionDeniedError) as unknown:
            client.chat.completions.create(
                model="stock", messages=user("Hi"), extra_body={"loop": {"tools": ["no_such"]}}
            )
    for err in (forbidden.value, unknown.value):
        assert (err.param, err.code) == ("loop.tools[0]", "tool_not_allowed")
    assert forbidden.value.message.endswith("key 'alpha' may not use tool 'get_weather'")
    assert upstream.requests == []


def test_two_keys_naming_one_thread_each_get_their_own_limit(
    keyed_proxy: str, upstream: ScriptedUpstream, tool_server: tuple[str, ToolServer]
) -> None:
    upstream.script(
        keep(each_run(call("check_inventory", item="bolts"), then=say_tool_result("Got: {}")))
    )
    thread = f"shared-{secrets.token_hex(4)}"
    executed = []
    for secret in ("sk-alpha", "sk-beta", "sk-alpha"):
        with sdk(keyed_proxy, secret) as client:
            reply = client.chat.completions.create(
                model="stock",
                messages=user("Bolts?"),
                extra_headers={"x-loopwarden-thread-id": thread},
            )
        executed.append(loop_of(reply)["tool_calls"])
    assert executed == [1, 1, 0]  # beta spent none of alpha's thread limit
    served = [c["thread_id"] for c in tool_server[1].calls if thread in (c["thread_id"] or "")]
    assert served == [f"alpha/{thread}", f"beta/{thread}"]


def test_metrics_behind_a_key(keyed_proxy: str) -> None:
    anonymous = httpx.get(f"{keyed_proxy}/metrics")
    team = httpx.get(f"{keyed_proxy}/metrics", headers={"authorization": "Bearer sk-alpha"})
    scraper = httpx.get(f"{keyed_proxy}/metrics", headers={"authorization": "Bearer sk-prom"})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    assert team.status_code == 403
    assert team.json()["error"]["code"] == "metrics_not_allowed"
    assert scraper.status_code == 200
    assert "loopwarden_runs_total" in scraper.text
    assert httpx.get(f"{keyed_proxy}/healthz").status_code == 200
