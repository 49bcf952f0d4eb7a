"""`POST /v1/chat/completions` as a raw ASGI app: read, plan, run, render. Errors it raises are
rendered by the app's `ErrorBoundary`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token, header, send_json
from proxy.api.auth import Caller
from proxy.api.chat_request import ChatRequest, parse_chat_request
from proxy.api.completion import completion_body, completion_id
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
from proxy.api.services import Services
from proxy.api.sse import SSEWriter
from proxy.api.upstream_param import ClientTerms
from proxy.engine.run import Run
from proxy.engine.run_spec import RunResult
from proxy.engine.stop import StopReason
from proxy.errors import ClientDisconnected, ShuttingDown

_THREAD_HEADER = THREAD_HEADER.encode()


class ChatCompletions:
    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sv = self.services()
        bearer = bearer_token(scope)
        caller = sv.keys.caller(bearer)
        thread = header(scope, _THREAD_HEADER)
        req = await read_json(
            receive, scope, sv.config.server, lambda raw: parse_chat_request(raw, thread)
        )
        plan = await sv.plan(req.run, caller)
        deps = sv.deps(plan.upstream, bearer, scope["path"])
        spec = plan.spec
        if spec.policy.tools:
            spec.messages = await sv.restore(spec.messages, caller)
        owner = plan.agent or req.run.model
        include = req.run.loop.include_messages
        headers = run_headers(spec.run_id)
        if req.stream:
            writer = SSEWriter(
                send,
                completion_id(spec.run_id),
                spec.model,
                headers,
                req.run.loop.include_loop_events,
            )
            run = Run(spec, deps, writer, keep=sv.keep_held(spec, caller))
            await self._stream(run, writer, req, receive, sv, owner, caller)
            return
        run = Run(spec, deps, keep=sv.keep_held(spec, caller))
        reported = partial(loop_report, include_messages=include)
        ended = await sv.execute(run, receive)
        drain_end = drain_end_answer(send, headers, reported)
        result = await sv.answerable(run, ended, reported, owner, caller, drain_end=drain_end)
        if result is None:
            return
        with_stop_reason(headers, result)
        report = loop_report(result, include)
        await sv.remember(result, report, owner, caller)
        if failed(result):
            await send_failure(send, result, report, headers, _terms(req))
            return
        passthrough = not spec.policy.tools and not req.run.has_loop
        await send_json(
            send, 200, completion_body(result, spec.model, report, passthrough), headers
        )

    async def _stream(
        self,
        run: Run,
        writer: SSEWriter,
        req: ChatRequest,
        receive: Receive,
        sv: Services,
        owner: str,
        caller: Caller | None,
    ) -> None:
        include = req.run.loop.include_messages
        reported = partial(loop_report, include_messages=include)

        async def fail(error: ShuttingDown, ended: RunResult) -> None:
            await writer.fail(error.body(), reported(ended))

        ended = await sv.execute_streamed(run, writer, receive)
        drain_end = stream_drain_end(writer, fail, reported)
        result = await sv.answerable(run, ended, reported, owner, caller, drain_end=drain_end)
        if result is None:
            return
        with_stop_reason(writer.headers, result)
        report = loop_report(result, include)
        await sv.remember(result, report, owner, caller)
        try:
            if failed(result):
                if not writer.started:
                    await send_failure(writer.send, result, report, writer.headers, _terms(req))
                    return
                await writer.fail(failure_error(result, _terms(req)).body(), report)
                return
            text = result.message.get("content")
            if run.one_document and isinstance(text, str) and text:
                await writer.content(text)  # held back until now: one JSON document
            if result.stop.reason is StopReason.CLIENT_TOOL_CALL:
                await writer.tool_calls(result.message.get("tool_calls") or [])
            usage = result.usage.to_openai() if req.include_usage else None
            refusal = result.message.get("refusal")
            await writer.finish(result.finish_reason, report, usage, refusal)
        except ClientDisconnected:
            return


def _terms(req: ChatRequest) -> ClientTerms:
    return ClientTerms(req.run.messages, req.run.client_tools)
