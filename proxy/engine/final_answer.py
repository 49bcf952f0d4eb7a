"""The final-answer call of a run a limit stopped (SPEC §6.3, `final_answer: true`): one
tool-free call within what the run's budgets, invocations and time have left."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from proxy.deadline import Deadline
from proxy.engine.checkpoints import Checkpoints
from proxy.engine.final_message import FINAL_ANSWER_DIRECTIVE
from proxy.engine.model_call import call_model
from proxy.engine.policies.base import StepPlan
from proxy.engine.run_spec import Deps, RunSpec
from proxy.engine.state import RunState
from proxy.engine.values import ModelReply
from proxy.engine.voice import Voice
from proxy.errors import ClientDisconnected

log = logging.getLogger(__name__)


async def final_answer(
    spec: RunSpec,
    deps: Deps,
    voice: Voice,
    checkpoints: Checkpoints,
    run: RunState,
    offered: list[dict[str, Any]],
) -> ModelReply | None:
    """The answer's reply, or None: nothing is left for it, or the call failed before the
    client saw any of it (the run keeps its stop, and its text so far answers)."""
    plan = StepPlan(list(offered), "none" if offered else None, spec.max_completion_tokens)
    plan.extra_messages.append({"role": "system", "content": FINAL_ANSWER_DIRECTIVE})
    run.now = deps.clock()
    budget = spec.policy.time_budget
    left_s = None if budget is None else budget.value - run.elapsed_s
    if (left_s is not None and left_s <= 0) or not checkpoints.allows_final(run, plan):
        return None
    for extra in plan.extra_messages:
        run.append(extra)
    loop = asyncio.get_running_loop()
    deadline = None if left_s is None else Deadline(loop.time() + left_s)
    parts = voice.parts
    try:
        return await call_model(spec, deps, voice, run, plan, final=True)
    except asyncio.CancelledError:
        if deadline is None or not deadline.disarm():
            raise
        log.warning("run %s: the final answer took longer than its time budget", run.run_id)
    except ClientDisconnected:
        raise
    except Exception as exc:
        if voice.parts != parts:  # the client saw part of it: the run failed there
            raise
        # Else the stop stands: a limit's answer is no upstream failure.
        log.warning("run %s: the final answer failed: %s", run.run_id, exc)
    finally:
        if deadline is not None:
            deadline.disarm()
    del run.messages[-len(plan.extra_messages) :]  # no answer came after them
    del run.generated[-len(plan.extra_messages) :]
    return None
