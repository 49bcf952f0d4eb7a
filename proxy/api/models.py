"""`GET /v1/models`: the configured agents and aliases, then the default upstream's models;
`GET /v1/models/{id}`: one of them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, send_json
from proxy.api.services import Services
from proxy.errors import NotFound, UpstreamFailure

CACHE_S = 60.0


class ModelList:
    """A raw ASGI app. The upstream's list is cached; an upstream that fails lists none. A key
    sees only the agents and models it may use."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services
        self._upstream: list[dict[str, Any]] = []
        self._until = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        caller = sv.keys.caller(bearer_token(scope))
        now = int(time.time())
        data = [
            {"id": name, "object": "model", "created": now, "owned_by": "loopwarden"}
            for name in [*sv.config.agents, *sv.config.models]
        ]
        seen = {entry["id"] for entry in data}
        data.extend(m for m in await self._upstream_models(sv) if m.get("id") not in seen)
        if caller is not None:
            data = [m for m in data if caller.allows(str(m.get("id")))]
        asked = scope.get("path_params", {}).get("model_id")
        if asked is None:
            await send_json(send, 200, {"object": "list", "data": data})
            return
        found = next((m for m in data if m.get("id") == asked), None)
        if found is None:  # as the list shows it: another key's models are not there either
            raise NotFound(
                f"no model {asked[:200]!r} (GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            )
        await send_json(send, 200, found)

    async def _upstream_models(self, sv: Services) -> list[dict[str, Any]]:
        if self._until <= time.monotonic():
            try:
                self._upstream = await sv.upstreams[sv.config.default_upstream].models()
            except UpstreamFailure:
                self._upstream = []
            self._until = time.monotonic() + CACHE_S
        return self._upstream
