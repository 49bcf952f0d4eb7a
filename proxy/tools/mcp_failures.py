"""What an MCP server's failures mean to its session, and how the proxy tells them: a
server's own text kept short, without secrets, on one line."""

from __future__ import annotations

import re

import anyio
import httpx2
import mcp_types
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from proxy.engine.options import UNSAFE_IN_NAMES
from proxy.redaction import redacted

MAX_LOC_CHARS = 200  # of where an invalid message went wrong, in a tool error
# Errors after which the session is taken for dropped: the SDK's own for a closed connection,
# and what a streamable HTTP server's 404 for a session it no longer knows (a restarted server)
# becomes: -32600 "Session terminated" (the SDK's), or the server's own error, "Session not
# found" (-32600 from Python servers, -32001 from TypeScript ones). Another -32600 is a server's
# answer to one call (a quota, an OAuth session of its own that expired), and any over stdio,
# which has no sessions: that call fails, the session stays.
SESSION_GONE_CODES = frozenset({mcp_types.INVALID_REQUEST, -32001})
SESSION_GONE = re.compile(r"session (?:id )?(?:not found|terminated)|(?:unknown|invalid) session")
# Over streamable HTTP, the SDK's closed connection is one call's answer cut short (a balancer
# ending a long call): that call fails; an ended transport is seen where it ends (`on_end`).


# What the SDK itself says of a connection that closed: the code alone (-32000) is also what
# servers send for any failure of theirs ("rate limited"), which ended the session.
SDK_CLOSED = "Connection closed"
# The most of a server's own text (an error's message) kept, logged and told: 12 MB of one
# held the event loop 1.6 s a call (its secrets looked for), in `/readyz` and the log whole.
MAX_SERVER_TEXT = 1024
# Control characters (line breaks too) and direction marks: none in what is kept of a server's.
_UNSAFE = re.compile(f"[{UNSAFE_IN_NAMES}]")


def said(text: str) -> str:
    """A server's own text as the proxy keeps and tells it: what looks like a secret left out
    (looked for in a few times the text kept, before the cut, so that no cut hides one from
    the search), cut, and on one line of safe characters."""
    text = redacted(text[: 4 * MAX_SERVER_TEXT])
    if len(text) > MAX_SERVER_TEXT:
        text = text[:MAX_SERVER_TEXT] + "…"
    return _UNSAFE.sub("\ufffd", text)


def session_gone(error: mcp_types.ErrorData, over_http: bool) -> bool:
    """Whether an error a call met means its session is over."""
    if error.code == mcp_types.CONNECTION_CLOSED and error.message == SDK_CLOSED:
        return not over_http
    if not over_http or error.code not in SESSION_GONE_CODES:
        return False
    return SESSION_GONE.search(error.message.lower()) is not None


DROPPED_ERRORS = (
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    OSError,
    httpx2.TransportError,
)


def reason(exc: BaseException) -> str:
    """Why a session failed (to connect, or later), as a line the proxy keeps and tells."""
    if isinstance(exc, MCPError):
        return said(exc.error.message)
    if isinstance(exc, ValidationError):
        return invalid(exc)
    text = said(str(exc))
    name = type(exc).__name__
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return reason(exc.exceptions[0])
    return f"{name}: {text}" if text else name


def invalid(exc: ValidationError) -> str:
    """What a message the SDK could not read as MCP got wrong, in a line: pydantic's own text
    holds every error (65,000 of them: 66 KB for the model), with links and the values sent."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"])[:MAX_LOC_CHARS]
    count = exc.error_count()
    more = f" (and {count - 1} more)" if count > 1 else ""
    return f"not a valid MCP {exc.title[:64]}: {where}: {first['msg'][:200]}{more}"
