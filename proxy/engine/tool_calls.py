"""Executing the tool calls of one reply (SPEC §5.1 steps 4 to 6): split server from client calls,
review each in order, run the admitted ones (in parallel batches when asked), and cut the reply
at the first terminal tool that succeeds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
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
    listed_names,
    tool_content,
)

log = logging.getLogger(__name__)
MAX_NAME_SHOWN = 64  # of a tool name the model made up, in the message that says so

NOT_EXECUTED = "Not executed: the run has stopped."
CUT_SHORT = "Cut short: the run stopped while this call was under way; it may have had effects."


@dataclass(frozen=True, slots=True)
class CallsEnded:
    """A reply's calls ended the run; `message` is the run's last message when they decided
    it (the client calls, or a terminal tool's output)."""

    stop: Stop
    message: dict[str, Any] | None = None


@dataclass(slots=True)
class _ReplyPass:
    """One reply's calls as they are gone through: those the proxy answers and those the
    client gets (each in the reply's order), the answers' contents by call id, the arguments
    of each admitted call as its tool checked them, the calls kept to run together, and the
    stop, once a call ended the run."""

    answered: list[ToolCall] = field(default_factory=list)
    client: list[ToolCall] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    checked: dict[int, dict[str, Any]] = field(default_factory=dict)
    batch: list[ToolCall] = field(default_factory=list)
    stop: Stop | None = None
    began: set[str] = field(default_factory=set)  # the ids of the calls that began to run


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
        max_output: int | None = None,
    ) -> None:
        self.tools = tools
        self.checkpoints = checkpoints
        self.server = server
        self.client = client
        self.terminal = terminal
        self.parallel = parallel
        self.max_output = max_output  # what the run's calls may give the model together
        self.output_left = max_output
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
        calls = _ReplyPass()
        earlier = [m for m in run.generated if m.get("role") in ("assistant", "tool")]
        try:
            for call in reply.tool_calls:
                if await self._go_through(run, calls, call):
                    break
            await self._flush(run, calls)
        except asyncio.CancelledError:  # the run's end (its time budget): what ran is kept
            self._record(run, reply, calls)
            if calls.batch:  # admitted, waiting for their batch: what they took goes back
                await asyncio.shield(self.checkpoints.unreserve(run, calls.batch))
            raise
        self._record(run, reply, calls)
        stop = calls.stop
        if stop is not None and stop.reason is StopReason.TERMINAL_TOOL:
            return CallsEnded(stop, {"role": "assistant", "content": run.messages[-1]["content"]})
        if stop is not None:
            return CallsEnded(stop)
        if calls.client:
            return CallsEnded(
                Stop(StopReason.CLIENT_TOOL_CALL),
                self._hand_over(run, reply, calls.client, calls.answered, calls.outputs, earlier),
            )
        return None

    @staticmethod
    def _record(run: RunState, reply: ModelReply, calls: _ReplyPass) -> None:
        """The reply's answered calls, each with its output, into the run's history; a call the
        run's end cut short is answered so (and one it stopped before it ran, as not executed),
        for the history to hold every call the reply made that the proxy went through."""
        if not calls.answered:
            return
        message = dict(reply.message)
        message["tool_calls"] = [c.to_openai() for c in calls.answered]
        run.append(message)
        outputs = calls.outputs
        for call in calls.answered:
            if call.id in outputs:
                content = outputs[call.id]
            else:  # cut as it ran, or before (under review, or waiting for its batch)
                content = error_content(CUT_SHORT if call.id in calls.began else NOT_EXECUTED)
            run.append({"role": "tool", "tool_call_id": call.id, "content": content})

    async def _go_through(self, run: RunState, calls: _ReplyPass, call: ToolCall) -> bool:
        """One call at its place in the reply: handed to the client, answered as blocked or not
        run, run now, or kept to run with the calls beside it. True when a terminal tool that
        succeeded drops the calls after it, the client's too."""
        block: Block | None = None
        if self.is_client_call(call):
            if calls.stop is not None:  # the run has stopped: it goes nowhere
                return False
            block = await self.checkpoints.refusal(run, call)
            if block is None:
                calls.client.append(call)
                return False
        calls.answered.append(call)
        if calls.stop is not None:  # an earlier call of this reply ended the run
            calls.outputs[call.id] = error_content(NOT_EXECUTED)
            return False
        block = block or await self._review(run, call, calls.checked)
        if block is not None:
            calls.outputs[call.id] = error_content(block.message)
            if block.outcome is ToolOutcome.BLOCKED_LIMIT:
                run.limited.add(call.name)
            await self.emit(
                ev.CallBlocked(run.run_id, run.step_count, call, block.outcome, block.message)
            )
            calls.stop = block.stop
            return False
        alone = call.name in self.terminal or self.checkpoints.decides_next(call)
        if self.parallel and not alone:  # (a terminal tool, or one the next review reads)
            calls.batch.append(call)
            return False
        await self._flush(run, calls)
        calls.began.add(call.id)
        result = await self._run(run, call, calls.checked.get(id(call)))
        stop = self._settle(run, calls, call, result)
        if stop is not None and stop.reason is StopReason.TERMINAL_TOOL:
            calls.client = []
            return True
        return False

    async def _flush(self, run: RunState, calls: _ReplyPass) -> None:
        """Runs the calls kept to run together, at once."""
        batch, calls.batch = calls.batch, []
        if not batch:
            return
        calls.began.update(c.id for c in batch)
        if len(batch) == 1:  # a lone call runs in this task: a task of its own costs more
            results = [await self._run(run, batch[0], calls.checked.get(id(batch[0])))]
        else:
            results = list(await asyncio.gather(*(self._run_kept(run, calls, c) for c in batch)))
        for call, result in zip(batch, results, strict=True):
            self._settle(run, calls, call, result)

    async def _run_kept(self, run: RunState, calls: _ReplyPass, call: ToolCall) -> ToolResult:
        """A call of a batch, its output kept as it ends: the run's end may cut the others."""
        result = await self._run(run, call, calls.checked.get(id(call)))
        calls.outputs[call.id] = tool_content(result)
        return result

    def _settle(
        self, run: RunState, calls: _ReplyPass, call: ToolCall, result: ToolResult
    ) -> Stop | None:
        """A call ran: its output kept, and the policies told; the run's stop, if any (the
        first one a call brought)."""
        calls.outputs[call.id] = tool_content(result)
        held = self.checkpoints.after_tool(run, call, result)
        calls.stop = calls.stop or held
        return calls.stop

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
            named, tools = call.name[:MAX_NAME_SHOWN], listed_names(sorted(self.server))
            return Block(f"Unknown tool '{named}'. Tools: {tools}.", ToolOutcome.ERROR)
        block = await self.checkpoints.refusal(run, call)
        if block is not None:
            return block
        arguments = await self.tools.check(call)
        if isinstance(arguments, str):
            return None
        checked[id(call)] = arguments
        return await self.checkpoints.admit(run, call)

    def _within_the_run_s_output(self, result: ToolResult) -> ToolResult:
        """`result`, or, when its output would pass what the run's calls may still give the
        model, a tool error saying so (the outputs of the calls before it are kept)."""
        assert self.output_left is not None
        output = result.output  # (an ASCII text's length is its size: no copy to measure it)
        size = len(output) if output.isascii() else len(output.encode("utf-8", "replace"))
        if size <= self.output_left:
            self.output_left -= size
            return result
        return ToolResult(
            f"the output ({size} bytes) was left out: the tool calls of a run may give the "
            f"model {self.max_output} bytes together (server.max_run_tool_output_bytes), and "
            f"{self.output_left} are left",
            ToolOutcome.ERROR,
        )

    async def _run(
        self, run: RunState, call: ToolCall, arguments: dict[str, Any] | None
    ) -> ToolResult:
        try:
            await self.emit(ev.ToolStarted(run.run_id, run.step_count, call))
        except asyncio.CancelledError:  # (a stream that showed it was cut): it never ran
            await asyncio.shield(self.checkpoints.unreserve(run, [call]))
            raise
        run.tool_calls += 1  # as it starts: a call cut short (the run cancelled or out of time) ran
        run.tools_ran = True
        started = self.clock()
        run.tool_began(started)
        try:
            context = ToolContext(run.run_id, run.thread_id, run.step_count, call.id)
            result = await self.tools.execute(call, context, arguments)
        except Exception as exc:  # an executor bug is still only a tool error for the model
            log.exception("tool %s raised", call.name)
            result = ToolResult(f"tool failed: {type(exc).__name__}", ToolOutcome.ERROR)
        finally:
            run.tool_ended(self.clock())
        given = result  # what the model reads: the call counts as it ended (its tool's health)
        ends_run = call.name in self.terminal and not result.is_error
        if self.output_left is not None and not ends_run:
            given = self._within_the_run_s_output(result)
        elapsed = self.clock() - started
        run.steps[-1].tool_results.append(
            {"name": call.name, "output": given.output, "is_error": given.is_error}
        )
        ended = result.outcome if given is not result else None
        await self.emit(ev.ToolExecuted(run.run_id, run.step_count, call, given, elapsed, ended))
        return given
