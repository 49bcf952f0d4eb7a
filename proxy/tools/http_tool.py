"""`kind: http`: POST the call as JSON to a configured URL; a 2xx body is the result."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from proxy.engine.values import ToolContext
from proxy.tools.base import Invoke, ToolFailed


def http_invoke(
    name: str, url: str, headers: dict[str, str], client: httpx.AsyncClient, timeout_s: float
) -> Invoke:
    async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        payload = {
            "name": name,
            "arguments": arguments,
            "call_id": ctx.call_id,
            "run_id": ctx.run_id,
            "thread_id": ctx.thread_id,
        }
        try:
            response = await client.post(
                url,
                content=orjson.dumps(payload),
                headers={"content-type": "application/json", **headers},
                timeout=timeout_s,
            )
        except httpx.TimeoutException:
            raise TimeoutError from None
        except httpx.HTTPError as exc:
            raise ToolFailed(f"tool server unreachable: {type(exc).__name__}") from None
        body = response.content
        if not 200 <= response.status_code < 300:
            snippet = body[:500].decode("utf-8", "replace")
            raise ToolFailed(f"tool server answered HTTP {response.status_code}: {snippet}")
        if "json" in response.headers.get("content-type", ""):
            try:
                return orjson.dumps(orjson.loads(body)).decode()
            except orjson.JSONDecodeError:
                pass
        return body.decode("utf-8", "replace")

    return invoke
