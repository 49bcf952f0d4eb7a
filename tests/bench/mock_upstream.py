"""A fast OpenAI-compatible mock upstream, so that the upstream is never the bottleneck of a
benchmark: a raw asyncio protocol on httptools, uvloop and orjson.

    python -m tests.bench.mock_upstream --port P [--chunks 16] [--chunk-delay-ms 0]

- `POST …/chat/completions`: a `chat.completion`, or with `"stream": true` an SSE stream (a role
  chunk, the content chunks, the finish chunk, a usage chunk when
  `stream_options.include_usage`, `[DONE]`). A request with `tools` and no `role: "tool"`
  message yet gets a call of its first tool (arguments: a generic value for each required
  parameter, e.g. `{"city": "Paris"}`); with tool results, a text answer.
- The model name's suffix `+cdN` puts N ms between the SSE chunks (`mock+cd2`).
- `GET …/models`, `GET /health`; `POST /v1/traces` answers 200, so that a second mock is an
  OTLP/HTTP receiver that drops what it gets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import socket
import time
from typing import Any, cast

import httptools
import orjson
import uvloop

_ids = itertools.count(1)
GENERIC: dict[str, Any] = {"string": "Paris", "number": 1, "integer": 1, "boolean": True}
MODELS = orjson.dumps({"object": "list", "data": [{"id": "mock", "object": "model"}]})


class Script:
    """What the mock answers to one chat request: text words, or a tool call."""

    def __init__(self, request: dict[str, Any], words: int) -> None:
        self.model = str(request.get("model") or "mock")
        self.usage_chunk = bool((request.get("stream_options") or {}).get("include_usage"))
        messages = request.get("messages") or []
        tools = request.get("tools") or []
        answered = any(isinstance(m, dict) and m.get("role") == "tool" for m in messages)
        self.call = _tool_call(tools[0]) if tools and not answered else None
        text = "the tool said enough" if answered else " ".join(["mock"] * words)
        self.words = [] if self.call else text.split(" ")
        prompt = max(1, len(orjson.dumps(messages)) // 4)
        completion = 8 if self.call else len(self.words)
        self.usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        self.id = f"chatcmpl-mock{next(_ids)}"
        self.finish = "tool_calls" if self.call else "stop"

    def chat_completion(self) -> bytes:
        message: dict[str, Any] = {"role": "assistant", "content": " ".join(self.words) or None}
        if self.call:
            message["tool_calls"] = [self.call]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish}
        return orjson.dumps(self._head("chat.completion", [choice], self.usage))

    def events(self) -> list[bytes]:
        chunks = [self._chunk({"role": "assistant", "content": "" if self.words else None})]
        if self.call:
            chunks.append(self._chunk({"tool_calls": [{"index": 0, **self.call}]}))
        for i, word in enumerate(self.words):
            chunks.append(self._chunk({"content": word if i == 0 else " " + word}))
        chunks.append(self._chunk({}, self.finish))
        if self.usage_chunk:
            chunks.append(orjson.dumps(self._head("chat.completion.chunk", [], self.usage)))
        return [b"data: " + c + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return orjson.dumps(self._head("chat.completion.chunk", [choice], None))

    def _head(self, kind: str, choices: list[Any], usage: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": kind, "created": int(time.time()), "model": self.model}
        return {**head, "choices": choices, "usage": usage}


def _tool_call(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") or {}
    schema = function.get("parameters") or {}
    properties = schema.get("properties") or {}
    arguments = {
        name: GENERIC.get((properties.get(name) or {}).get("type", "string"), "x")
        for name in schema.get("required") or []
    }
    name = function.get("name", "tool")
    call = {"name": name, "arguments": orjson.dumps(arguments).decode()}
    return {"id": f"call_{next(_ids)}", "type": "function", "function": call}


def chunk_gap_ms(model: str, default: float) -> float:
    for option in model.split("+")[1:]:
        if option.startswith("cd"):
            try:
                return float(option[2:])
            except ValueError:
                pass
    return default


class MockProtocol(asyncio.Protocol):
    words = 16
    chunk_gap_ms = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.send(400, b'{"error":{"message":"bad request"}}', keep=False)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, path = self.parser.get_method(), self.url.split(b"?", 1)[0]
        keep = self.parser.should_keep_alive()
        if method == b"POST" and path.endswith(b"/chat/completions"):
            try:
                request = orjson.loads(b"".join(self.body))
                script = Script(request, self.words)
            except (orjson.JSONDecodeError, AttributeError, TypeError):
                self.send(400, b'{"error":{"message":"invalid request"}}', keep)
                return
            if request.get("stream"):
                gap = chunk_gap_ms(script.model, self.chunk_gap_ms)
                self.stream(script.events(), keep, gap / 1000)
            else:
                self.send(200, script.chat_completion(), keep)
        elif method == b"POST" and path == b"/v1/traces":
            self.send(200, b"", keep, b"application/x-protobuf")
        elif method == b"GET" and path.endswith(b"/models"):
            self.send(200, MODELS, keep)
        elif method == b"GET" and path == b"/health":
            self.send(200, b'{"status":"ok"}', keep)
        else:
            self.send(404, b'{"error":{"message":"not found"}}', keep)

    def send(self, status: int, body: bytes, keep: bool, kind: bytes = b"application/json") -> None:
        if self.closed:
            return
        head = b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            status, kind, len(body), b"" if keep else b"connection: close\r\n"
        )  # fmt: skip
        self.transport.write(head + body)
        if not keep:
            self.transport.close()

    def stream(self, events: list[bytes], keep: bool, gap_s: float) -> None:
        close = b"" if keep else b"connection: close\r\n"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        head += b"transfer-encoding: chunked\r\n%s\r\n" % close
        framed = [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
        if gap_s <= 0:
            self.transport.write(head + b"".join(framed))
        else:
            self.transport.write(head + framed[0])
            asyncio.get_running_loop().call_later(gap_s, self.trickle, framed, 1, keep, gap_s)
            return
        if not keep:
            self.transport.close()

    def trickle(self, framed: list[bytes], i: int, keep: bool, gap_s: float) -> None:
        if self.closed:
            return
        self.transport.write(framed[i])
        if i + 1 < len(framed):
            loop = asyncio.get_running_loop()
            loop.call_later(gap_s, self.trickle, framed, i + 1, keep, gap_s)
        elif not keep:
            self.transport.close()


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        MockProtocol, host, port, backlog=4096, reuse_address=True
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=16, help="words of a text answer")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    MockProtocol.words, MockProtocol.chunk_gap_ms = args.chunks, args.chunk_delay_ms
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
