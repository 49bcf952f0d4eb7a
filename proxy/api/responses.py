"""`POST /v1/responses` and `GET`/`DELETE /v1/responses/{id}` (SPEC §12) as raw ASGI apps: read,
resolve the stored items, plan, run, render. Errors they raise are rendered by the app's
`ErrorBoundary`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, header, run_or_cancel, send_json
from proxy.api.auth import Caller
from proxy.api.chat_request import THREAD_HEADER
from proxy.api.completion import loop_report
from proxy.api.failures import failed, failure_error, send_failure
from proxy.api.input_items import listed
from proxy.api.json_body import read_json
from proxy.api.planning import Plan
from proxy.api.response_body import (
    finished_response,
    item_prefix,
    response_id,
    response_object,
    response_usage,
)
from proxy.api.response_items import (
    OUTPUT_ITEMS,
    ServerCalls,
    client_items,
    items_to_messages,
    output_items,
)
from proxy.api.response_store import (
    CONVERSATION_RECORD,
    READ_BYTES_PER_BODY,
    RESPONSE_RECORD,
    UNREAD,
    ChainThreads,
    ConversationTooLarge,
    ResponseStore,
    StoredInput,
    StoredResponse,
    Unread,
    asked_for,
    chain_thread,
    owned_by,
    parsed,
    response_of_item,
    usable,
)
from proxy.api.responses_request import ResponsesRequest, parse_responses_request
from proxy.api.responses_stream import ResponsesStream
from proxy.api.services import Services
from proxy.config.server import ServerConfig
from proxy.engine.run import Run
from proxy.engine.run_spec import RunResult
from proxy.errors import (
    BodyTooLarge,
    ClientDisconnected,
    InvalidRequest,
    NotFound,
    StateUnavailable,
)
from proxy.state.store import RECORDS_AT_ONCE

log = logging.getLogger(__name__)
CALL_KINDS = frozenset({"function_call", "custom_tool_call"})
_THREAD_HEADER = THREAD_HEADER.encode()
# Stored responses one request may read: its previous one and those its item references name
# (the AI SDK names an item of every earlier response of a conversation), and the bytes of
# their records it may parse (`READ_BYTES_PER_BODY`), giving the loop to others every so many.
MAX_STORED_READS = 1_000
YIELD_EVERY_BYTES = 1024 * 1024
# A continued response is read with the conversation through it when the two hold at most this
# (most do: one round trip); a larger conversation is read once the response is found to be
# the key's own, so that another key's request is sent none of it.
CONVERSATION_AHEAD_BYTES = 256 * 1024


class Responses:
    """`POST /v1/responses`: the Responses API on the run loop."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        bearer = bearer_token(scope)
        caller = sv.keys.caller(bearer)
        raw = await read_json(receive, scope, sv.config.server)
        req = parse_responses_request(raw, header(scope, _THREAD_HEADER))
        store = ResponseStore(sv.store, sv.config.state.response_ttl_s)
        reads = _StoredReads(store, caller, sv.config.server)
        history, inputs = await _history(req, reads)
        run = req.run
        run.messages = (
            [{"role": "system", "content": req.instructions}, *history]
            if req.instructions
            else history
        )
        plan = sv.planner.plan(run, caller)
        spec = plan.spec
        thread = _thread(req, plan, caller)
        deps = sv.deps(plan.upstream, bearer, scope["path"])
        chain = spec.thread_id if chain_thread(thread) else None
        if chain is not None:
            deps.threads = ChainThreads(sv.store, sv.config.state.response_ttl_s)
        shown = sv.config.server.responses_server_calls == "mcp_call"
        if spec.policy.tools:  # server calls a client did not send back are put back (§5.1.6)
            spec.messages = await sv.restore(spec.messages, caller)
        prefix = item_prefix(spec.run_id)
        calls = ServerCalls(prefix, spec.policy.tools) if shown and spec.policy.tools else None
        created = int(time.time())
        owner = plan.agent or run.model
        headers = {"x-loopwarden-run-id": spec.run_id}
        context = _Context(
            sv, req, store, caller, history, inputs, thread, chain, owner, created, prefix
        )
        if req.stream:
            base = response_object(spec.run_id, created, spec.model, req.echo, "in_progress", [])
            writer = ResponsesStream(send, base, headers, calls, prefix)
            await self._stream(Run(spec, deps, writer), writer, context, receive)
            return
        if calls is not None:
            deps.observers = [*deps.observers, calls]
        running = Run(spec, deps)
        ended = await run_or_cancel(running.execute, receive)
        result = await sv.unless_left(running, ended, context.report, owner, caller)
        if result is None:
            return
        headers["x-loopwarden-stop-reason"] = result.stop.reason.value
        report = context.report(result)
        if failed(result):
            await sv.remember(result, report, owner, caller)
            await send_failure(send, result, report, headers)
            return
        if calls is not None:
            calls.unfinished()
        output = output_items(result, prefix, req.names, calls.items if calls else [])
        body = context.response(result, spec.model, output, report)
        await context.keep(result, body, report)
        await send_json(send, 200, body, headers)

    async def _stream(
        self, run: Run, writer: ResponsesStream, context: _Context, receive: Receive
    ) -> None:
        sv = context.sv
        with writer.kept_alive(sv.config.server.keepalive_interval_s):
            ended = await run_or_cancel(run.execute, receive)
        result = await sv.unless_left(run, ended, context.report, context.owner, context.caller)
        if result is None:
            return
        writer.headers["x-loopwarden-stop-reason"] = result.stop.reason.value
        report = context.report(result)
        try:
            if failed(result):
                await sv.remember(result, report, context.owner, context.caller)
                if not writer.started:
                    await send_failure(writer.send, result, report, writer.headers)
                    return
                await writer.fail(context.failed_response(result, writer.base, report))
                return
            text = result.message.get("content")
            data = writer.closing(
                text if isinstance(text, str) else None, context.client_items(result)
            )
            body = context.response(result, writer.base["model"], writer.output, report)
            await context.keep(result, body, report)
            await writer.finish(data, body)
        except ClientDisconnected:
            return


@dataclass(slots=True)
class _Context:
    """What a create request carries from its parse to its answer."""

    sv: Services
    req: ResponsesRequest
    store: ResponseStore
    caller: Caller | None
    history: list[dict[str, Any]]
    inputs: StoredInput  # the request's input items, references read, and what they follow
    thread: str | None
    chain: str | None  # the thread's key, when it is a chain's (`chain_thread`)
    owner: str
    created: int
    prefix: str

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
        self, result: RunResult, base: dict[str, Any], report: dict[str, Any]
    ) -> dict[str, Any]:
        error = failure_error(result)
        body = {**base, "status": "failed", "usage": response_usage(result.usage)}
        body["error"] = {"code": error.code or error.type, "message": error.message}
        body["loop"] = report
        return body

    async def keep(self, result: RunResult, body: dict[str, Any], report: dict[str, Any]) -> None:
        """Stores the response when asked (`store`, the default): its body, the conversation
        through it for `previous_response_id` and its input items (SPEC §12.4). That record also
        answers `GET /v1/runs/{id}`, so the run's own is written only without it, or for the
        server calls it held back (`Services.remember`). A backend that fails is logged: the
        answer does not depend on it."""
        if self.req.store:
            generated = [m for m in result.generated if m.get("role") != "system"]
            key = self.caller.name if self.caller is not None else None
            stored = StoredResponse(body, self.thread, self.owner, key)
            try:
                # The chain's thread lasts as long as the chain: as long as this response
                # (whether this run counted calls in it or not).
                await self.store.save(
                    body["id"], stored, self.history + generated, self.inputs, self.chain
                )
            except StateUnavailable as exc:
                log.warning("response %s was not stored: %s", body["id"], exc.message)
            else:
                if result.held is None:
                    return
        await self.sv.remember(result, report, self.owner, self.caller)


class _StoredReads:
    """The stored responses one request reads (its previous one, those its item references
    name): each read once, at most MAX_STORED_READS of them and READ_BYTES_PER_BODY request
    bodies of their records (and of the input records its references read), charged before
    they are parsed. They are read together, in the order the request names them: the previous
    one with the conversation through it, the others RECORDS_AT_ONCE at a time and only as many
    bytes of them as the budget has left. Of a response an item reference names, only its
    output items are kept, and its input items when a reference names one; the conversation of
    the previous one may hold no more bytes or values than a request's body (it goes upstream
    in this one's)."""

    def __init__(self, store: ResponseStore, caller: Caller | None, bounds: ServerConfig) -> None:
        self.store = store
        self.caller = caller
        self.bounds = bounds
        self._outputs: dict[str, dict[str, dict[str, Any]]] = {}  # by response id, by item id
        self._readable: set[str] = set()
        self._inputs: set[str] = set()  # the responses whose input items are in `_outputs`
        self._ahead: dict[str, None] = {}  # the responses the request names, not read yet
        self._fetched: dict[str, bytes | None] = {}  # response records read, not yet parsed
        self._budget = READ_BYTES_PER_BODY * bounds.max_body_bytes
        self._spent = 0
        self._yielded = 0

    def will_read(self, named: list[str]) -> None:
        """The responses the request's item references name, in order: read together."""
        self._ahead = dict.fromkeys(list(dict.fromkeys(named))[:MAX_STORED_READS])

    async def previous(
        self, response_id: str, param: str
    ) -> tuple[StoredResponse, list[dict[str, Any]]]:
        """The response a request continues, and the conversation through it: read together
        when the two hold at most CONVERSATION_AHEAD_BYTES (a request of another key is sent
        no more of it, and learns no more of its size), else the conversation once the
        response is known to be the key's own."""
        wanted = [(RESPONSE_RECORD, response_id), (CONVERSATION_RECORD, response_id)]
        read = await self.store.store.get_records(wanted, max_bytes=CONVERSATION_AHEAD_BYTES)
        self._fetched[response_id] = read[0]
        found: bytes | Unread | None = read[1] if len(read) > 1 else UNREAD
        self._ahead.pop(response_id, None)
        stored = await self._read(response_id, param)
        conversation = None
        if stored is not None:
            try:
                conversation = await self.store.conversation(stored, self.bounds, found)
            except ConversationTooLarge as exc:
                raise BodyTooLarge(str(exc), param=param) from None
        if stored is None or conversation is None:
            raise NotFound(f"no stored response {response_id!r}", param=param)
        return stored, conversation

    async def item(self, item_id: str, param: str) -> dict[str, Any]:
        """The stored output item `item_id` names."""
        owner = response_of_item(item_id)
        if owner is not None and owner not in self._outputs:
            await self._read(owner, param)
        item = self._outputs[owner].get(item_id) if owner is not None else None
        if item is None and owner in self._readable and owner not in self._inputs:
            self._inputs.add(owner)
            found = await self.store.input(owner, lambda size: self._charge(size, param))
            for given in listed(found.items, owner) if found is not None else ():
                self._outputs[owner].setdefault(given["id"], given)
            item = self._outputs[owner].get(item_id)
        if item is None:
            raise NotFound(f"no stored item {item_id[:64]!r}", param=param)
        return dict(item)

    async def _read(self, response_id: str, param: str) -> StoredResponse | None:
        if len(self._outputs) >= MAX_STORED_READS:
            raise InvalidRequest(
                f"a request may read at most {MAX_STORED_READS} stored responses (its "
                "previous_response_id and the responses its item references name)",
                param=param,
            )
        self._outputs[response_id] = {}  # counted, whatever it holds
        found = await self._record(response_id)
        if found is not None and (self.caller is None or owned_by(found, self.caller.name)):
            self._charge(len(found), param)  # another key's response has no size for it
        if self._spent - self._yielded >= YIELD_EVERY_BYTES:
            self._yielded = self._spent
            await asyncio.sleep(0)  # other requests' turn
        stored = usable(parsed(found, self.caller), self.caller)
        if stored is None:
            return None
        self._readable.add(response_id)
        output = stored.response.get("output") or ()
        self._outputs[response_id] = {item.get("id"): item for item in output}
        return stored

    async def _record(self, response_id: str) -> bytes | None:
        """A response's record, read with those the request names after it: as many as
        RECORDS_AT_ONCE and the bytes its budget has left allow (what is not read is not held)."""
        if response_id not in self._fetched:
            self._ahead.pop(response_id, None)
            chunk = [response_id, *itertools.islice(self._ahead, RECORDS_AT_ONCE - 1)]
            wanted = [(RESPONSE_RECORD, named) for named in chunk]
            left = max(0, self._budget - self._spent)
            found = await self.store.store.get_records(wanted, max_bytes=left)
            for named, record in zip(chunk, found, strict=False):  # the first ones only
                self._fetched[named] = record
                self._ahead.pop(named, None)
        return self._fetched.pop(response_id)

    def _charge(self, size: int, param: str) -> None:
        """Counts `size` bytes of records read against the budget, before they are parsed."""
        self._spent += size
        if self._spent > self._budget:
            raise BodyTooLarge(
                f"the stored responses this request reads hold more than {self._budget} bytes "
                f"({READ_BYTES_PER_BODY} x server.max_body_bytes); continue the conversation "
                "with previous_response_id instead of naming so many of its items",
                param=param,
            )


async def _history(
    req: ResponsesRequest, reads: _StoredReads
) -> tuple[list[dict[str, Any]], StoredInput]:
    """The conversation a request continues: the stored one of `previous_response_id`, then
    its input items with every `item_reference` read; and those items, after the output of
    the response they continue. A function call output must answer a call of that
    conversation. An item the stored conversation holds already (an item or a call of the
    previous response, an output its call has) is refused, as OpenAI refuses it: the model
    would see it twice."""
    conversation: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    previous_id = req.previous_response_id
    named = [item["id"] for item in req.items if item.get("type") == "item_reference"]
    reads.will_read([owner for ref in named if (owner := response_of_item(ref)) is not None])
    if previous_id is not None:
        previous, conversation = await reads.previous(previous_id, "previous_response_id")
        outputs = list(previous.response.get("output") or ())
        if req.run.thread_id is None:
            req.run.thread_id = previous.thread
    known: set[str] = set()
    done: dict[str, bool] = {}  # by call id: whether an output follows its last call
    for message in conversation:
        for call in message.get("tool_calls") or ():
            known.add(call["id"])
            done[call["id"]] = False
        if message.get("role") == "tool":
            done[message.get("tool_call_id") or ""] = True
    # An upstream may give every turn the same call ids (`call_0`): a call is the previous
    # response's by its place, and an output is one too many only after its call's last output.
    answered = {call_id for call_id, output in done.items() if output}
    previous_calls = {item.get("call_id") for item in outputs if item.get("type") in CALL_KINDS}
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(req.items):
        kind = item.get("type", "message")
        if kind == "item_reference":
            ref = item["id"]
            if ref in seen:  # the same stored item named twice (a call, and its result)
                continue
            seen.add(ref)
            if previous_id is not None and response_of_item(ref) == previous_id:
                raise _held_already("id", ref, f"input[{i}].id")
            item = await reads.item(ref, f"input[{i}].id")
            kind = item.get("type", "message")
        if kind in CALL_KINDS:
            if item["call_id"] in previous_calls:
                raise _held_already("call_id", item["call_id"], f"input[{i}].call_id")
            known.add(item["call_id"])
            answered.discard(item["call_id"])
        elif kind == "mcp_call":
            known.add(item["id"])
        elif kind in OUTPUT_ITEMS:
            if item["call_id"] in answered:
                raise _held_already("call_id", item["call_id"], f"input[{i}].call_id")
            if item["call_id"] not in known:
                raise InvalidRequest(
                    f"no tool call with call_id {item['call_id'][:64]!r} comes before this output",
                    param=f"input[{i}].call_id",
                )
        items.append(item)
    messages = [*conversation, *items_to_messages(items)]
    return messages, StoredInput(req.previous_response_id, items, outputs)


def _held_already(key: str, value: str, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"Duplicate item found with {key} {value[:64]!r}: the conversation of "
        "previous_response_id holds it already; send only the items that follow it",
        param=param,
    )


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
        store, stored = await asked_for(self.services(), scope)
        asked = scope["path_params"]["response_id"]
        if scope["method"] == "DELETE":
            await store.delete(stored)
            await send_json(send, 200, {"id": asked, "object": "response", "deleted": True})
            return
        await send_json(send, 200, stored.response)
