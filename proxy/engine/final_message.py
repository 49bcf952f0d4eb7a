"""The message a run ends with (SPEC §5.3, §6.3), decided in one place for every stop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from proxy.engine.state import RunState
from proxy.engine.stop import FINISH_REASONS, LIMIT_STOPS, Stop, StopReason
from proxy.engine.values import ModelReply

FINAL_ANSWER_DIRECTIVE = (
    "You cannot call tools any more. Answer the user now, from what is known so far."
)


@dataclass(frozen=True, slots=True)
class Ending:
    stop: Stop
    message: dict[str, Any]
    finish_reason: str | None


def stated_stop(stop: Stop) -> str:
    """One sentence that states a limit stop, for a run that has no text to give."""
    details = stop.details
    threshold = details.get("threshold")
    reason = stop.reason
    if reason is StopReason.MAX_STEPS:
        return f"Stopped: the run reached its step limit ({_counted(threshold, 'step')})."
    if reason is StopReason.TOKEN_BUDGET:
        return f"Stopped: the run reached its token budget ({_counted(threshold, 'token')})."
    if reason is StopReason.COST_BUDGET:
        return f"Stopped: the run reached its cost budget ({threshold} USD)."
    if reason is StopReason.TIME_BUDGET:
        return f"Stopped: the run reached its time budget ({threshold} s)."
    if reason is StopReason.TOOL_CALLED:
        called = ", ".join(details.get("observed") or ())
        return f"Stopped: the run called {called}."
    if reason is StopReason.CONDITION_ERROR:
        return f"Stopped: the stop condition {details.get('condition')} could not be evaluated."
    if reason is StopReason.MAX_INVOCATIONS:
        return f"Stopped: the run reached its limit of model calls (max_invocations: {threshold})."
    if reason is StopReason.NUDGES_EXHAUSTED:
        return (
            "Stopped: the model answered without calling a terminating tool after "
            f"{_counted(threshold, 'nudge')} (consecutive_nudges)."
        )
    if reason is StopReason.TOOL_CALL_LIMIT:  # (the model read its own message: not for users)
        scope = "thread" if details.get("kind") == "thread_limit" else "run"
        observed = details.get("observed")
        counted = f"{scope}: {observed}/{threshold}" if observed is not None else scope
        tool = details.get("tool")
        return f"Stopped: the run reached a tool call limit ({counted}) calling {tool}."
    return f"Stopped: the stop condition {details.get('condition')} held."


def _counted(count: object, unit: str) -> str:
    return f"{count} {unit}" if count == 1 else f"{count} {unit}s"


def without_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "tool_calls"}


async def final_message(
    run: RunState,
    stop: Stop,
    decided: dict[str, Any] | None,
    last_reply: ModelReply | None,
    *,
    final_answer: Callable[[], Awaitable[ModelReply | None]] | None,
    say: Callable[[str], Awaitable[None]],
) -> Ending:
    """The run's last message for `stop`.

    `decided` is the message a step already chose (client calls, a terminal tool's output);
    `final_answer`, when the policy asks for one, makes the last tool-free call (None: none
    could be made, and the text so far answers); `say` streams text the client has not seen
    yet."""
    if stop.is_policy_failure:
        return Ending(stop, {"role": "assistant", "content": None}, None)
    if stop.reason is StopReason.CLIENT_TOOL_CALL and decided is not None:
        # Its text is every step's, as the stream said it (the calls' reply's alone was not).
        message = {**decided, "content": run.text or decided.get("content")}
        return Ending(stop, message, FINISH_REASONS[stop.reason])
    if stop.reason is StopReason.TERMINAL_TOOL and decided is not None:
        await say(decided["content"])
        run.generated.append(decided)
        return Ending(stop, decided, FINISH_REASONS[stop.reason])
    if stop.reason in LIMIT_STOPS:
        if final_answer is not None:
            reply = await final_answer()
            if reply is not None:
                message = without_tool_calls(reply.message)
                if not message.get("content"):  # it called a tool anyway, or said nothing
                    message = {"role": "assistant", "content": stated_stop(stop)}
                    await say(message["content"])
                run.append(message)
                stop = replace(stop, details={**stop.details, "final_answer": True})
                return Ending(stop, message, FINISH_REASONS[stop.reason])
            stop = replace(stop, details={**stop.details, "final_answer": False})
        text = run.text
        # A 200 reply is never empty; a tool call limit's stop is stated after the text so far,
        # as the stream says it, never after a document (`one_document`): that is the answer.
        if not text or (stop.reason is StopReason.TOOL_CALL_LIMIT and not run.one_document):
            stated = stated_stop(stop)
            await say(stated)
            run.generated.append({"role": "assistant", "content": stated})
            text = f"{text}\n\n{stated}" if text else stated
        return Ending(stop, {"role": "assistant", "content": text}, FINISH_REASONS[stop.reason])
    # Calls of the last reply, if any, were the server's and have run: a client would run them
    # again (a `finish_reason_is: tool_calls` condition holds after them).
    message = without_tool_calls(last_reply.message) if last_reply else {"role": "assistant"}
    if not (run.one_document and message.get("refusal")):  # a refusal is no document
        message["content"] = run.text or message.get("content")
    finish = FINISH_REASONS.get(stop.reason) or (last_reply.finish_reason if last_reply else None)
    if stop.reason is StopReason.FINISH_REASON:
        if not message["content"]:
            stated = stated_stop(stop)  # as a limit stop's: never an empty reply
            await say(stated)
            run.generated.append({"role": "assistant", "content": stated})
            message["content"] = stated
        if finish == "tool_calls":  # the calls ran: a client would look for them
            finish = "stop"
    return Ending(stop, message, finish)
