"""Tool call limits (SPEC §9): caps on executed calls per run and per thread."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from proxy.engine.options import ToolCallLimitOptions
from proxy.engine.policies.base import Block, Policy, StepPlan
from proxy.engine.ports import ThreadCounters
from proxy.engine.state import RunState
from proxy.engine.stop import Stop, StopReason, limit_details
from proxy.engine.values import ModelReply, ToolCall, ToolOutcome
from proxy.errors import SpecError, StateUnavailable

log = logging.getLogger(__name__)

ALL_TOOLS = "*"  # the counter key of a limit on every tool
_SEVERITY = {"continue": 0, "end": 1, "error": 2}


@dataclass(frozen=True, slots=True)
class ToolCallLimit:
    tool_name: str | None
    thread_limit: int | None
    run_limit: int | None
    exit_behavior: str
    path: str

    @property
    def key(self) -> str:
        return self.tool_name or ALL_TOOLS

    def applies_to(self, tool: str) -> bool:
        return self.tool_name is None or self.tool_name == tool

    @classmethod
    def of(cls, options: ToolCallLimitOptions, path: str) -> ToolCallLimit:
        return cls(
            options.tool_name,
            options.thread_limit,
            options.run_limit,
            options.exit_behavior,
            path,
        )


def check_limits(limits: Iterable[ToolCallLimit], server_tools: Iterable[str]) -> None:
    """Raises SpecError for a limit on a tool the run lacks, or an `end` that cannot hold."""
    tools = set(server_tools)
    for limit in limits:
        if limit.tool_name is None:
            continue
        if limit.tool_name not in tools:
            raise SpecError(
                f"{limit.tool_name!r} is not a server tool of this run",
                param=f"{limit.path}.tool_name",
            )
        others = sorted(tools - {limit.tool_name})
        if limit.exit_behavior == "end" and others:
            raise SpecError(
                f"exit_behavior 'end' on {limit.tool_name!r} cannot stop other tools of the "
                f"same reply ({', '.join(others)}); limit every tool (no tool_name) or use "
                "'continue' or 'error'",
                param=f"{limit.path}.exit_behavior",
            )


@dataclass(frozen=True, slots=True)
class _Hit:
    limit: ToolCallLimit
    scope: str  # "run" | "thread"
    run_count: int
    thread_count: int | None


class ToolCallLimits(Policy):
    """Counts executed calls; a call that would pass a limit is blocked.

    Thread counts are reserved in the state backend, once every other review passed.
    """

    def __init__(self, limits: tuple[ToolCallLimit, ...], threads: ThreadCounters | None) -> None:
        self.limits = limits
        self.threads = threads
        self.run_counts: Counter[str] = Counter()
        # What each admitted call of the reply under way took: its run counts' keys and its
        # thread counters' (None: the thread is the run), by the call object (ids repeat).
        self._taken: dict[int, tuple[list[str], list[str] | None]] = {}

    async def reserve(self, run: RunState, call: ToolCall) -> Block | None:
        limits = [lim for lim in self.limits if lim.applies_to(call.name)]
        if not limits:
            return None
        hits = [
            _Hit(lim, "run", self.run_counts[lim.key], None)
            for lim in limits
            if lim.run_limit is not None and self.run_counts[lim.key] >= lim.run_limit
        ]
        thread_limits = [lim for lim in limits if lim.thread_limit is not None]
        thread_counts: dict[str, int] = {}
        reserved: list[str] | None = None  # the thread's counters it took
        if not hits and thread_limits:
            if run.thread_id is None or self.threads is None:  # the thread is the run
                thread_counts = {lim.key: self.run_counts[lim.key] for lim in thread_limits}
                ok = all(thread_counts[lim.key] < (lim.thread_limit or 0) for lim in thread_limits)
            else:
                caps: dict[str, int] = {}
                for lim in thread_limits:
                    caps[lim.key] = min(
                        caps.get(lim.key, lim.thread_limit or 0), lim.thread_limit or 0
                    )
                ok, thread_counts = await self.threads.reserve(run.thread_id, caps)
                reserved = list(caps)
            if not ok:
                hits = [
                    _Hit(lim, "thread", self.run_counts[lim.key], thread_counts[lim.key])
                    for lim in thread_limits
                    if thread_counts[lim.key] >= (lim.thread_limit or 0)
                ]
        if not hits:
            keys = list({lim.key for lim in limits})
            for key in keys:
                self.run_counts[key] += 1
            self._taken[id(call)] = (keys, reserved)
            return None
        hits += await self._stricter_thread_hits(run, hits, thread_limits)
        hit = max(hits, key=lambda h: _SEVERITY[h.limit.exit_behavior])
        thread_count = hit.thread_count
        if thread_count is None and hit.limit.thread_limit is not None:  # a run limit's hit
            thread_count = await self._thread_count(run, hit.limit)
        message = limit_message(hit.limit, call.name, hit.run_count, thread_count)
        return Block(message, ToolOutcome.BLOCKED_LIMIT, self._stop(hit, call, run, message))

    def after_reply(self, run: RunState, plan: StepPlan, reply: ModelReply) -> Stop | None:
        self._taken.clear()  # an earlier reply's calls ran, or were given back
        return None

    async def unreserve(self, run: RunState, calls: Sequence[ToolCall]) -> None:
        """Admitted calls of this reply that never ran: the run's counts and the thread's give
        back what they took (the thread's in one call)."""
        released: Counter[str] = Counter()
        for call in calls:
            keys, reserved = self._taken.pop(id(call), ([], None))
            for key in keys:
                self.run_counts[key] -= 1
            released.update(reserved or ())
        if released and run.thread_id is not None and self.threads is not None:
            try:
                await self.threads.release(run.thread_id, released)
            except StateUnavailable as exc:
                log.warning("the thread %s kept a call that never ran: %s", run.thread_id, exc)

    async def _stricter_thread_hits(
        self, run: RunState, hits: list[_Hit], thread_limits: list[ToolCallLimit]
    ) -> list[_Hit]:
        """The thread limits a call blocked by a run limit has reached too, of those stricter
        than that run limit: a request's `continue` limit on the run does not loosen an agent's
        `end` or `error` limit on the thread (SPEC §4.1). Read, not reserved: the call is
        blocked whatever they say."""
        worst = max(_SEVERITY[hit.limit.exit_behavior] for hit in hits)
        stricter = [lim for lim in thread_limits if _SEVERITY[lim.exit_behavior] > worst]
        if not stricter or hits[0].scope == "thread":
            return []
        counts = await self._thread_counts(run)  # (one read for them all)
        if counts is None:
            return []
        return [
            _Hit(lim, "thread", self.run_counts[lim.key], counts.get(lim.key, 0))
            for lim in stricter
            if counts.get(lim.key, 0) >= (lim.thread_limit or 0)
        ]

    async def _thread_count(self, run: RunState, limit: ToolCallLimit) -> int | None:
        """The thread's count of `limit`'s calls, for its message; None when the state backend
        cannot say."""
        counts = await self._thread_counts(run)
        return None if counts is None else counts.get(limit.key, 0)

    async def _thread_counts(self, run: RunState) -> Mapping[str, int] | None:
        """The thread's counts: the run's, when the run is the thread; None when the state
        backend cannot say (the call is blocked all the same; its message says less)."""
        if run.thread_id is None or self.threads is None:
            return self.run_counts
        try:
            return await self.threads.thread_counts(run.thread_id)
        except StateUnavailable:
            return None

    @staticmethod
    def _stop(hit: _Hit, call: ToolCall, run: RunState, message: str) -> Stop | None:
        behavior = hit.limit.exit_behavior
        if behavior == "continue":
            return None
        threshold = hit.limit.run_limit if hit.scope == "run" else hit.limit.thread_limit
        details = limit_details(
            hit.limit.path,
            f"{hit.scope}_limit",
            run.step_count,
            threshold=threshold,
            observed=hit.run_count if hit.scope == "run" else hit.thread_count,
            tool=call.name,
            message=message,
        )
        code = "tool_call_limit_exceeded" if behavior == "error" else None
        return Stop(StopReason.TOOL_CALL_LIMIT, details, code)


def limit_message(limit: ToolCallLimit, tool: str, run_count: int, thread_count: int | None) -> str:
    parts = []
    if limit.thread_limit is not None and thread_count is not None:
        parts.append(f"thread: {thread_count}/{limit.thread_limit}")
    if limit.run_limit is not None:
        parts.append(f"run: {run_count}/{limit.run_limit}")
    again = f"call '{tool}'" if limit.tool_name is not None else "call any tool"
    return f"Tool call limit exceeded ({', '.join(parts)}). Do not {again} again."
