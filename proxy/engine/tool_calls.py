"""Executing the tool calls of one reply (SPEC §5.1 steps 4 to 6): split server from client calls,
review each in order, run the admitted ones (in parallel batches when asked), and cut the reply
at the first terminal tool that succeeds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from proxy.engine import events as ev
from proxy.engine.checkpoints import Checkpoints
from proxy.engine.held_calls import held_calls, private_call_id
from proxy.engine.policies.base import Block
from proxy.engine.ports import ToolExecutor
from proxy.engine.state import RunState
from proxy.engine.stop import Stop, StopReason
from proxy.engine.values import (
    ModelReply,
    ToolCall,
    ToolContext,
    ToolOutcome,
    ToolResult,
    ToolSpec,
    error_content,
    tool_content,
)

log = logging.getLogger(__name__)

NOT_EXECUTED = "Not executed: the run has stopped."


@dataclass(frozen=True, slots=True)
class CallsEnded:
    """A reply's calls ended the run; `message` is the run's last message when they decided
    it (the client calls, or a terminal tool's output)."""

    stop: Stop
    message: dict[str, Any] | None = None


class ReplyCalls:
    """The calls of one reply: reviewed in order, the server's executed, the client's handed
    over (or held back with the server's results, SPEC §5.1.6)."""

    def __init__(
        self,
        tools: ToolExecutor,
        checkpoints: Checkpoints,
        server: Mapping[str, ToolSpec],
        client: Collection[str],
        terminal: Collection[str],
        parallel: bool,
        clock: Callable[[], float],
        emit: Callable[[ev.RunEvent], Awaitable[None]],
    ) -> None:
        self.tools = tools
        self.checkpoints = checkpoints
        self.server = server
        self.client = client
        self.terminal = terminal
        self.parallel = parallel
        self.clock = clock
        self.emit = emit

    def is_client_call(self, call: ToolCall) -> bool:
        """A call the client runs: one of its tools, or any call when the server has none. A
        call to a tool neither has is the server's, and gets an error result."""
        if call.name in self.server:
            return False
        return call.name in self.client or not self.server

    async def execute(self, run: RunState, reply: ModelReply) -> CallsEnded | None:
        """Runs the server calls of `reply` in order; None when the loop goes on. A client
        call the tool rules do not allow at its place in the reply is answered as a blocked
        server call is (SPEC §8); the others go back to the client."""
        answered: list[ToolCall] = []  # the calls the proxy answers, in the reply's order
        client: list[ToolCall] = []
        outputs: dict[str, str] = {}
        checked: dict[int, dict[str, Any]] = {}  # each admitted call's arguments, as checked
        batch: list[ToolCall] = []
        stop: Stop | None = None

        async def flush() -> None:
            nonlocal stop
            if len(batch) == 1:  # a lone call runs in this task: a task of its own costs more
                results = [await self._run(run, batch[0], checked.get(id(batch[0])))]
            elif batch:
                runs = (self._run(run, c, checked.get(id(c))) for c in batch)
                results = await asyncio.gather(*runs)
            else:
                return
            for call, result in zip(batch, results, strict=True):
                outputs[call.id] = tool_content(result)
                held = self.checkpoints.after_tool(run, call, result)
                stop = stop or held
            batch.clear()

        for call in reply.tool_calls:
            block: Block | None = None
            if self.is_client_call(call):
                if stop is not None:  # the run has stopped: it goes nowhere
                    continue
                block = await self.checkpoints.refusal(run, call)
                if block is None:
                    client.append(call)
                    continue
            answered.append(call)
            if stop is not None:  # an earlier call of this reply ended the run
                outputs[call.id] = error_content(NOT_EXECUTED)
                continue
            block = block or await self._review(run, call, checked)
            if block is not None:
                outputs[call.id] = error_content(block.message)
                await self.emit(
                    ev.CallBlocked(run.run_id, run.step_count, call, block.outcome, block.message)
                )
                stop = block.stop
                continue
            if self.parallel and not (
                call.name in self.terminal or self.checkpoints.decides_next(call)
            ):  # a terminal tool, or one whose output the next call's review reads, runs alone
                batch.append(call)
                continue
            await flush()
            result = await self._run(run, call, checked.get(id(call)))
            outputs[call.id] = tool_content(result)
            held = self.checkpoints.after_tool(run, call, result)
            stop = stop or held
            if stop is not None and stop.reason is StopReason.TERMINAL_TOOL:
                client = []  # the later calls of this reply are dropped, client ones too
                break
        await flush()

        earlier = [m for m in run.generated if m.get("role") in ("assistant", "tool")]
        if answered:
            message = dict(reply.message)
            message["tool_calls"] = [c.to_openai() for c in answered]
            run.append(message)
            for call in answered:
                run.append({"role": "tool", "tool_call_id": call.id, "content": outputs[call.id]})
        if stop is not None and stop.reason is StopReason.TERMINAL_TOOL:
            return CallsEnded(stop, {"role": "assistant", "content": run.messages[-1]["content"]})
        if stop is not None:
            return CallsEnded(stop)
        if client:
            return CallsEnded(
                Stop(StopReason.CLIENT_TOOL_CALL),
                self._hand_over(run, reply, client, answered, outputs, earlier),
            )
        return None

    def _hand_over(
        self,
        run: RunState,
        reply: ModelReply,
        client: list[ToolCall],
        answered: list[ToolCall],
        outputs: Mapping[str, str],
        earlier: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The message that gives the client its calls; what it is not shown is held
        (SPEC §5.1.6)."""
        message = dict(reply.message)
        given = client
        if self.server:  # ids of the proxy's own, whether or not this run held calls back
            given = [replace(c, id=private_call_id(c.id)) for c in client]
        if answered or earlier:
            renamed = {id(c): new.id for c, new in zip(client, given, strict=True)}
            ids = [renamed.get(id(c), c.id) for c in reply.tool_calls]
            run.held = held_calls(earlier, reply, ids, answered, outputs)
        message["tool_calls"] = [c.to_openai() for c in given]
        if run.held is not None and answered:  # the history keeps the reply as it came: its
            run.generated[-1 - len(answered)] = run.held["message"]  # calls in one message
        else:
            run.generated.append(message)
        return message

    async def _review(
        self, run: RunState, call: ToolCall, checked: dict[int, dict[str, Any]]
    ) -> Block | None:
        """The rules' review, then the limits'. A call whose arguments its tool refuses is
        let through to fail at once as a tool error, with no limit counting it (SPEC §9: only
        executed calls count); the arguments of one it takes are kept in `checked`."""
        if call.name not in self.server:
            allowed = ", ".join(sorted(self.server))
            return Block(f"Unknown tool '{call.name}'. Tools: {allowed}.", ToolOutcome.ERROR)
        block = await self.checkpoints.refusal(run, call)
        if block is not None:
            return block
        arguments = await self.tools.check(call)
        if isinstance(arguments, str):
            return None
        checked[id(call)] = arguments
        return await self.checkpoints.admit(run, call)

    async def _run(
        self, run: RunState, call: ToolCall, arguments: dict[str, Any] | None
    ) -> ToolResult:
        await self.emit(ev.ToolStarted(run.run_id, run.step_count, call))
        run.tool_calls += 1  # as it starts: a call cut short (the run cancelled or out of time) ran
        run.tools_ran = True
        started = self.clock()
        try:
            context = ToolContext(run.run_id, run.thread_id, run.step_count, call.id)
            result = await self.tools.execute(call, context, arguments)
        except Exception as exc:  # an executor bug is still only a tool error for the model
            log.exception("tool %s raised", call.name)
            result = ToolResult(f"tool failed: {type(exc).__name__}", ToolOutcome.ERROR)
        elapsed = self.clock() - started
        run.tools_s += elapsed
        run.steps[-1].tool_results.append(
            {"name": call.name, "output": result.output, "is_error": result.is_error}
        )
        await self.emit(ev.ToolExecuted(run.run_id, run.step_count, call, result, elapsed))
        return result
