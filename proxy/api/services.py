"""The services every request uses, built once in the app's lifespan (`wiring.build_services`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from starlette.types import Receive

from proxy.api import held_call_records
from proxy.api.asgi import RUN_ENDED, Shutdown, run_or_cancel, shutting_down
from proxy.api.auth import Caller, KeyRing
from proxy.api.event_stream import EventStream
from proxy.api.failures import Failing
from proxy.api.planning import Plan, Planner
from proxy.api.report_writes import ReportWrites
from proxy.api.run_request import RunRequest
from proxy.conditions import ConfiguredChecks
from proxy.config import Config, ConfigError
from proxy.deadline import within
from proxy.engine.policy import compile_expressions, expressions
from proxy.engine.ports import RunObserver
from proxy.engine.run import Run
from proxy.engine.run_spec import Deps, Keep, RunResult, RunSpec
from proxy.engine.stop import StopReason
from proxy.errors import ShuttingDown
from proxy.pricing import PriceTable
from proxy.state.expiring_threads import ExpiringThreads
from proxy.state.store import Record, StateStore
from proxy.telemetry.http import CUT_ON_PURPOSE
from proxy.tools.registry import ToolRegistry
from proxy.upstream.client import Upstream

log = logging.getLogger(__name__)
# What `Services.execute` gives: the run's result, the drain's end, or None (the client left).
Ended = RunResult | ShuttingDown | None

RUN_RECORD = "run"  # a finished run's report, by run id
# A request's `expr` conditions longer than this together are compiled in a thread.
COMPILE_IN_THREAD_PAST_CHARS = 256
# What a run's answer's writes get once the drain's end came: a run's keep under way is waited
# for this long, a write of its answer it cut is done again within it; within the time the
# server gives the requests it stopped (`server.SETTLE_S`).
GRACE_S = 3.0


def one_after_another(*keeps: Keep | None) -> Keep | None:
    """A run's keep doing `keeps` (those given) one after another."""
    given = [keep for keep in keeps if keep is not None]
    if len(given) < 2:
        return given[0] if given else None

    async def keep(result: RunResult) -> None:
        for each in given:
            await each(result)

    return keep


@dataclass(slots=True)
class Services:
    config: Config
    client: httpx.AsyncClient  # http tools' and webhooks': never the upstreams' pool
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
    shutdown: Shutdown = field(default_factory=Shutdown)  # the server's, once it begins
    reports: ReportWrites = field(init=False)
    threads: ExpiringThreads = field(init=False)  # the store's, ending `state.thread_ttl_s`

    def __post_init__(self) -> None:
        self.reports = ReportWrites(self.store, self.config.state.run_ttl_s)
        ttl = self.config.state.thread_ttl_s
        self.threads = ExpiringThreads(self.store, ttl)

    async def remember(
        self,
        result: RunResult,
        report: dict[str, Any],
        owner: str,
        caller: Caller | None = None,
        *,
        in_keep: bool = False,
    ) -> None:
        """Keeps the run's report for `state.run_ttl_s` (`GET /v1/runs/{id}`, for the key that
        ran it, with the agent or model that `owner` names). A backend that fails is logged:
        the run's answer does not depend on it (`ReportWrites`); the server calls it held back
        from its client were kept as it ended (`keep_held`). `in_keep`: in a run's keep (its
        own time given at the drain's end), not its answer."""
        records = self.run_records(result, report, owner, caller)
        run_id = result.run_id
        try:
            await self.reports.keep(run_id, records)
        except asyncio.CancelledError:
            # The drain's end stops runs, not the answers of runs that ended: a write it cut
            # is done again, within GRACE_S, past which the request is answered `ShuttingDown`
            # (in a run's keep, given its own time, it is not).
            if in_keep or not self.shutdown.stopped(asyncio.current_task()):
                raise
            try:
                await within(self.reports.keep(run_id, records), GRACE_S)
            except TimeoutError:
                raise shutting_down(result) from None

    @staticmethod
    def run_records(
        result: RunResult, report: dict[str, Any], owner: str, caller: Caller | None
    ) -> list[Record]:
        """What `remember` keeps of a run."""
        key = caller.name if caller is not None else None
        kept = orjson.dumps({"owner": owner, "key": key, "loop": report})
        return [Record(RUN_RECORD, result.run_id, kept)]

    async def plan(self, req: RunRequest, caller: Caller | None) -> Plan:
        """The planner's plan of `req`; the `expr` conditions of its `loop`, when they are
        more than a few, compiled in a thread first (a few milliseconds of Python each)."""
        if req.has_loop:
            sources = expressions(req.loop)
            if sum(map(len, sources)) > COMPILE_IN_THREAD_PAST_CHARS:
                await asyncio.to_thread(compile_expressions, sources)
        return self.planner.plan(req, caller)

    async def execute(self, run: Run, receive: Receive) -> Ended:
        """`run` to its end; None when its client went away first (`run_or_cancel`). Stopped
        at the end of the server's drain: its result when it had ended then (its answer kept:
        answered as it is), else `ShuttingDown` (answered by `answerable`, once the run is
        kept), raised when the run had not begun; `ShuttingDown` asks the client not to send
        it again when its tools ran."""
        try:
            return await run_or_cancel(run.execute, receive)
        except asyncio.CancelledError:
            if not self.shutdown.stopped(asyncio.current_task()):
                raise
            ended = run.result
            if ended is not None and ended.stop.reason is not StopReason.CANCELLED:
                return ended
            error = shutting_down(ended, running=True)
            if ended is None:
                raise error from None
            return error
        finally:
            RUN_ENDED.set(run.result)

    async def execute_streamed(self, run: Run, writer: EventStream, receive: Receive) -> Ended:
        """`execute`, `writer` kept alive meanwhile. A stream the proxy cut (a call's task may
        have: its own context) is told to the server as left unfinished on purpose."""
        try:
            with writer.kept_alive(self.config.server.keepalive_interval_s):
                return await self.execute(run, receive)
        finally:
            if writer.silenced:
                CUT_ON_PURPOSE.set(True)

    async def answerable(
        self,
        run: Run,
        ended: Ended,
        report: Callable[[RunResult], dict[str, Any]],
        owner: str,
        caller: Caller | None,
        *,
        drain_end: Failing,
    ) -> RunResult | None:
        """The result to answer with; None when the run's answer is sent or never will be: the
        client went away before the run ended (nothing more is sent), or the drain's end
        stopped it (`drain_end`'s answer). The run is kept all the same (`remember`, with its
        `report`), to be looked up by its id, before that answer."""
        if isinstance(ended, RunResult) and ended.stop.reason is not StopReason.CANCELLED:
            return ended
        if run.result is not None:
            await self.remember(run.result, report(run.result), owner, caller)
            if isinstance(ended, ShuttingDown):
                await drain_end(ended, run.result)
        return None

    def keep_held(self, spec: RunSpec, caller: Caller | None) -> Keep | None:
        """The keep of a run that may hold server calls back from its client (it has server
        and client tools, SPEC §5.1.6): those calls written as the run ends, a backend that
        fails ending it `state_unavailable` (its client answered as if they were kept)."""
        if not (spec.policy.tools and spec.client_tools):
            return None
        return held_call_records.keeper(self.store, self.config.state.run_ttl_s, caller)

    async def restore(
        self, messages: list[dict[str, Any]], caller: Caller | None = None
    ) -> list[dict[str, Any]]:
        """`messages` with the server calls held back from the client put back in place."""
        return await held_call_records.restore(self.store, messages, caller)

    async def open_sources(self) -> None:
        """Connects the MCP sources and plans with the tools they expose; from then on a change
        of their tools is planned with too. Raises SourcesUnavailable (or ConfigError) when
        start-up cannot go on, the sources closed again."""
        await self.registry.open()
        try:
            self.registry.check_started()
            self.replan()
        except BaseException:
            await self.registry.close()
            raise
        self.registry.listeners.append(self._tools_changed)

    async def close_sources(self) -> None:
        await self.registry.close()

    def replan(self) -> None:
        """Compiles the agents again against the tools as they are now."""
        registry = self.registry
        self.planner = Planner(self.config, registry.specs(), self.prices, registry.groups)

    def _tools_changed(self) -> None:
        try:
            self.replan()
        except ConfigError as exc:
            log.error("the MCP sources' tools changed; runs keep the tools they had: %s", exc)

    def upstream(self, name: str, bearer: str | None) -> Upstream:
        """The upstream `name`. The client's bearer token goes upstream only where the config
        forwards it, which it may not while the proxy has keys of its own."""
        upstream = self.upstreams[name]
        if self.forwards_client_key(name):
            return upstream.with_key(bearer)
        return upstream

    def forwards_client_key(self, name: str) -> bool:
        return self.config.upstreams[name].forward_client_key and not self.keys.enabled

    def deps(self, upstream: str, bearer: str | None, route: str) -> Deps:
        """What a run on `upstream` started by `route` needs."""
        model = self.upstream(upstream, bearer)
        observers = self.route_observers.get(route, self.observers)
        return Deps(
            model,
            self.registry,
            self.prices,
            observers,
            self.checks,
            threads=self.threads,
            keep_grace_s=self._keep_grace_s,
        )

    def _keep_grace_s(self) -> float | None:
        """A run's keep is finished, unless the drain's end stopped the run: then GRACE_S."""
        return GRACE_S if self.shutdown.ended else None
