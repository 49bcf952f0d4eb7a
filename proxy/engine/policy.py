"""A run's policy: options compiled against what they refer to, and tightened by a request.

An agent's policy is compiled once, at start-up (and by `loopwarden check`); a request's `loop`
is compiled on its own and merged with `tighten`, which can only make the agent's rules
stricter. `check_references` then finds what the merged whole refers to and lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from proxy.engine.expressions import precompile
from proxy.engine.options import PolicyOptions
from proxy.engine.policies.base import Policy
from proxy.engine.policies.budgets import Budgets
from proxy.engine.policies.dead_ends import dead_ends
from proxy.engine.policies.stop_conditions import (
    Condition,
    FailureSink,
    StopConditions,
    compile_conditions,
    expressions_of,
    walk,
)
from proxy.engine.policies.terminal import TerminalTools, TerminatingConfig
from proxy.engine.policies.tool_call_limits import ToolCallLimit, ToolCallLimits, check_limits
from proxy.engine.policies.tool_rules import RuleBook, ToolRule, ToolRules
from proxy.engine.ports import ConditionChecks, ThreadCounters
from proxy.engine.values import Prices, ToolSpec
from proxy.errors import PolicyInvalid, SpecError

DEFAULT_MAX_STEPS = 25


@dataclass(frozen=True, slots=True)
class Catalog:
    """What a policy may refer to: the server tools, by name or id, and the named conditions."""

    tools: Mapping[str, ToolSpec]
    conditions: Mapping[str, str] = field(default_factory=dict)  # name -> webhook | python
    names: Mapping[str, str] = field(init=False)  # tool name or id -> tool name

    def __post_init__(self) -> None:
        names = {s.id: name for name, s in self.tools.items() if s.id is not None}
        names.update((name, name) for name in self.tools)
        object.__setattr__(self, "names", names)


@dataclass(frozen=True, slots=True)
class LoopPolicy:
    tools: Mapping[str, ToolSpec] = field(default_factory=dict)
    stop_when: tuple[Condition, ...] = ()
    max_steps: int | None = None
    terminating: TerminatingConfig | None = None
    tool_rules: tuple[ToolRule, ...] = ()
    tool_call_limits: tuple[ToolCallLimit, ...] = ()
    final_answer: bool = False
    parallel_tool_calls: bool | None = None

    # The tools whose call ends the run: flagged terminal, terminating ids, exit rules.
    terminal_tools: frozenset[str] = field(init=False)
    # The tightest `max_duration_s` that holds on its own: a deadline for every wait of the run.
    time_budget: Condition | None = field(init=False)

    def __post_init__(self) -> None:
        names = {name for name, spec in self.tools.items() if spec.terminal}
        if self.terminating is not None:
            names.update(self.terminating.tool_ids)
        names.update(RuleBook(self.tool_rules).exit_tools)
        object.__setattr__(self, "terminal_tools", frozenset(names))
        durations = [
            leaf
            for cond in self.stop_when
            for leaf in cond.walk_any()
            if leaf.kind == "max_duration_s"
        ]
        object.__setattr__(self, "time_budget", min(durations, key=_threshold, default=None))

    @property
    def may_take_steps(self) -> bool:
        """Whether a run may take more than one step: one with server tools, rules, limits or
        a terminating config (a call they block, or a nudge, is answered by a step more)."""
        return bool(self.tools or self.tool_rules or self.tool_call_limits or self.terminating)

    @property
    def has_cost_condition(self) -> bool:
        return any(c.kind == "max_cost" for c in walk(self.stop_when))

    def effective_max_steps(self) -> int | None:
        """The run's cap on steps: its own, else DEFAULT_MAX_STEPS for a run that can take a
        step more than one: one with server tools, or rules or limits (a call they block, or a
        nudge, is answered by a step more); a run of one step needs none."""
        if self.max_steps is not None:
            return self.max_steps
        if self.tools or self.tool_rules or self.tool_call_limits:
            return DEFAULT_MAX_STEPS
        return None

    def build(
        self,
        prices: Prices | None,
        checks: ConditionChecks | None,
        threads: ThreadCounters | None,
        failed: FailureSink,
    ) -> list[Policy]:
        """Fresh, per-run policy objects, only those with something to do (a pass-through run
        has none). Their order is the order of their answers: the first stop wins
        (`proxy.engine.checkpoints`)."""
        policies: list[Policy] = []
        if self.terminal_tools or self.terminating is not None:
            policies.append(TerminalTools(self.terminal_tools, self.terminating))
        if self.tool_rules:
            policies.extend(ToolRules(book) for book in rule_books(self.tool_rules))
        max_steps = self.effective_max_steps()
        if self.stop_when or max_steps is not None:
            policies.append(StopConditions(self.stop_when, max_steps, checks, failed))
        if self.tool_call_limits:
            policies.append(ToolCallLimits(self.tool_call_limits, threads))
        if self.stop_when:
            policies.append(Budgets(self.stop_when, prices))
        return policies


def rule_books(rules: Sequence[ToolRule]) -> list[RuleBook]:
    """The rules of each source (an agent's, a request's `loop`), a book each: rules of one
    source join as Letta joins them, and the books intersect, so a request's rules only
    tighten its agent's (SPEC §4.1)."""
    sources: dict[str, list[ToolRule]] = {}
    for rule in rules:
        sources.setdefault(rule.path.rpartition("tool_rules[")[0], []).append(rule)
    return [RuleBook(tuple(group)) for group in sources.values()]


def _first_tools_in_common(books: Sequence[RuleBook], enabled: set[str]) -> list[tuple[str, str]]:
    """An agent's `run_first` rules and a request's intersect: none in common would leave the
    first step no tool to call."""
    first = set(enabled)
    for book in books:
        if book.run_first:
            first &= book.run_first
    if first or len(books) < 2:
        return []
    rule = books[-1].of("run_first")[0]
    message = "no tool may be called first: the agent's run_first rules and these name none alike"
    return [(f"{rule.path}.tool_name", message)]


def _threshold(condition: Condition) -> float:
    return float(condition.value)


EMPTY = LoopPolicy()


def compile_policy(
    options: PolicyOptions,
    tool_refs: Sequence[str],
    catalog: Catalog,
    path: str = "",
    found: list[tuple[str, str]] | None = None,
) -> LoopPolicy:
    """Options with their tools (names or ids) -> a policy; raises PolicyInvalid with every
    problem found, each at its JSON path under `path` (`""` for an agent, `"loop."`), or, given
    `found`, adds them there and makes the policy of what it could (for every problem of a
    config told at once)."""
    problems: list[tuple[str, str]] = []
    tools: dict[str, ToolSpec] = {}
    for i, ref in enumerate(tool_refs):
        name = catalog.names.get(ref)
        if name is None:
            problems.append((f"{path}tools[{i}]", f"no server tool named {ref!r}"))
        else:
            tools[name] = catalog.tools[name]
    conditions = compile_conditions(options.stop_when, f"{path}stop_when", problems)
    for cond in walk(conditions):
        if cond.kind in ("webhook", "python") and catalog.conditions.get(cond.value) != cond.kind:
            problems.append(
                (f"{cond.path}.{cond.kind}", f"no {cond.kind} condition named {cond.value!r}")
            )
    terminating = None
    if options.terminating_config is not None:
        terminating = TerminatingConfig.of(options.terminating_config, f"{path}terminating_config")
        where = f"{terminating.path}.tool_ids"
        names = []
        for i, ref in enumerate(terminating.tool_ids):
            name = catalog.names.get(ref)
            if name is None:
                problems.append((f"{where}[{i}]", f"no server tool named {ref!r}"))
            names.append(name or ref)
        terminating = replace(terminating, tool_ids=tuple(names))
    if problems and found is None:
        raise PolicyInvalid(problems)
    if found is not None:
        found.extend(problems)
    return LoopPolicy(
        tools=tools,
        stop_when=conditions,
        max_steps=options.max_steps,
        terminating=terminating,
        tool_rules=tuple(
            ToolRule.of(rule, f"{path}tool_rules[{i}]") for i, rule in enumerate(options.tool_rules)
        ),
        tool_call_limits=tuple(
            ToolCallLimit.of(limit, f"{path}tool_call_limits[{i}]")
            for i, limit in enumerate(options.tool_call_limits)
        ),
        final_answer=bool(options.final_answer),
        parallel_tool_calls=options.parallel_tool_calls,
    )


def expressions(options: PolicyOptions) -> list[str]:
    """The sources of the `expr` conditions `compile_policy` would compile."""
    return expressions_of(options.stop_when)


def condition_problems(options: PolicyOptions, path: str) -> list[tuple[str, str]]:
    """What `compile_policy` finds wrong in the stop conditions alone (expressions that do not
    compile, or too many of them), each at its path under `path` (`"agents.a."`)."""
    problems: list[tuple[str, str]] = []
    compile_conditions(options.stop_when, f"{path}stop_when", problems)
    return problems


def compile_expressions(sources: list[str]) -> None:
    """Compiles `sources` ahead of `compile_policy`, which then finds them compiled: meant for
    a thread, the event loop going on meanwhile."""
    precompile(sources)


def tighten(agent: LoopPolicy, request: LoopPolicy) -> LoopPolicy:
    """The agent's policy with a request's added: tools, conditions, rules, limits and
    terminating tools add up; numbers can only get smaller (an agent's `max_steps` unset is the
    default); `final_answer` only turns on (SPEC §4.1)."""
    terminating = request.terminating or agent.terminating
    if request.terminating is not None and agent.terminating is not None:
        base = agent.terminating
        terminating = replace(
            request.terminating,
            # The request's first, as it gave them: what is checked of them is named by their
            # places.
            tool_ids=request.terminating.tool_ids
            + tuple(t for t in base.tool_ids if t not in request.terminating.tool_ids),
            consecutive_nudges=min(request.terminating.consecutive_nudges, base.consecutive_nudges),
            max_invocations=min(request.terminating.max_invocations, base.max_invocations),
            given_at=tuple(
                (name, base.path)
                for name in ("consecutive_nudges", "max_invocations")
                if getattr(base, name) < getattr(request.terminating, name)
            ),
        )
    max_steps = agent.max_steps
    if request.max_steps is not None:  # an agent without a cap of its own has the default
        cap = DEFAULT_MAX_STEPS if agent.max_steps is None else agent.max_steps
        max_steps = min(cap, request.max_steps)
    return LoopPolicy(
        tools={**agent.tools, **request.tools},
        stop_when=agent.stop_when + request.stop_when,
        max_steps=max_steps,
        terminating=terminating,
        tool_rules=agent.tool_rules + request.tool_rules,
        tool_call_limits=agent.tool_call_limits + request.tool_call_limits,
        final_answer=agent.final_answer or request.final_answer,
        parallel_tool_calls=(
            agent.parallel_tool_calls
            if request.parallel_tool_calls is None
            else request.parallel_tool_calls
        ),
    )


def check_references(
    policy: LoopPolicy, client_tools: Collection[str], model: str, priced: Callable[[], bool]
) -> None:
    """Raises PolicyInvalid for what the policy names but the run lacks: tools of rules, limits,
    conditions and the terminating config; a price for a cost condition (`priced` is asked
    only when there is one)."""
    problems: list[tuple[str, str]] = []
    server = set(policy.tools)
    enabled = server | set(client_tools)
    for cond in walk(policy.stop_when):
        if cond.kind == "has_tool_call":
            problems.extend(
                (f"{cond.path}.has_tool_call", f"{name!r} is not a tool of this run")
                for name in cond.value
                if name not in enabled
            )
    if policy.terminating is not None:
        for i, name in enumerate(policy.terminating.tool_ids):
            if name not in server:
                problems.append(
                    (
                        f"{policy.terminating.path}.tool_ids[{i}]",
                        f"{name!r} is not a server tool enabled for this run",
                    )
                )
    books = rule_books(policy.tool_rules)
    rules = RuleBook(policy.tool_rules).problems(enabled)
    problems.extend(rules or _first_tools_in_common(books, enabled) or dead_ends(books, enabled))
    try:
        check_limits(policy.tool_call_limits, server)
    except SpecError as exc:
        problems.append((exc.param or "", exc.message))
    if policy.has_cost_condition and not priced():
        problems.append(
            (
                "model",
                f"a cost condition is set but model {model!r} has no known price; add it to "
                "`pricing` or use an upstream that reports cost",
            )
        )
    if problems:
        raise PolicyInvalid(problems, code="unknown_model_price" if _only_price(problems) else None)


def _only_price(problems: list[tuple[str, str]]) -> bool:
    return [path for path, _ in problems] == ["model"]
