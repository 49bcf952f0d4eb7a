"""`POST /v1/responses` and `GET`/`DELETE /v1/responses/{id}` (SPEC §12) as raw ASGI apps: read,
resolve the stored items, plan, run, render. Errors they raise are rendered by the app's
`ErrorBoundary`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, header, send_json
from proxy.api.auth import Caller
from proxy.api.failures import (
    drain_end_answer,
    failed,
    failure_error,
    send_failure,
    stream_drain_end,
)
from proxy.api.headers import THREAD_HEADER, run_headers, with_stop_reason
from proxy.api.json_body import read_json
from proxy.api.loop_report import loop_report
from proxy.api.planning import Plan
from proxy.api.response_body import (
    cut_short,
    finished_response,
    item_prefix,
    response_id,
    response_object,
    response_usage,
)
from proxy.api.response_history import History, request_history
from proxy.api.response_items import (
    ServerCalls,
    client_items,
    message_item,
    output_items,
    refusal_of,
)
from proxy.api.response_store import (
    ResponseStore,
    StoredResponse,
    asked_for,
    chain_thread,
)
from proxy.api.responses_request import ResponsesRequest, parse_responses_request
from proxy.api.responses_stream import ResponsesStream
from proxy.api.services import Services, one_after_another
from proxy.api.stored_reads import StoredReads
from proxy.api.upstream_param import ClientTerms
from proxy.engine.run import Run
from proxy.engine.run_spec import RunResult
from proxy.errors import (
    ClientDisconnected,
    InvalidRequest,
    ProxyError,
    ShuttingDown,
)
from proxy.state.expiring_threads import ExpiringThreads

log = logging.getLogger(__name__)
_THREAD_HEADER = THREAD_HEADER.encode()


class Responses:
    """`POST /v1/responses`: the Responses API on the run loop."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        bearer = bearer_token(scope)
        caller = sv.keys.caller(bearer)
        thread = header(scope, _THREAD_HEADER)
        req = await read_json(
            receive, scope, sv.config.server, lambda raw: parse_responses_request(raw, thread)
        )
        state = sv.config.state
        store = ResponseStore(sv.store, state.response_ttl_s, state.rolling_upgrade)
        reads = StoredReads(store, caller, sv.config.server)
        history = await request_history(req, reads)
        run = req.run
        run.messages = (
            [{"role": "system", "content": req.instructions}, *history.messages]
            if req.instructions
            else history.messages
        )
        plan = await sv.plan(run, caller)
        spec = plan.spec
        thread = _thread(req, plan, caller)
        deps = sv.deps(plan.upstream, bearer, scope["path"])
        chain = spec.thread_id if chain_thread(thread) else None
        if chain is not None:
            deps.threads = ExpiringThreads(sv.store, sv.config.state.response_ttl_s)
        shown = sv.config.server.responses_server_calls == "mcp_call"
        if spec.policy.tools:  # server calls a client did not send back are put back (§5.1.6)
            spec.messages = await sv.restore(spec.messages, caller)
        prefix = item_prefix(spec.run_id)
        calls = ServerCalls(prefix, spec.policy.tools) if shown and spec.policy.tools else None
        created = int(time.time())
        owner = plan.agent or run.model
        headers = run_headers(spec.run_id)
        creation = _ResponseCreation(
            sv,
            req,
            store,
            caller,
            history,
            thread,
            chain,
            owner,
            created,
            prefix,
            calls,
            spec.model,
        )
        # The server calls held back, then the response stored (`store`): kept as the run ends.
        keep = one_after_another(sv.keep_held(spec, caller), creation.keep if req.store else None)
        if req.stream:
            base = response_object(spec.run_id, created, spec.model, req.echo, "in_progress", [])
            writer = ResponsesStream(send, base, headers, calls, prefix)
            creation.writer = writer
            await self._stream(Run(spec, deps, writer, keep=keep), writer, creation, receive)
            return
        if calls is not None:
            deps.observers = [*deps.observers, calls]
        running = Run(spec, deps, keep=keep)
        ended = await sv.execute(running, receive)
        drain_end = drain_end_answer(send, headers, creation.report, creation.shown_failed)
        result = await sv.answerable(
            running, ended, creation.report, owner, caller, drain_end=drain_end
        )
        if result is None:
            return
        with_stop_reason(headers, result)
        report = creation.report(result)
        if failed(result):
            await sv.remember(result, report, owner, caller)
            made = creation.shown_failed(result, report)
            await send_failure(send, result, report, headers, creation.terms, made)
            return
        body = await creation.answered(result, report)
        await send_json(send, 200, body, headers)

    async def _stream(
        self, run: Run, writer: ResponsesStream, creation: _ResponseCreation, receive: Receive
    ) -> None:
        sv = creation.sv

        async def fail(error: ShuttingDown, ended: RunResult) -> None:
            report = creation.report(ended)
            failure = creation.failed_response(ended, writer.base, report, error)
            await writer.fail(failure, creation.closing)  # (made, if its keep was cut)

        ended = await sv.execute_streamed(run, writer, receive)
        drain_end = stream_drain_end(writer, fail, creation.report, creation.shown_failed)
        result = await sv.answerable(
            run, ended, creation.report, creation.owner, creation.caller, drain_end=drain_end
        )
        if result is None:
            return
        with_stop_reason(writer.headers, result)
        report = creation.report(result)
        try:
            if failed(result):
                await sv.remember(result, report, creation.owner, creation.caller)
                if not writer.started:
                    made = creation.shown_failed(result, report)
                    await send_failure(
                        writer.send, result, report, writer.headers, creation.terms, made
                    )
                    return
                failure = creation.failed_response(result, writer.base, report)
                await writer.fail(failure, creation.closing)
                return
            body = await creation.answered(result, report)
            await writer.finish(creation.closing or [], body)
        except ClientDisconnected:
            return


@dataclass(slots=True)
class _ResponseCreation:
    """What a create request carries from its parse to its answer."""

    sv: Services
    req: ResponsesRequest
    store: ResponseStore
    caller: Caller | None
    history: History
    thread: str | None
    chain: str | None  # the thread's key, when it is a chain's (`chain_thread`)
    owner: str
    created: int
    prefix: str
    calls: ServerCalls | None  # the server calls shown as items
    model: str
    writer: ResponsesStream | None = None  # a stream's: its closing events made with the answer
    closing: list[bytes] | None = None
    kept: dict[str, Any] | None = None  # the response as stored as its run ended (`keep`)

    @property
    def terms(self) -> ClientTerms:
        """A Responses request names no `messages`, and its tools its own way."""
        run = self.req.run
        return ClientTerms(None, run.client_tools, run.tool_params)

    def report(self, result: RunResult) -> dict[str, Any]:
        report = loop_report(result, self.req.run.loop.include_messages)
        if self.req.ignored_tools:
            report["ignored_tools"] = self.req.ignored_tools
        return report

    def client_items(self, result: RunResult) -> list[dict[str, Any]]:
        return client_items(result, self.prefix, self.req.names)

    def response(
        self,
        result: RunResult,
        model: str,
        output: list[dict[str, Any]],
        report: dict[str, Any],
    ) -> dict[str, Any]:
        req = self.req
        return finished_response(
            result, self.created, model, req.echo, output, report, req.max_output_tokens
        )

    def failed_response(
        self,
        result: RunResult,
        base: dict[str, Any],
        report: dict[str, Any],
        error: ProxyError | None = None,
    ) -> dict[str, Any]:
        """The `response.failed` event's response: the run's failure, or `error`."""
        error = error or failure_error(result, self.terms)
        body = {**base, "status": "failed", "usage": response_usage(result.usage)}
        body["error"] = {"code": error.code or error.type, "message": error.message}
        body["loop"] = report
        return body

    def shown_failed(
        self, result: RunResult, report: dict[str, Any], error: ProxyError | None = None
    ) -> dict[str, Any]:
        """What the error body of a failed run's answer gives besides its `report`: the
        failed response (`error` its answer's, else the run's failure), as a stream's
        `response.failed` shows it, with the server calls that ran and what the model said."""
        output = self._call_items()
        if result.text:
            output.append(message_item(f"msg_{self.prefix}", result.text, "incomplete"))
        base = response_object(
            result.run_id, self.created, self.model, self.req.echo, "failed", output
        )
        failed = self.failed_response(result, base, report, error)
        del failed["loop"]  # the error body's own: its messages once (`include_messages`)
        return {"response": failed}

    def _call_items(self) -> list[dict[str, Any]]:
        """The server calls shown as items, those still unfinished ended (failed)."""
        calls = self.calls
        if calls is None:
            return []
        calls.unfinished()
        return list(calls.items)

    async def keep(self, result: RunResult) -> None:
        """The run's `keep` when the response is stored (`store`, the default): the response
        made and stored as the run ends. A backend that fails ends the run
        `state_unavailable`: answered 200, the response would be found by nothing after."""
        if result.stop.fails_run:
            return
        report = self.report(result)
        body = self._made(result, report)
        await self.store_response(result, body, report, in_keep=True)
        self.kept = body

    async def answered(self, result: RunResult, report: dict[str, Any]) -> dict[str, Any]:
        """The response a run that ended answers with: as kept, else made now (the run's own
        record kept)."""
        if self.kept is not None:
            return self.kept
        body = self._made(result, report)
        await self.store_response(result, body, report)
        return body

    def _made(self, result: RunResult, report: dict[str, Any]) -> dict[str, Any]:
        """The response of a run that ended; a stream's closing events made with it."""
        writer, req = self.writer, self.req
        if writer is None:
            items = self._call_items()
            output = output_items(result, self.prefix, req.names, items, req.max_output_tokens)
            return self.response(result, self.model, output, report)
        text = result.message.get("content")
        self.closing = writer.closing(
            text if isinstance(text, str) else None,
            self.client_items(result),
            cut_short(result, req.max_output_tokens),
            refusal_of(result),
        )
        return self.response(result, writer.base["model"], writer.output, report)

    async def store_response(
        self,
        result: RunResult,
        body: dict[str, Any],
        report: dict[str, Any],
        *,
        in_keep: bool = False,
    ) -> None:
        """Stores the response when asked (`store`): its body, the conversation through it
        for `previous_response_id` and its input items (SPEC §12.4). That record also answers
        `GET /v1/runs/{id}`, so the run's own is written only without it, or when responses
        are kept for less than `run_ttl_s` (the server calls it held back were kept as the run
        ended: `Services.keep_held`). Raises StateUnavailable when the backend fails to store
        it."""
        if self.req.store:
            generated = [m for m in result.generated if m.get("role") != "system"]
            key = self.caller.name if self.caller is not None else None
            stored = StoredResponse(body, self.thread, self.owner, key)
            # The chain's thread lasts as long as the chain: as long as this response
            # (whether this run counted calls in it or not).
            history = self.history
            await self.store.save(
                body["id"],
                stored,
                history.messages + generated,
                history.inputs,
                self.chain,
                history.continued,
                history.lineage,
            )
            state = self.sv.config.state
            if state.response_ttl_s >= state.run_ttl_s:
                return
        await self.sv.remember(result, report, self.owner, self.caller, in_keep=in_keep)


def _thread(req: ResponsesRequest, plan: Plan, caller: Caller | None) -> str | None:
    """The thread a stored response's chain keeps: the one it continues, else its own id
    (SPEC §12.4). A run with no thread of its own gets that thread, in the key's namespace."""
    if req.run.thread_id is not None:
        return req.run.thread_id
    if not req.store:
        return None
    own = response_id(plan.spec.run_id)
    plan.spec.thread_id = caller.scoped(own) if caller is not None else own
    return own


class StoredResponses:
    """`GET` and `DELETE /v1/responses/{id}`: a key reads and drops the responses it created;
    to any other key they do not exist."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        store, stored = await asked_for(self.services(), scope)  # (the key checked first)
        if scope["method"] == "GET" and _asks_for_a_stream(scope.get("query_string", b"")):
            raise InvalidRequest(
                "a stored response is read whole: its events are not kept to stream again",
                param="stream",
                code="unsupported_parameter",
            )
        asked = scope["path_params"]["response_id"]
        if scope["method"] == "DELETE":
            await store.delete(stored)
            await send_json(send, 200, {"id": asked, "object": "response", "deleted": True})
            return
        await send_json(send, 200, stored.response)


def _asks_for_a_stream(query: bytes) -> bool:
    """`?stream=true` (the SDK's `retrieve(id, stream=True)`), which would get plain JSON and
    iterate no event."""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    return any(key == "stream" and value.lower() not in ("", "false", "0") for key, value in pairs)
