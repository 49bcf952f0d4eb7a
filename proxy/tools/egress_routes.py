"""The tool servers' pool behind the environment's web proxy (`proxy.egress`): a request of an
http tool or a webhook goes directly, or through the proxy its URL's scheme and host are named
for, each way on a pool of its own."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from proxy.egress import Egress, WebProxy

# A pool of connections: direct (None), or through a proxy.
PoolMaker = Callable[[httpx.Proxy | None], httpx.AsyncBaseTransport]


class EgressRoutes(httpx.AsyncBaseTransport):
    def __init__(self, make: PoolMaker, egress: Egress | None = None) -> None:
        self._make = make
        self._egress = egress or Egress()
        self._direct = make(None)
        self._proxied: dict[WebProxy, httpx.AsyncBaseTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        proxy = self._egress.proxy_for(request.url.scheme, request.url.host)
        return await self._pool(proxy).handle_async_request(request)

    def _pool(self, proxy: WebProxy | None) -> httpx.AsyncBaseTransport:
        if proxy is None:
            return self._direct
        pool = self._proxied.get(proxy)
        if pool is None:  # at most one a scheme
            pool = self._proxied[proxy] = self._make(httpx.Proxy(proxy.url, auth=proxy.auth))
        return pool

    async def aclose(self) -> None:
        for pool in (self._direct, *self._proxied.values()):
            await pool.aclose()
