"""Everything a request needs, wired once in the app's lifespan."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from proxy.api.auth import KeyRing
from proxy.api.resolve import Resolver
from proxy.conditions import ConfiguredChecks
from proxy.config import Config
from proxy.engine.ports import RunObserver
from proxy.engine.run import Deps
from proxy.pricing import PriceTable
from proxy.state.store import StateStore
from proxy.tools.registry import ToolRegistry, build_registry
from proxy.upstream.client import AttemptHook, HeadersHook, Upstream


@dataclass(slots=True)
class Gateway:
    config: Config
    client: httpx.AsyncClient
    upstreams: dict[str, Upstream]
    registry: ToolRegistry
    resolver: Resolver
    prices: PriceTable
    checks: ConfiguredChecks
    keys: KeyRing
    store: StateStore
    observers: Sequence[RunObserver] = field(default_factory=list)

    def deps(self, upstream: str, authorization: str | None) -> Deps:
        """What a run on `upstream` needs; the caller's key goes upstream only when allowed."""
        model = self.upstreams[upstream]
        if self.config.upstreams[upstream].forward_client_key:
            model = model.with_key((authorization or "")[7:].strip() or None)
        return Deps(
            model, self.registry, self.prices, self.observers, self.checks, threads=self.store
        )


def build_gateway(
    config: Config,
    client: httpx.AsyncClient,
    transport: httpx.AsyncBaseTransport,
    store: StateStore,
    observers: Sequence[RunObserver] = (),
    on_attempt: AttemptHook | None = None,
    inject_headers: HeadersHook | None = None,
    prices: PriceTable | None = None,
) -> Gateway:
    """Raises ValueError for anything in the config that cannot be wired. `prices` shares a
    price table (and its cache) the caller already has."""
    upstreams = {
        name: Upstream(
            name=name,
            base_url=cfg.base_url,
            transport=transport,
            api_key=os.environ.get(cfg.api_key_env) if cfg.api_key_env else None,
            timeout_s=cfg.timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            max_retries=cfg.max_retries,
            on_attempt=on_attempt,
            inject_headers=inject_headers,
        )
        for name, cfg in config.upstreams.items()
    }
    registry = build_registry(config, client)
    prices = prices or PriceTable(config.pricing)
    specs = {name: tool.spec for name, tool in registry.tools.items()}
    return Gateway(
        config=config,
        client=client,
        upstreams=upstreams,
        registry=registry,
        resolver=Resolver(config, specs, prices),
        prices=prices,
        checks=ConfiguredChecks(config.conditions, client),
        keys=KeyRing(config.auth),
        store=store,
        observers=list(observers),
    )
