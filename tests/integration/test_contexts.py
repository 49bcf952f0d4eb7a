"""Stored contexts (SPEC §10) through the HTTP API."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
import redis.asyncio as aioredis

from proxy.state.memory import MemoryStore
from proxy.state.redis import RedisStore
from proxy.state.sqlite import SqliteStore
from proxy.state.store import StateStore, StoredContext
from tests.integration.conftest import Proxy, ProxyFactory
from tests.integration.counted_store import ForgetfulStore
from tests.scripted_upstream import call, each_run, fail, keep, say, say_tool_result

REPORTER = {
    "agents": {
        "reporter": {"model": "scripted", "tools": ["get_weather", "final_answer"]},
        "capped": {
            "model": "scripted",
            "tools": ["get_weather"],
            "tool_call_limits": [{"thread_limit": 2}],
        },
    }
}


async def post(proxy: Proxy, path: str, **body: Any) -> Any:
    return await proxy.client.post(path, json=body)


async def test_chat_creates_a_context_runs_the_loop_and_reports_the_messages(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(call("get_weather", city="Oslo"), say_tool_result("Found: {}"))
        r = await post(proxy, "/chat", context_id="c1", agent="reporter", message="Oslo?")
        stored = (await proxy.client.get("/v1/contexts/c1")).json()
    assert r.status_code == 200
    body = r.json()
    assert body["saved_ai_messages"] is True
    assert body["response"] == 'Found: {"city":"Oslo","celsius":4.0,"sky":"clear"}'
    assert body["loop"]["stop_reason"] == "completed"
    assert r.headers["x-loopwarden-stop-reason"] == "completed"
    human, asked, result, ai = body["generated_messages"]
    assert human == {"sender": "human", "message": "Oslo?"}
    assert asked["type"] == "tool_call"
    assert asked["tool_name"] == "get_weather"
    assert asked["tool_input"] == {"city": "Oslo"}
    assert result["type"] == "tool_response"
    assert result["tool_call_id"] == asked["tool_call_id"]
    assert '"celsius":4.0' in result["tool_output"]
    assert ai == {"sender": "ai", "message": body["response"]}
    assert stored["object"] == "loopwarden.context"
    assert stored["agent"] == "reporter"
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "tool", "assistant"]


async def test_a_second_chat_sees_the_history(proxy_for: ProxyFactory) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Noted: first"), say("Noted: second"))
        await post(proxy, "/chat", context_id="c2", model="scripted", message="first")
        r = await post(proxy, "/chat", context_id="c2", message="second")
        sent = proxy.upstream.bodies[-1]["messages"]
    assert r.json()["response"] == "Noted: second"
    assert [(m["role"], m["content"]) for m in sent] == [
        ("user", "first"),
        ("assistant", "Noted: first"),
        ("user", "second"),
    ]


async def test_invoke_runs_without_a_new_message(proxy_for: ProxyFactory) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Hello."), say("Still here."))
        await post(proxy, "/chat", context_id="c3", model="scripted", message="hello")
        r = await post(proxy, "/chat/invoke", context_id="c3")
        stored = (await proxy.client.get("/v1/contexts/c3")).json()
    body = r.json()
    assert body["generated_messages"] == [{"sender": "ai", "message": "Still here."}]
    assert proxy.upstream.bodies[-1]["messages"][-1] == {"role": "assistant", "content": "Hello."}
    assert len(stored["messages"]) == 3


async def test_add_ai_message_prompt_applies_to_that_run_only(proxy_for: ProxyFactory) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Hello."), say("A warm welcome!"))
        await post(proxy, "/chat", context_id="c4", model="scripted", message="hello")
        await post(proxy, "/chat/add-ai-message", context_id="c4", prompt="Greet warmly.")
        sent = proxy.upstream.bodies[-1]["messages"]
        stored = (await proxy.client.get("/v1/contexts/c4")).json()
    assert sent[-1] == {"role": "system", "content": "Greet warmly."}
    assert all(m["role"] != "system" for m in stored["messages"])
    assert len(stored["messages"]) == 3


async def test_terminating_config_nudges_to_the_terminal_tool(proxy_for: ProxyFactory) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Hi."), call("final_answer", answer="Hello!"))
        r = await post(
            proxy,
            "/chat",
            context_id="c5",
            agent="reporter",
            message="just say hi",
            terminating_config={"tool_ids": ["final_answer"]},
        )
    body = r.json()
    assert body["loop"]["stop_reason"] == "terminal_tool"
    assert body["response"] == "Hello!"
    kinds = [m.get("type") or m.get("sender") for m in body["generated_messages"]]
    assert kinds == ["human", "ai", "tool_call", "tool_response", "ai"]


async def test_a_failed_run_saves_nothing(proxy_for: ProxyFactory) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Hello there."), say("Hi."))
        await post(proxy, "/chat", context_id="c6", agent="reporter", message="hello")
        r = await post(
            proxy,
            "/chat",
            context_id="c6",
            message="just say hi",
            loop={"terminating_config": {"tool_ids": ["final_answer"], "consecutive_nudges": 0}},
        )
        stored = (await proxy.client.get("/v1/contexts/c6")).json()
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "max_consecutive_nudges_exceeded"
    assert r.json()["loop"]["stop_reason"] == "nudges_exhausted"
    assert [m["content"] for m in stored["messages"]] == ["hello", "Hello there."]


async def test_a_failed_run_tells_what_it_made_though_nothing_is_saved(
    proxy_for: ProxyFactory,
) -> None:
    """Its tool had acted, and its answer gave the loop report alone: `GET /v1/runs/{id}`
    neither, and `include_messages` is no option of a context's."""
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(call("get_weather", city="Oslo"), fail(500))
        r = await post(proxy, "/chat", context_id="c-f", agent="reporter", message="Oslo?")
        missing = await proxy.client.get("/v1/contexts/c-f")
    assert r.status_code == 502, r.text
    assert r.json()["loop"]["stop_reason"] == "upstream_error"
    assert r.json()["saved_ai_messages"] is False
    made = r.json()["generated_messages"]
    assert [m.get("sender") or m["type"] for m in made] == ["human", "tool_call", "tool_response"]
    assert "Oslo" in made[2]["tool_output"]
    assert missing.status_code == 404


async def test_a_context_is_the_thread_of_its_limits(proxy_for: ProxyFactory) -> None:
    lima = call("get_weather", city="Lima")
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(lima, say("Warm."), lima, lima, lima, say("Still warm."))
        first = await post(proxy, "/chat", context_id="c7", agent="capped", message="Lima?")
        second = await post(proxy, "/chat", context_id="c7", message="And now, three times?")
        stored = (await proxy.client.get("/v1/contexts/c7")).json()
    assert first.json()["loop"]["tool_calls"] == 1
    assert second.json()["loop"]["tool_calls"] == 1  # the thread limit of 2 blocks the others
    assert stored["tool_call_counts"] == {"*": 2}


async def test_concurrent_runs_on_one_context_are_serialised(proxy_for: ProxyFactory) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(
            say("Ready."),
            keep(each_run(call("get_weather", city="Lima"), then=say_tool_result("Found: {}"))),
        )
        await post(proxy, "/chat", context_id="c8", agent="reporter", message="start")
        replies = await asyncio.gather(
            *(post(proxy, "/chat", context_id="c8", message=f"Lima #{i}?") for i in range(5))
        )
        stored = (await proxy.client.get("/v1/contexts/c8")).json()
    assert all(r.status_code == 200 for r in replies)
    roles = [m["role"] for m in stored["messages"]]
    assert roles == ["user", "assistant"] + ["user", "assistant", "tool", "assistant"] * 5


async def test_a_client_that_leaves_while_its_context_is_held_runs_nothing(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    """It waits for the run that holds the context only while it stays; a read does not wait:
    it gets the context as last saved."""
    async with proxy_for(REPORTER, store=backend) as proxy:
        proxy.upstream.script(say("Ready."))
        await post(proxy, "/chat", context_id="c-wait", agent="reporter", message="start")
        async with backend.hold("c-wait"):  # a run (of another replica, say) holds it
            read = await asyncio.wait_for(proxy.client.get("/v1/contexts/c-wait"), 5)
            assert [m["content"] for m in read.json()["messages"]] == ["start", "Ready."]
            body = {"context_id": "c-wait", "message": "gone"}
            assert await proxy.leaving(body, 0.2, path="/chat") == []  # returns: it left
            dropping = await proxy.leaving({}, 0.2, path="/v1/contexts/c-wait", method="DELETE")
            assert dropping == []
        assert len(proxy.upstream.requests) == 1
        proxy.upstream.script(say("Here."))
        again = await post(proxy, "/chat", context_id="c-wait", message="here")
        stored = (await proxy.client.get("/v1/contexts/c-wait")).json()
    assert again.status_code == 200
    assert [m["content"] for m in stored["messages"]] == ["start", "Ready.", "here", "Here."]


async def test_a_context_s_run_is_read_with_its_hold_and_kept_as_it_is_let_go(
    proxy_for: ProxyFactory, backend: StateStore
) -> None:
    """On every backend: the context as its hold found it, the run saved and kept by the hold's
    last write, and the context free for the next run as soon as the answer is sent."""
    async with proxy_for(REPORTER, store=backend) as proxy:
        proxy.upstream.script(say("Noted: first"), say("Noted: second"))
        await post(proxy, "/chat", context_id="c-end", model="scripted", message="first")
        second = await post(proxy, "/chat", context_id="c-end", message="second")
        async with asyncio.timeout(1), backend.hold("c-end") as holding:  # the lease is 30 s
            assert holding.context is not None
            said = [m["content"] for m in holding.context.messages]
        run = await proxy.client.get(f"/v1/runs/{second.headers['x-loopwarden-run-id']}")
    assert second.status_code == 200, second.text
    assert said == ["first", "Noted: first", "second", "Noted: second"]
    assert run.status_code == 200
    assert run.json()["stop_reason"] == "completed"


async def test_a_context_s_run_on_redis_is_two_round_trips(
    proxy_for: ProxyFactory, redis_url: str
) -> None:
    """The hold taken with the context read, then the save, the run kept and the hold let go
    in one call (were five: the lock, the read, the save, the run, the lock); a delete is the
    hold, the delete and the let-go (were four: the context read again)."""
    prefix = f"trips-{secrets.token_hex(4)}:"
    store = RedisStore(redis_url, prefix=prefix)
    monitor = aioredis.Redis.from_url(redis_url)

    async def sent_by(request: Awaitable[Any]) -> tuple[Any, list[str]]:
        """What `request` got, and the commands the store sent redis for it."""
        async with monitor.monitor() as watching:
            answer = await request
            await monitor.ping()  # from the connection that watches: not seen
            await store.ping()  # the last command seen
            sent = []
            while (seen := await asyncio.wait_for(watching.next_command(), 5))["command"] != "PING":
                if seen["client_type"] != "lua" and prefix in seen["command"]:
                    sent.append(seen["command"].split()[0].upper())
        return answer, sent

    try:
        async with proxy_for(REPORTER, store=store) as proxy:
            proxy.upstream.script(say("Noted: first"), say("Noted: second"))
            await post(proxy, "/chat", context_id="c", model="scripted", message="first")
            await proxy.client.delete("/v1/contexts/none")  # every script loaded: a 404
            second, chatting = await sent_by(post(proxy, "/chat", context_id="c", message="x"))
            deleted, deleting = await sent_by(proxy.client.delete("/v1/contexts/c"))
    finally:
        await store.close()
        await monitor.aclose()
    assert second.status_code == 200, second.text
    assert chatting == ["EVALSHA", "EVALSHA"]
    assert deleted.status_code == 200, deleted.text
    assert deleting == ["EVALSHA", "DEL", "EVALSHA"]


async def test_a_context_s_run_on_sqlite_is_two_transactions(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    """The lock row taken with the context read, then the save, the run kept and the lock let
    go in one transaction (were four: the lock, the save, the run, the release): what the
    file's write-ahead log holds is what the store committed."""
    store = SqliteStore(tmp_path / "state.sqlite")
    try:
        async with proxy_for(REPORTER, store=store) as proxy:
            proxy.upstream.script(say("Noted: first"), say("Noted: second"))
            await post(proxy, "/chat", context_id="c", model="scripted", message="first")
            statements: list[str] = []  # what the store's connection runs, from here on
            store._db.set_trace_callback(statements.append)
            second = await post(proxy, "/chat", context_id="c", message="second")
            store._db.set_trace_callback(None)
            run = await proxy.client.get(f"/v1/runs/{second.headers['x-loopwarden-run-id']}")
            stored = (await proxy.client.get("/v1/contexts/c")).json()
    finally:
        await store.close()
    assert second.status_code == 200, second.text
    assert transactions(statements) == 2
    assert run.json()["stop_reason"] == "completed"
    assert [m["content"] for m in stored["messages"]] == [
        "first",
        "Noted: first",
        "second",
        "Noted: second",
    ]


def transactions(statements: list[str]) -> int:
    """The write transactions `statements` made: each `BEGIN` … `COMMIT`, and each write made
    alone (the store's connection commits every statement outside a `BEGIN`). (Not counted
    from the write-ahead log: the store's checkpoints let it begin again at any write.)"""
    count, within = 0, False
    for statement in statements:
        word = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else ""
        if word == "BEGIN":
            within = True
        elif word in ("COMMIT", "END", "ROLLBACK"):
            count += word != "ROLLBACK"
            within = False
        elif word in ("INSERT", "UPDATE", "DELETE", "REPLACE") and not within:
            count += 1
    return count


async def test_a_run_saved_whose_record_cannot_be_kept_still_answers(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The context was saved: the run is answered as it ran (a 503 would have its client send
    the turn again, and the context hold it twice), its record's loss logged."""
    async with proxy_for(REPORTER, store=ForgetfulStore()) as proxy:
        proxy.upstream.script(say("Noted."))
        r = await post(proxy, "/chat", context_id="c-rec", model="scripted", message="hi")
        stored = (await proxy.client.get("/v1/contexts/c-rec")).json()
    assert r.status_code == 200, r.text
    assert r.headers["x-loopwarden-stop-reason"] == "completed"
    assert [m["content"] for m in stored["messages"]] == ["hi", "Noted."]
    assert "context 'c-rec' was saved, but its run's records were not" in caplog.text


async def test_delete_drops_the_context(proxy_for: ProxyFactory) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Hi."))
        await post(proxy, "/chat", context_id="c9", model="scripted", message="hi")
        deleted = await proxy.client.delete("/v1/contexts/c9")
        gone = await proxy.client.get("/v1/contexts/c9")
        again = await proxy.client.delete("/v1/contexts/c9")
    assert deleted.json() == {"id": "c9", "object": "loopwarden.context.deleted", "deleted": True}
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "no context 'c9'"
    assert again.status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/chat", {"context_id": "new", "message": "hi"}, "agent", "does not exist"),
        ("/chat", {"context_id": "new", "agent": "reporter"}, "message", "string"),
        ("/chat", {"message": "hi", "agent": "reporter"}, "context_id", "string"),
        ("/chat", {"context_id": "x", "message": "hi", "agent": "a", "n": 2}, "n", "unknown field"),
        ("/chat/invoke", {"context_id": "x", "prompt": "p"}, "prompt", "unknown field"),
        ("/chat/invoke", {"context_id": "empty", "model": "scripted"}, "context_id", "no messages"),
        (
            "/chat",
            {"context_id": "x", "message": "hi", "agent": "reporter", "loop": {"thread_id": "t"}},
            "loop.thread_id",
            "its own thread",
        ),
        (
            "/chat",
            {"context_id": "x", "message": "hi", "agent": "reporter", "terminating_config": {}},
            "terminating_config.tool_ids",
            "is required",
        ),
        (
            "/chat",
            {
                "context_id": "x",
                "message": "hi",
                "agent": "reporter",
                "terminating_config": {"tool_ids": ["nope"]},
            },
            "terminating_config.tool_ids[0]",
            "no server tool named 'nope'",
        ),
        (
            "/chat",
            {"context_id": "x", "message": "hi", "agent": "nobody"},
            "agent",
            "no agent named 'nobody'",
        ),
        ("/chat", {"context_id": "x", "message": "hi", "model": "m" * 300}, "model", "longer"),
        (
            "/chat",
            {"context_id": "x", "message": "hi", "agent": "reporter", "model": "scripted"},
            "model",
            "not both",
        ),
        (
            "/chat",
            {
                "context_id": "x",
                "message": "hi",
                "agent": "reporter",
                "loop": {"include_messages": True},
            },
            "loop.include_messages",
            "generated_messages",
        ),
        ("/chat", {"context_id": "x", "message": "hi", "agent": "reporter", "loop": []},
         "loop", "must be an object"),
        ("/chat", {"context_id": "x", "message": "hi", "agent": "reporter", "loop": ""},
         "loop", "must be an object"),
    ],
)  # fmt: skip
async def test_bad_context_requests_are_a_400_naming_the_field(
    proxy_for: ProxyFactory, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    async with proxy_for(REPORTER) as proxy:
        r = await post(proxy, path, **body)
        assert proxy.upstream.requests == []
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert message in r.json()["error"]["message"]


@pytest.mark.parametrize("other", [{"agent": "capped"}, {"model": "gpt-4o"}])
async def test_a_context_keeps_its_agent(proxy_for: ProxyFactory, other: dict[str, str]) -> None:
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Hi."))
        await post(proxy, "/chat", context_id="c10", agent="reporter", message="hi")
        r = await post(proxy, "/chat", context_id="c10", message="hi", **other)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == next(iter(other))
    assert error["message"] == "context 'c10' was created with agent 'reporter'"  # (not model None)


async def test_a_context_whose_agent_the_config_no_longer_has_runs_nothing(
    proxy_for: ProxyFactory,
) -> None:
    """Its agent's name is no model: the run went upstream as a pass-through for model `bot`,
    without the agent's prompt, tools or limits."""
    store = MemoryStore()
    async with proxy_for(REPORTER, store=store) as proxy:
        proxy.upstream.script(say("Hi."))
        await post(proxy, "/chat", context_id="kept", agent="reporter", message="hi")
    renamed = {**REPORTER, "agents": {"reporter_v2": REPORTER["agents"]["reporter"]}}
    async with proxy_for(renamed, store=store) as proxy:
        r = await post(proxy, "/chat", context_id="kept", message="again")
        assert len(proxy.upstream.requests) == 1  # the first proxy's run's
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "context_id"
    assert r.json()["error"]["code"] == "agent_not_found"
    assert "agent 'reporter', which the config no longer has" in r.json()["error"]["message"]


async def test_a_key_not_allowed_a_contexts_agent_is_told_so_of_agent(
    proxy_for: ProxyFactory, capped_keys: dict[str, Any]
) -> None:
    async with proxy_for({**REPORTER, "auth": capped_keys}) as proxy:
        body = {"context_id": "theirs", "agent": "reporter", "message": "hi"}
        r = await proxy.client.post(
            "/chat", json=body, headers={"authorization": "Bearer sk-alice"}
        )
    assert r.status_code == 403
    assert r.json()["error"]["param"] == "agent"


KEYS = {
    "keys": [
        {"name": "alice", "key_env": "ALICE_KEY", "agents": ["reporter"]},
        {"name": "bob", "key_env": "BOB_KEY", "agents": ["reporter"]},
    ]
}


async def test_two_keys_that_name_one_context_id_have_a_context_each(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key learns nothing of another's contexts, not even that an id is taken: ids are in
    each key's namespace (one key took an id first, and another's `/chat` on it was a 404)."""
    monkeypatch.setenv("ALICE_KEY", "sk-alice")
    monkeypatch.setenv("BOB_KEY", "sk-bob")
    alice = {"authorization": "Bearer sk-alice"}
    bob = {"authorization": "Bearer sk-bob"}
    async with proxy_for({**REPORTER, "auth": KEYS}) as proxy:
        proxy.upstream.script(say("Hi Alice."), say("Hi Bob."), say("Again."))
        body = {"context_id": "mine", "agent": "reporter", "message": "hi"}
        created = await proxy.client.post("/chat", json=body, headers=alice)
        unknown = [
            await proxy.client.get("/v1/contexts/mine", headers=bob),
            await proxy.client.delete("/v1/contexts/mine", headers=bob),
        ]
        invoked = await proxy.client.post("/chat/invoke", json={"context_id": "mine"}, headers=bob)
        bobs = await proxy.client.post("/chat", json=body, headers=bob)
        bob_kept = await proxy.client.get("/v1/contexts/mine", headers=bob)
        dropped = await proxy.client.delete("/v1/contexts/mine", headers=bob)
        again = await proxy.client.post("/chat", json=body, headers=alice)
        kept = await proxy.client.get("/v1/contexts/mine", headers=alice)
    assert created.status_code == 200
    for other in unknown:
        assert other.status_code == 404, other.text
        assert other.json()["error"]["message"] == "no context 'mine'"
    assert invoked.status_code == 400  # as for any id no context has
    assert "does not exist" in invoked.json()["error"]["message"]
    assert bobs.json()["response"] == "Hi Bob."
    assert bob_kept.json()["id"] == "mine"
    assert [m["content"] for m in bob_kept.json()["messages"]] == ["hi", "Hi Bob."]
    assert dropped.json() == {"id": "mine", "object": "loopwarden.context.deleted", "deleted": True}
    assert again.status_code == 200
    assert kept.json()["id"] == "mine"
    assert [m["content"] for m in kept.json()["messages"]] == ["hi", "Hi Alice.", "hi", "Again."]


@pytest.fixture
def capped_keys(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The `auth` of Alice's and Bob's keys (`sk-alice`, `sk-bob`), each for `capped` only."""
    monkeypatch.setenv("ALICE_KEY", "sk-alice")
    monkeypatch.setenv("BOB_KEY", "sk-bob")
    return {"keys": [{**k, "agents": ["capped"]} for k in KEYS["keys"]]}


async def test_a_context_id_another_key_dropped_starts_with_no_tool_call_counts(
    proxy_for: ProxyFactory, capped_keys: dict[str, Any]
) -> None:
    alice = {"authorization": "Bearer sk-alice"}
    bob = {"authorization": "Bearer sk-bob"}
    lima = call("get_weather", city="Lima")
    async with proxy_for({**REPORTER, "auth": capped_keys}) as proxy:
        proxy.upstream.script(lima, lima, lima, say("Warm."), lima, say("Warm too."))
        body = {"context_id": "reused", "agent": "capped", "message": "Lima?"}
        spent = await proxy.client.post("/chat", json=body, headers=alice)
        counted = (await proxy.client.get("/v1/contexts/reused", headers=alice)).json()
        await proxy.client.delete("/v1/contexts/reused", headers=alice)
        fresh = await proxy.client.post("/chat", json=body, headers=bob)
        bobs = (await proxy.client.get("/v1/contexts/reused", headers=bob)).json()
    assert spent.json()["loop"]["tool_calls"] == 2  # the thread limit of 2 blocked the third
    assert counted["tool_call_counts"] == {"*": 2}
    assert fresh.json()["loop"]["tool_calls"] == 1
    assert bobs["tool_call_counts"] == {"*": 1}


async def test_a_delete_racing_the_run_that_moves_a_context_leaves_none(
    proxy_for: ProxyFactory, capped_keys: dict[str, Any], backend: StateStore
) -> None:
    """The run read the old copy without holding it: a `DELETE` between its holds answered
    200 and the run saved the context back (1 in 10 on redis)."""
    messages = [{"role": "user", "content": "Before."}, {"role": "assistant", "content": "Noted."}]
    alice = {"authorization": "Bearer sk-alice"}
    async with proxy_for({**REPORTER, "auth": capped_keys}, store=backend) as proxy:
        proxy.upstream.script(keep(say("Warm.")))
        for n in range(40):
            earlier = {"version": 0, "id": f"old{n}", "agent": "capped", "owner": "alice"}
            await backend.save_context(
                StoredContext.loads(orjson.dumps({**earlier, "messages": messages}))
            )
            body = {"context_id": f"old{n}", "message": "More."}
            dropped, ran = await asyncio.gather(
                proxy.client.delete(f"/v1/contexts/old{n}", headers=alice),
                proxy.client.post("/chat", json=body, headers=alice),
            )
            after = await proxy.client.get(f"/v1/contexts/old{n}", headers=alice)
            assert dropped.status_code == 200
            if ran.status_code == 200:  # it ran first: the delete came after it
                assert after.status_code == 404, (n, after.text)
            else:  # the delete came first: nothing to run
                assert ran.status_code == 400
                assert after.status_code == 404


async def test_a_delete_whose_client_leaves_before_it_holds_both_copies_drops_neither(
    proxy_for: ProxyFactory, capped_keys: dict[str, Any]
) -> None:
    """It dropped the key's own at once and then waited for the old copy: left then, the old
    copy came back as the context at the key's next run."""
    store = MemoryStore()
    for stored in ("alice/x", "x"):  # moved, and a copy left where it was
        fields = {"version": 0, "id": stored, "agent": "capped", "owner": "alice"}
        await store.save_context(StoredContext.loads(orjson.dumps(fields)))
    async with proxy_for({**REPORTER, "auth": capped_keys}, store=store) as proxy:
        alice = [(b"authorization", b"Bearer sk-alice")]
        async with store.hold("x"):  # a run of another replica holds the old copy
            sent = await proxy.leaving({}, 0.2, "/v1/contexts/x", "DELETE", headers=alice)
    assert sent == []
    assert await store.load_context("alice/x") is not None
    assert await store.load_context("x") is not None


async def test_a_key_s_delete_drops_a_context_made_before_keys_only_when_it_has_none(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key that may use every agent drops one made while no keys were on (so that its id
    can be used again), but not with its own of that id."""
    monkeypatch.setenv("ADMIN_KEY", "sk-admin")
    store = MemoryStore()
    before_keys = {"version": 0, "id": "shared", "agent": "reporter", "owner": None}
    await store.save_context(StoredContext.loads(orjson.dumps({**before_keys, "created": 1})))
    admin = {"authorization": "Bearer sk-admin"}
    auth = {"keys": [{"name": "admin", "key_env": "ADMIN_KEY", "agents": ["*"]}]}
    async with proxy_for({**REPORTER, "auth": auth}, store=store) as proxy:
        proxy.upstream.script(say("Hi."))
        body = {"context_id": "shared", "agent": "reporter", "message": "hi"}
        assert (await proxy.client.post("/chat", json=body, headers=admin)).status_code == 200
        own = await proxy.client.delete("/v1/contexts/shared", headers=admin)
        assert await store.load_context("shared") is not None  # not the key's own
        then = await proxy.client.delete("/v1/contexts/shared", headers=admin)
    assert (own.status_code, then.status_code) == (200, 200)
    assert await store.load_context("shared") is None


async def test_a_context_stored_before_its_thread_was_kept_keeps_its_counts(
    proxy_for: ProxyFactory, capped_keys: dict[str, Any]
) -> None:
    """Its thread stays its id: an upgrade does not hand out calls a limit had used up."""
    store = MemoryStore()
    earlier = {"version": 0, "id": "old", "agent": "capped", "model": None, "owner": "alice"}
    await store.save_context(StoredContext.loads(orjson.dumps({**earlier, "created": 1})))
    await store.reserve("old", {"*": 2})
    async with proxy_for({**REPORTER, "auth": capped_keys}, store=store) as proxy:
        proxy.upstream.script(call("get_weather", city="Lima"), say("Warm."))
        alice = {"authorization": "Bearer sk-alice"}
        body = {"context_id": "old", "message": "Lima?"}
        ran = await proxy.client.post("/chat", json=body, headers=alice)
        counts = (await proxy.client.get("/v1/contexts/old", headers=alice)).json()
    assert ran.json()["loop"]["tool_calls"] == 1  # the second of its thread limit of 2
    assert counts["tool_call_counts"] == {"*": 2}


async def test_a_key_s_context_kept_before_namespaces_is_moved_into_its_namespace(
    proxy_for: ProxyFactory, capped_keys: dict[str, Any], backend: StateStore
) -> None:
    """Kept as it was named: its key's next run moves it into the key's namespace, and another
    key does not see it."""
    store = backend
    messages = [{"role": "user", "content": "Before."}, {"role": "assistant", "content": "Noted."}]
    earlier = {"version": 0, "id": "old", "agent": "capped", "owner": "alice", "messages": messages}
    await store.save_context(StoredContext.loads(orjson.dumps({**earlier, "created": 1})))
    alice = {"authorization": "Bearer sk-alice"}
    bob = {"authorization": "Bearer sk-bob"}
    async with proxy_for({**REPORTER, "auth": capped_keys}, store=store) as proxy:
        proxy.upstream.script(say("Warm."))
        body = {"context_id": "old", "message": "More."}
        ran = await proxy.client.post("/chat", json=body, headers=alice)
        moved = await store.load_context("old")
        kept = (await proxy.client.get("/v1/contexts/old", headers=alice)).json()
        unseen = await proxy.client.get("/v1/contexts/old", headers=bob)
        dropped = await proxy.client.delete("/v1/contexts/old", headers=alice)
    assert ran.status_code == 200, ran.text
    assert [m["content"] for m in proxy.upstream.bodies[0]["messages"]][-3:] == [
        "Before.",
        "Noted.",
        "More.",
    ]
    assert moved is None  # moved, not copied: a version without namespaces finds none
    assert [m["content"] for m in kept["messages"]] == ["Before.", "Noted.", "More.", "Warm."]
    assert unseen.status_code == 404
    assert dropped.status_code == 200
    assert await store.load_context("old") is None
    assert await store.load_context("alice/old") is None


@pytest.mark.parametrize(
    ("context_id", "message"),
    [
        ("a/b", "must not contain '/'"),
        ("/", "must not contain '/'"),
        ("..", "must not contain '/' or be '.' or '..'"),
        ("tab\there", "control or text direction characters"),
        ("nul\x00", "control or text direction characters"),
        ("evil\u202egnp.exe", "control or text direction characters"),
        ("x" * 257, "at most 256 characters (state.max_context_id_chars)"),
        ("", "non-empty string"),
    ],
)
async def test_a_context_id_the_api_cannot_address_is_refused(
    proxy_for: ProxyFactory, context_id: str, message: str
) -> None:
    async with proxy_for(REPORTER) as proxy:
        body = {"context_id": context_id, "agent": "reporter", "message": "hi"}
        r = await proxy.client.post("/chat", json=body)
        assert proxy.upstream.requests == []
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "context_id"
    assert message in r.json()["error"]["message"]


async def test_the_longest_context_id_is_addressable(proxy_for: ProxyFactory) -> None:
    longest = "é%? #" + "x" * 251
    async with proxy_for(REPORTER) as proxy:
        proxy.upstream.script(say("Hi."))
        body = {"context_id": longest, "agent": "reporter", "message": "hi"}
        created = await proxy.client.post("/chat", json=body)
        found = await proxy.client.get(f"/v1/contexts/{quote(longest, safe='')}")
    assert created.status_code == 200
    assert found.json()["id"] == longest


SMALL = {**REPORTER, "state": {"backend": "memory", "max_context_bytes": 2048}}


async def test_a_message_that_would_overfill_its_context_is_a_413(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(SMALL) as proxy:
        proxy.upstream.script(say("Hi."))
        body = {"context_id": "small", "agent": "reporter", "message": "hi"}
        assert (await proxy.client.post("/chat", json=body)).status_code == 200
        big = await proxy.client.post("/chat", json={**body, "message": "x" * 2000})
        stored = (await proxy.client.get("/v1/contexts/small")).json()
    assert big.status_code == 413
    error = big.json()["error"]
    assert (error["code"], error["param"]) == ("context_too_large", "message")
    assert "more than 2048 bytes of messages (state.max_context_bytes)" in error["message"]
    assert len(stored["messages"]) == 2  # the upstream was not asked; nothing was saved


async def test_a_run_whose_messages_would_overfill_its_context_saves_nothing_and_answers(
    proxy_for: ProxyFactory,
) -> None:
    """The run ended: its answer is the client's, with what it generated, though nothing was
    saved (`saved_ai_messages: false`, and why in `save_error`)."""
    async with proxy_for(SMALL) as proxy:
        proxy.upstream.script(call("get_weather", city="Oslo"), say("y" * 2000))
        body = {"context_id": "small", "agent": "reporter", "message": "Oslo?"}
        r = await proxy.client.post("/chat", json=body)
        missing = await proxy.client.get("/v1/contexts/small")
    assert r.status_code == 200
    reply = r.json()
    assert (reply["response"], reply["saved_ai_messages"]) == ("y" * 2000, False)
    assert reply["save_error"]["code"] == "context_too_large"
    assert reply["save_error"]["param"] == "context_id"
    assert "nothing was saved" in reply["save_error"]["message"]
    kinds = [m.get("sender") or m.get("type") for m in reply["generated_messages"]]
    assert kinds == ["human", "tool_call", "tool_response", "ai"]
    assert reply["loop"]["tool_calls"] == 1
    assert reply["loop"]["stop_reason"] == "completed"
    assert missing.status_code == 404
