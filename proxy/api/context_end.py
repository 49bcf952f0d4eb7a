"""A stored context run's end (SPEC §10): what the run adds to its context, saved with the
run's record in the hold's last write."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from proxy.api.auth import Caller
from proxy.api.loop_report import loop_report
from proxy.api.services import Services
from proxy.engine.run_spec import RunResult
from proxy.errors import BodyTooLarge, ProxyError, StateUnavailable
from proxy.state.store import Holding, StoredContext

log = logging.getLogger(__name__)

KEPT_ROLES = frozenset({"user", "assistant", "tool"})  # nudges and directives are per run


def kept_messages(result: RunResult) -> list[dict[str, Any]]:
    """What a run adds to its context: its messages, which end with the reply it gave."""
    return [m for m in result.generated if m.get("role") in KEPT_ROLES]


def messages_size(messages: list[dict[str, Any]]) -> int:
    return len(orjson.dumps(messages))


def saved(
    context: StoredContext, messages: list[dict[str, Any]], cap: int
) -> tuple[StoredContext | None, ProxyError | None]:
    """The context to save with the run's `messages`, or why nothing is saved (over `cap`)."""
    if messages_size(messages) > cap:
        refused = BodyTooLarge(
            f"the run's messages would make context {context.name!r} larger than {cap} "
            "bytes (state.max_context_bytes); nothing was saved",
            param="context_id",
            code="context_too_large",
        )
        return None, refused
    context.messages, context.updated = messages, int(time.time())
    return context, None


class ContextEnd:
    """A context run's end, in the hold's last write: the run's messages saved with the run's
    record as the run ends (its `keep`), or, for a run that failed, its record alone."""

    def __init__(
        self,
        sv: Services,
        holding: Holding,
        context: StoredContext,
        messages: list[dict[str, Any]],
        owner: str,
        caller: Caller | None,
    ) -> None:
        self.sv, self.holding, self.context, self.messages = sv, holding, context, messages
        self.owner, self.caller = owner, caller
        self.tried = False
        self.refused: ProxyError | None = None  # why the messages were not saved

    async def save(self, result: RunResult) -> None:
        """Saves the run's messages and record. A save the backend refuses (it failed, or
        another request changed the context since this run read it) raises StateUnavailable:
        the run ends `state_unavailable`, in its report, span and metrics alike."""
        self.tried = True
        cap = self.sv.config.state.max_context_bytes
        save, self.refused = saved(self.context, self.messages + kept_messages(result), cap)
        if save is None:
            await self.records(result, loop_report(result, False))
            return
        await self._end(save, result, loop_report(result, False))

    async def records(self, result: RunResult, report: dict[str, Any]) -> None:
        """Keeps the run alone: a backend that fails is logged (its answer does not depend on
        it)."""
        try:
            await self._end(None, result, report)
        except StateUnavailable as exc:
            log.warning("run %s was not kept: %s", result.run_id, exc.message)

    async def _end(
        self, save: StoredContext | None, result: RunResult, report: dict[str, Any]
    ) -> None:
        records = self.sv.run_records(result, report, self.owner, self.caller)
        await self.holding.end(save, records, self.sv.config.state.run_ttl_s)
