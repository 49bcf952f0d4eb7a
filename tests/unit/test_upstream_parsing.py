"""Upstream SSE and chunk parsing, replies and their usage, Retry-After, error bodies, and the
body sent upstream."""

from __future__ import annotations

import itertools
import logging
import math
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.engine.values import ModelRequest, ToolCall
from proxy.errors import UpstreamBadReply, UpstreamStatusError
from proxy.redaction import redacted
from proxy.upstream.client import Upstream
from proxy.upstream.error_body import (
    MAX_RETRY_HEADERS,
    MESSAGE_LIMIT,
    RETRY_HEADER_LIMIT,
    scrub,
    status_failure,
)
from proxy.upstream.httpx_transport import HttpxTransport
from proxy.upstream.reply import (
    MAX_USAGE_ENTRIES,
    ChunkAccumulator,
    MalformedReply,
    ReplyLimits,
    reply_from_body,
    reported_usage,
    unique_ids,
)
from proxy.upstream.retry import Retry, retry_after_s
from proxy.upstream.sse import ErrorEvent, EventTooLarge, SSEDecoder


def test_sse_events_split_across_reads() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a"') == []
    tail = b":1}\n\n: comment\n\ndata: x\r\ndata: y\r\n\r\n"
    assert decoder.feed(tail) == [b'{"a":1}', b"x\ny"]
    assert not decoder.done
    assert decoder.feed(b"data: [DONE]\n\n") == []
    assert decoder.done


def test_chunks_accumulate_content_tool_calls_and_usage() -> None:
    acc = ChunkAccumulator(ReplyLimits(reports_cost=True))
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


def test_a_delta_with_text_and_more_keeps_all_of_it() -> None:
    """Text deltas take a shorter path; one that carries a tool call or a refusal beside its
    text (and a role) keeps them too."""
    acc = ChunkAccumulator()
    call = {"index": 0, "id": "c1", "function": {"name": "look", "arguments": "{}"}}
    text_and_call = {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    assert acc.add({"choices": [{"delta": text_and_call}]}) == "Let me look."
    assert acc.add({"choices": [{"delta": {"content": " No.", "refusal": "not that"}}]}) == " No."
    assert acc.add({"choices": [{"delta": {"role": "assistant"}, "finish_reason": "stop"}]}) is None
    reply = acc.reply()
    assert reply.text == "Let me look. No."
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [("c1", "look", "{}")]
    assert reply.message["refusal"] == "not that"
    assert reply.finish_reason == "stop"
    with pytest.raises(MalformedReply, match=r"choices\[0\].delta.refusal is not a string"):
        acc.add({"choices": [{"delta": {"content": "x", "refusal": 5}}]})


def _calls_of(*deltas: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    acc = ChunkAccumulator()
    for calls in deltas:
        acc.add({"choices": [{"delta": {"tool_calls": calls}}]})
    acc.add({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    return [(c.id, c.name, c.arguments) for c in acc.reply().tool_calls]


def _part(arguments: str, **fields: Any) -> dict[str, Any]:
    name = fields.pop("name", None)
    function = {"arguments": arguments} | ({"name": name} if name else {})
    return {**fields, "function": function}


def test_calls_streamed_as_other_upstreams_stream_them() -> None:
    """Deltas that repeat the id and the whole name (as some OpenAI-compatible servers send
    them), and deltas without an `index`: one call each, as OpenAI's own deltas would be."""
    repeated = [
        [_part('{"city":', index=0, id="a", name="look")],
        [_part(' "Oslo"}', index=0, id="a", name="look")],
        [_part("{}", index=1, id="b", name="note")],
        [_part("", index=1, id="b", name="note")],
    ]
    assert _calls_of(*repeated) == [("a", "look", '{"city": "Oslo"}'), ("b", "note", "{}")]
    unindexed = [
        [_part('{"city":', id="a", name="look")],
        [_part(' "Oslo"}')],
        [_part("{}", id="b", name="note")],
        [_part("{}", name="ask")],  # no id: another name is another call
        [_part("", name="ask")],  # the same name again: the same call
    ]
    fragments = [[_part("", index=0, id="c", name="get")], [_part("{}", index=0, name="get")]]
    assert _calls_of(*fragments) == [("c", "getget", "{}")]  # a name in two like parts
    assert _calls_of(*unindexed) == [
        ("a", "look", '{"city": "Oslo"}'),
        ("b", "note", "{}"),
        ("call_2", "ask", "{}"),
    ]


def test_upstream_body_caps_tokens_and_drops_tool_fields_without_tools() -> None:
    up = Upstream("u", "http://u/v1", HttpxTransport(httpx.AsyncHTTPTransport()))
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
    assert body["max_tokens"] == 50
    assert "max_completion_tokens" not in body  # OpenAI refuses the two at once
    assert "parallel_tool_calls" not in body
    assert "tool_choice" not in body
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0


# Bounds and faults of the SSE decoder


def test_sse_a_stream_s_leading_byte_order_mark_is_no_part_of_its_first_line() -> None:
    """The SSE format lets a stream begin with one: its first event was dropped unsaid."""
    d = SSEDecoder()
    assert d.feed(b'\xef\xbb\xbfdata: {"a":1}\n\ndata: {"b":2}\n\n') == [b'{"a":1}', b'{"b":2}']
    assert SSEDecoder().feed(b'data: {"a":1}\n\n\xef\xbb\xbfdata: 2\n\n') == [b'{"a":1}']


def test_sse_an_event_over_the_cap_is_refused_before_it_ends() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    assert decoder.feed(b"data: " + b"a" * 60 + b"\n") == []
    assert decoder.feed(b"data: " + b"b" * 50) == []  # the second line is not even ended
    assert isinstance(decoder.failure, EventTooLarge)
    assert "more than 100 bytes" in str(decoder.failure)
    assert decoder.done
    assert decoder.feed(b"\n\n") == []  # nothing after it is read


@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
def test_sse_an_event_at_the_cap_is_read_whatever_follows_it_in_the_read(end: bytes) -> None:
    """The bound is the event's: the next event's first bytes in the same read do not count
    against the one before (whole events and lines read one by one agree)."""
    decoder = SSEDecoder(max_event_bytes=100)
    read = b"data: " + b"x" * 100 + end + end + b"data: yyyy"
    assert decoder.feed(read) == [b"x" * 100]
    assert decoder.failure is None
    assert decoder.feed(end + end) == [b"yyyy"]


def test_sse_a_line_without_end_is_refused_at_the_cap() -> None:
    decoder = SSEDecoder(max_event_bytes=1000)
    for _ in range(9):
        assert decoder.feed(b": " + b"x" * 98) == []
    assert decoder.failure is None
    decoder.feed(b"x" * 200)
    assert isinstance(decoder.failure, EventTooLarge)


@pytest.mark.parametrize(
    "failing", [b"event: error\ndata: overloaded\n\n", b"data: " + b"x" * 200 + b"\n\n"]
)
def test_sse_the_events_before_a_failure_in_the_same_read_are_returned(failing: bytes) -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    assert decoder.feed(b"data: 1\n\ndata: 2\n\n" + failing + b"data: 3\n\n") == [b"1", b"2"]
    assert isinstance(decoder.failure, ErrorEvent | EventTooLarge)
    assert decoder.done


def test_sse_a_line_in_many_pieces_is_read_whole() -> None:
    decoder = SSEDecoder(max_event_bytes=10_000)
    pieces = [b'data: {"a": "', *[b"x" * 10] * 50, b'"}', b"\n\n"]
    events = [event for piece in pieces for event in decoder.feed(piece)]
    assert events == [b'{"a": "' + b"x" * 500 + b'"}']


def test_sse_nothing_after_done_is_read() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: 1\n\ndata: [DONE]\n\ndata: 2\n\n") == [b"1"]
    assert decoder.done
    assert decoder.feed(b"data: 3\n\n") == []


def _read_whole(stream: bytes) -> tuple[list[bytes], str | None]:
    """The events of a whole stream read line by line, and how it ended (`done`, `error`)."""
    events: list[bytes] = []
    data: list[bytes] = []
    error = False
    for raw in stream.split(b"\n")[:-1]:  # the lines that end
        line = raw.rstrip(b"\r")
        if not line:
            if data:
                event, data = b"\n".join(data), []
                if error:
                    return events, "error"
                if event == b"[DONE]":
                    return events, "done"
                events.append(event)
            error = False
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:"):
            error = line[6:].strip() == b"error"
    return events, None


_LINES = st.sampled_from(
    [b"data: {\"a\":1}", b'data:{"b":2}', b"data: x", b"data:  y", b"data: [DONE]", b"data:",
     b": keep-alive", b"id: 7", b"event: message", b"event: error", b"retry: 5", b""]
)  # fmt: skip
_EVENTS = st.lists(st.tuples(st.lists(_LINES, min_size=1, max_size=3), st.booleans()))


@settings(max_examples=400, deadline=None)
@given(events=_EVENTS, cuts=st.lists(st.integers(min_value=0), max_size=8))
@example(events=[([b"event: error", b"data: x"], False)], cuts=[13])  # type, then its data
@example(events=[([b"id: 7", b"data: x", b"data: y"], False)], cuts=[6])
def test_sse_the_events_are_the_same_however_the_reads_fall(
    events: list[tuple[list[bytes], bool]], cuts: list[int]
) -> None:
    """Whole events take a shorter path than lines read one by one; wherever the reads begin
    and end (an event, a line or a `\\r\\n` cut in two), the decoder returns what reading the
    whole stream line by line does, and ends as it does."""
    stream = b"".join(
        b"".join(line + (b"\r\n" if crlf else b"\n") for line in lines) + b"\n"
        for lines, crlf in events
    )
    marks = sorted({cut % (len(stream) + 1) for cut in cuts} | {0, len(stream)})
    decoder = SSEDecoder(max_event_bytes=1_000)
    read = [e for a, b in itertools.pairwise(marks) for e in decoder.feed(stream[a:b])]
    expected, end = _read_whole(stream)
    assert read == expected
    assert decoder.done == (end is not None)
    assert isinstance(decoder.failure, ErrorEvent) == (end == "error")


# Replies: ids, usage


def test_repeated_and_missing_tool_call_ids_are_made_unique() -> None:
    calls = unique_ids(
        [ToolCall("a", "f", "{}"), ToolCall("a", "g", "{}"), ToolCall("", "h", "{}")]
    )
    assert calls[0] == ToolCall("a", "f", "{}")
    assert [c.name for c in calls] == ["f", "g", "h"]
    assert len({c.id for c in calls}) == 3
    assert all(c.id.startswith("call_") for c in calls[1:])


def test_a_repaired_id_keeps_the_rest_of_its_entry() -> None:
    entry = {
        "id": "same",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
        "extra_content": {"google": {"thought_signature": "sig"}},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [entry, dict(entry)]}
    reply = reply_from_body({"choices": [{"message": message, "finish_reason": "tool_calls"}]})
    first, second = reply.message["tool_calls"]
    assert first == entry
    assert second == {**entry, "id": reply.tool_calls[1].id}
    assert reply.tool_calls[1].id != "same"
    assert message["tool_calls"][1]["id"] == "same"  # the upstream's body is left as it came


@pytest.mark.parametrize(
    ("usage", "tokens", "cost"),
    [
        ({"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.5}, (3, 2, 5), 0.5),
        ({"prompt_tokens": -3, "completion_tokens": 2, "cost": -0.5}, (0, 2, 2), None),
        ({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": -9}, (3, 2, 5), None),
        ({"cost": math.inf}, (0, 0, 0), None),
        ({"cost": math.nan}, (0, 0, 0), None),
        ({"cost": "0.5"}, (0, 0, 0), None),
        ({"cost": True}, (0, 0, 0), None),
        ({"cost": 10**400}, (0, 0, 0), None),
        ({"cost": 1e308}, (0, 0, 0), None),  # finite, and no reply's cost: counters would overflow
        ({"cost": 9_999.0}, (0, 0, 0), 9_999.0),
        # Whole numbers written as floats are counts (they counted as 0: budgets never held).
        ({"prompt_tokens": 50_000.0, "completion_tokens": 7.0}, (50_000, 7, 50_007), None),
        ({"prompt_tokens": 1e308, "completion_tokens": 1}, (10**9, 1, 10**9 + 1), None),
        ({"prompt_tokens": 2.5, "completion_tokens": "9"}, (0, 0, 0), None),
        ({"prompt_tokens": math.inf, "completion_tokens": math.nan}, (0, 0, 0), None),
    ],
)
def test_usage_no_upstream_can_mean_is_not_believed(
    usage: dict[str, Any], tokens: tuple[int, int, int], cost: float | None
) -> None:
    read, reported = reported_usage(usage, "usage")
    assert (read.prompt_tokens, read.completion_tokens, read.total_tokens) == tokens
    assert reported == cost


def test_usage_details_below_zero_are_dropped() -> None:
    raw = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": -50, "audio_tokens": 2}}
    read, _ = reported_usage(raw, "usage")
    assert read.details == {"prompt_tokens_details": {"audio_tokens": 2}}


def test_usage_details_are_bounded_in_entries_and_depth(caplog: pytest.LogCaptureFixture) -> None:
    """240,000 entries were kept, summed over every step and sent to the client (190 ms of the
    event loop a run): a usage's first MAX_USAGE_ENTRIES are, to MAX_USAGE_DEPTH levels."""
    many = {f"k{i}": 1 for i in range(240_000)}
    raw = {
        "prompt_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4, **many},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    read, _ = reported_usage(raw, "usage")
    kept = read.details["prompt_tokens_details"]
    assert kept["cached_tokens"] == 4
    assert len(kept) == MAX_USAGE_ENTRIES
    assert read.details["completion_tokens_details"] == {}  # no room left
    assert "the rest of usage.prompt_tokens_details dropped" in caplog.text
    deep = {"prompt_tokens_details": {"a": {"b": {"c": 1}, "d": 2}, "cached_tokens": 1}}
    read, _ = reported_usage(deep, "usage")
    assert read.details == {"prompt_tokens_details": {"a": {"b": {}, "d": 2}, "cached_tokens": 1}}


# Retry-After


NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        (None, None),
        ("", None),
        ("3", 3.0),
        (" 1.5 ", 1.5),
        ("-5", 0.0),
        ("nan", None),
        ("inf", math.inf),
        ("soon", None),
        ("Thu, 01 Jan 2026 12:00:30 GMT", 30.0),
        ("Thu, 01 Jan 2026 11:00:00 GMT", 0.0),
    ],
)
def test_retry_after(header: str | None, seconds: float | None) -> None:
    assert retry_after_s(header, NOW) == seconds


@pytest.mark.parametrize("header", ["nan", "inf", "1e12", "-1", "garbage", None])
def test_a_retry_waits_at_most_the_max(header: str | None) -> None:
    delay = Retry(RuntimeError(), header).delay_s(attempt=3, base_s=0.5, max_s=2.0)
    assert 0.0 <= delay <= 2.0


# Upstream error bodies


def test_scrub_removes_the_key_and_what_looks_like_one() -> None:
    text = (
        "key my-own-secret-key-123 rejected; Authorization: Bearer abc.def-ghi; "
        "also sk-proj-AbCdEf0123456789 and api_key=hunter2&x=1"
    )
    assert scrub(text, ["my-own-secret-key-123"]) == (
        "key [redacted] rejected; Authorization: [redacted]; also [redacted] and [redacted]&x=1"
    )


def test_scrub_removes_the_tail_or_any_piece_of_the_key_echoed_alone() -> None:
    """An upstream that echoes the key's last characters ("tail efghijklmnop") showed them."""
    key = "sk-upstream-abcdefghijklmnop"
    assert scrub("key ending efghijklmnop is revoked", [key]) == "key ending [redacted] is revoked"
    assert scrub("stream-abcdefg was seen", [key]) == "[redacted] was seen"
    assert scrub("abcdefg is seven", [key]) == "abcdefg is seven"  # shorter than a piece
    # a key that holds the word itself: no endless redaction
    assert scrub("x [redacted]-tail y", ["[redacted]-tail-0123"]) == "x [redacted] y"
    # one pass over the text: a key of its client's choosing, echoed, was work a square of its
    # length (a 200-character key in 64 KB of its own letters: minutes)
    assert redacted("a" * 65536, ["a" * 200]) == "[redacted]"
    assert scrub("x" * 5000 + "KEY-0123456789abcdef", ["KEY-0123456789abcdef"]) == "x" * 999 + "…"


def test_scrub_removes_the_start_of_the_key_echoed_alone() -> None:
    key = "Zq9plainSecretToken7781abc"
    assert scrub("bad key Zq9plainSecr... (Zq9plainSecretToken7781abc)", [key]) == (
        "bad key [redacted]... ([redacted])"
    )
    assert scrub("Zq9plain is fine, Zq9plai is not the key", [key]) == (
        "[redacted] is fine, Zq9plai is not the key"
    )


def test_scrub_caps_the_length() -> None:
    assert len(scrub("x" * 5000)) == MESSAGE_LIMIT


@pytest.mark.parametrize(
    ("status", "body", "content_type", "expected"),
    [
        (
            429,
            b'{"error": {"message": "slow down", "type": "rate_limit", "code": 429, "param": 1}}',
            "application/json",
            (429, "slow down", "rate_limit", None, "429"),
        ),
        (
            400,
            b'{"error": "no such model"}',
            None,
            (400, "no such model", "invalid_request_error", None, None),  # a client's error
        ),
        (
            404,
            b"<html>Not Found</html>",
            "text/html",
            (
                404,
                "upstream u answered HTTP 404; its text/html body is not shown",
                "invalid_request_error",
                None,
                "upstream_error",
            ),
        ),
        (
            502,
            b"<html>Bad Gateway</html>",
            "text/html; charset=utf-8",
            (
                502,
                "upstream u answered HTTP 502; its text/html body is not shown",
                "server_error",
                None,
                "upstream_error",
            ),
        ),
        (
            500,
            b'{"detail": "boom"}',
            "application/json",
            (
                500,
                "upstream u answered HTTP 500; its application/json body is not shown",
                "server_error",
                None,
                "upstream_error",
            ),
        ),
        (
            503,
            b"",
            "text/plain",
            (
                503,
                "upstream u answered HTTP 503 with no body",
                "server_error",
                None,
                "upstream_error",
            ),
        ),
    ],
)
def test_an_error_answer_is_relayed_openai_shaped(
    status: int,
    body: bytes,
    content_type: str | None,
    expected: tuple[int, str, str, str | None, str | None],
) -> None:
    error = status_failure("u", status, body, content_type)
    assert isinstance(error, UpstreamStatusError)
    assert (error.status, error.message, error.type, error.param, error.code) == expected


def test_an_error_answer_with_a_status_no_client_can_be_given_is_a_bad_reply() -> None:
    error = status_failure("u", 999, b'{"error": {"message": "odd"}}', "application/json")
    assert isinstance(error, UpstreamBadReply)
    assert (error.status, error.code) == (502, "upstream_error")
    assert error.message == "upstream u answered HTTP 999, which is not a reply"


def test_an_error_answer_keeps_the_headers_a_retry_reads_within_bounds() -> None:
    headers = [
        (b"Retry-After", b"7"),
        (b"retry-after", b"9"),  # the first of a name holds
        (b"x-ratelimit-limit-tokens", b"30000"),
        (b"x-ratelimit-reset-tokens", b"x" * (RETRY_HEADER_LIMIT + 1)),
        (b"x-ratelimit-bad", b"a\x01b"),
        (b"x-ratelimit-latin", "é".encode("latin-1")),
        (b"set-cookie", b"a=b"),
        *((b"x-ratelimit-n%d" % i, b"1") for i in range(2 * MAX_RETRY_HEADERS)),
    ]
    body = b'{"error": {"message": "slow down"}}'
    error = status_failure("u", 429, body, "application/json", (), headers)
    assert isinstance(error, UpstreamStatusError)
    kept = error.retry_headers
    assert list(kept)[:2] == ["retry-after", "x-ratelimit-limit-tokens"]
    assert (kept["retry-after"], len(kept)) == ("7", MAX_RETRY_HEADERS)
    assert all(name.startswith("x-ratelimit-n") for name in list(kept)[2:])


@pytest.mark.parametrize("reports_cost", [True, False])
def test_a_reported_cost_is_read_only_from_an_upstream_that_reports_costs(
    reports_cost: bool,
) -> None:
    body = {
        "choices": [{"message": {"content": "Hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.25},
    }
    reply = reply_from_body(body, ReplyLimits(reports_cost=reports_cost))
    assert reply.reported_cost_usd == (0.25 if reports_cost else None)
    acc = ChunkAccumulator(ReplyLimits(reports_cost=reports_cost))
    acc.add({"choices": [{"delta": {"content": "Hi"}, "finish_reason": "stop"}]})
    acc.add({"choices": [], "usage": body["usage"]})
    assert acc.reply().reported_cost_usd == (0.25 if reports_cost else None)


def test_a_token_count_that_is_no_count_is_told(caplog: pytest.LogCaptureFixture) -> None:
    """It counted as 0 without a word (the budgets count such a step by estimate)."""
    with caplog.at_level(logging.WARNING, logger="proxy.upstream.reply"):
        reported_usage({"prompt_tokens": "12", "completion_tokens": 2}, "usage")
    assert "upstream reported usage.prompt_tokens = '12'; not a count of tokens" in caplog.text
