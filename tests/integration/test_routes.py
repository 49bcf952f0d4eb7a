"""SPEC §4: other /v1 routes are relayed, /models and /chat/completions answer without /v1, and
every route's errors are OpenAI-shaped."""

from __future__ import annotations

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

from proxy.state.memory import MemoryStore
from proxy.state.store import StoredContext
from tests.integration.conftest import UPSTREAM, ProxyFactory
from tests.integration.counted_store import ForgetfulStore
from tests.scripted_upstream import say


async def echoing(request: httpx.Request) -> httpx.Response:
    if request.url.path.endswith("/models"):
        return httpx.Response(200, json={"object": "list", "data": [{"id": "up-model"}]})
    content = await request.aread()
    body = orjson.loads(content) if content else None
    echo = {
        "path": request.url.path,
        "query": request.url.query.decode(),
        "body": body,
        "authorization": request.headers.get("authorization"),
        "account": {
            name: request.headers.get(name)
            for name in ("openai-organization", "openai-project", "x-api-key", "api-key")
            if name in request.headers
        },
    }
    headers = {"x-upstream": "yes", "content-type": "application/json"}
    return httpx.Response(201, stream=httpx.ByteStream(orjson.dumps(echo)), headers=headers)


async def test_other_v1_routes_are_relayed_to_the_upstream_unchanged(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(handler=echoing) as proxy:
        r = await proxy.client.post(
            "/v1/embeddings?dims=8",
            json={"model": "text-embedding-3-small", "input": "hé"},
            headers={"authorization": "Bearer client-key"},
        )
    assert r.status_code == 201
    assert r.headers["x-upstream"] == "yes"
    echo = r.json()
    assert echo["path"] == httpx.URL(UPSTREAM).path + "/embeddings"
    assert echo["query"] == "dims=8"
    assert echo["body"] == {"model": "text-embedding-3-small", "input": "hé"}
    assert echo["authorization"] is None  # the client's key is not the upstream's


ACCOUNT = {
    "openai-organization": "org-other",
    "openai-project": "proj-other",
    "x-api-key": "client-key",
    "api-key": "client-key",
}


async def test_a_client_s_account_headers_never_go_beside_the_proxy_s_key(
    proxy_for: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They pick the organisation or project billed, or carry a key of the client's: beside the
    proxy's key a client chose whom the proxy's account bills. With no key of the proxy's, or
    the client's own forwarded, they are the client's to send."""
    upstreams = {
        "keyed": {"base_url": "http://keyed.test/v1", "api_key_env": "PROXY_KEY", "max_retries": 0},
        "open": {"base_url": "http://open.test/v1", "max_retries": 0},
        "own": {"base_url": "http://own.test/v1", "forward_client_key": True, "max_retries": 0},
    }
    models = {name: {"upstream": name, "model": "m"} for name in upstreams}
    monkeypatch.setenv("PROXY_KEY", "sk-proxy")
    async with proxy_for({"upstreams": upstreams, "models": models}, handler=echoing) as proxy:
        seen = {}
        for name in upstreams:
            r = await proxy.client.post(
                "/v1/embeddings",
                json={"model": name, "input": "x"},
                headers={**ACCOUNT, "authorization": "Bearer client-key"},
            )
            seen[name] = r.json()["account"]
    assert seen == {"keyed": {}, "open": ACCOUNT, "own": ACCOUNT}


async def test_an_audio_upload_goes_to_the_upstream_of_the_model_its_form_names(
    proxy_for: ProxyFactory,
) -> None:
    """The openai SDK's transcription: a multipart form whose `model` field routes it, its file
    relayed as it came."""
    seen: list[tuple[str, bytes]] = []

    async def upstreams(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, await request.aread()))
        return httpx.Response(200, json={"text": f"heard on {request.url.host}"})

    config = {
        "upstreams": {"speech": {"base_url": "http://speech.test/v1", "max_retries": 0}},
        "models": {"whisper-large-v3": {"upstream": "speech", "model": "whisper-large-v3"}},
    }
    audio = b"RIFF" + bytes(range(256)) * 8192  # 2 MiB: past what is read to find the model
    async with proxy_for(config, handler=upstreams) as proxy:
        client = AsyncOpenAI(
            base_url="http://proxy.test/v1", api_key="sk", http_client=proxy.client, max_retries=0
        )
        routed = await client.audio.transcriptions.create(
            model="whisper-large-v3", file=("talk.wav", audio, "audio/wav"), language="en"
        )
        default = await client.audio.transcriptions.create(
            model="whisper-1", file=("talk.wav", b"RIFF", "audio/wav")
        )
    assert (routed.text, default.text) == ("heard on speech.test", "heard on upstream.test")
    (host, form), _ = seen
    assert host == "speech.test"
    assert audio in form
    assert b'name="model"\r\n\r\nwhisper-large-v3\r\n' in form


async def test_models_and_chat_answer_without_the_v1_prefix(proxy_for: ProxyFactory) -> None:
    async with proxy_for(handler=echoing) as proxy:
        listed = (await proxy.client.get("/models")).json()
        same = (await proxy.client.get("/v1/models")).json()
    ids = [m["id"] for m in listed["data"]]
    assert ids == [m["id"] for m in same["data"]]
    assert ids[0] == "weather"  # the configured agent first
    assert "up-model" in ids  # then the upstream's, through its adapter


async def test_another_method_on_an_own_route_is_a_405_not_a_relay(
    proxy_for: ProxyFactory,
) -> None:
    async with proxy_for(handler=echoing) as proxy:
        r = await proxy.client.get("/v1/chat/completions")
        # The ids below the proxy's own routes are its own: no upstream knows them.
        patched = await proxy.client.patch("/v1/responses/resp_1", json={})
        posted = await proxy.client.post("/v1/runs/run_1", json={})
        below = await proxy.client.post("/v1/responses/resp_1/cancel")
        unknown = await proxy.client.get("/v1/responses/resp_1/input_items")
        listing = [
            await proxy.client.request(method, f"{root}/responses/resp_1/input_items")
            for method in ("POST", "DELETE")
            for root in ("/v1", "")
        ]
        counted = await proxy.client.post("/v1/responses/input_tokens", json={"input": "hi"})
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert (patched.status_code, posted.status_code) == (405, 405)
    assert [r.status_code for r in listing] == [405] * 4
    assert below.status_code == 404
    assert counted.status_code == 201  # OpenAI's own route there: relayed
    assert counted.json()["path"].endswith("/responses/input_tokens")
    assert unknown.json()["error"]["message"] == "no stored response 'resp_1'"
    assert below.json()["error"] == {
        "message": "the proxy has no route /v1/responses/resp_1/cancel",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }


async def test_a_path_that_climbs_out_of_v1_is_refused(proxy_for: ProxyFactory) -> None:
    async with proxy_for(handler=echoing) as proxy:
        r = await proxy.client.get("/v1/%2E%2E/admin")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_a_failing_state_backend_is_an_openai_shaped_error(proxy_for: ProxyFactory) -> None:
    class Broken(MemoryStore):
        async def load_context(self, context_id: str) -> StoredContext | None:
            raise ConnectionError("backend down")

    async with proxy_for(store=Broken()) as proxy:
        r = await proxy.client.get("/v1/contexts/c-1")
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "internal_error"


async def test_a_run_answers_though_its_report_cannot_be_kept(proxy_for: ProxyFactory) -> None:
    async with proxy_for(store=ForgetfulStore()) as proxy:
        proxy.upstream.script(say("Hi."))
        r = await proxy.chat(model="scripted")
        assert r.status_code == 200
        assert r.json()["loop"]["stop_reason"] == "completed"
        looked_up = await proxy.client.get(f"/v1/runs/{r.json()['loop']['run_id']}")
        assert looked_up.status_code == 404  # it was not kept


async def test_a_relayed_answer_keeps_no_redirect_and_none_of_the_proxy_s_own_headers(
    proxy_for: ProxyFactory,
) -> None:
    async def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/moved"):
            return httpx.Response(302, headers={"location": "http://10.0.0.7:8000/v1/x"})
        spoofed = {"x-loopwarden-stop-reason": "completed", "x-upstream": "yes"}
        return httpx.Response(200, json={"object": "list"}, headers=spoofed)

    async with proxy_for(handler=upstream) as proxy:
        moved = await proxy.client.post("/v1/moved", json={"model": "m"})
        listed = await proxy.client.post("/v1/embeddings", json={"model": "m"})
    assert moved.status_code == 502
    assert "location" not in moved.headers
    assert moved.json()["error"]["message"] == (
        "upstream main answered HTTP 302, a redirect the proxy does not follow"
    )
    assert listed.headers["x-upstream"] == "yes"
    assert "x-loopwarden-stop-reason" not in listed.headers


async def test_a_model_is_retrieved_as_the_list_shows_it(proxy_for: ProxyFactory) -> None:
    async with proxy_for(handler=echoing) as proxy:
        agent = (await proxy.client.get("/v1/models/weather")).json()
        upstream = (await proxy.client.get("/models/up-model")).json()
        unknown = await proxy.client.get("/v1/models/org/no-such-model")
        # Other methods below /v1/models/ are the upstream's: deleting a fine-tuned model.
        deleted = await proxy.client.delete("/v1/models/ft:up-model:org:1")
    assert (agent["id"], agent["object"], agent["owned_by"]) == ("weather", "model", "loopwarden")
    assert upstream == {"id": "up-model"}
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert "org/no-such-model" in unknown.json()["error"]["message"]
    assert (deleted.status_code, deleted.json()["path"]) == (201, "/v1/models/ft:up-model:org:1")
