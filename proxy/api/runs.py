"""`GET /v1/runs/{id}`: the `loop` report of a recent run, by its run id or by the id of the
completion or response it answered with (SPEC §4.2), from the state backend: the run's record,
or the stored response it answered with (which is the one record such a run writes)."""

from __future__ import annotations

from collections.abc import Callable

import orjson
from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, send_json
from proxy.api.response_store import ResponseStore
from proxy.api.services import RUN_RECORD, Services
from proxy.errors import NotFound

ID_PREFIXES = ("run_", "chatcmpl-", "resp_")


def run_id_of(any_id: str) -> str | None:
    """The run id a run, completion or response id is made from."""
    for prefix in ID_PREFIXES:
        if any_id.startswith(prefix) and len(any_id) > len(prefix):
            return "run_" + any_id.removeprefix(prefix)
    return None


class RunReports:
    """A raw ASGI app. A key reads the runs it made; to any other key they do not exist."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        caller = sv.keys.caller(bearer_token(scope))
        asked = scope["path_params"]["run_id"]
        run_id = run_id_of(asked)
        if run_id is not None:
            await sv.reports.written(run_id)  # a report this process is writing: read it
        found = await sv.store.get_record(RUN_RECORD, run_id) if run_id else None
        record = orjson.loads(found) if found is not None else None
        if record is None and run_id is not None:  # a stored response keeps its run's report
            responses = ResponseStore(sv.store, sv.config.state.response_ttl_s)
            kept = await responses.load("resp_" + run_id[4:], caller)
            if kept is not None:
                record = {"key": kept.key, "loop": kept.response["loop"]}
        if record is None:
            raise NotFound(f"no recent run {asked[:64]!r}")
        if caller is not None and record.get("key") != caller.name:
            raise NotFound(f"no recent run {asked[:64]!r}")
        await send_json(send, 200, {"object": "loopwarden.run", **record["loop"]})
