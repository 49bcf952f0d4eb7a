"""One call to the model within a run: the request a step sends, and what the run keeps of the
reply (its usage, cost and step record), told to observers before and after."""

from __future__ import annotations

from proxy.engine import events as ev
from proxy.engine.policies.base import StepPlan
from proxy.engine.run_spec import Deps, RunSpec
from proxy.engine.state import RunState, StepRecord
from proxy.engine.values import ModelReply, ModelRequest
from proxy.engine.voice import Voice


async def call_model(
    spec: RunSpec, deps: Deps, voice: Voice, run: RunState, plan: StepPlan, *, final: bool
) -> ModelReply:
    """Calls the model for the run's next step. A `final` call (the answer after a limit stop)
    records its reply's tool calls as none: they are never run."""
    index = run.step_count + 1
    request = ModelRequest(
        model=spec.model,
        messages=list(run.messages),
        tools=plan.tools,
        tool_choice=plan.tool_choice,
        max_completion_tokens=plan.max_completion_tokens,
        stream=voice.stream is not None,
        params=spec.params,
        step=index,
    )
    clock = deps.clock
    started = clock()
    await voice.emit(ev.StepStarted(run.run_id, index, request, started))
    run.invocations += 1
    run.last_request = request
    try:
        reply = await deps.model.complete(request, voice.step_sink())
    except BaseException as exc:
        elapsed = clock() - started
        run.upstream_s += elapsed
        voice.notify(ev.ModelFailed(run.run_id, index, exc, elapsed))
        raise
    elapsed = clock() - started
    run.upstream_s += elapsed
    cost = reply.reported_cost_usd
    if cost is None:
        cost = deps.prices.cost(spec.model, reply.usage)
    run.usage.add(reply.usage)
    run.add_cost(cost)
    calls = [] if final else reply.tool_calls
    run.steps.append(
        StepRecord(index, list(calls), [], reply.usage, cost, reply.finish_reason, reply.text)
    )
    run.last_reply = reply
    await voice.emit(ev.ModelReplied(run.run_id, index, reply, cost, elapsed))
    return reply
