"""Stop conditions (SPEC §6): `stop_when` entries, compiled once and evaluated after each step."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.engine.expressions import (
    MAX_POLICY_EXPR_CHARS,
    MAX_POLICY_PATTERN_COST,
    Budget,
    Expression,
    ExpressionFailed,
    ExpressionTooCostly,
    compile_condition,
)
from proxy.engine.options import ConditionOptions, kind_of
from proxy.engine.policies.base import Policy
from proxy.engine.ports import ConditionChecks
from proxy.engine.state import RunState
from proxy.engine.stop import Stop, StopReason, limit_details

# What a threshold condition observes of the run when it holds (None: it does not hold).
Observe = Callable[[RunState, Any], Any]


def _steps(run: RunState, value: int) -> int | None:
    return run.step_count if run.step_count >= value else None


def _called(run: RunState, value: list[str]) -> list[str] | None:
    return sorted(run.called_tools() & set(value)) or None


def _tokens(run: RunState, value: int) -> int | None:
    used = run.usage.total_tokens
    return used if used >= value else None


def _cost(run: RunState, value: float) -> float | None:
    cost = run.cost_usd or 0.0
    return round(cost, 10) if cost >= value else None


def _finish_reason(run: RunState, value: str) -> str | None:
    return value if any(step.finish_reason == value for step in run.steps) else None


def _duration(run: RunState, value: float) -> float | None:
    elapsed = run.elapsed_s
    return round(elapsed, 3) if elapsed >= value else None


_THRESHOLDS: dict[str, tuple[StopReason, Observe]] = {
    "step_count_is": (StopReason.MAX_STEPS, _steps),
    "has_tool_call": (StopReason.TOOL_CALLED, _called),
    "max_tokens_used": (StopReason.TOKEN_BUDGET, _tokens),
    "max_cost": (StopReason.COST_BUDGET, _cost),
    "finish_reason_is": (StopReason.FINISH_REASON, _finish_reason),
    "max_duration_s": (StopReason.TIME_BUDGET, _duration),
}
_COMBINATORS = ("any", "all", "not")


# Told of a condition that could not be evaluated: (run, condition path, reason).
FailureSink = Callable[[RunState, str, str], None]


class Unevaluable(Exception):
    """A condition whose evaluation the run cannot afford: it ends the run (`condition_error`)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Held:
    reason: StopReason
    details: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Condition:
    """One `stop_when` entry. `value` is the threshold, names, expression or children."""

    path: str
    kind: str
    value: Any
    id: str | None = None
    program: Expression | None = None  # of an `expr`

    def held(self, reason: StopReason, observed: Any, run: RunState) -> Held:
        limit = {} if self.kind in _COMBINATORS else {"threshold": self.value}
        details = limit_details(
            self.path, self.kind, run.step_count, **limit, observed=observed, id=self.id
        )
        return Held(reason, details)

    async def evaluate(
        self,
        run: RunState,
        checks: ConditionChecks | None,
        failed: FailureSink,
        budget: Budget | None = None,
    ) -> Held | None:
        """Whether the condition holds; one that cannot be evaluated does not hold, and is
        reported to `failed` with its path. Raises Unevaluable for an expression too costly to
        evaluate over the run's data, alone or within the step's `budget`."""
        found = await self._evaluate(run, checks, failed, budget)
        return None if isinstance(found, Unknown) else found

    async def _evaluate(
        self,
        run: RunState,
        checks: ConditionChecks | None,
        failed: FailureSink,
        budget: Budget | None,
    ) -> Held | Unknown | None:
        """Held, None (does not hold) or UNKNOWN (could not be evaluated): `any`, `all` and
        `not` carry UNKNOWN as three-valued logic does, so `not` of a failed check is no stop."""
        kind, value = self.kind, self.value
        threshold = _THRESHOLDS.get(kind)
        if threshold is not None:
            reason, observe = threshold
            observed = observe(run, value)
            return None if observed is None else self.held(reason, observed, run)
        if kind == "any":
            return await self._any(run, checks, failed, budget)
        if kind == "all":
            return await self._all(run, checks, failed, budget)
        if kind == "not":
            inner: Condition = value
            found = await inner._evaluate(run, checks, failed, budget)
            if found is UNKNOWN:
                return UNKNOWN
            return self.held(StopReason.CUSTOM_CONDITION, True, run) if found is None else None
        if kind == "expr" and self.program is not None:
            return self._expr(self.program, run, failed, budget)
        if checks is None:  # pragma: no cover - a run with custom conditions always has checks
            return None
        answer = await checks.check(kind, value, run.snapshot())
        if answer is None:
            failed(run, self.path, f"the {kind} check {value!r} failed")
            return UNKNOWN
        return self.held(StopReason.CUSTOM_CONDITION, True, run) if answer else None

    async def _any(
        self,
        run: RunState,
        checks: ConditionChecks | None,
        failed: FailureSink,
        budget: Budget | None,
    ) -> Held | Unknown | None:
        """The first entry that holds, with this one's `id` when it has none of its own; else
        UNKNOWN when one could not be evaluated."""
        unknown = False
        for child in self.value:
            found = await child._evaluate(run, checks, failed, budget)
            if isinstance(found, Held):
                if self.id is not None and "id" not in found.details:
                    return Held(found.reason, {**found.details, "id": self.id})
                return found
            unknown = unknown or found is UNKNOWN
        return UNKNOWN if unknown else None

    async def _all(
        self,
        run: RunState,
        checks: ConditionChecks | None,
        failed: FailureSink,
        budget: Budget | None,
    ) -> Held | Unknown | None:
        """Held when every entry holds; None as soon as one does not; else UNKNOWN."""
        unknown = False
        for child in self.value:
            found = await child._evaluate(run, checks, failed, budget)
            if found is None:
                return None
            unknown = unknown or found is UNKNOWN
        return UNKNOWN if unknown else self.held(StopReason.CUSTOM_CONDITION, True, run)

    def _expr(
        self, program: Expression, run: RunState, failed: FailureSink, budget: Budget | None
    ) -> Held | Unknown | None:
        """An `expr`, evaluated within the step's budget: one too costly ends the run."""
        try:
            result = program.evaluate(run.snapshot(program.variables), budget)
        except ExpressionFailed as exc:
            failed(run, self.path, exc.reason)
            if isinstance(exc, ExpressionTooCostly):
                raise Unevaluable(self.path, exc.reason) from None
            return UNKNOWN
        return self.held(StopReason.CUSTOM_CONDITION, True, run) if result else None

    def walk_any(self) -> list[Condition]:
        """This condition and, through `any`, the entries that hold on their own (a budget's,
        a time budget's), each with the `id` of the `any` it is in when it has none."""
        if self.kind != "any":
            return [self]
        leaves = [leaf for child in self.value for leaf in child.walk_any()]
        if self.id is None:
            return leaves
        return [leaf if leaf.id is not None else replace(leaf, id=self.id) for leaf in leaves]


class Unknown:
    """What a condition is that could not be evaluated."""

    __slots__ = ()


UNKNOWN = Unknown()


def compile_conditions(
    options: Sequence[ConditionOptions], path: str, problems: list[tuple[str, str]]
) -> tuple[Condition, ...]:
    """`stop_when` entries -> conditions with their paths; every expression that does not
    compile, or that takes the policy's expressions past MAX_POLICY_EXPR_CHARS, is added to
    `problems`."""
    compiler = _Compiler(problems)
    return tuple(compiler.compile(entry, f"{path}[{i}]") for i, entry in enumerate(options))


def expressions_of(options: Sequence[ConditionOptions]) -> list[str]:
    """The sources of the `expr` conditions of `stop_when` entries, in order, up to what one
    policy may hold (MAX_POLICY_EXPR_CHARS: past it, no more are compiled)."""
    found: list[str] = []
    left = MAX_POLICY_EXPR_CHARS
    entries = list(options)
    while entries and left > 0:
        entry = entries.pop(0)
        kind = kind_of(entry)
        value: Any = getattr(entry, "not_" if kind == "not" else kind)
        if kind in ("any", "all"):
            entries[:0] = value
        elif kind == "not":
            entries.insert(0, value)
        elif kind == "expr":
            found.append(value)
            left -= len(value)
    return found


@dataclass(slots=True)
class _Compiler:
    problems: list[tuple[str, str]]
    chars_left: int = MAX_POLICY_EXPR_CHARS
    patterns_left: int = MAX_POLICY_PATTERN_COST

    def compile(self, options: ConditionOptions, path: str) -> Condition:
        kind = kind_of(options)
        value: Any = getattr(options, "not_" if kind == "not" else kind)
        where = f"{path}.{kind}"
        program = None
        if kind in ("any", "all"):
            value = tuple(self.compile(c, f"{where}[{i}]") for i, c in enumerate(value))
        elif kind == "not":
            value = self.compile(value, where)
        elif kind == "has_tool_call":
            value = tuple(value)
        elif kind == "expr":
            program = self._expression(value, where)
        return Condition(path, kind, value, options.id, program)

    def _expression(self, source: str, where: str) -> Expression | None:
        self.chars_left -= len(source)
        if self.chars_left < 0:
            self.problems.append(
                (
                    where,
                    f"the expressions of one policy may hold {MAX_POLICY_EXPR_CHARS} "
                    "characters in all",
                )
            )
            return None
        if self.patterns_left < 0:  # an earlier expression's problem says so
            return None
        try:
            expression = compile_condition(source)
        except ValueError as exc:
            self.problems.append((where, f"invalid CEL expression: {exc}"))
            return None
        self.patterns_left -= expression.patterns
        if self.patterns_left < 0:
            self.problems.append(
                (
                    where,
                    "the matches() patterns of one policy may cost "
                    f"{MAX_POLICY_PATTERN_COST:,} units of compiling in all",
                )
            )
            return None
        return expression


def walk(conditions: Sequence[Condition]) -> Iterator[Condition]:
    """Every condition of a tree, combinators and the entries inside them."""
    for cond in conditions:
        yield cond
        if cond.kind in ("any", "all"):
            yield from walk(cond.value)
        elif cond.kind == "not":
            yield from walk([cond.value])


class StopConditions(Policy):
    """`stop_when` plus the run's `max_steps` safety cap."""

    def __init__(
        self,
        conditions: Sequence[Condition],
        max_steps: int | None,
        checks: ConditionChecks | None,
        failed: FailureSink,
    ) -> None:
        self.conditions = list(conditions)
        self.max_steps = max_steps
        self.checks = checks
        self.failed = failed

    async def after_step(self, run: RunState) -> Stop | None:
        budget = Budget()  # the expressions' evaluations after this step, together
        for cond in self.conditions:
            try:
                held = await cond.evaluate(run, self.checks, self.failed, budget)
            except Unevaluable as exc:
                details = limit_details(exc.path, "expr", run.step_count, error=exc.reason)
                return Stop(StopReason.CONDITION_ERROR, details)
            if held is not None:
                return Stop(held.reason, held.details)
        if self.max_steps is not None and run.step_count >= self.max_steps:
            details = limit_details(
                "max_steps",
                "max_steps",
                run.step_count,
                threshold=self.max_steps,
                observed=run.step_count,
            )
            return Stop(StopReason.MAX_STEPS, details)
        return None
