"""What an MCP server asks of the proxy (sampling, elicitation, roots, pings), bounded.

The `mcp` SDK answers each request a server sends in a task of its own, which lives until its
answer is written; a server that asks faster than it reads the answers made tasks without end
(60,000 requests on stdio: 928 MB), and its session read its messages slower than it sent them
(a tool's answer after 20,000 requests came past its timeout). At most `MAX_ASKED` of a
server's requests are unanswered at once: the ones past them are dropped unread, and told in
the log once a second with their count."""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCError, JSONRPCNotification, JSONRPCRequest, JSONRPCResponse

from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)

MAX_ASKED = 16
CANCELLED = "notifications/cancelled"


class AskedRequests:
    """The requests of one session's server whose tasks may still live: admitted and neither
    answered nor given up, by id. A request whose id is open already is dropped (JSON-RPC: ids
    of requests in flight are unique; the SDK's cancel finds only the newest of a reused id,
    and the others' answers would wait uncounted). A cancelled one is given up, its task ending
    unanswered, unless its answer is being written: the SDK then writes it all the same, and it
    is settled when written."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.open: set[int | str] = set()
        self.writing: set[int | str] = set()  # open ones whose answer is being written
        self.warnings = ThrottledWarnings(log)

    def admit(self, item: SessionMessage | Exception) -> bool:
        """Whether the session reads `item`: not a request past the bound, nor one whose id is
        open."""
        if not isinstance(item, SessionMessage):
            return True
        message = item.message
        if isinstance(message, JSONRPCRequest):
            key = coerce_request_id(message.id)
            if key in self.open or len(self.open) >= MAX_ASKED:
                self.warnings.warning(
                    "MCP server %s asked more than %d requests at once, or one id twice; %r is "
                    "dropped",
                    self.server,
                    MAX_ASKED,
                    message.method[:80],
                )
                return False
            self.open.add(key)
        elif isinstance(message, JSONRPCNotification) and message.method == CANCELLED:
            asked = (message.params or {}).get("requestId")
            if isinstance(asked, int | str) and not isinstance(asked, bool):
                key = coerce_request_id(asked)
                if key not in self.writing:  # its handler ends unanswered
                    self.open.discard(key)
        return True

    def writes(self, item: SessionMessage) -> int | str | None:
        """The id of the request `item` answers, marked as being written; None for any other
        message."""
        message = item.message
        if not isinstance(message, JSONRPCResponse | JSONRPCError) or message.id is None:
            return None
        key = coerce_request_id(message.id)
        self.writing.add(key)
        return key

    def answered(self, key: int | str) -> None:
        """The answer to `key` is written, or never will be: its task ends."""
        self.writing.discard(key)
        self.open.discard(key)

    def close(self) -> None:
        self.warnings.close("MCP server %s asked more than it read", self.server)


class AnswerWrites:
    """A session's write stream that tells `asked` of each answer once it is written."""

    def __init__(self, inner: Any, asked: AskedRequests) -> None:
        self.inner = inner
        self.asked = asked

    async def send(self, item: SessionMessage, /) -> None:
        key = self.asked.writes(item)
        try:
            await self.inner.send(item)
        finally:  # written, or never to be: its task ends either way
            if key is not None:
                self.asked.answered(key)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> AnswerWrites:
        await self.inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        result: bool | None = await self.inner.__aexit__(exc_type, exc_val, exc_tb)
        return result
