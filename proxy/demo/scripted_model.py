"""A deterministic OpenAI-compatible model server, for the demo.

It reads its plan from the conversation: the tools named in the last user message are
called in the order they are mentioned, one per step (all in the first reply with the word
"together"); with the word "keep" the last one is called forever; `!name` calls a tool even when
it is not offered. A forced `tool_choice` is obeyed. After a nudge it calls the tool the system
prompt names as terminal (it imports the proxy's nudge and hint rather than matching words).
When the plan is done it answers from the last tool result. Usage is counted honestly (four
bytes a token) and `max_completion_tokens` is honoured, cutting the reply short.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.engine.options import DEFAULT_NUDGE
from proxy.engine.policies.terminal import terminal_hint

_ids = itertools.count(1)


def _tokens(value: Any) -> int:
    return max(1, math.ceil(len(orjson.dumps(value)) / 4))


def _arguments(tool: dict[str, Any], text: str, found: str | None) -> dict[str, Any]:
    props = tool["function"].get("parameters", {}).get("properties", {})
    args: dict[str, Any] = {}
    city = re.search(r"\bin ([A-Z][a-z]+)", text)
    for name, schema in props.items():
        kind = schema.get("type")
        if kind == "string" and name in ("answer", "result"):
            args[name] = f"Here is what I found: {found}" if found else "Hello!"
        elif kind == "string":
            args[name] = city.group(1) if city and name == "city" else text[:80]
        elif kind in ("number", "integer"):
            args[name] = 21
        elif kind == "boolean":
            args[name] = True
    return args


def decide(body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply for a request: (content, tool calls)."""
    messages = body.get("messages", [])
    tools = {t["function"]["name"]: t for t in body.get("tools", []) or []}
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    text = str(messages[last_user].get("content", "")) if last_user >= 0 else ""
    since = messages[last_user + 1 :]
    results = [m for m in since if m.get("role") == "tool"]
    done = sum(len(m.get("tool_calls") or []) for m in since if m.get("role") == "assistant")
    choice = body.get("tool_choice")
    allowed = choice != "none"
    found = str(results[-1].get("content")) if results else None
    named: set[str] = set(re.findall(r"!(\w+)", text))  # called even when not offered
    plan = sorted({n for n in tools if n in text} | named, key=text.index)
    # The next planned tool, while the plan (or "keep") says to call one.
    upcoming = None
    if allowed and plan and ("keep" in text or done < len(plan)):
        upcoming = plan[min(done, len(plan) - 1)]
    if upcoming is not None and upcoming in named:
        return None, [_call(tools.get(upcoming, _unknown(upcoming)), text, found)]
    if isinstance(choice, dict) and choice.get("function", {}).get("name") in tools:
        return None, [_call(tools[choice["function"]["name"]], text, found)]
    if allowed and since and since[-1].get("content") == DEFAULT_NUDGE:
        first_system = str(messages[0].get("content", "")) if messages else ""
        terminal = sorted(n for n in tools if f"`{n}`" in first_system)
        if terminal and terminal_hint(terminal) in first_system:
            return None, [_call(tools[terminal[0]], text, found)]
    if allowed and plan and "together" in text and not done:
        return None, [_call(tools.get(n, _unknown(n)), text, found) for n in plan]
    if upcoming is not None:
        name = upcoming
        if choice == "required" and name not in tools:
            name = next(iter(tools))
        return None, [_call(tools.get(name, _unknown(name)), text, found)]
    if choice == "required" and tools:
        return None, [_call(next(iter(tools.values())), text, found)]
    if results:
        return f"Here is what I found: {results[-1].get('content')}", []
    return f"You said: {text}", []


def _unknown(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _call(tool: dict[str, Any], text: str, found: str | None) -> dict[str, Any]:
    return {
        "id": f"call_{next(_ids)}",
        "type": "function",
        "function": {
            "name": tool["function"]["name"],
            "arguments": orjson.dumps(_arguments(tool, text, found)).decode(),
        },
    }


def complete(body: dict[str, Any]) -> dict[str, Any]:
    content, calls = decide(body)
    prompt = _tokens(body.get("messages", [])) + (
        _tokens(body["tools"]) if body.get("tools") else 0
    )
    completion = _tokens(calls) if calls else _tokens(content)
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    finish = "tool_calls" if calls else "stop"
    if isinstance(cap, int) and completion > cap:
        completion, calls, finish = cap, [], "length"
        content = (content or "")[: cap * 4]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-scripted-{next(_ids)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "scripted"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


HEAD = ("id", "created", "model", "system_fingerprint", "service_tier")  # a chunk's, of its body


async def sse_chunks(completion: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """A completion as SSE: a role chunk, the content in pieces of 8 characters, each tool call
    as a head delta then an arguments delta, the finish chunk, a usage chunk when asked, [DONE]."""
    head = {k: completion[k] for k in HEAD if k in completion}
    head["object"] = "chat.completion.chunk"
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    content = message.get("content") or ""
    for i in range(0, len(content), 8):
        yield chunk({"content": content[i : i + 8]})
    if message.get("refusal"):
        yield chunk({"refusal": message["refusal"]})
    for index, tool_call in enumerate(message.get("tool_calls") or []):
        function = tool_call["function"]
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": tool_call["id"],
                        "type": "function",
                        "function": {"name": function["name"], "arguments": ""},
                    }
                ]
            }
        )
        yield chunk(
            {"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]}
        )
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        data = {**head, "choices": [], "usage": completion["usage"]}
        yield b"data: " + orjson.dumps(data) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def chat_completions(request: Request) -> Response:
    body = orjson.loads(await request.body())
    reply = complete(body)
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(sse_chunks(reply, include_usage), media_type="text/event-stream")
    return Response(orjson.dumps(reply), media_type="application/json")


async def models(request: Request) -> Response:
    data = [{"id": "scripted", "object": "model", "created": 0, "owned_by": "loopwarden-demo"}]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


def scripted_app() -> Starlette:
    """The scripted model as an ASGI app."""
    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )
