"""The tool loop: call the model, run the server's tools, repeat until a policy stops the run."""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from proxy.deadline import Deadline
from proxy.engine import events as ev
from proxy.engine.checkpoints import Checkpoints
from proxy.engine.failures import ending_for
from proxy.engine.final_answer import final_answer
from proxy.engine.final_message import Ending, final_message, without_tool_calls
from proxy.engine.keeping import ended_well, to_its_end
from proxy.engine.model_call import call_model
from proxy.engine.policies.base import Nudge, StepPlan
from proxy.engine.policies.stop_conditions import Condition
from proxy.engine.policies.terminal import terminal_hint
from proxy.engine.ports import RunStream
from proxy.engine.run_spec import Deps, Keep, RunResult, RunSpec
from proxy.engine.state import RunState
from proxy.engine.stop import Stop, StopReason
from proxy.engine.tool_calls import CallsEnded, ReplyCalls
from proxy.engine.values import ModelReply
from proxy.engine.voice import Voice
from proxy.errors import without_frames

log = logging.getLogger(__name__)


class Run:
    """One run of the tool loop (SPEC §5): steps until a policy, the model or a failure stops
    it; `stream` hears what a streaming client sees as it happens."""

    def __init__(
        self,
        spec: RunSpec,
        deps: Deps,
        stream: RunStream | None = None,
        keep: Keep | None = None,
    ) -> None:
        self.spec = spec
        self.deps = deps
        self.stream = stream
        # What the caller keeps of a run that did not fail (a stored context's messages), before
        # the run is told as ended: a StateUnavailable it raises ends the run so, everywhere.
        self.keep = keep
        self.one_document = spec.one_document  # its text sent whole at the end (a stream's)
        self.voice = Voice(deps.observers, stream, quiet=self.one_document)
        self.result: RunResult | None = None  # once it ended, however (a cancelled run too)
        policy = spec.policy
        # Every tool the model may see: the server's, then the client's.
        self.offered = [t.definition for t in policy.tools.values()] + spec.client_tools
        self.checkpoints = Checkpoints(
            policy.build(
                deps.prices.prices(spec.model),
                deps.checks,
                deps.threads,
                partial(_condition_failed, self.voice),
            )
        )
        client = {t["function"]["name"] for t in spec.client_tools}
        self.calls = ReplyCalls(
            deps.tools,
            self.checkpoints,
            policy.tools,
            client,
            policy.terminal_tools,
            bool(policy.parallel_tool_calls),
            deps.clock,
            self.voice.emit,
            spec.max_tool_output,
        )

    async def execute(self) -> RunResult:
        """Runs to its stop, and says how it ended; a failure is a result too (its stop
        reason and error), never an exception, but for the run's cancellation."""
        spec, clock = self.spec, self.deps.clock
        started = clock()
        run = RunState(
            spec.run_id, spec.model, started, self._first_messages(), spec.thread_id, started
        )
        run.one_document = self.one_document
        self.voice.notify(
            ev.RunStarted(spec.run_id, spec.agent, spec.model, spec.thread_id, started)
        )
        ending = Ending(Stop(StopReason.INTERNAL_ERROR), {"role": "assistant"}, None)
        error: BaseException | None = None
        keeping: asyncio.Future[None] | None = None
        try:
            ending = await self._loop(run)
            if self.keep is not None and not ending.stop.is_policy_failure:
                run.now = clock()
                keeping = asyncio.ensure_future(self.keep(RunResult.of(run, ending, None)))
                await to_its_end(keeping, self.deps.keep_grace_s)
        except asyncio.CancelledError:
            if not ended_well(keeping):  # (kept as the client left: the run ended as it did)
                ending = Ending(Stop(StopReason.CANCELLED, {"step": run.step_count}), {}, None)
            raise
        except Exception as exc:
            ending, error = ending_for(exc, spec.run_id, run.step_count), exc
        finally:
            run.now = clock()
            self.voice.notify(ev.RunFinished.of(run, spec.agent, ending.stop, error))
            self.result = RunResult.of(run, ending, error)
            if error is not None:  # told and logged: its frames would hold this run
                without_frames(error)
        return self.result

    async def _loop(self, run: RunState) -> Ending:
        checkpoints = self.checkpoints
        budget = self.spec.policy.time_budget
        while True:
            plan = StepPlan(
                list(self.offered),
                self.spec.client_tool_choice if run.step_count == 0 else None,
                self.spec.max_completion_tokens,
            )
            run.now = self.deps.clock()
            stop = checkpoints.before_step(run, plan)
            if stop is not None:
                return await self._end(run, stop)
            for extra in plan.extra_messages:
                run.append(extra)
            if budget is None:
                outcome = await self._step(run, plan)
            else:
                outcome = await self._step_within(budget, run, plan)
            if outcome is not None:
                return await self._end(run, outcome.stop, outcome.message)
            run.now = self.deps.clock()
            stop = await checkpoints.after_step(run)
            if stop is not None:
                return await self._end(run, stop)

    async def _step_within(
        self, budget: Condition, run: RunState, plan: StepPlan
    ) -> CallsEnded | None:
        """A step within the run's time budget, which holds while the run waits on the upstream
        and on tools: cut at its deadline, the step ends the run (`time_budget`)."""
        loop = asyncio.get_running_loop()
        deadline = Deadline(loop.time() + budget.value - run.elapsed_s)
        try:
            return await self._step(run, plan)
        except asyncio.CancelledError:
            if not deadline.disarm():
                raise
            run.now = self.deps.clock()
            held = budget.held(StopReason.TIME_BUDGET, round(run.elapsed_s, 3), run)
            return CallsEnded(Stop(held.reason, held.details))
        finally:
            deadline.disarm()

    async def _step(self, run: RunState, plan: StepPlan) -> CallsEnded | None:
        """One upstream call and its tool calls; how the run ends, if this step ends it."""
        checkpoints = self.checkpoints
        reply = await call_model(self.spec, self.deps, self.voice, run, plan, final=False)
        stop = checkpoints.after_reply(run, plan, reply)
        if stop is not None:
            run.append(without_tool_calls(reply.message))
            return CallsEnded(stop)
        if reply.tool_calls:
            return await self.calls.execute(run, reply)
        run.append(reply.message)
        if reply.finish_reason == "content_filter":
            return CallsEnded(Stop(StopReason.CONTENT_FILTER))
        verdict = checkpoints.after_reply_without_tools(run, reply)
        if not isinstance(verdict, Nudge):
            return CallsEnded(verdict or Stop(StopReason.COMPLETED))
        run.append({"role": "system", "content": verdict.message})
        await self.voice.emit(ev.Nudged(run.run_id, run.step_count, verdict.message))
        return None

    def _first_messages(self) -> list[dict[str, Any]]:
        parts = [self.spec.system_prompt] if self.spec.system_prompt else []
        policy = self.spec.policy  # (a client tool's call ends the run anyway, its output unseen)
        if policy.terminal_tools and (
            terminal := [name for name in policy.terminal_tools if name in policy.tools]
        ):
            parts.append(terminal_hint(terminal))
        messages = list(self.spec.messages)
        if parts:
            messages.insert(0, {"role": "system", "content": "\n\n".join(parts)})
        return messages

    async def _end(
        self, run: RunState, stop: Stop, decided: dict[str, Any] | None = None
    ) -> Ending:
        if "condition" in stop.details and stop.reason is not StopReason.CONDITION_ERROR:
            self.voice.notify(ev.ConditionHeld(run.run_id, run.step_count, stop.details))

        async def answer() -> ModelReply | None:
            return await final_answer(
                self.spec, self.deps, self.voice, self.checkpoints, run, self.offered
            )

        return await final_message(
            run,
            stop,
            decided,
            run.last_reply,
            final_answer=answer if self.spec.policy.final_answer else None,
            say=self.voice.say,
        )


def _condition_failed(voice: Voice, run: RunState, path: str, reason: str) -> None:
    # A function of the voice, not a method of the run: policies hold it, and a bound method
    # would make every run a reference cycle.
    log.warning("run %s: stop condition %s failed: %s", run.run_id, path, reason)
    voice.notify(ev.ConditionFailed(run.run_id, run.step_count, path, reason))
