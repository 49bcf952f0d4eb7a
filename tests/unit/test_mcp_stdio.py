"""The framing of a stdio MCP server's output: one message a line, each bounded in size."""

from __future__ import annotations

import logging

import anyio
import mcp_types
import pytest
from anyio.abc import ByteReceiveStream

from proxy.tools.mcp_stdio import LineNotices, MessageTooLarge, lines, message

TEXT = b'{"jsonrpc":"2.0","id":1,"result":{}}\n\n{"a":"b\\\\n"}\r\nlast\n'


class Chunks(ByteReceiveStream):
    """A pipe that gives these chunks, then its end."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.given = 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self.given == len(self.chunks):
            raise anyio.EndOfStream
        self.given += 1
        return self.chunks[self.given - 1]

    async def aclose(self) -> None:
        pass


async def framed(chunks: list[bytes], limit: int = 1024) -> list[bytes]:
    return [line async for line in lines(Chunks(chunks), limit)]


async def test_lines_are_the_same_however_the_pipe_cuts_them() -> None:
    whole = await framed([TEXT])
    assert whole == [b'{"jsonrpc":"2.0","id":1,"result":{}}', b'{"a":"b\\\\n"}\r', b"last"]
    for size in (1, 2, 3, 7, 16):
        cut = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
        assert await framed(cut) == whole
    assert await framed([b"no line feed at the end"]) == []  # a message is a whole line


async def test_a_line_longer_than_the_bound_fails_before_its_end_comes() -> None:
    assert await framed([b"a" * 10 + b"\n"], limit=10) == [b"a" * 10]
    with pytest.raises(MessageTooLarge, match="larger than 10 bytes"):
        await framed([b"a" * 11 + b"\n"], limit=10)
    pipe = Chunks([b"ok\n" + b"a" * 6, b"a" * 6, b"never read\n"])
    framing = lines(pipe, 10)
    assert await anext(framing) == b"ok"  # what came before it is given
    with pytest.raises(MessageTooLarge):
        await anext(framing)
    assert pipe.given == 2  # and no more is read


def test_a_line_that_is_no_message_is_the_error_the_session_is_given() -> None:
    parsed = message(b'{"jsonrpc":"2.0","id":7,"result":{}}')
    assert not isinstance(parsed, Exception)
    assert parsed.message.id == 7
    assert isinstance(message(b"not json"), ValueError)


DEEP = b'{"a":' * 3000 + b"1" + b"}" * 3000  # past what any parser here recurses into


@pytest.mark.parametrize(
    ("line", "answered"),
    [
        (b'{"jsonrpc":"2.0","id":7,"result":{"structuredContent":' + DEEP + b"}}", 7),
        (b'{"jsonrpc":"2.0","id":8,"result":{"content":"half \\ud800 a pair"}}', 8),
        (
            b'{"jsonrpc":"2.0","result":{"x":"said \\"id\\": 9","id":5,"y":'
            + DEEP
            + b'},"id":"c"}',
            "c",
        ),
        (b'{"id": "a\\"b", "error": [1, {"id": 2}]}', 'a"b'),
        (b'{"i\\u0064": 5, "\\u0072esult": ' + DEEP + b"}", 5),  # names written with escapes
        (b'{"id": "' + b"x" * 300 + b'", "result": ' + DEEP + b"}", "x" * 300),
    ],
)
def test_an_answer_the_sdk_cannot_read_is_its_requests_error(line: bytes, answered: object) -> None:
    """Its call fails at once: dropped, the call waited for its timeout."""
    answer = message(line)
    assert not isinstance(answer, Exception)
    assert isinstance(answer.message, mcp_types.JSONRPCError)
    assert answer.message.id == answered
    assert answer.message.error.message == "the server's answer could not be read"


@pytest.mark.parametrize(
    "line",
    [
        b"a line of a server's log",
        b'{"jsonrpc":"2.0","method":"x","params":{"id":5,"result":1},"extra":' + DEEP + b"}",
        b'{"result": {"id": 4}, "x": ' + DEEP + b"}",
        b'{"id": true, "result": ' + DEEP + b"}",
        b'{"id": 1.5, "result": ' + DEEP + b"}",
    ],
)
def test_a_line_that_answers_no_request_is_only_an_error(line: bytes) -> None:
    assert isinstance(message(line), ValueError)


def test_lines_that_are_no_message_are_told_in_one_line_at_most_once_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that logs to its stdout: 1,000 such lines are one warning of one line naming
    the server, and the count of the rest when its session ends (200,000 lines made 600,000
    lines of log, a warning of three lines each)."""
    notices = LineNotices("noisy")
    with caplog.at_level(logging.WARNING, logger="proxy.tools.mcp_stdio"):
        for i in range(1000):
            error = message(b"INFO: starting worker %d" % i, notices)
            assert isinstance(error, ValueError)
            assert "\n" in str(error)  # pydantic's, of several lines
        notices.close()
    told = [r.getMessage() for r in caplog.records]
    assert all("\n" not in line and "MCP server noisy " in line for line in told)
    assert "b'INFO: starting worker 0'" in told[0]
    alone = [line for line in told if "sent a line" in line]
    counted = [int(line.split("(")[-1].split()[0]) for line in told if "more since" in line]
    assert len(alone) + sum(counted) == 1000  # each line told, or counted
