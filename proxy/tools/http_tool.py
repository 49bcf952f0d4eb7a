"""`kind: http`: POST the call as JSON to a configured URL; a 2xx body is the result."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from proxy import exact_json
from proxy.engine.values import ToolContext
from proxy.http_body import declared_length, read_up_to
from proxy.json_values import holds_over
from proxy.redaction import origin
from proxy.throttled_log import ThrottledWarnings, described
from proxy.tools.base import Invoke, ToolFailed, output_too_large

log = logging.getLogger(__name__)

ERROR_SNIPPET_BYTES = 500  # of a non-2xx body, in the error the model reads
# A JSON answer of more values goes to the model as it came: rewriting it compact would hold
# the event loop (a mebibyte of small objects: ~0.1 s, parsed and written on it).
MAX_REWRITTEN_VALUES = 50_000


def http_invoke(
    name: str,
    url: str,
    headers: dict[str, str],
    client: httpx.AsyncClient,
    timeout_s: float,
    max_output_bytes: int,
) -> Invoke:
    warnings, where = ThrottledWarnings(log), origin(url)

    def unreachable(exc: BaseException) -> ToolFailed:
        """The model reads the error's name; the operator's log what it says too."""
        warnings.warning("http tool %s: %s unreachable: %s", name, where, described(exc))
        return ToolFailed(f"tool server unreachable: {type(exc).__name__}")

    async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        payload = {
            "name": name,
            "arguments": arguments,
            "call_id": ctx.call_id,
            "run_id": ctx.run_id,
            "thread_id": ctx.thread_id,
        }
        request = client.build_request(
            "POST",
            url,
            content=exact_json.dumps(payload),
            headers={"content-type": "application/json", **headers},
            timeout=timeout_s,
        )
        try:
            response = await client.send(request, stream=True)
            try:
                ok = 200 <= response.status_code < 300
                if ok and (declared_length(response) or 0) > max_output_bytes:
                    raise output_too_large(max_output_bytes)
                cap = max_output_bytes if ok else ERROR_SNIPPET_BYTES
                body, more = await read_up_to(response, cap)
            finally:
                await response.aclose()
        except httpx.TimeoutException as exc:
            if _timed_out(exc):
                raise TimeoutError from None
            raise unreachable(exc.__cause__ or exc) from None
        except httpx.HTTPError as exc:
            raise unreachable(exc) from None
        if not ok:
            snippet = body.decode("utf-8", "replace")
            raise ToolFailed(f"tool server answered HTTP {response.status_code}: {snippet}")
        if more:
            raise output_too_large(max_output_bytes)
        if "json" in response.headers.get("content-type", "") and not await holds_over(
            body, MAX_REWRITTEN_VALUES
        ):
            try:  # compact, its numbers exact
                return exact_json.dumps(exact_json.loads(body)).decode()
            except (ValueError, RecursionError):  # no JSON, or too deep to rewrite: as it came
                pass
        return body.decode("utf-8", "replace")

    return invoke


def _timed_out(exc: httpx.TimeoutException) -> bool:
    """Whether the transport's timeout is a timeout: the httpx API over aiohttp reports a
    connection refused or reset as a `ConnectTimeout` too, its cause telling them apart."""
    cause = exc.__cause__
    return cause is None or isinstance(cause, TimeoutError)
