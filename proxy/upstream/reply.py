"""Turning upstream bodies and stream chunks into the engine's `ModelReply`, checking their
shape as they are read.

A reply the proxy cannot read as it came raises MalformedReply, naming the field (the client
turns it into a 502 `upstream_error`). What can be read safely is repaired and logged instead:
a tool-call id that repeats one before it gets a fresh one (each call gets its own result), and
a usage the upstream cannot mean (a negative or non-finite `cost`, negative token counts) is
not believed, so no upstream can lower the run's totals below what it spent.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from proxy.config.upstreams import MAX_RESPONSE_VALUES
from proxy.engine.usage import Usage
from proxy.engine.values import ModelReply, ToolCall
from proxy.json_values import MAX_DEPTH, too_deep
from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)
# An upstream that sends a strange reply sends it for every request: each kind told once a
# second.
doubted_counts = ThrottledWarnings(log)
doubted_costs = ThrottledWarnings(log)
repeated_ids = ThrottledWarnings(log)


class MalformedReply(ValueError):
    """A reply whose shape is not a Chat Completions reply; the message names the field."""


@dataclass(frozen=True, slots=True)
class ReplyLimits:
    """What one upstream reply may hold (UpstreamConfig's bounds of the same names), and whether
    the cost it reports is read (`reports_cost`; else its steps are priced from the tokens)."""

    max_response_bytes: int = 32 * 1024 * 1024
    max_event_bytes: int = 8 * 1024 * 1024
    max_tool_calls: int = 128
    reports_cost: bool = False
    max_values: int = MAX_RESPONSE_VALUES


# The most one reply may cost: a larger `usage.cost` is no cost an upstream can mean (added up,
# it would soon make the cost counters infinite).
MAX_REPORTED_COST_USD = 10_000.0
# The most tokens one count of a reply's usage may hold: no model reads or writes a billion in
# one reply; a count past it is taken as this many (2**63 in two steps overflowed every writer
# of the run's usage: a 500, a stream cut short, a cost counter at 3e13 dollars).
MAX_REPORTED_TOKENS = 1_000_000_000
# The keys of a usage looked at, and the entries of its `*_details` kept, and how deep: OpenAI's
# have a dozen entries a level down (240,000 were summed every step, held the loop 190 ms).
MAX_USAGE_ENTRIES = 64
MAX_USAGE_DEPTH = 2


def reply_from_body(body: dict[str, Any], limits: ReplyLimits = ReplyLimits()) -> ModelReply:
    """The reply of a whole `chat.completion` body (its first choice)."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedReply("choices is not a list with a choice in it")
    choice = _object(_first(choices) or choices[0], "choices[0]")
    message = _object(choice.get("message"), "choices[0].message")
    _content(message, "choices[0].message")
    calls, entries = _calls(message.get("tool_calls"), "choices[0].message.tool_calls", limits)
    if entries is not None:
        message = {**message, "tool_calls": entries}
    usage, cost = reported_usage(body.get("usage"), "usage")
    return ModelReply(
        message=message,
        tool_calls=calls,
        finish_reason=_finish_reason(choice, "choices[0].finish_reason"),
        usage=usage,
        reported_cost_usd=cost if limits.reports_cost else None,
        response_id=_text(body.get("id")),
        response_model=_text(body.get("model")),
        raw=body,
    )


class ChunkAccumulator:
    """Builds one reply from `chat.completion.chunk`s."""

    def __init__(self, limits: ReplyLimits = ReplyLimits()) -> None:
        self.limits = limits
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.id: str | None = None
        self.model: str | None = None
        self.head: dict[str, str] | None = None  # that of the first chunk with a model

    def add(self, chunk: dict[str, Any]) -> str | None:
        """Takes a chunk; returns its content delta, if any. Raises MalformedReply.

        Called for every event of every stream: the checks of the fields that nearly every
        chunk has are written out here rather than called."""
        if not self.id:
            self.id = _text(chunk.get("id"))
        if not self.model:  # (Azure's prompt-filter chunk comes first, with a model of "")
            self.model = _text(chunk.get("model"))
            if self.model:
                self.head = stream_head(chunk)
        usage = chunk.get("usage")
        if usage:  # the one object of a chunk that goes on as it came
            self.usage = _object(usage, "usage")
            if too_deep(usage):
                raise MalformedReply(f"usage nests deeper than {MAX_DEPTH} levels")
        choices = chunk.get("choices")
        if not choices:
            return None
        if not isinstance(choices, list):
            raise MalformedReply("choices of a chunk is not a list")
        choice = choices[0]
        if not isinstance(choice, dict):
            raise MalformedReply("choices[0] is not an object")
        if choice.get("index", 0) != 0:  # the reply is the first choice's, whatever the order
            choice = _first(choices)
            if choice is None:
                return None
        finish = choice.get("finish_reason")
        if finish is not None:
            if not isinstance(finish, str) or len(finish) > MAX_FINISH_REASON_CHARS:
                raise MalformedReply(_NO_FINISH_REASON)
            self.finish_reason = finish or self.finish_reason
        delta = choice.get("delta")
        if delta is None:
            return None
        if not isinstance(delta, dict):
            raise MalformedReply("choices[0].delta is not an object")
        if len(delta) > ("content" in delta) + ("role" in delta):  # more than text
            self._add_rest(delta)
        content = delta.get("content")
        if content is None:
            return None
        if not isinstance(content, str):
            raise MalformedReply("choices[0].delta.content is not a string")
        if content:
            self.content.append(content)
            return content
        return None

    def _add_rest(self, delta: dict[str, Any]) -> None:
        """A delta's tool calls and refusal."""
        calls = delta.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise MalformedReply("choices[0].delta.tool_calls is not a list")
            for i, call in enumerate(calls):
                self._add_call(_object(call, f"choices[0].delta.tool_calls[{i}]"), i)
        refusal = _optional_text(delta.get("refusal"), "choices[0].delta.refusal")
        if refusal:
            self.refusal.append(refusal)

    def _add_call(self, call: dict[str, Any], i: int) -> None:
        """A delta of a call: of the call at its `index`, or, from an upstream that sends none,
        of the last call unless it brings another call's id or name. A name sent again whole
        (with the id, or without an index, as some upstreams send each delta) is the same name;
        OpenAI's deltas may cut a name in parts, which follow its first without an id."""
        path = f"choices[0].delta.tool_calls[{i}]"
        call_id = _optional_text(call.get("id"), f"{path}.id")
        function = call.get("function")
        function = {} if function is None else _object(function, f"{path}.function")
        name = _optional_text(function.get("name"), f"{path}.function.name") or ""
        index = call.get("index")
        whole = bool(call_id) or index is None  # its name, if any, comes whole
        if index is None:
            index = self._unindexed(call_id, name)
        if isinstance(index, bool) or not isinstance(index, int):
            raise MalformedReply(f"{path}.index is not an integer")
        slot = self.calls.get(index)
        if slot is None:
            if len(self.calls) >= self.limits.max_tool_calls:
                raise _too_many(self.limits)
            slot = self.calls[index] = {"id": None, "name": "", "arguments": []}
        slot["id"] = slot["id"] or call_id
        if not (whole and name == slot["name"]):  # a name sent again whole is the same name
            slot["name"] += name
        arguments = _optional_text(function.get("arguments"), f"{path}.function.arguments")
        slot["arguments"].append(arguments or "")

    def _unindexed(self, call_id: str | None, name: str) -> int:
        """The index of a call delta without one: the last call's, or the next."""
        last = max(self.calls, default=-1)
        held = self.calls.get(last)
        if held is None or (call_id and call_id != held["id"]):
            return last + 1
        return last + 1 if name and held["name"] not in ("", name) else last

    def reply(self) -> ModelReply:
        calls = unique_ids(
            ToolCall(slot["id"] or f"call_{index}", slot["name"], "".join(slot["arguments"]))
            for index, slot in sorted(self.calls.items())
        )
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content or not calls else None,
        }
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        usage, cost = reported_usage(self.usage, "usage")
        return ModelReply(
            message=message,
            tool_calls=calls,
            finish_reason=self.finish_reason,
            usage=usage,
            reported_cost_usd=cost if self.limits.reports_cost else None,
            response_id=self.id,
            response_model=self.model,
        )


# A finish reason is a word (`stop`, `tool_calls`, a provider's `end_turn`): a longer one goes
# on to the client, the run's record and its span as it came, so it is no reply.
MAX_FINISH_REASON_CHARS = 64
_NO_FINISH_REASON = (
    f"choices[0].finish_reason is not a string of at most {MAX_FINISH_REASON_CHARS} characters"
)

HEAD_FIELDS = ("model", "system_fingerprint", "service_tier")
MAX_HEAD_CHARS = 256


def stream_head(body: dict[str, Any]) -> dict[str, str]:
    """The fields of an upstream's answer that its client's chunks carry too (each a string of
    1 to MAX_HEAD_CHARS characters; another value is left out)."""
    head: dict[str, str] = {}
    for name in HEAD_FIELDS:
        value = body.get(name)
        if isinstance(value, str) and 0 < len(value) <= MAX_HEAD_CHARS:
            head[name] = value
    return head


def _first(choices: list[Any]) -> dict[str, Any] | None:
    """The choice of `index` 0 (an upstream may list them in any order)."""
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def reported_usage(raw: Any, path: str) -> tuple[Usage, float | None]:
    """The usage and cost a reply reports. Token counts below zero count as zero, details below
    zero or not finite are dropped, and a `cost` below zero, not finite or over
    MAX_REPORTED_COST_USD is no reported cost (the price table prices the step instead); each
    is logged."""
    if raw is None:
        return Usage(), None
    raw = _object(raw, path)
    prompt = _tokens(raw, "prompt_tokens", path)
    completion = _tokens(raw, "completion_tokens", path)
    total = _tokens(raw, "total_tokens", path) or prompt + completion
    room = [MAX_USAGE_ENTRIES]
    details = {
        name: _sane_details(value, f"{path}.{name}", room)
        for name, value in islice(raw.items(), MAX_USAGE_ENTRIES)
        if name.endswith("_details") and isinstance(value, dict)
    }
    cost = raw.get("cost")
    if cost is not None and not (
        _number(cost) and _finite_and_not_negative(cost) and cost <= MAX_REPORTED_COST_USD
    ):
        doubted_costs.warning("upstream reported %s.cost = %r; not believed", path, cost)
        cost = None
    return Usage(prompt, completion, total, details), float(cost) if cost is not None else None


def _tokens(usage: dict[str, Any], name: str, path: str) -> int:
    """A token count of `usage`: a whole number, written as an integer or a float (`50000.0`);
    0 for none, and for one below zero or any other value (a fraction, a string: logged), which
    the budgets then count by estimate; MAX_REPORTED_TOKENS for one above it (logged)."""
    value = usage.get(name)
    if type(value) is not int:  # (a bool is no count either)
        if value is None:
            return 0
        if not (type(value) is float and value.is_integer()):  # (inf and nan are not)
            said = "upstream reported %s.%s = %.64r; not a count of tokens: counted as 0"
            doubted_counts.warning(said, path, name, value)
            return 0
        value = int(value)
    if value < 0:
        doubted_counts.warning("upstream reported %s.%s = %s; counted as 0", path, name, value)
        return 0
    if value > MAX_REPORTED_TOKENS:
        said = "upstream reported %s.%s = %s; counted as %d"
        doubted_counts.warning(said, path, name, value, MAX_REPORTED_TOKENS)
        return MAX_REPORTED_TOKENS
    return value


def unique_ids(calls: Iterable[ToolCall]) -> list[ToolCall]:
    """`calls`, each id that repeats an earlier one (or is empty) replaced by a fresh one."""
    seen: set[str] = set()
    out = []
    for call in calls:
        if not call.id or call.id in seen:
            fresh = f"call_{uuid.uuid4().hex[:24]}"
            said = "upstream repeated tool call id %r; the call is now %s"
            repeated_ids.warning(said, call.id, fresh)
            call = ToolCall(fresh, call.name, call.arguments)
        seen.add(call.id)
        out.append(call)
    return out


def _calls(
    raw: Any, path: str, limits: ReplyLimits
) -> tuple[list[ToolCall], list[dict[str, Any]] | None]:
    """The tool calls of a message, and its `tool_calls` entries as they go on (with the ids
    that were repaired), or None when they go on as they came."""
    if raw is None:
        return [], None
    if not isinstance(raw, list):
        raise MalformedReply(f"{path} is not a list")
    if len(raw) > limits.max_tool_calls:
        raise _too_many(limits)
    read = []
    for i, entry in enumerate(raw):
        call = _object(entry, f"{path}[{i}]")
        function = _object(call.get("function"), f"{path}[{i}].function")
        name = function.get("name")
        if not isinstance(name, str):
            raise MalformedReply(f"{path}[{i}].function.name is not a string")
        arguments = _optional_text(function.get("arguments"), f"{path}[{i}].function.arguments")
        call_id = _optional_text(call.get("id"), f"{path}[{i}].id")
        read.append(ToolCall(call_id or f"call_{i}", name, arguments or ""))
    calls = unique_ids(read)
    if all(call.id == entry.get("id") for call, entry in zip(calls, raw, strict=True)):
        return calls, None
    return calls, [{**entry, "id": call.id} for call, entry in zip(calls, raw, strict=True)]


def _too_many(limits: ReplyLimits) -> MalformedReply:
    limit = limits.max_tool_calls
    return MalformedReply(f"more than {limit} tool calls in one reply (max_tool_calls_per_reply)")


def _sane_details(
    details: dict[str, Any], path: str, room: list[int], depth: int = 1
) -> dict[str, Any]:
    """A usage's `*_details` object, its counts believed; `room`: the entries the usage may
    still have (MAX_USAGE_ENTRIES in all: each is summed over the run's steps and sent on)."""
    sane: dict[str, Any] = {}
    for key, value in details.items():
        room[0] -= 1
        if room[0] < 0 or depth > MAX_USAGE_DEPTH:
            doubted_counts.warning(
                "upstream reported a usage of more than %d entries or %d levels; the rest of %s"
                " dropped",
                MAX_USAGE_ENTRIES,
                MAX_USAGE_DEPTH,
                path,
            )
            return sane
        if isinstance(value, dict):
            sane[key] = _sane_details(value, f"{path}.{key}", room, depth + 1)
        elif _number(value) and not (
            _finite_and_not_negative(value) and value <= MAX_REPORTED_TOKENS
        ):
            doubted_counts.warning("upstream reported %s.%s = %s; dropped", path, key, value)
        else:
            sane[key] = value
    return sane


def _content(message: dict[str, Any], path: str) -> None:
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise MalformedReply(f"{path}.content is neither a string, a list nor null")


def _finish_reason(choice: dict[str, Any], path: str) -> str:
    """Why the reply ended: a reply without it may have been cut short."""
    reason = _optional_text(choice.get("finish_reason"), path)
    if not reason:
        raise MalformedReply(f"{path} is missing: the reply may have been cut short")
    if len(reason) > MAX_FINISH_REASON_CHARS:
        raise MalformedReply(_NO_FINISH_REASON)
    return reason


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MalformedReply(f"{path} is not an object")
    return value


def _optional_text(value: Any, path: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise MalformedReply(f"{path} is not a string")
    return value


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _finite_and_not_negative(value: float) -> bool:
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int too large for a float
        return False


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
