"""`ScriptedUpstream`: an OpenAI-compatible Chat Completions server that replays the turns a test
gives it, in order, and records every request it gets.

    upstream.script(
        call("get_weather", city="Paris"),
        say_tool_result("It is {} in Paris."),
    )

A turn is the model's reply (`say`, `call`, `calls`), an HTTP error (`fail`), or a function of
the request body that returns one of those. `keep(turn)` answers every request from there on, so
the script never runs out; `keep(each_run(call(...), then=say_tool_result(...)))` serves runs that
share the script at once. Usage is counted honestly unless a reply gives its own: a token is four
bytes of the compact JSON of the messages and tools (prompt) and of the reply (completion), and a
`max_completion_tokens` (or `max_tokens`) smaller than the reply cuts it short with
`finish_reason: length` and no tool calls.

A request that finds the script exhausted is answered with HTTP 500 and remembered: `check()`
fails the test afterwards (the fixtures call it), unless the test called `allow_exhaustion()`.

The same object serves in-process (`app`, behind `httpx.ASGITransport`) or on 127.0.0.1 in a
thread (`serve()`); the test sets the script in Python either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.demo.runner import free_port, serve_in_thread
from proxy.demo.scripted_model import sse_chunks

Body = dict[str, Any]
MODEL = "scripted"  # the one model `GET /v1/models` lists


@dataclass(frozen=True)
class Call:
    """One tool call of a reply; `arguments` as a dict or as JSON text (sent as it is)."""

    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)
    id: str | None = None  # generated when not given


@dataclass(frozen=True)
class Reply:
    """The model's reply: text and/or tool calls.

    `finish_reason` defaults to `tool_calls` when there are calls, else `stop`. `usage` keys
    (`prompt_tokens`, `completion_tokens`, `total_tokens`, `cost`, ...) replace the honest
    counts; `total_tokens` follows the other two unless given.
    """

    content: str | None = None
    calls: tuple[Call, ...] = ()
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None
    after_s: float = 0.0  # how long the upstream takes before it answers
    refusal: str | None = None  # the model's refusal, beside (or instead of) its text
    logprobs: Mapping[str, Any] | None = None  # the choice's, as they come in a JSON answer

    def replace(self, **changes: Any) -> Reply:
        return replace(self, **changes)


@dataclass(frozen=True)
class Failure:
    """An HTTP error instead of a reply, with an OpenAI-shaped error body."""

    status: int
    message: str
    error_type: str = "server_error"
    code: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    param: str | None = None


Answer = Reply | Failure
Turn = Answer | Callable[[Body], Answer]


@dataclass(frozen=True)
class Keep:
    """A turn that is never used up: it answers this request and every one after it."""

    turn: Turn


def say(text: str, *, finish_reason: str | None = None) -> Reply:
    return Reply(content=text, finish_reason=finish_reason)


def call(name: str, /, **arguments: Any) -> Reply:
    """A reply with one tool call of `name` with these arguments."""
    return Reply(calls=(Call(name, arguments),))


def calls(*items: Reply | Call) -> Reply:
    """One reply with several tool calls: `calls(call("a", x=1), call("b"))`."""
    found: list[Call] = []
    for item in items:
        found.extend(item.calls if isinstance(item, Reply) else (item,))
    return Reply(calls=tuple(found))


def fail(
    status: int,
    message: str = "scripted failure",
    *,
    error_type: str = "server_error",
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> Failure:
    return Failure(status, message, error_type, code, dict(headers or {}), param)


def keep(turn: Turn) -> Keep:
    return Keep(turn)


def last_message(body: Body) -> dict[str, Any]:
    return dict(body["messages"][-1])


def last_tool_result(body: Body) -> str:
    """The content of the last tool message of a request; fails the turn when there is none."""
    results = [m for m in body["messages"] if m.get("role") == "tool"]
    if not results:
        raise AssertionError("the request has no tool result to answer from")
    return str(results[-1]["content"])


def say_tool_result(template: str = "{}") -> Callable[[Body], Reply]:
    """A turn that answers with the last tool result put in `template` at `{}`."""

    def turn(body: Body) -> Reply:
        return say(template.format(last_tool_result(body)))

    return turn


def each_run(first: Turn, then: Turn) -> Callable[[Body], Answer]:
    """A turn for runs that share a script (concurrent ones, with `keep`): `first` for a request
    whose last message is not a tool result (a run's first step), else `then`."""

    def turn(body: Body) -> Answer:
        chosen = then if last_message(body).get("role") == "tool" else first
        return chosen(body) if callable(chosen) else chosen

    return turn


@dataclass(frozen=True)
class Recorded:
    """One request the upstream got: its body and its headers (names lower-case)."""

    body: Body
    headers: Mapping[str, str]

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")

    @property
    def traceparent(self) -> str | None:
        return self.headers.get("traceparent")


class ScriptedUpstream:
    """An OpenAI-compatible upstream that replays a script; see the module docstring."""

    def __init__(self, *turns: Turn | Keep) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._script: list[Turn | Keep] = list(turns)
        self._exhaustion_allowed = False
        self.requests: list[Recorded] = []
        self.exhausted: list[int] = []  # the numbers of the requests that found no turn left
        self.errors: list[str] = []  # turns (functions of the request) that raised
        self.url: str | None = None  # the base URL (with /v1) while `serve()` runs
        # Fields every answer and chunk carries, as a provider names what served it (a dated
        # `model`, `system_fingerprint`, `service_tier`); by default the model asked for.
        self.served: dict[str, str] = {}
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    # -- what a test sets and reads ------------------------------------------------------------

    def script(self, *turns: Turn | Keep) -> None:
        """Replaces what is left of the script with `turns`."""
        with self._lock:
            self._script = list(turns)

    def allow_exhaustion(self) -> None:
        """This test expects requests beyond the script (answered 500): `check()` passes."""
        self._exhaustion_allowed = True

    def reset(self) -> None:
        """No script, no records: for a server shared between tests."""
        with self._lock:
            self._script = []
            self._exhaustion_allowed = False
            self.requests.clear()
            self.exhausted.clear()
            self.errors.clear()
            self.served = {}

    def check(self) -> None:
        """Fails when a turn raised, or a request found the script exhausted (unless allowed)."""
        problems = list(self.errors)
        if not self._exhaustion_allowed:
            problems += [f"request #{n} found the script exhausted" for n in self.exhausted]
        assert not problems, "the scripted upstream failed: " + "; ".join(problems)

    @property
    def bodies(self) -> list[Body]:
        return [r.body for r in self.requests]

    @property
    def authorizations(self) -> list[str | None]:
        return [r.authorization for r in self.requests]

    @property
    def traceparents(self) -> list[str | None]:
        return [r.traceparent for r in self.requests]

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Serves on 127.0.0.1 in a thread until the block ends; yields the base URL (with /v1)."""
        with serve_in_thread(self.app, free_port()) as url:
            self.url = f"{url}/v1"
            try:
                yield self.url
            finally:
                self.url = None

    # -- the server ----------------------------------------------------------------------------

    def _next(self, recorded: Recorded) -> Answer:
        """Records the request and answers it with the next turn."""
        with self._lock:
            self.requests.append(recorded)
            number = len(self.requests)
            if not self._script:
                self.exhausted.append(number)
                message = f"script exhausted: request #{number} found no turn left"
                return Failure(500, message, code="script_exhausted")
            entry = self._script[0]
            if isinstance(entry, Keep):
                turn = entry.turn
            else:
                del self._script[0]
                turn = entry
        if not callable(turn):
            return turn
        try:
            return turn(recorded.body)
        except Exception as exc:
            error = f"request #{number}: the turn raised {type(exc).__name__}: {exc}"
            self.errors.append(error)
            return Failure(500, error, code="script_error")

    async def _chat_completions(self, request: Request) -> Response:
        body: Body = orjson.loads(await request.body())
        answer = self._next(Recorded(body, dict(request.headers)))
        if isinstance(answer, Failure):
            error = {
                "message": answer.message,
                "type": answer.error_type,
                "param": answer.param,
                "code": answer.code,
            }
            return Response(
                orjson.dumps({"error": error}),
                status_code=answer.status,
                headers=dict(answer.headers),
                media_type="application/json",
            )
        if answer.after_s:
            await asyncio.sleep(answer.after_s)
        completion = self._completion(body, answer)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                sse_chunks(completion, include_usage), media_type="text/event-stream"
            )
        return Response(orjson.dumps(completion), media_type="application/json")

    async def _models(self, request: Request) -> Response:
        data = [{"id": MODEL, "object": "model", "created": 0, "owned_by": "tests"}]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    def _completion(self, body: Body, reply: Reply) -> dict[str, Any]:
        content = reply.content
        tool_calls = [
            {
                "id": c.id or f"call_{next(self._ids)}",
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": c.arguments
                    if isinstance(c.arguments, str)
                    else orjson.dumps(c.arguments).decode(),
                },
            }
            for c in reply.calls
        ]
        finish = reply.finish_reason or ("tool_calls" if tool_calls else "stop")
        prompt = _tokens(body.get("messages", []))
        if body.get("tools"):
            prompt += _tokens(body["tools"])
        given = dict(reply.usage or {})
        prompt = given.pop("prompt_tokens", prompt)
        completion = given.pop("completion_tokens", _tokens(tool_calls or content))
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(cap, int) and completion > cap:
            completion, tool_calls, finish = cap, [], "length"
            content = (content or "")[: cap * 4]
        total = given.pop("total_tokens", prompt + completion)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reply.refusal is not None:
            message["refusal"] = reply.refusal
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "id": f"chatcmpl-scripted-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", MODEL),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": reply.logprobs,
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": total,
                **given,
            },
            **self.served,
        }


def _tokens(value: Any) -> int:
    return max(1, math.ceil(len(orjson.dumps(value)) / 4))
