"""What each loop feature costs a run, in microseconds of CPU, with no network noise: runs of one
tool call each (two upstream calls) made straight to the app's ASGI callable, the upstream's two
answers canned (an `httpx.MockTransport`), for an agent with nothing configured and for agents
that differ from it by one feature. The agents take turns; each figure is the best of the
rounds.

    python -m tests.bench.policy_cost [--runs N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message

from proxy.api.app import create_app
from proxy.api.headers import THREAD_HEADER
from proxy.config import parse_config
from tests.direct_asgi import body_then_stay, post_scope

TOOL = "get_weather"
OVER_STEPS = "size(steps) >= 5 && steps.exists(s, s.tool_calls.exists(c, c.name == 'x'))"
# The agents, by the feature each adds to the bare one: (its config, a thread id to send).
FEATURES: dict[str, tuple[dict[str, Any], str | None]] = {
    "nothing configured": ({}, None),
    "4 stop conditions": (
        {
            "stop_when": [
                {"max_cost": 1.0},
                {"max_tokens_used": 100_000},
                {"step_count_is": 10},
                {"max_duration_s": 60},
            ]
        },
        None,
    ),
    "CEL over the totals": ({"stop_when": [{"expr": "cost_usd > 5.0 || elapsed_s > 600.0"}]}, None),
    "CEL over the steps": ({"stop_when": [{"expr": OVER_STEPS}]}, None),
    "tool call limits": (
        {"tool_call_limits": [{"tool_name": TOOL, "run_limit": 5, "thread_limit": 50}]},
        None,
    ),
    "tool rules": (
        {"tool_rules": [{"type": "max_count_per_step", "tool_name": TOOL, "max_count_limit": 3}]},
        None,
    ),
    "a thread id": ({}, "bench-thread"),
}
CONFIG: dict[str, Any] = {
    "upstreams": {"main": {"base_url": "http://upstream.test/v1", "max_retries": 0}},
    "default_upstream": "main",
    "pricing": {"scripted": {"input": 1.0, "output": 4.0}},
    "state": {"backend": "memory"},
    "tools": {TOOL: {"kind": "python", "callable": "tests.bench.tools:get_weather"}},
    "agents": {
        f"agent-{i}": {"model": "scripted", "tools": [TOOL], **options}
        for i, (options, _) in enumerate(FEATURES.values())
    },
}


def canned(request: httpx.Request) -> httpx.Response:
    """The upstream: a call of the tool, or, once its result is in, an answer."""
    answered = b'"role":"tool"' in request.content
    UPSTREAM_CALLS[answered] += 1
    return httpx.Response(200, content=ANSWER if answered else CALL, headers=JSON)


UPSTREAM_CALLS = [0, 0]  # calls answered with the tool call, with the answer


def _reply(message: dict[str, Any], finish_reason: str) -> bytes:
    usage = {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48}
    choice = {"index": 0, "message": message, "finish_reason": finish_reason}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "model": "scripted"}
    return orjson.dumps({**body, "choices": [choice], "usage": usage})


JSON = {"content-type": "application/json"}
ANSWER = _reply({"role": "assistant", "content": "Lima is warm."}, "stop")
FUNCTION = {"name": TOOL, "arguments": '{"city": "Lima"}'}
CALL = _reply(
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": FUNCTION}],
    },
    "tool_calls",
)


async def cpu_per_run(app: ASGIApp, agent: str, thread: str | None, runs: int) -> float:
    """Seconds of this process's CPU per run of `agent`."""
    body = orjson.dumps({"model": agent, "messages": [{"role": "user", "content": "Lima?"}]})
    scope = post_scope("/v1/chat/completions")
    if thread:
        scope["headers"] = [*scope["headers"], (THREAD_HEADER.encode(), thread.encode())]
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    calls = list(UPSTREAM_CALLS)
    started = time.process_time()
    for _ in range(runs):
        await app(scope, body_then_stay(body), send)
    seconds = (time.process_time() - started) / runs
    # What is measured: each run called the tool once, and the upstream twice.
    assert [n - before for n, before in zip(UPSTREAM_CALLS, calls, strict=True)] == [runs, runs]
    statuses = {m["status"] for m in sent if m["type"] == "http.response.start"}
    assert statuses == {200}, sent[-1]
    return seconds


async def measure(runs: int, rounds: int) -> dict[str, float]:
    config = parse_config(CONFIG)
    app = create_app(config, transport=httpx.MockTransport(canned), registry=CollectorRegistry())
    best = dict.fromkeys(FEATURES, float("inf"))
    async with app.router.lifespan_context(app):
        for i, (_, thread) in enumerate(FEATURES.values()):  # warm up
            await cpu_per_run(app, f"agent-{i}", thread, 5)
        for _ in range(rounds):
            for i, (feature, (_, thread)) in enumerate(FEATURES.items()):
                seconds = await cpu_per_run(app, f"agent-{i}", thread, runs)
                best[feature] = min(best[feature], seconds)
    return best


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="policy_cost")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    best = asyncio.run(measure(args.runs, args.rounds))
    bare = best["nothing configured"]
    print(f"{'run of one tool call, the agent has':40} {'CPU us':>8} {'added':>8}")
    for feature, seconds in best.items():
        print(f"{feature:40} {seconds * 1e6:8.0f} {(seconds - bare) * 1e6:+8.0f}")


if __name__ == "__main__":
    main()
