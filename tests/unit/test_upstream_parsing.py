"""Upstream SSE and chunk parsing, and the body sent upstream."""

from __future__ import annotations

import httpx

from proxy.engine.values import ModelRequest
from proxy.upstream.client import Upstream
from proxy.upstream.reply import ChunkAccumulator
from proxy.upstream.sse import SSEDecoder


def test_sse_events_split_across_reads() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a"') == []
    tail = b":1}\n\n: comment\n\ndata: x\r\ndata: y\r\n\r\n"
    assert decoder.feed(tail) == [b'{"a":1}', b"x\ny"]
    assert not decoder.done
    assert decoder.feed(b"data: [DONE]\n\n") == []
    assert decoder.done


def test_chunks_accumulate_content_tool_calls_and_usage() -> None:
    acc = ChunkAccumulator()
    assert acc.add({"id": "a", "choices": [{"delta": {"content": "Hi"}}]}) == "Hi"
    acc.add(
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "function": {"name": "look", "arguments": '{"q":'},
                            }
                        ]
                    }
                }
            ]
        }
    )
    acc.add(
        {
            "choices": [
                {
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    acc.add(
        {
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "cost": 0.25},
        }
    )
    reply = acc.reply()
    assert reply.text == "Hi"
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [("c1", "look", '{"q":"x"}')]
    assert reply.finish_reason == "tool_calls"
    assert reply.usage.total_tokens == 5
    assert reply.reported_cost_usd == 0.25


def test_upstream_body_caps_tokens_and_drops_tool_fields_without_tools() -> None:
    up = Upstream("u", "http://u/v1", httpx.AsyncHTTPTransport())
    request = ModelRequest(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        tools=[],
        tool_choice="auto",
        max_completion_tokens=50,
        stream=True,
        params={"max_tokens": 500, "parallel_tool_calls": True, "temperature": 0},
    )
    body = up.body(request)
    assert body["max_completion_tokens"] == 50
    assert body["max_tokens"] == 50
    assert "parallel_tool_calls" not in body
    assert "tool_choice" not in body
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0
