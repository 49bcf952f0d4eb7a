"""SPEC §4.4, §6: what a request's policy refers to is checked before any upstream call."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, parse_config
from tests.integration.conftest import CheckConfig, ProxyFactory


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("__import__('os').system('true')", "unknown function '__import__'"),
        ("size(steps)", "boolean"),
        ("secrets == 1", "unknown variable 'secrets'"),
    ],
)
async def test_a_cel_expression_is_checked_when_the_request_is_parsed(
    proxy_for: ProxyFactory, expr: str, message: str
) -> None:
    async with proxy_for() as proxy:
        r = await proxy.chat(model="weather", loop={"stop_when": [{"any": [{"expr": expr}]}]})
        assert proxy.upstream.requests == []
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "loop.stop_when[0].any[0].expr"
    assert message in error["message"]


async def test_an_agent_cost_condition_on_an_unpriced_model_is_a_start_up_error(
    proxy_for: ProxyFactory,
) -> None:
    agents = {"spender": {"model": "unpriced-x", "stop_when": [{"max_cost": 1}]}}
    with pytest.raises(ConfigError) as err:
        async with proxy_for({"agents": agents}):
            pass
    assert err.value.problems[0][0] == "agents.spender.model"
    assert "no known price" in err.value.problems[0][1]


async def test_a_key_without_the_agent_gets_a_403_before_its_loop_is_read(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIMITED_KEY", "k-limited")
    auth = {"keys": [{"name": "limited", "key_env": "LIMITED_KEY", "agents": ["other"]}]}
    async with proxy_for({"auth": auth}) as proxy:
        r = await proxy.client.post(
            "/v1/chat/completions",
            json={
                "model": "weather",
                "messages": [{"role": "user", "content": "hi"}],
                "loop": {"stop_when": [{"webhook": "undefined"}]},
            },
            headers={"authorization": "Bearer k-limited"},
        )
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_error"


def test_the_proxy_key_can_never_be_forwarded_upstream() -> None:
    config = {
        "auth": {"keys": [{"name": "a", "key_sha256": "0" * 64}]},
        "upstreams": {"main": {"base_url": "http://u.test/v1", "forward_client_key": True}},
        "default_upstream": "main",
    }
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    assert [path for path, _ in err.value.problems] == ["upstreams.main.forward_client_key"]


def test_a_python_conditions_callable_is_checked_like_a_python_tools() -> None:
    config = {
        "upstreams": {"main": {"base_url": "http://u.test/v1"}},
        "default_upstream": "main",
        "conditions": {"bad": {"kind": "python", "callable": "no_colon"}},
        "tools": {"bad": {"kind": "python", "callable": "no_colon"}},
    }
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    message = "callable must look like package.module:function"
    found = sorted((path, message in text) for path, text in err.value.problems)
    assert found == [("conditions.bad", True), ("tools.bad", True)]


def test_check_names_the_condition_whose_callable_cannot_be_loaded(
    check_config: CheckConfig,
) -> None:
    status, _, err = check_config(
        "conditions: {gone: {kind: python, callable: 'tests.tools:no_such_function'}}\n"
    )
    assert status == 1
    assert "conditions.gone: 'tests.tools' has no attribute 'no_such_function'" in err
