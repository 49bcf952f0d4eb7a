"""Every stop reason of SPEC §5.2 through `/v1/responses`, JSON and streaming (SPEC §12.2,
§12.3): its status, its `loop` report, its count and its spans under route `/v1/responses`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import Proxy, ProxyFactory
from tests.integration.test_stop_reason_telemetry import CASES, Case
from tests.response_events import checked, parse_events

# Stops that fail after the stream has sent something: `response.failed` in the stream.
# (A failure after the first step's answer began, too: the response starts with it.)
FAILED_IN_STREAM = {"max_invocations", "nudges_exhausted", "internal_error", "state_unavailable"}


def responses_body(case: Case, stream: bool) -> dict[str, Any]:
    """The case's chat body as a Responses body: messages as input, function tools flat."""
    body = {k: v for k, v in case.body.items() if k not in ("messages", "tools")}
    body["input"] = case.body["messages"]
    if "tools" in case.body:
        body["tools"] = [{"type": "function", **t["function"]} for t in case.body["tools"]]
    body["stream"] = stream
    return body


async def run_json(proxy: Proxy, reason: str, case: Case) -> None:
    r = await proxy.client.post("/v1/responses", json=responses_body(case, False))
    assert r.status_code == case.status, r.text
    body = r.json()
    assert body["loop"]["stop_reason"] == reason
    assert r.headers["x-loopwarden-stop-reason"] == reason
    if case.status == 200:
        assert body["object"] == "response"
        assert body["status"] == "completed"
        if reason != "content_filter":  # the upstream refused: there may be nothing to show
            assert body["output"], body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}


async def run_stream(proxy: Proxy, reason: str, case: Case) -> None:
    r = await proxy.client.post("/v1/responses", json=responses_body(case, True))
    if reason not in FAILED_IN_STREAM and case.status != 200:  # failed before the first byte
        assert r.status_code == case.status, r.text
        assert r.json()["loop"]["stop_reason"] == reason
        return
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_events(r.text)
    final = checked(events)
    assert final["loop"]["stop_reason"] == reason
    if reason in FAILED_IN_STREAM:
        assert events[-1]["type"] == "response.failed"
        assert final["status"] == "failed"
        assert final["error"]["code"] == case_code(reason)
    else:
        assert events[-1]["type"] == "response.completed"
        assert final["status"] == "completed"
        usage = final["usage"]
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        got = await proxy.client.get(f"/v1/responses/{final['id']}")
        assert got.json()["output"] == final["output"]


def case_code(reason: str) -> str:
    return {
        "max_invocations": "max_invocations_exceeded",
        "nudges_exhausted": "max_consecutive_nudges_exceeded",
        "internal_error": "internal_error",
        "state_unavailable": "state_unavailable",
    }[reason]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("reason", sorted(CASES))
async def test_each_stop_reason_through_responses(
    proxy_for: ProxyFactory, reason: str, stream: bool
) -> None:
    case = CASES[reason]
    async with proxy_for(store=case.store) as proxy:
        proxy.upstream.script(*case.turns)
        if case.leave_after_s is not None:
            body = responses_body(case, stream)
            sent = await proxy.leaving(body, case.leave_after_s, "/v1/responses")
            if stream:  # the server call had started: nothing follows it, not even an end
                text = b"".join(m.get("body", b"") for m in sent).decode()
                assert [e["type"] for e in parse_events(text)][
                    -1
                ] == "response.mcp_call.in_progress"
            else:
                assert sent == []
        elif stream:
            await run_stream(proxy, reason, case)
        else:
            await run_json(proxy, reason, case)
        runs = {
            sample.labels["stop_reason"]: sample.value
            for family in proxy.registry.collect()
            if family.name == "loopwarden_runs"
            for sample in family.samples
            if sample.name == "loopwarden_runs_total" and sample.value
        }
        assert runs == {reason: 1.0}
        (run,) = [s for s in proxy.spans() if s.name.startswith("invoke_agent")]
        assert run.attributes is not None
        assert run.attributes["loopwarden.stop_reason"] == reason
        (server,) = [s for s in proxy.spans() if s.name == "POST /v1/responses"]
        assert server.attributes is not None
        assert server.attributes["http.route"] == "/v1/responses"
        overhead = proxy.metric("loopwarden_proxy_overhead_seconds_count", route="/v1/responses")
        assert overhead == 1.0
