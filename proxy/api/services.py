"""The wired services: everything a request needs, built once in the app's lifespan."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from proxy.api.auth import KeyRing
from proxy.api.planning import Planner
from proxy.conditions import ConfiguredChecks
from proxy.config import Config
from proxy.engine.ports import RunObserver
from proxy.engine.run_spec import Deps, RunResult
from proxy.engine.tool_calls import restore_held_calls
from proxy.pricing import PriceTable
from proxy.state.store import StateStore
from proxy.tools.registry import ToolRegistry, build_registry
from proxy.upstream.client import AttemptHook, HeadersHook, Upstream
from proxy.upstream.reply import ReplyLimits

RUN_RECORD = "run"  # a finished run's report, by run id
HELD_RECORD = "held_calls"  # server calls held back from the client, by client call id


@dataclass(slots=True)
class Services:
    config: Config
    client: httpx.AsyncClient
    upstreams: dict[str, Upstream]
    registry: ToolRegistry
    planner: Planner
    prices: PriceTable
    checks: ConfiguredChecks
    keys: KeyRing
    store: StateStore
    observers: Sequence[RunObserver] = field(default_factory=list)
    # The observers of runs started by a route, where they differ (the route's own metrics).
    route_observers: Mapping[str, Sequence[RunObserver]] = field(default_factory=dict)

    async def remember(self, result: RunResult, report: dict[str, Any], owner: str) -> None:
        """Keeps what later requests may ask for, for `state.run_ttl_s`: the run's report
        (`GET /v1/runs/{id}`, with the agent or model that `owner` names) and the server calls
        it held back from the client (SPEC §5.1.6)."""
        ttl = self.config.state.run_ttl_s
        record = orjson.dumps({"owner": owner, "loop": report})
        await self.store.put_record(RUN_RECORD, result.run_id, record, ttl)
        if result.held is not None:
            held = orjson.dumps(result.held)
            for call in result.message.get("tool_calls") or []:
                await self.store.put_record(HELD_RECORD, call["id"], held, ttl)

    async def restore(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with the server calls held back from the client put back in place."""
        held: dict[str, dict[str, Any]] = {}
        for message in messages:
            calls = message.get("tool_calls") if message.get("role") == "assistant" else None
            if isinstance(calls, list) and calls and isinstance(calls[0], dict):
                call_id = calls[0].get("id")
                found = await self.store.get_record(HELD_RECORD, str(call_id))
                if found is not None:
                    held[str(call_id)] = orjson.loads(found)
        return restore_held_calls(messages, held) if held else messages

    def upstream(self, name: str, bearer: str | None) -> Upstream:
        """The upstream `name`. The client's bearer token goes upstream only where the config
        forwards it, which it may not while the proxy has keys of its own."""
        upstream = self.upstreams[name]
        if self.config.upstreams[name].forward_client_key and not self.keys.enabled:
            return upstream.with_key(bearer)
        return upstream

    def deps(self, upstream: str, bearer: str | None, route: str) -> Deps:
        """What a run on `upstream` started by `route` needs."""
        model = self.upstream(upstream, bearer)
        observers = self.route_observers.get(route, self.observers)
        return Deps(model, self.registry, self.prices, observers, self.checks, threads=self.store)


def build_services(
    config: Config,
    client: httpx.AsyncClient,
    transport: httpx.AsyncBaseTransport,
    store: StateStore,
    observers: Sequence[RunObserver] = (),
    route_observers: Mapping[str, Sequence[RunObserver]] | None = None,
    on_attempt: AttemptHook | None = None,
    inject_headers: HeadersHook | None = None,
    prices: PriceTable | None = None,
) -> Services:
    """Raises ConfigError for agents whose policy does not compile, ValueError for anything
    else that cannot be wired. `prices` shares a price table (and its cache) the caller
    already has."""
    upstreams = {
        name: Upstream(
            name=name,
            base_url=cfg.base_url,
            transport=transport,
            api_key=os.environ.get(cfg.api_key_env) if cfg.api_key_env else None,
            timeout_s=cfg.timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            step_timeout_s=cfg.step_timeout_s,
            max_retries=cfg.max_retries,
            max_retry_wait_s=cfg.max_retry_wait_s,
            limits=ReplyLimits(
                cfg.max_response_bytes, cfg.max_event_bytes, cfg.max_tool_calls_per_reply
            ),
            on_attempt=on_attempt,
            inject_headers=inject_headers,
        )
        for name, cfg in config.upstreams.items()
    }
    registry = build_registry(config, client)
    prices = prices or PriceTable(config.pricing)
    specs = {name: tool.spec for name, tool in registry.tools.items()}
    return Services(
        config=config,
        client=client,
        upstreams=upstreams,
        registry=registry,
        planner=Planner(config, specs, prices),
        prices=prices,
        checks=ConfiguredChecks(config.conditions, client),
        keys=KeyRing(config.auth),
        store=store,
        observers=list(observers),
        route_observers=dict(route_observers or {}),
    )
