"""What a proxy key may use beyond its agents: the tools it may add with `loop.tools`, its own
threads, and `GET /metrics` when that is protected."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai import AsyncOpenAI

from proxy.config import ConfigError, parse_config
from proxy.state.memory import MemoryStore
from tests.bodies import user
from tests.integration.conftest import BASE_CONFIG, CheckConfig, Proxy, ProxyFactory
from tests.scripted_upstream import call, calls, say

AGENTS: dict[str, Any] = {
    "weather": {"model": "scripted", "tools": ["get_weather", "to_fahrenheit"]},
    "notes": {"model": "scripted", "tools": ["search_notes"]},
    "capped": {
        "model": "scripted",
        "tools": ["get_weather"],
        "tool_call_limits": [{"tool_name": "get_weather", "thread_limit": 1}],
    },
}
TOOLS = {**BASE_CONFIG["tools"], "sleep": {**BASE_CONFIG["tools"]["sleep"], "id": "tool-sleep"}}


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def key(name: str, **fields: Any) -> dict[str, Any]:
    """A key whose secret is `sk-<name>`."""
    return {"name": name, "key_sha256": sha(f"sk-{name}"), **fields}


def keyed(*keys: Any, **auth: Any) -> dict[str, Any]:
    return {"auth": {"keys": list(keys), **auth}, "agents": AGENTS, "tools": TOOLS}


async def chat_as(proxy: Proxy, name: str, **body: Any) -> httpx.Response:
    body.setdefault("messages", user("Lima?"))
    headers = {"authorization": f"Bearer sk-{name}"}
    return await proxy.client.post("/v1/chat/completions", json=body, headers=headers)


# --- tools -----------------------------------------------------------------------------------


async def test_a_key_cannot_add_a_tool_that_only_another_agent_lists(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(keyed(key("a", agents=["weather"]))) as proxy:
        r = await chat_as(proxy, "a", model="weather", loop={"tools": ["search_notes"]})
    assert r.status_code == 403
    assert r.json()["error"] == {
        "message": "key 'a' may not use tool 'search_notes'",
        "type": "permission_error",
        "param": "loop.tools[0]",
        "code": "tool_not_allowed",
    }
    assert proxy.upstream.requests == []


async def test_an_unknown_tool_reads_the_same_as_a_forbidden_one(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(keyed(key("a", agents=["weather"]))) as proxy:
        forbidden = await chat_as(
            proxy, "a", model="weather", loop={"tools": ["get_weather", "search_notes"]}
        )
        unknown = await chat_as(
            proxy, "a", model="weather", loop={"tools": ["get_weather", "no_such_tool"]}
        )
    assert (forbidden.status_code, unknown.status_code) == (403, 403)
    shown = forbidden.json()["error"]
    hidden = unknown.json()["error"]
    assert hidden["message"] == shown["message"].replace("search_notes", "no_such_tool")
    assert {k: v for k, v in hidden.items() if k != "message"} == {
        k: v for k, v in shown.items() if k != "message"
    }
    assert hidden["param"] == "loop.tools[1]"


async def test_by_default_a_key_may_add_the_tools_of_its_agents(
    proxy_for: ProxyFactory,
) -> None:
    config = keyed(key("a", agents=["weather", "scripted"]), key("all"))
    async with proxy_for(config) as proxy:
        proxy.upstream.script(call("to_fahrenheit", celsius=20), say("68 °F."), say("Noted."))
        own = await chat_as(proxy, "a", model="scripted", loop={"tools": ["to_fahrenheit"]})
        other = await chat_as(proxy, "a", model="scripted", loop={"tools": ["search_notes"]})
        every = await chat_as(proxy, "all", model="scripted", loop={"tools": ["search_notes"]})
        unknown = await chat_as(proxy, "all", model="scripted", loop={"tools": ["ghost"]})
    assert own.status_code == 200
    assert own.json()["loop"]["tool_calls"] == 1
    assert other.status_code == 403
    assert every.status_code == 200
    # A key that may use every tool learns nothing from a 400 for an unknown one.
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "loop.tools[0]"


async def test_a_keys_tools_list_names_tools_by_name_or_id(proxy_for: ProxyFactory) -> None:
    config = keyed(
        key("listed", agents=["weather"], tools=["search_notes", "tool-sleep"]),
        key("star", agents=["weather"], tools=["*"]),
    )
    async with proxy_for(config) as proxy:
        proxy.upstream.script(*(say(n) for n in ("One.", "Two.", "Three.", "Four.", "Five.")))
        by_name = await chat_as(proxy, "listed", model="weather", loop={"tools": ["search_notes"]})
        by_id = await chat_as(proxy, "listed", model="weather", loop={"tools": ["tool-sleep"]})
        by_other_ref = await chat_as(proxy, "listed", model="weather", loop={"tools": ["sleep"]})
        # The agent's own tools come with the agent, whatever the key's list says.
        agent_only = await chat_as(proxy, "listed", model="weather")
        outside = await chat_as(proxy, "listed", model="weather", loop={"tools": ["meet"]})
        star = await chat_as(proxy, "star", model="weather", loop={"tools": ["meet"]})
    assert [r.status_code for r in (by_name, by_id, by_other_ref, agent_only)] == [200] * 4
    assert (outside.status_code, star.status_code) == (403, 200)
    assert [t["function"]["name"] for t in proxy.upstream.bodies[3]["tools"]] == [
        "get_weather",
        "to_fahrenheit",
    ]


async def test_stored_context_runs_respect_the_keys_tools(proxy_for: ProxyFactory) -> None:
    async with proxy_for(keyed(key("a", agents=["weather"]))) as proxy:
        r = await proxy.client.post(
            "/chat",
            json={
                "context_id": "c-1",
                "agent": "weather",
                "message": "hi",
                "loop": {"tools": ["search_notes"]},
            },
            headers={"authorization": "Bearer sk-a"},
        )
    assert r.status_code == 403
    assert r.json()["error"]["param"] == "loop.tools[0]"


async def test_a_context_made_before_keys_were_on_is_no_key_s(proxy_for: ProxyFactory) -> None:
    """It belongs to no key, as a stored response made then does: every key read it, added to
    it and could drop it."""
    store = MemoryStore()
    async with proxy_for({"agents": AGENTS}, store=store) as open_proxy:
        open_proxy.upstream.script(say("Kept."))
        made = await open_proxy.client.post(
            "/chat", json={"context_id": "old", "agent": "weather", "message": "hi"}
        )
    assert made.status_code == 200
    async with proxy_for(keyed(key("a", agents=["weather"]), key("all")), store=store) as proxy:
        headers = {"authorization": "Bearer sk-a"}
        read = await proxy.client.get("/v1/contexts/old", headers=headers)
        ran = await proxy.client.post(
            "/chat", json={"context_id": "old", "message": "more"}, headers=headers
        )
        dropped = await proxy.client.delete("/v1/contexts/old", headers=headers)
        assert [r.status_code for r in (read, ran, dropped)] == [404, 400, 404]
        assert "does not exist" in ran.json()["error"]["message"]  # for this key
        assert await store.load_context("old") is not None
        # A key that may use every agent drops it, so that its id can be used again.
        everyone = {"authorization": "Bearer sk-all"}
        assert (await proxy.client.get("/v1/contexts/old", headers=everyone)).status_code == 404
        assert (await proxy.client.delete("/v1/contexts/old", headers=everyone)).status_code == 200
    assert await store.load_context("old") is None


async def test_a_context_s_agent_the_key_may_not_use_is_a_403_whether_it_exists_or_not(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(keyed(key("a", agents=["weather"]))) as proxy:
        replies = [
            await proxy.client.post(
                "/chat",
                json={"context_id": "c", "agent": agent, "message": "hi"},
                headers={"authorization": "Bearer sk-a"},
            )
            for agent in ("ghost", "notes")
        ]
    assert [r.status_code for r in replies] == [403, 403]
    assert [r.json()["error"]["param"] for r in replies] == ["agent", "agent"]


async def test_without_keys_any_configured_tool_can_be_added(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"agents": AGENTS}) as proxy:
        proxy.upstream.script(say("Fine."))
        added = await proxy.chat(model="weather", loop={"tools": ["search_notes"]})
        unknown = await proxy.chat(model="weather", loop={"tools": ["ghost"]})
    assert added.status_code == 200
    assert unknown.status_code == 400


# --- threads ---------------------------------------------------------------------------------


async def test_two_keys_naming_one_thread_id_have_separate_counts(
    proxy_for: ProxyFactory,
) -> None:
    two_calls = [call("get_weather", city="Lima"), call("get_weather", city="Lima"), say("Done.")]
    async with proxy_for(keyed(key("a"), key("b"))) as proxy:
        proxy.upstream.script(*two_calls, *two_calls, *two_calls)
        first_a = await chat_as(proxy, "a", model="capped", loop={"thread_id": "t-1"})
        # b names a's thread id: it gets a thread of its own, and spends none of a's limit.
        first_b = await chat_as(proxy, "b", model="capped", loop={"thread_id": "t-1"})
        again_a = await proxy.client.post(
            "/v1/chat/completions",
            json={"model": "capped", "messages": user("Lima?")},
            headers={"authorization": "Bearer sk-a", "x-loopwarden-thread-id": "t-1"},
        )
    executed = [r.json()["loop"]["tool_calls"] for r in (first_a, first_b, again_a)]
    assert executed == [1, 1, 0]


async def test_a_keyed_thread_is_named_with_its_key_in_spans(proxy_for: ProxyFactory) -> None:
    async with proxy_for(keyed(key("a"))) as proxy:
        proxy.upstream.script(say("Hi."))
        r = await chat_as(proxy, "a", model="capped", loop={"thread_id": "t-1"})
    assert r.status_code == 200
    runs = [s for s in proxy.spans() if s.name.startswith("invoke_agent")]
    assert dict(runs[0].attributes or {})["gen_ai.conversation.id"] == "a/t-1"


async def test_without_keys_thread_ids_are_used_as_sent(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"agents": AGENTS}) as proxy:
        proxy.upstream.script(say("Hi."))
        await proxy.chat(model="capped", loop={"thread_id": "t-1"})
    runs = [s for s in proxy.spans() if s.name.startswith("invoke_agent")]
    assert dict(runs[0].attributes or {})["gen_ai.conversation.id"] == "t-1"


# --- many keys -------------------------------------------------------------------------------


async def test_each_of_many_keys_names_its_own_caller(proxy_for: ProxyFactory) -> None:
    """A request's key is found among a thousand."""
    many = [key(f"k{i}", agents=["notes"]) for i in range(1000)]
    async with proxy_for(keyed(*many)) as proxy:
        proxy.upstream.script(say("Lima is warm."), say("Lima is warm."))
        assert (await chat_as(proxy, "k0", model="notes")).status_code == 200
        assert (await chat_as(proxy, "k999", model="notes")).status_code == 200
        denied = await chat_as(proxy, "k999", model="weather")
        unknown = await chat_as(proxy, "k1000", model="notes")
    assert denied.json()["error"]["message"] == "key 'k999' may not use 'weather'"
    assert unknown.status_code == 401


# --- /metrics --------------------------------------------------------------------------------


async def test_metrics_stay_open_by_default(proxy_for: ProxyFactory) -> None:
    async with proxy_for(keyed(key("a"))) as proxy:
        r = await proxy.client.get("/metrics")
    assert r.status_code == 200
    assert "loopwarden_runs_total" in r.text


async def test_protected_metrics_need_a_metrics_key(proxy_for: ProxyFactory) -> None:
    config = keyed(key("team"), key("prometheus", agents=[], metrics=True), metrics_key=True)
    async with proxy_for(config) as proxy:
        anonymous = await proxy.client.get("/metrics")
        wrong = await proxy.client.get("/metrics", headers={"authorization": "Bearer sk-nope"})
        team = await proxy.client.get("/metrics", headers={"authorization": "Bearer sk-team"})
        scraper = await proxy.client.get(
            "/metrics", headers={"authorization": "Bearer sk-prometheus"}
        )
        healthz = await proxy.client.get("/healthz")
        denied_run = await chat_as(proxy, "prometheus", model="weather")
    assert (anonymous.status_code, wrong.status_code) == (401, 401)
    assert anonymous.json()["error"]["type"] == "authentication_error"
    assert team.status_code == 403
    assert team.json()["error"] == {
        "message": "key 'team' may not read /metrics",
        "type": "permission_error",
        "param": None,
        "code": "metrics_not_allowed",
    }
    assert scraper.status_code == 200
    assert "loopwarden_runs_total" in scraper.text
    assert healthz.status_code == 200
    assert denied_run.status_code == 403


# --- start-up checks -------------------------------------------------------------------------


def problems_of(config: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE_CONFIG, **config})
    return err.value.problems


def test_a_keys_unknown_tool_is_a_start_up_error_with_its_path() -> None:
    found = problems_of(keyed(key("a"), key("b", tools=["get_weather", "ghost", "*"])))
    assert found == [("auth.keys[1].tools[1]", "no tool named 'ghost'")]
    after_junk = problems_of(keyed("junk", key("b", tools=["ghost"])))
    assert ("auth.keys[1].tools[0]", "no tool named 'ghost'") in after_junk


def test_key_names_are_unique_and_free_of_slashes() -> None:
    found = problems_of(keyed(key("a"), key("a"), key("team/x")))
    assert ("auth.keys[1].name", "name 'a' is not unique") in found
    assert any(path == "auth.keys[2].name" and "'/'" in msg for path, msg in found)


def test_one_key_under_two_names_is_a_start_up_error() -> None:
    twice = {"name": "b", "key_sha256": sha("sk-a").upper()}  # hex in either case
    found = problems_of(keyed(key("a"), twice))
    assert found == [("auth.keys[1].key_sha256", "the same key as auth.keys[0]")]


def test_check_names_two_keys_whose_environment_holds_one_secret(
    check_config: CheckConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALPHA_KEY", "sk-shared")
    monkeypatch.setenv("BETA_KEY", "sk-shared")
    monkeypatch.setenv("GAMMA_KEY", "sk-shared")
    config = (
        "auth:\n  keys:\n"
        "    - {name: alpha, key_env: ALPHA_KEY, agents: [a]}\n"
        "    - {name: beta, key_env: BETA_KEY}\n"
        "    - {name: gamma, key_env: GAMMA_KEY}\n"
    )
    shared = check_config(config)
    monkeypatch.setenv("BETA_KEY", "sk-other")
    monkeypatch.setenv("GAMMA_KEY", "sk-third")
    assert check_config(config).status == 0
    assert shared.status == 1
    assert "auth.keys.beta: the same key as auth.keys.alpha" in shared.err
    assert "auth.keys.gamma: the same key as auth.keys.alpha" in shared.err  # every one


def test_protected_metrics_need_a_key_that_may_read_them() -> None:
    found = problems_of(keyed(key("a"), metrics_key=True))
    assert found == [("auth.metrics_key", "no key has metrics: true, so none could read /metrics")]


def test_check_names_a_keys_unknown_tool(check_config: CheckConfig) -> None:
    status, _, err = check_config(
        "tools:\n  final_answer: {kind: builtin}\n"
        "auth:\n  keys:\n"
        f"    - {{name: a, key_sha256: {sha('x')}, tools: [final_answer, ghost]}}\n"
    )
    assert status == 1
    assert "auth.keys[0].tools[1]: no tool named 'ghost'" in err


def test_a_keys_tools_may_be_empty_or_name_tools_by_id() -> None:
    config = parse_config(
        {**BASE_CONFIG, **keyed(key("a", tools=[]), key("b", tools=["tool-sleep"]))}
    )
    assert [k.tools for k in config.auth.keys] == [[], ["tool-sleep"]]
    assert [k.metrics for k in config.auth.keys] == [False, False]


# --- models ----------------------------------------------------------------------------------


async def test_a_key_lists_only_the_agents_and_models_it_may_use(proxy_for: ProxyFactory) -> None:
    config = keyed(key("a", agents=["weather", "scripted"]), key("all"))
    async with proxy_for(config) as proxy:
        listed = {
            name: [
                m["id"]
                for m in (
                    await proxy.client.get(
                        "/v1/models", headers={"authorization": f"Bearer sk-{name}"}
                    )
                ).json()["data"]
            ]
            for name in ("a", "all")
        }
    assert listed["a"] == ["weather", "scripted"]
    assert {"weather", "notes", "capped", "scripted"} <= set(listed["all"])


async def test_a_key_retrieves_only_the_models_it_may_use(proxy_for: ProxyFactory) -> None:
    config = keyed(key("a", agents=["weather"]), key("all"))
    async with proxy_for(config) as proxy:
        found = {
            (name, model): await proxy.client.get(
                f"/v1/models/{model}", headers={"authorization": f"Bearer sk-{name}"}
            )
            for name in ("a", "all")
            for model in ("weather", "notes")
        }
    assert found["a", "weather"].json()["id"] == "weather"
    assert found["all", "notes"].json()["id"] == "notes"
    # Another key's model is not there for it, as in its list.
    assert found["a", "notes"].status_code == 404
    assert found["a", "notes"].json()["error"]["code"] == "model_not_found"


async def test_an_unknown_agent_reads_the_same_as_a_forbidden_one(proxy_for: ProxyFactory) -> None:
    async with proxy_for(keyed(key("a", agents=["weather"]))) as proxy:
        forbidden = await chat_as(proxy, "a", model="weather", loop={"agent": "notes"})
        unknown = await chat_as(proxy, "a", model="weather", loop={"agent": "nobody"})
    assert (forbidden.status_code, unknown.status_code) == (403, 403)
    assert forbidden.json()["error"]["param"] == unknown.json()["error"]["param"] == "loop.agent"
    assert unknown.json()["error"]["message"] == "key 'a' may not use 'nobody'"


# --- what a key's runs leave behind ----------------------------------------------------------


async def test_a_run_report_is_read_by_the_key_that_made_it_only(proxy_for: ProxyFactory) -> None:
    async with proxy_for(keyed(key("a", agents=["weather"]), key("b"))) as proxy:
        proxy.upstream.script(say("Clear."))
        run_id = (await chat_as(proxy, "a", model="weather")).json()["loop"]["run_id"]
        reads = {
            name: await proxy.client.get(
                f"/v1/runs/{run_id}", headers={"authorization": f"Bearer sk-{name}"}
            )
            for name in ("a", "b")
        }
    assert reads["a"].json()["run_id"] == run_id
    assert reads["b"].status_code == 404  # not a 403 that confirms the run exists
    assert reads["b"].json()["error"]["code"] == "not_found"


async def test_held_server_calls_are_put_back_for_the_key_that_made_them_only(
    proxy_for: ProxyFactory,
) -> None:
    ask_user = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}
    async with proxy_for(keyed(key("a"), key("b"))) as proxy:
        proxy.upstream.script(
            calls(call("get_weather", city="Oslo"), call("ask_user", question="Coat?")),
            say("Take a coat."),
            say("Take a coat."),
        )
        first = await chat_as(proxy, "a", model="weather", tools=[ask_user])
        message = first.json()["choices"][0]["message"]
        history = [
            *user("Lima?"),
            {k: v for k, v in message.items() if v is not None},
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "yes"},
        ]
        for name in ("b", "a"):
            r = await chat_as(proxy, name, model="weather", tools=[ask_user], messages=history)
            assert r.status_code == 200
    as_b, as_a = (
        [m["role"] for m in body["messages"] if m["role"] != "system"]
        for body in proxy.upstream.bodies[1:]
    )
    assert as_b == ["user", "assistant", "tool"]  # served as sent: b learns nothing of a's call
    assert as_a == ["user", "assistant", "tool", "tool"]


@pytest.mark.parametrize("field", ["MODEL", "Model", "models", "model\u017f"])
async def test_a_limited_key_sends_no_other_field_that_names_a_model(
    proxy_for: ProxyFactory, field: str
) -> None:
    """Some upstreams match field names in any case (and take the later), OpenRouter runs the
    `models` it lists as fallbacks: each went upstream as the client sent it."""
    other: Any = ["gpt-4o"] if field == "models" else "gpt-4o"
    async with proxy_for(keyed(key("a", agents=["scripted"]), key("all"))) as proxy:
        proxy.upstream.script(say("Hi."))
        limited = await chat_as(proxy, "a", model="scripted", **{field: other})
        unrestricted = await chat_as(proxy, "all", model="scripted", **{field: other})
    assert limited.status_code == 403
    assert limited.json()["error"]["param"] == field
    assert unrestricted.status_code == 200
    assert proxy.upstream.bodies[0][field] == other  # the unrestricted key's, as it sent it


# --- relayed routes --------------------------------------------------------------------------

UNREADABLE = [  # bodies whose model the proxy cannot read, which a lenient upstream may
    ({"content-type": "application/json"}, b'{"model":"gpt-4o","prompt":"hi","top_p":NaN}'),
    ({"content-type": "application/json"}, b'{"model":"gpt-4o","prompt":"\\ud800"}'),
    ({"content-type": "text/plain"}, b'{"model":"gpt-4o","prompt":"hi"}'),
    ({}, b'{"model":"gpt-4o","prompt":"hi"}'),
    # over server.max_body_bytes (8 MiB)
    ({"content-type": "application/json"}, b'{"model":"gpt-4o","prompt":"hi"}' + b" " * (8 << 20)),
    ({"content-type": "application/json"}, b'{"model":["gpt-4o"],"prompt":"hi"}'),
    # another case of the key: some parsers (Go's) match it, and take the later one
    ({"content-type": "application/json"}, b'{"model":"gpt-4o-mini","MODEL":"gpt-4o"}'),
]


@pytest.mark.parametrize(("headers", "body"), UNREADABLE)
async def test_a_key_limited_to_some_models_relays_only_a_request_whose_model_it_may_use(
    proxy_for: ProxyFactory, headers: dict[str, str], body: bytes
) -> None:
    relayed: list[bytes] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        relayed.append(await request.aread())
        return httpx.Response(200, json={"object": "text_completion"})

    config = keyed(key("a", agents=["weather", "gpt-4o-mini"]), key("all"))
    async with proxy_for(config, handler=upstream) as proxy:

        async def post(name: str, content: bytes, **extra: str) -> httpx.Response:
            sent = {"authorization": f"Bearer sk-{name}", **extra}
            return await proxy.client.post("/v1/completions", content=content, headers=sent)

        json = {"content-type": "application/json"}
        allowed = await post("a", b'{"model":"gpt-4o-mini","prompt":"hi"}', **json)
        denied = await post("a", b'{"model":"gpt-4o","prompt":"hi"}', **json)
        unread = await post("a", body, **headers)
        unrestricted = await post("all", body, **headers)
    assert (allowed.status_code, denied.status_code, unrestricted.status_code) == (200, 403, 200)
    assert unread.status_code == 403
    assert unread.json()["error"] == {
        "message": "key 'a' may use only the models it names, and the model of this request "
        "cannot be read (a JSON body of at most 8388608 bytes (server.max_body_bytes) and "
        "100000 values (server.max_body_values) naming one `model`, a string, or a form with "
        "one `model` field in its first 1048576 bytes)",
        "type": "permission_error",
        "param": "model",
        "code": "model_not_allowed",
    }
    assert relayed == [b'{"model":"gpt-4o-mini","prompt":"hi"}', body]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/files"),
        ("DELETE", "/v1/files/file-x"),
        ("DELETE", "/v1/models/ft:gpt-4o-mini:org:private"),
        ("GET", "/v1/chat/completions/chatcmpl-x"),
        ("POST", "/v1/fine_tuning/jobs"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/organization/costs"),
        ("GET", "/v1/embeddings"),
    ],
)
async def test_a_key_limited_to_some_models_relays_only_the_routes_that_run_one(
    proxy_for: ProxyFactory, method: str, path: str
) -> None:
    """A body naming a model it may use took any route, with the upstream's key: the account's
    files, fine-tunes, batches and stored completions, to read, delete or spend on."""
    relayed: list[str] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        relayed.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"object": "list"})

    config = keyed(key("a", agents=["gpt-4o-mini"]), key("all"))
    body = {"model": "gpt-4o-mini", "input": "x"}
    async with proxy_for(config, handler=upstream) as proxy:

        async def send(name: str) -> httpx.Response:
            headers = {"authorization": f"Bearer sk-{name}"}
            return await proxy.client.request(method, path, json=body, headers=headers)

        limited, unrestricted = await send("a"), await send("all")
        embedded = await proxy.client.post(
            "/v1/embeddings", json=body, headers={"authorization": "Bearer sk-a"}
        )
    assert limited.status_code == 403
    assert limited.json()["error"]["code"] == "route_not_allowed"
    assert (unrestricted.status_code, embedded.status_code) == (200, 200)
    assert relayed == [f"{method} {path}", "POST /v1/embeddings"]


async def test_a_limited_key_embeds_a_batch_as_large_as_a_body_may_be(
    proxy_for: ProxyFactory,
) -> None:
    """An embeddings batch of 2,048 inputs (3 MiB of JSON, as OpenAI takes): its model read to
    be checked, within `server.max_body_bytes` as every JSON body the proxy reads."""
    relayed: list[tuple[str, bytes]] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        relayed.append((request.url.host, await request.aread()))
        return httpx.Response(200, json={"object": "list", "data": []})

    config = {
        **keyed(key("a", agents=["text-embedding-3-large"]), key("all")),
        "upstreams": {"vectors": {"base_url": "http://vectors.test/v1", "max_retries": 0}},
        "models": {
            "text-embedding-3-large": {"upstream": "vectors", "model": "text-embedding-3-large"}
        },
    }
    batch = {"model": "text-embedding-3-large", "input": ["x" * 1500] * 2048}
    async with proxy_for(config, handler=upstream) as proxy:
        replies = [
            await proxy.client.post(
                "/v1/embeddings", json=batch, headers={"authorization": f"Bearer sk-{name}"}
            )
            for name in ("a", "all")
        ]
    assert [r.status_code for r in replies] == [200, 200]
    assert [host for host, _ in relayed] == ["vectors.test", "vectors.test"]
    assert orjson.loads(relayed[0][1]) == batch


async def test_a_limited_key_s_body_goes_upstream_as_the_proxy_read_it(
    proxy_for: ProxyFactory,
) -> None:
    """A repeated `model` is read last by the proxy, first by some upstreams: the body relayed
    for a key whose models are checked holds only the one checked."""
    relayed: list[bytes] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        relayed.append(await request.aread())
        return httpx.Response(200, json={"object": "list"})

    twice = b'{"model": "gpt-4o", "input": "x", "model": "gpt-4o-mini"}'
    async with proxy_for(keyed(key("a", agents=["gpt-4o-mini"])), handler=upstream) as proxy:
        r = await proxy.client.post(
            "/v1/embeddings",
            content=twice,
            headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
        )
    assert r.status_code == 200
    assert relayed == [b'{"model":"gpt-4o-mini","input":"x"}']


@pytest.mark.parametrize(("depth", "status"), [(240, 200), (300, 400), (1000, 400)])
async def test_a_limited_key_s_deeply_nested_body_is_a_400(
    proxy_for: ProxyFactory, depth: int, status: int
) -> None:
    """A body read to check its model is written again for the upstream: past orjson's 254
    levels that failed, a 500."""

    async def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"object": "list"})

    deep = b'{"model": "gpt-4o-mini", "input": ' + b"[" * depth + b"]" * depth + b"}"
    async with proxy_for(keyed(key("a", agents=["gpt-4o-mini"])), handler=upstream) as proxy:
        r = await proxy.client.post(
            "/v1/embeddings",
            content=deep,
            headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
        )
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["message"] == "the body nests deeper than 246 levels"


async def test_a_limited_key_uploads_audio_only_for_a_model_it_may_use(
    proxy_for: ProxyFactory,
) -> None:
    """Through the openai SDK: a transcription's form names its model in a field, read as the
    key's models are checked; a form that names another model after its file is cut off as it
    goes, so the upstream never gets it whole (some parsers take the last)."""
    relayed: list[bytes] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        relayed.append(await request.aread())
        return httpx.Response(200, json={"text": "heard"})

    config = keyed(key("a", agents=["whisper-1"]), key("all"))
    audio = b"RIFF" + b"\x01" * 300_000
    boundary = "b0und"
    second = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        ).encode()
        + audio
        + (
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="MODEL"\r\n\r\nwhisper-2\r\n'
            f"--{boundary}--\r\n"
        ).encode()
    )
    form = {"content-type": f"multipart/form-data; boundary={boundary}"}
    async with proxy_for(config, handler=upstream) as proxy:

        def sdk(name: str) -> AsyncOpenAI:
            return AsyncOpenAI(
                base_url="http://proxy.test/v1",
                api_key=f"sk-{name}",
                http_client=proxy.client,
                max_retries=0,
            )

        heard = await sdk("a").audio.transcriptions.create(
            model="whisper-1", file=("a.wav", audio, "audio/wav")
        )
        with pytest.raises(openai.PermissionDeniedError) as other:
            await sdk("a").audio.transcriptions.create(
                model="whisper-2", file=("a.wav", audio, "audio/wav")
            )
        named_twice = await proxy.client.post(
            "/v1/audio/transcriptions",
            content=in_pieces(second, 65_536),  # as a client streams it: read as it comes
            headers={"authorization": "Bearer sk-a", **form},
        )
        unchecked = await proxy.client.post(
            "/v1/audio/transcriptions",
            content=second,
            headers={"authorization": "Bearer sk-all", **form},
        )
    assert heard.text == "heard"
    assert (other.value.code, other.value.param) == ("model_not_allowed", "model")
    assert named_twice.status_code == 403, named_twice.text
    assert named_twice.json()["error"]["code"] == "model_not_allowed"
    assert unchecked.status_code == 200
    assert len(relayed) == 2  # the first upload and the unchecked key's: not the one named twice
    assert audio in relayed[0]
    assert relayed[1] == second


async def in_pieces(body: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]
