"""A stdio MCP server's process at the end of its session: told by its stdin closing, it exits
on its own, even with output the session never read."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio

from proxy.tools.mcp_stdio import close_pipes, stdio_client

NOTICE = '{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":"x"}}'


def child(before_exit: str, marker: Path) -> list[str]:
    """A server that writes `before_exit`'s output, then reads its stdin to the end, writes
    `marker` and exits: the marker is there only if it was let exit on its own."""
    code = (
        "import sys\n"
        f"{before_exit}\n"
        "sys.stdout.buffer.flush()\n"
        "sys.stdin.buffer.read()\n"
        f"open({str(marker)!r}, 'w').write('done')\n"
    )
    return [sys.executable, "-c", code]


async def test_a_server_blocked_writing_what_was_never_read_exits_when_the_session_ends(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "exited"
    many = f"sys.stdout.write({NOTICE + chr(10)!r} * 20000)"  # 1.7 MB: more than a pipe holds
    ends: list[str] = []
    async with stdio_client(child(many, marker), {}, 1 << 20, 10**6, ends.append) as (read, _):
        first = await read.receive()
        assert not isinstance(first, Exception)
        assert first.message.method == "notifications/message"
        started = time.monotonic()
    assert time.monotonic() - started < 1.0  # not the grace period, then a signal
    assert marker.read_text() == "done"
    assert ends == []


async def test_a_server_cut_off_mid_message_exits_when_the_session_ends(tmp_path: Path) -> None:
    marker = tmp_path / "exited"
    huge = "sys.stdout.write('[' + '0,' * 1_000_000 + '0]\\n')"  # one 2 MB line
    ends: list[str] = []
    async with stdio_client(child(huge, marker), {}, 64 << 10, 10**6, ends.append) as (read, _):
        assert [item async for item in read] == []  # the stream ends at the message too large
        started = time.monotonic()
    assert time.monotonic() - started < 1.0
    assert marker.read_text() == "done"
    assert ends == ["the server sent a message larger than 65536 bytes (max_message_bytes)"]


def pipes_open_here() -> set[str]:
    fds = Path("/proc/self/fd")
    return {target for fd in fds.iterdir() if (target := _link(fd)).startswith("pipe:")}


def _link(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:  # the listing's own descriptor, gone
        return ""


async def test_a_server_left_running_keeps_none_of_our_ends_of_its_pipes() -> None:
    """What is done for a child that outlived SIGKILL, on a real child still running."""
    process = await anyio.open_process([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        theirs = {_link(Path(f"/proc/{process.pid}/fd/{fd}")) for fd in (0, 1, 2)}
        assert theirs <= pipes_open_here()
        close_pipes(process)
        await anyio.sleep(0.05)  # a pipe transport's close completes on the next loop turn
        assert process.returncode is None
        assert not theirs & pipes_open_here()
    finally:
        process.kill()
        await process.wait()
