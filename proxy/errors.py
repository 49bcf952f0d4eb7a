"""The exception hierarchy and the OpenAI-shaped error body.

Every error the proxy returns to a client is built from a `ProxyError`, so the body is always
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ProxyError(Exception):
    """An error with an HTTP status and an OpenAI-shaped body."""

    status = 500
    type = "server_error"
    code: str | None = None
    headers: ClassVar[dict[str, str]] = {}  # sent with the error's response

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": _cut(self.message, MAX_MESSAGE_CHARS),
                "type": self.type,
                "param": None if self.param is None else _cut(self.param, MAX_PARAM_CHARS),
                "code": self.code,
            }
        }


# What of an error's text a client gets back: a name or key it sent (4 MB of one) is not echoed
# whole.
MAX_MESSAGE_CHARS = 2048
MAX_PARAM_CHARS = 256


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class InvalidRequest(ProxyError):
    """Bad input: `param` is the JSON path of the offending field."""

    status = 400
    type = "invalid_request_error"


class BodyTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class UnsupportedEncoding(InvalidRequest):
    """A body compressed (`content-encoding`) where the proxy reads it as JSON."""

    status = 415
    code = "unsupported_content_encoding"


class HeadersTooLarge(InvalidRequest):
    """A request's line and headers are longer than the server reads (answered as the
    connection is closed: no request was made of them)."""

    status = 431
    code = "request_too_large"


class AuthenticationFailed(ProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(ProxyError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class InternalError(ProxyError):
    """A bug (stop reason `internal_error`); the message never carries its details."""

    code = "internal_error"

    def __init__(self) -> None:
        super().__init__("internal error")


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class LoopFailed(ProxyError):
    """A run that a loop rule failed (SPEC §4.4: 422 `loop_error`)."""

    status = 422
    type = "loop_error"


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class UpstreamFailure(ProxyError):
    """The upstream could not give a usable answer (stop reason `upstream_error`)."""


class UpstreamUnavailable(UpstreamFailure):
    """The upstream could not be reached."""

    status = 502
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamFailure):
    status = 504
    code = "upstream_timeout"


class UpstreamPoolExhausted(UpstreamFailure):
    """Every connection to the upstreams was in use for `server.upstream_pool_timeout_s`: the
    proxy is at its own limit, the upstream was not asked."""

    status = 503
    code = "upstream_pool_exhausted"


class CallDeadlineReached(UpstreamTimeout):
    """The deadline the caller gave one model call (the run's time budget) passed before the
    upstream finished; an upstream timeout to anyone who does not tell it apart."""


class UpstreamBadReply(UpstreamFailure):
    """The upstream answered, but not with anything the proxy can use as it came: a malformed
    or oversized body, a stream cut short, a status no HTTP client understands."""

    status = 502
    code = "upstream_error"


class UpstreamStatusError(UpstreamFailure):
    """The upstream answered with an error status (400-599): relayed with that status and the
    upstream's own error, OpenAI-shaped and scrubbed of secrets (`proxy.upstream.error_body`),
    and the headers a client's retry reads (`retry_headers`: `retry-after`, `x-ratelimit-…`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        param: str | None = None,
        code: str | None = "upstream_error",
        retry_headers: dict[str, str] | None = None,
    ) -> None:
        """`error_type` None: the client's error for a 4xx, the server's for a 5xx."""
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = error_type or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_headers = retry_headers or {}

    def __str__(self) -> str:
        return f"upstream returned HTTP {self.status}: {self.message}"


class ServerBusy(ProxyError):
    """The proxy is at one of its own bounds (runs or requests in flight); retry later."""

    status = 503
    code = "server_busy"


class ShuttingDown(ProxyError):
    """The server shut down (SIGTERM) and its run was still going at the end of the drain
    (`server.shutdown_timeout_s`); the run's stop reason is `cancelled`."""

    status = 503
    code = "shutting_down"

    def __init__(self, message: str = "the server shut down before the run ended") -> None:
        super().__init__(message)


class ShuttingDownActed(ShuttingDown):
    """`ShuttingDown`, for a request that may have acted already (its run's server tools ran,
    or it was relayed to its upstream): not to be sent again as it was."""

    headers: ClassVar[dict[str, str]] = {"x-should-retry": "false"}


class RequestTimeout(InvalidRequest):
    """The client did not send its whole request body within `server.body_timeout_s`."""

    status = 408
    code = "request_timeout"
    headers: ClassVar[dict[str, str]] = {"connection": "close"}  # the rest of the body is lost


class StateUnavailable(ProxyError):
    """The state backend failed or cannot be trusted (stop reason `state_unavailable`)."""

    status = 503
    code = "state_unavailable"


class SpecError(InvalidRequest):
    """A policy (stop conditions, terminating config, …) that does not validate.

    Raised by the parsers shared by the config file and the request's `loop` object; `param`
    is the path inside whichever document was parsed.
    """


class PolicyInvalid(SpecError):
    """Every problem found in a policy, each as (JSON path, message); the first is the error's
    own `param` and message."""

    def __init__(self, problems: list[tuple[str, str]], *, code: str | None = None) -> None:
        param, message = problems[0]
        super().__init__(message, param=param, code=code)
        self.problems = problems


class ClientDisconnected(Exception):
    """The client went away while its run was going (stop reason `cancelled`)."""


def without_frames(error: BaseException) -> None:
    """Lets go of the frames that `error`, and the errors it was raised from or during, hold
    in their tracebacks. A failed run's error outlives the run (its result, the answer's
    `param`), and its traceback's frames hold the run, its request and its reply, in a cycle
    that only a full collection frees: rare in a process that makes them rare (`gc.freeze`),
    while a failure's few objects may hold megabytes."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        found = pending.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        found.__traceback__ = None
        pending += (found.__cause__, found.__context__)
