"""What an MCP server asks of the proxy (sampling, elicitation, roots, pings), bounded.

The `mcp` SDK answers each request a server sends in a task of its own, which lives until its
answer is written; a server that asks faster than it reads the answers made tasks without end
(60,000 requests on stdio: 928 MB), and its session read its messages slower than it sent them
(a tool's answer after 20,000 requests came past its timeout). At most `MAX_ASKED` of a
server's requests are unanswered at once: the ones past them are dropped unread, and told in
the log once a second with their count."""

from __future__ import annotations

import logging
from collections import Counter
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
    """The requests of one session's server that are not answered yet, by id (one id may be
    asked more than once)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.open: Counter[int | str] = Counter()
        self.warnings = ThrottledWarnings(log)

    def admit(self, item: SessionMessage | Exception) -> bool:
        """Whether the session reads `item`: not a request past the bound."""
        if not isinstance(item, SessionMessage):
            return True
        message = item.message
        if isinstance(message, JSONRPCRequest):
            if self.open.total() >= MAX_ASKED:
                self.warnings.warning(
                    "MCP server %s asked more than %d requests at once; %r is dropped",
                    self.server,
                    MAX_ASKED,
                    message.method[:80],
                )
                return False
            self.open[coerce_request_id(message.id)] += 1
        elif isinstance(message, JSONRPCNotification) and message.method == CANCELLED:
            asked = (message.params or {}).get("requestId")  # its handler ends unanswered
            if isinstance(asked, int | str) and not isinstance(asked, bool):
                self._settle(asked)
        return True

    def answered(self, item: SessionMessage) -> None:
        message = item.message
        if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
            self._settle(message.id)

    def _settle(self, request: int | str) -> None:
        key = coerce_request_id(request)
        if self.open[key] > 0:
            self.open[key] -= 1
        if not self.open[key]:
            del self.open[key]

    def close(self) -> None:
        self.warnings.close("MCP server %s asked more than it read", self.server)


class AnswerWrites:
    """A session's write stream that tells `asked` of each answer once it is written."""

    def __init__(self, inner: Any, asked: AskedRequests) -> None:
        self.inner = inner
        self.asked = asked

    async def send(self, item: SessionMessage, /) -> None:
        try:
            await self.inner.send(item)
        finally:  # written, or never to be: its task ends either way
            self.asked.answered(item)

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
