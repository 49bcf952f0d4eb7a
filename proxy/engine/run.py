"""The tool loop: call the model, run the server's tools, repeat until a policy stops the run."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.engine import events as ev
from proxy.engine.policies.base import Block, Nudge, Policy, StepPlan
from proxy.engine.policies.terminal import terminal_hint
from proxy.engine.policy import LoopPolicy
from proxy.engine.ports import (
    ChatModel,
    ConditionChecks,
    ModelReply,
    ModelRequest,
    PriceBook,
    RunObserver,
    RunStream,
    ThreadCounters,
    ToolCall,
    ToolContext,
    ToolExecutor,
    ToolResult,
)
from proxy.engine.state import RunState, StepRecord
from proxy.engine.stop import FINISH_REASONS, LIMIT_STOPS, Stop, StopReason
from proxy.engine.usage import Usage
from proxy.errors import ClientDisconnected, UpstreamFailure

log = logging.getLogger(__name__)

FINAL_ANSWER_DIRECTIVE = (
    "You cannot call tools any more. Answer the user now, from what is known so far."
)


@dataclass(slots=True)
class RunSpec:
    """Everything one run needs that the client or the config decided."""

    run_id: str
    model: str  # the upstream model name
    messages: list[dict[str, Any]]
    policy: LoopPolicy
    agent: str | None = None
    system_prompt: str | None = None
    client_tools: list[dict[str, Any]] = field(default_factory=list)
    client_tool_choice: Any = None
    max_completion_tokens: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    thread_id: str | None = None
    route: str = "/v1/chat/completions"


@dataclass(slots=True)
class Deps:
    model: ChatModel
    tools: ToolExecutor
    prices: PriceBook
    observers: Sequence[RunObserver] = ()
    checks: ConditionChecks | None = None
    clock: Callable[[], float] = time.monotonic
    threads: ThreadCounters | None = None


@dataclass(slots=True)
class RunResult:
    run_id: str
    stop: Stop
    message: dict[str, Any]
    finish_reason: str | None
    usage: Usage
    cost_usd: float | None
    steps: int
    tool_calls: int
    generated: list[dict[str, Any]]
    tools_ran: bool
    last_reply: ModelReply | None = None
    error: BaseException | None = None


class Run:
    def __init__(self, spec: RunSpec, deps: Deps, stream: RunStream | None = None) -> None:
        self.spec = spec
        self.deps = deps
        self.stream = stream
        self.policy = spec.policy
        self.terminal = spec.policy.terminal_tools
        # Every tool the model may see: the server's, then the client's.
        self.offered = [t.definition for t in spec.policy.tools.values()] + spec.client_tools
        self.policies: list[Policy] = spec.policy.build(
            deps.prices.prices(spec.model), deps.checks, deps.threads
        )
        self.client_names = {
            t["function"]["name"] for t in spec.client_tools if isinstance(t.get("function"), dict)
        }
        self.last_reply: ModelReply | None = None

    # -- the loop -------------------------------------------------------------------------

    async def execute(self) -> RunResult:
        spec, clock = self.spec, self.deps.clock
        started = clock()
        state = RunState(
            spec.run_id, spec.model, started, self._initial_messages(), spec.thread_id, started
        )
        self._emit(ev.RunStarted(spec.run_id, spec.agent, spec.model, spec.thread_id, started))
        stop = Stop(StopReason.INTERNAL_ERROR)
        message: dict[str, Any] = {"role": "assistant", "content": None}
        finish: str | None = None
        error: BaseException | None = None
        try:
            stop, message, finish = await self._loop(state)
        except asyncio.CancelledError:
            stop = Stop(StopReason.CANCELLED, {"step": state.step_count})
            raise
        except ClientDisconnected as exc:
            stop, error = Stop(StopReason.CANCELLED, {"step": state.step_count}), exc
        except Exception as exc:
            error = exc
            if isinstance(exc, UpstreamFailure):
                stop = Stop(
                    StopReason.UPSTREAM_ERROR, {"error": str(exc), "step": state.step_count}
                )
            else:
                log.exception("run %s failed", spec.run_id)
                stop = Stop(StopReason.INTERNAL_ERROR, {"step": state.step_count})
        finally:
            state.now = clock()
            self._emit(
                ev.RunFinished(
                    spec.run_id,
                    spec.agent,
                    spec.model,
                    stop,
                    state.step_count,
                    state.tool_calls,
                    state.usage,
                    state.cost_usd,
                    state.elapsed_s,
                    state.upstream_s,
                    state.tools_s,
                    error,
                    spec.route,
                )
            )
        return RunResult(
            spec.run_id,
            stop,
            message,
            finish,
            state.usage,
            state.cost_usd,
            state.step_count,
            state.tool_calls,
            state.generated,
            state.tools_ran,
            self.last_reply,
            error,
        )

    async def _loop(self, run: RunState) -> tuple[Stop, dict[str, Any], str | None]:
        while True:
            plan = self._plan(run)
            run.now = self.deps.clock()
            for policy in self.policies:
                stop = policy.before_step(run, plan)
                if stop is not None:
                    return await self._finish(run, stop)
            for extra in plan.extra_messages:
                run.append(extra)
            reply = await self._call_model(run, plan)
            for policy in self.policies:
                stop = policy.after_reply(run, plan, reply)
                if stop is not None:
                    run.append(_without_tool_calls(reply.message))
                    return await self._finish(run, stop)
            if not reply.tool_calls:
                run.append(reply.message)
                if reply.finish_reason == "content_filter":
                    return Stop(StopReason.CONTENT_FILTER), reply.message, reply.finish_reason
                nudge = None
                for policy in self.policies:
                    verdict = policy.after_reply_without_tools(run, reply)
                    if isinstance(verdict, Stop):
                        return await self._finish(run, verdict)
                    if isinstance(verdict, Nudge):
                        nudge = verdict
                        break
                if nudge is None:
                    return Stop(StopReason.COMPLETED), reply.message, reply.finish_reason
                await self._nudge(run, nudge)
            else:
                outcome = await self._run_tools(run, reply)
                if outcome is not None:
                    return outcome
            run.now = self.deps.clock()
            for policy in self.policies:
                stop = await policy.after_step(run)
                if stop is not None:
                    self._emit(ev.ConditionHeld(run.run_id, run.step_count, stop.details))
                    return await self._finish(run, stop)

    def _plan(self, run: RunState) -> StepPlan:
        choice = self.spec.client_tool_choice if run.step_count == 0 else None
        return StepPlan(list(self.offered), choice, self.spec.max_completion_tokens)

    def _initial_messages(self) -> list[dict[str, Any]]:
        parts = [self.spec.system_prompt] if self.spec.system_prompt else []
        if self.terminal:
            parts.append(terminal_hint(self.terminal))
        messages = list(self.spec.messages)
        if parts:
            messages.insert(0, {"role": "system", "content": "\n\n".join(parts)})
        return messages

    # -- one upstream call ------------------------------------------------------------------

    async def _call_model(
        self, run: RunState, plan: StepPlan, *, final_answer: bool = False
    ) -> ModelReply:
        index = run.step_count + 1
        request = ModelRequest(
            model=self.spec.model,
            messages=list(run.messages),
            tools=plan.tools,
            tool_choice=plan.tool_choice,
            max_completion_tokens=plan.max_completion_tokens,
            stream=self.stream is not None,
            params=self.spec.params,
            step=index,
        )
        clock = self.deps.clock
        started = clock()
        self._emit(ev.StepStarted(run.run_id, index, request, started))
        if self.stream is not None:
            await self.stream.loop_event({"type": "step_started", "step": index})
        run.invocations += 1
        on_delta = self.stream.content if self.stream is not None else None
        try:
            reply = await self.deps.model.complete(request, on_delta)
        except BaseException as exc:
            run.upstream_s += clock() - started
            self._emit(ev.ModelFailed(run.run_id, index, exc, clock() - started))
            raise
        elapsed = clock() - started
        run.upstream_s += elapsed
        if reply.reported_cost_usd is not None:
            cost: float | None = reply.reported_cost_usd
        else:
            cost = self.deps.prices.cost(self.spec.model, reply.usage)
        run.usage.add(reply.usage)
        run.add_cost(cost)
        calls = [] if final_answer else reply.tool_calls
        run.steps.append(
            StepRecord(index, list(calls), [], reply.usage, cost, reply.finish_reason, reply.text)
        )
        self.last_reply = reply
        self._emit(ev.ModelReplied(run.run_id, index, reply, cost, elapsed))
        return reply

    # -- tools -------------------------------------------------------------------------------

    def _is_client_call(self, call: ToolCall) -> bool:
        if call.name in self.policy.tools:
            return False
        return call.name in self.client_names or not self.policy.tools

    async def _run_tools(
        self, run: RunState, reply: ModelReply
    ) -> tuple[Stop, dict[str, Any], str | None] | None:
        server = [c for c in reply.tool_calls if not self._is_client_call(c)]
        client = [c for c in reply.tool_calls if self._is_client_call(c)]
        outputs: dict[str, str] = {}
        batch: list[ToolCall] = []
        stop: Stop | None = None

        async def flush() -> None:
            nonlocal stop
            results = await asyncio.gather(*(self._execute(run, c) for c in batch))
            for call, result in zip(batch, results, strict=True):
                outputs[call.id] = _tool_content(result)
                stop = self._after_tool(run, call, result) or stop
            batch.clear()

        for index, call in enumerate(server):
            if stop is not None:  # an earlier call of this reply ended the run
                outputs[call.id] = _error_content("Not executed: the run has stopped.")
                continue
            block = await self._review(run, call)
            if block is not None:
                outputs[call.id] = _error_content(block.message)
                self._emit(
                    ev.CallBlocked(run.run_id, run.step_count, call, block.outcome, block.message)
                )
                stop = block.stop
                continue
            terminal = call.name in self.terminal
            if self.policy.parallel_tool_calls and not terminal:
                batch.append(call)
                continue
            await flush()
            result = await self._execute(run, call)
            outputs[call.id] = _tool_content(result)
            stop = self._after_tool(run, call, result) or stop
            if stop is not None and stop.reason is StopReason.TERMINAL_TOOL:
                server = server[: index + 1]
                client = []  # the later calls of this reply are dropped, client ones too
                break
        await flush()

        if server:
            message = dict(reply.message)
            message["tool_calls"] = [c.to_openai() for c in server]
            run.append(message)
            for call in server:
                run.append({"role": "tool", "tool_call_id": call.id, "content": outputs[call.id]})
        if stop is not None and stop.reason is StopReason.TERMINAL_TOOL:
            output = run.messages[-1]["content"]
            if self.stream is not None:
                await self.stream.content(output)
            return stop, {"role": "assistant", "content": output}, FINISH_REASONS[stop.reason]
        if stop is not None:
            return await self._finish(run, stop)
        if client:
            message = dict(reply.message)
            if server:
                message["content"] = None
            message["tool_calls"] = [c.to_openai() for c in client]
            run.generated.append(message)
            return Stop(StopReason.CLIENT_TOOL_CALL), message, "tool_calls"
        return None

    async def _review(self, run: RunState, call: ToolCall) -> Block | None:
        if call.name not in self.policy.tools:
            allowed = ", ".join(sorted(self.policy.tools))
            return Block(f"Unknown tool '{call.name}'. Tools: {allowed}.", outcome="error")
        for policy in self.policies:
            block = await policy.review_call(run, call)
            if block is not None:
                return block
        for policy in self.policies:
            policy.admit(run, call)
        return None

    def _after_tool(self, run: RunState, call: ToolCall, result: ToolResult) -> Stop | None:
        stop = None
        for policy in self.policies:
            stop = policy.after_tool(run, call, result) or stop
        return stop

    async def _execute(self, run: RunState, call: ToolCall) -> ToolResult:
        clock = self.deps.clock
        if self.stream is not None:
            await self.stream.loop_event(
                {"type": "tool_call", "step": run.step_count, "tool": call.name, "call_id": call.id}
            )
        started = clock()
        try:
            result = await self.deps.tools.execute(
                call, ToolContext(run.run_id, run.thread_id, run.step_count, call.id)
            )
        except Exception as exc:  # an executor bug is still only a tool error for the model
            log.exception("tool %s raised", call.name)
            result = ToolResult(f"tool failed: {type(exc).__name__}", "error")
        elapsed = clock() - started
        run.tool_calls += 1
        run.tools_ran = True
        run.tools_s += elapsed
        run.steps[-1].tool_results.append(
            {"name": call.name, "output": result.output, "is_error": result.is_error}
        )
        self._emit(ev.ToolExecuted(run.run_id, run.step_count, call, result, elapsed))
        if self.stream is not None:
            await self.stream.loop_event(
                {
                    "type": "tool_result",
                    "step": run.step_count,
                    "tool": call.name,
                    "call_id": call.id,
                    "outcome": result.outcome,
                }
            )
        return result

    async def _nudge(self, run: RunState, nudge: Nudge) -> None:
        run.append({"role": "system", "content": nudge.message})
        self._emit(ev.Nudged(run.run_id, run.step_count, nudge.message))
        if self.stream is not None:
            await self.stream.loop_event({"type": "nudge", "step": run.step_count})

    # -- the end -----------------------------------------------------------------------------

    async def _finish(self, run: RunState, stop: Stop) -> tuple[Stop, dict[str, Any], str | None]:
        if stop.is_failure:
            return stop, {"role": "assistant", "content": None}, None
        if stop.reason in LIMIT_STOPS and self.policy.final_answer:
            directive = {"role": "system", "content": FINAL_ANSWER_DIRECTIVE}
            run.append(directive)
            choice = "none" if self.offered else None
            plan = StepPlan(list(self.offered), choice, self.spec.max_completion_tokens)
            reply = await self._call_model(run, plan, final_answer=True)
            message = _without_tool_calls(reply.message)
            run.append(message)
            details = dict(stop.details, final_answer=True)
            stop = Stop(stop.reason, details, stop.error_code)
            return stop, message, FINISH_REASONS[stop.reason]
        text = run.last_text
        if stop.reason is StopReason.TOOL_CALL_LIMIT:
            text = stop.details.get("message", text)  # the final message states the limit hit
        message = {"role": "assistant", "content": text}
        if stop.reason in FINISH_REASONS:
            return stop, message, FINISH_REASONS[stop.reason]
        return stop, message, self.last_reply.finish_reason if self.last_reply else None

    def _emit(self, event: ev.RunEvent) -> None:
        for observer in self.deps.observers:
            try:
                observer.on_event(event)
            except Exception:  # telemetry never breaks a run
                log.exception("observer %r failed on %s", observer, type(event).__name__)


def _without_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "tool_calls"}


def _error_content(message: str) -> str:
    return orjson.dumps({"error": message}).decode()


def _tool_content(result: ToolResult) -> str:
    return _error_content(result.output) if result.is_error else result.output
