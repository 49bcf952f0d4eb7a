"""Tool rules (SPEC §8, after Letta): which tools each step may call, and when a call is forced.

Rules of one type are joined the way Letta joins them (several `run_first` rules offer any of
their tools; several `constrain_child_tools` rules on one tool offer any of their children);
rules of different types intersect.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from proxy.engine.options import (
    Conditional,
    ConstrainChildTools,
    MaxCountPerStep,
    ParentLastTool,
    RuleOptions,
)
from proxy.engine.policies.base import Block, Nudge, Policy, StepPlan
from proxy.engine.state import RunState
from proxy.engine.stop import Stop
from proxy.engine.values import ModelReply, ToolCall, ToolResult, listed_names


@dataclass(frozen=True, slots=True)
class ToolRule:
    type: str
    tool_name: str
    path: str
    children: tuple[str, ...] = ()
    child_output_mapping: Mapping[str, str] = field(default_factory=dict)
    default_child: str | None = None
    require_output_mapping: bool = False
    max_count_limit: int = 0

    def named_tools(self) -> list[tuple[str, str]]:
        """Every tool the rule names, with the JSON path that names it."""
        names = [(self.tool_name, f"{self.path}.tool_name")]
        names += [(c, f"{self.path}.children[{i}]") for i, c in enumerate(self.children)]
        names += [
            (c, f"{self.path}.child_output_mapping.{k}")
            for k, c in self.child_output_mapping.items()
        ]
        if self.default_child is not None:
            names.append((self.default_child, f"{self.path}.default_child"))
        return names

    @classmethod
    def of(cls, options: RuleOptions, path: str) -> ToolRule:
        rule = cls(options.type, options.tool_name, path)
        if isinstance(options, ConstrainChildTools | ParentLastTool):
            return replace(rule, children=tuple(options.children))
        if isinstance(options, Conditional):
            return replace(
                rule,
                child_output_mapping=dict(options.child_output_mapping),
                default_child=options.default_child,
                require_output_mapping=options.require_output_mapping,
            )
        if isinstance(options, MaxCountPerStep):
            return replace(rule, max_count_limit=options.max_count_limit)
        return rule


@dataclass(frozen=True, slots=True)
class RuleBook:
    """A run's rules, indexed by what each checkpoint asks of them."""

    rules: tuple[ToolRule, ...]

    def of(self, kind: str) -> list[ToolRule]:
        return [r for r in self.rules if r.type == kind]

    @property
    def run_first(self) -> frozenset[str]:
        return frozenset(r.tool_name for r in self.of("run_first"))

    @property
    def exit_tools(self) -> frozenset[str]:
        return frozenset(r.tool_name for r in self.of("exit_loop"))

    def children_of(self, kind: str) -> dict[str, frozenset[str]]:
        joined: dict[str, set[str]] = {}
        for rule in self.of(kind):
            joined.setdefault(rule.tool_name, set()).update(rule.children)
        return {tool: frozenset(kids) for tool, kids in joined.items()}

    def max_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for rule in self.of("max_count_per_step"):
            counts[rule.tool_name] = min(
                counts.get(rule.tool_name, rule.max_count_limit), rule.max_count_limit
            )
        return counts

    def problems(self, tools: Iterable[str]) -> list[tuple[str, str]]:
        """Every tool a rule names that the run lacks, or else every contradiction, each with
        the rule's path."""
        enabled = set(tools)
        missing = [
            (path, f"{name!r} is not a tool of this run")
            for rule in self.rules
            for name, path in rule.named_tools()
            if name not in enabled
        ]
        if missing:
            return missing
        problems: list[tuple[str, str]] = []
        both = self.exit_tools & {r.tool_name for r in self.of("continue_loop")}
        for rule in self.of("continue_loop"):
            if rule.tool_name in both:
                problems.append(
                    (
                        rule.path,
                        f"{rule.tool_name!r} cannot both end the run (exit_loop) and continue it",
                    )
                )
        parents: dict[str, set[str]] = {}  # a tool's parents: it may only follow one of them
        for parent, kids in self.children_of("parent_last_tool").items():
            for kid in kids:
                parents.setdefault(kid, set()).add(parent)

        def reachable_after(last: str | None, names: Iterable[str]) -> set[str]:
            return {n for n in names if parents.get(n, set()) <= {last}}

        first = self.of("run_first")
        if first and not reachable_after(None, self.run_first):
            problems.append(
                (
                    first[0].path,
                    "no run_first tool can be called first: each may only follow its parent "
                    "(parent_last_tool)",
                )
            )
        for rule in self.of("constrain_child_tools"):
            if not reachable_after(rule.tool_name, rule.children):
                problems.append(
                    (
                        f"{rule.path}.children",
                        f"none of the children of {rule.tool_name!r} may follow it: each is "
                        "limited to another parent (parent_last_tool)",
                    )
                )
        for rule in self.of("conditional"):
            problems.extend(
                (
                    path,
                    f"{name!r} may not follow {rule.tool_name!r}: it is limited to another "
                    "parent (parent_last_tool)",
                )
                for name, path in rule.named_tools()[1:]
                if not reachable_after(rule.tool_name, [name])
            )
        required = self.of("required_before_exit")
        offered = self._ever_offered(enabled, parents) if required else set()
        problems.extend(
            (
                f"{rule.path}.tool_name",
                f"{rule.tool_name!r} must run before the run may end, but no step can offer "
                "it (run_first, constrain_child_tools, conditional and parent_last_tool "
                "rules leave it out of every step)",
            )
            for rule in required
            if rule.tool_name not in offered
        )
        return problems

    def _ever_offered(self, enabled: set[str], parents: Mapping[str, set[str]]) -> set[str]:
        """The tools some step of some run may offer, whatever the model calls and the tools
        answer (counts aside: more than can be offered, never fewer). A tool no rule names
        leads where any other such tool does, so that is worked out once."""
        children = self.children_of("constrain_child_tools")
        conditional = {r.tool_name: r for r in self.of("conditional")}
        special = set(children) | set(conditional) | {p for ps in parents.values() for p in ps}

        def after(last: str | None) -> set[str]:
            offered = set(enabled)
            if last is None and self.run_first:
                offered &= self.run_first
            if last in children:
                offered &= children[last]
            rule = conditional.get(last) if last is not None else None
            if rule is not None and (rule.default_child or rule.require_output_mapping):
                picked = set(rule.child_output_mapping.values())  # every output picks one
                offered &= picked | ({rule.default_child} if rule.default_child else set())
            return {n for n in offered if parents.get(n, set()) <= {last}}

        seen = after(None)
        pending, any_other_done = list(seen), False
        while pending:
            tool = pending.pop()
            if tool in self.exit_tools:  # calling it ends the run
                continue
            if tool not in special:
                if any_other_done:
                    continue
                any_other_done = True
            for name in after(tool) - seen:
                seen.add(name)
                pending.append(name)
        return seen


# An output that could hold more JSON values than this is matched as its text, not parsed (as
# a request body's values are bounded, by default: 1 MiB of nested empty arrays took 0.2 s).
MAX_MATCHED_VALUES = 100_000


def output_value(output: str) -> str:
    """What a conditional rule matches: the JSON `message` field, a JSON scalar, or the text."""
    if len(output) > MAX_MATCHED_VALUES and sum(map(output.count, ",:[{")) > MAX_MATCHED_VALUES:
        return output.strip()
    try:
        value = orjson.loads(output)
    except orjson.JSONDecodeError:
        return output.strip()
    if isinstance(value, dict) and "message" in value:
        value = value["message"]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value.strip()
    if not isinstance(value, dict | list):
        return str(value)
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # nested deeper than JSON is written: matched as the text it came as
        return output.strip()


def answered_in_turn(messages: list[dict[str, Any]]) -> frozenset[str]:
    """The tools whose calls the conversation answered since its last user message: a client
    tool runs between two runs of one turn, its result in the messages of the second, with the
    server calls of the first that the proxy put back (a history the client wrote can claim a
    server call too: the client owns its conversation, and the proxy cannot tell the one from
    the other without records of every call it ran)."""
    answered: set[str] = set()
    results: set[Any] = set()
    for message in reversed(messages):
        role = message.get("role")
        if role == "user":
            break
        if role == "tool":
            results.add(message.get("tool_call_id"))
        elif role == "assistant" and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and call.get("id") in results:
                    answered.add(str(function.get("name")))
    return frozenset(answered)


def last_answered(messages: list[dict[str, Any]]) -> str | None:
    """The tool whose result ends the messages (a client tool's, between two runs of a turn):
    the tool the run's first step comes after."""
    last = messages[-1] if messages else None
    if last is None or last.get("role") != "tool":
        return None
    for message in reversed(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and call.get("id") == last.get("tool_call_id"):
                    return str(function.get("name"))
            return None
    return None


def forced_choice(allowed: list[str]) -> Any:
    """`tool_choice` for a forced call: a single allowed tool is named explicitly."""
    if len(allowed) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}
    return "required"


class ToolRules(Policy):
    """Narrows each step's tools, blocks calls the rules forbid, nudges unmet requirements."""

    def __init__(self, book: RuleBook) -> None:
        self.book = book
        self.run_first = book.run_first
        self.children = book.children_of("constrain_child_tools")
        self.guarded = book.children_of("parent_last_tool")
        self.conditional = {r.tool_name: r for r in book.of("conditional")}
        self.max_counts = book.max_counts()
        self.continuing = frozenset(r.tool_name for r in book.of("continue_loop"))
        self.required = [r.tool_name for r in book.of("required_before_exit")]
        self.history: list[str] = []  # executed tool calls, in order
        self.counts: Counter[str] = Counter()
        self.last_value: str | None = None  # what the last conditional tool's output matches
        self.offered: list[str] = []
        # Tools the turn ran before this run: a client's, and the server's that an earlier run
        # of the turn held back with a client call and the proxy put back (or stored); and
        # the one whose result the run begins after (a client tool's, which parted this run
        # from the turn's run before: `run_first` held there).
        self.answered: frozenset[str] = frozenset()
        self.before: str | None = None
        self.nudged_after = 0  # the calls the run had made when it was last told to continue

    def allowed(
        self, names: Iterable[str], limited: AbstractSet[str] = frozenset()
    ) -> tuple[list[str], bool]:
        """Of `names`, those the rules allow next, and whether a call is forced. `run_first`
        stands aside once a tool call limit has blocked each of its tools in the run: its
        first call was made, and no later step could call a tool at all."""
        allowed = list(names)
        forced = False
        last = self.history[-1] if self.history else self.before
        if last is None and self.run_first and not self.run_first <= limited:
            allowed, forced = [n for n in allowed if n in self.run_first], True
        if last in self.children:
            allowed, forced = [n for n in allowed if n in self.children[last]], True
        picked = self._conditional_children(last)
        if picked is not None:
            allowed, forced = [n for n in allowed if n in picked], True
        allowed = [
            n
            for n in allowed
            if all(n not in kids or parent == last for parent, kids in self.guarded.items())
            and self.counts[n] < self.max_counts.get(n, self.counts[n] + 1)
        ]
        return allowed, forced

    def _conditional_children(self, last: str | None) -> frozenset[str] | None:
        rule = self.conditional.get(last) if last is not None else None
        if rule is None or self.last_value is None:
            return None
        value = self.last_value
        for key, child in rule.child_output_mapping.items():
            if key == value:
                return frozenset({child})
        if rule.default_child is not None:
            return frozenset({rule.default_child})
        if rule.require_output_mapping:
            return frozenset(rule.child_output_mapping.values())
        return None

    def before_step(self, run: RunState, plan: StepPlan) -> Stop | None:
        if run.step_count == 0:
            if self.required:
                self.answered = answered_in_turn(run.messages)
            self.before = last_answered(run.messages)
        names = [t["function"]["name"] for t in plan.tools]
        allowed, forced = self.allowed(names, run.limited)
        if forced and run.limited:  # forcing a call a limit blocks would take every step
            allowed = [n for n in allowed if n not in run.limited]
            forced = bool(allowed)
        self.offered = allowed
        if len(allowed) == len(names) and not forced:
            return None
        keep = set(allowed)
        plan.tools = [t for t in plan.tools if t["function"]["name"] in keep]
        if not plan.tools:
            plan.tool_choice = None
        elif forced:
            plan.tool_choice = forced_choice(allowed)
        return None

    def size_step(self, run: RunState, plan: StepPlan) -> Stop | None:
        # The step's tools as every policy left them (another source's rules too): those a
        # blocked call's message names.
        self.offered = [t["function"]["name"] for t in plan.tools]
        return None

    async def review_call(self, run: RunState, call: ToolCall) -> Block | None:
        allowed, _ = self.allowed([call.name], run.limited)
        if allowed:
            return None
        now, _ = self.allowed(self.offered, run.limited)
        listed = listed_names(now) if now else "none; answer without tools"
        return Block(
            f"Tool '{call.name}' is not allowed now by the tool rules. Allowed tools: {listed}."
        )

    def admit(self, run: RunState, call: ToolCall) -> None:
        self.history.append(call.name)
        self.counts[call.name] += 1
        self.last_value = None

    def decides_next(self, call: ToolCall) -> bool:
        return call.name in self.conditional  # its output picks the next tool

    def after_tool(self, run: RunState, call: ToolCall, result: ToolResult) -> Stop | None:
        if self.history and self.history[-1] == call.name and call.name in self.conditional:
            self.last_value = output_value(result.output)  # once: every review reads it
        return None

    def after_reply_without_tools(self, run: RunState, reply: ModelReply) -> Nudge | Stop | None:
        missing = [
            n
            for n in self.required
            if not self.counts[n] and n not in self.answered and n not in run.limited
        ]
        if missing:
            listed = ", ".join(f"'{name}'" for name in missing)
            return Nudge(f"You may not finish yet: first call {listed}.")
        if self.history and self.history[-1] in self.continuing:
            if self.nudged_after == len(self.history):  # told once after this call: it ends
                return None
            self.nudged_after = len(self.history)
            return Nudge(
                f"You must continue after '{self.history[-1]}': call a tool before you answer."
            )
        return None
