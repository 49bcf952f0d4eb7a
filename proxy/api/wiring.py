"""The services wired from a config: its upstreams on one bounded pool, its tools, agents,
prices, conditions and keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx

from proxy.api.asgi import Shutdown
from proxy.api.auth import KeyRing
from proxy.api.planning import Planner
from proxy.api.services import Services
from proxy.callables import CallThreads
from proxy.conditions import ConfiguredChecks
from proxy.config import Config
from proxy.config.environment import setting
from proxy.engine.ports import RunObserver
from proxy.pricing import PriceTable
from proxy.state.store import StateStore
from proxy.tools.building import build_registry
from proxy.tools.mcp_tool import CallHook
from proxy.upstream.client import AttemptHook, HeadersHook, Upstream
from proxy.upstream.pool import BoundedTransport
from proxy.upstream.reply import ReplyLimits
from proxy.upstream.transport import Transport


def build_services(
    config: Config,
    client: httpx.AsyncClient,
    transport: Transport,
    store: StateStore,
    observers: Sequence[RunObserver] = (),
    route_observers: Mapping[str, Sequence[RunObserver]] | None = None,
    on_attempt: AttemptHook | None = None,
    inject_headers: HeadersHook | None = None,
    prices: PriceTable | None = None,
    on_tool_call: CallHook | None = None,
    shutdown: Shutdown | None = None,
) -> Services:
    """Raises ConfigError for agents whose policy does not compile, ValueError for anything
    else that cannot be wired. `client` is for http tools and webhooks, `transport` for the
    upstreams (bounded here by `server.upstream_connections`): separate pools, so that a
    thousand open streams do not hold up a tool call. `prices` shares a price table (and its
    cache) the caller already has; `on_tool_call` is told of each MCP call as it starts;
    `shutdown`, the server's, once it begins. The MCP sources are connected by `open_sources`."""
    server = config.server
    bounded = BoundedTransport(
        transport, server.upstream_connections, server.upstream_pool_timeout_s
    )
    threads = CallThreads(server.tool_threads)  # sync python tools and conditions
    upstreams = {
        name: Upstream(
            name=name,
            base_url=cfg.base_url,
            transport=bounded,
            api_key=setting(cfg.api_key_env) if cfg.api_key_env else None,
            timeout_s=cfg.timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            step_timeout_s=cfg.step_timeout_s,
            max_retries=cfg.max_retries,
            max_retry_wait_s=cfg.max_retry_wait_s,
            limits=ReplyLimits(
                cfg.max_response_bytes,
                cfg.max_event_bytes,
                cfg.max_tool_calls_per_reply,
                cfg.reports_cost,
                cfg.max_response_values,
            ),
            on_attempt=on_attempt,
            inject_headers=inject_headers,
        )
        for name, cfg in config.upstreams.items()
    }
    registry = build_registry(config, client, threads, on_tool_call)
    prices = prices or PriceTable(config.pricing)
    return Services(
        config=config,
        client=client,
        upstreams=upstreams,
        registry=registry,
        planner=Planner(config, registry.specs(), prices, registry.groups),
        prices=prices,
        checks=ConfiguredChecks(config.conditions, client, threads),
        keys=KeyRing(config.auth),
        store=store,
        observers=list(observers),
        route_observers=dict(route_observers or {}),
        shutdown=shutdown or Shutdown(),
    )
