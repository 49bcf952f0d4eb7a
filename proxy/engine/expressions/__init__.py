"""CEL stop conditions (SPEC §6 `expr`): checked when compiled, evaluated after each step.

`compile_condition` accepts only a boolean expression over the run's snapshot (`steps`,
`usage`, `cost_usd`, `elapsed_s`) that calls CEL's standard functions and macros, and refuses
anything else with a `ValueError` that says what is wrong and where (`line:column`).
`Expression.evaluate` returns the boolean, or raises `ExpressionFailed`; it never turns a
failure into False.

The `cel` package (bindings of cel-rust) parses and evaluates, but it has no type checker and
exposes no syntax tree: `Program.references()` lists the names an expression uses, with
comprehension variables mixed in with free ones, and macros already expanded into operators.
So this package tokenizes and parses the source itself (`lexer`, `parser`) and checks it
against the snapshot's schema (`checker`, `types`). The library stays the authority on syntax
(a source it refuses is refused with its message), and its reference lists are checked again
after ours. This module holds the public API and the checks made through the library.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cel

from proxy.engine.expressions.checker import Checker
from proxy.engine.expressions.lexer import (
    MAX_COMPREHENSION_DEPTH,
    MAX_EXPR_CHARS,
    MAX_EXPR_DEPTH,
    MAX_POLICY_EXPR_CHARS,
    scan,
    where,
)
from proxy.engine.expressions.parser import Parser
from proxy.engine.expressions.patterns import MAX_POLICY_PATTERN_COST, pattern_cost
from proxy.engine.expressions.projection import Projection
from proxy.engine.expressions.vocabulary import FUNCTIONS, MACROS, VARIABLES

__all__ = [
    "FUNCTIONS",
    "MACROS",
    "MAX_COMPREHENSION_DEPTH",
    "MAX_EXPR_CHARS",
    "MAX_EXPR_DEPTH",
    "MAX_POLICY_EXPR_CHARS",
    "MAX_POLICY_PATTERN_COST",
    "VARIABLES",
    "Budget",
    "Expression",
    "ExpressionFailed",
    "ExpressionTooCostly",
    "compile_condition",
    "precompile",
]

# Operator and macro-expansion names that `Program.functions()` reports besides named functions.
_LIBRARY_INTERNALS = frozenset(
    {"_&&_", "_||_", "!_", "-_", "_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_", "_+_", "_-_"}
    | {"_*_", "_/_", "_%_", "_[_]", "_?_:_", "@in", "@not_strictly_false"}
)
_LIBRARY_ERROR = re.compile(
    r"ERROR: <input>:(?P<where>\d+:\d+): (?:Syntax error: )?(?P<problem>.*)"
)
_LIBRARY_INNER = re.compile(r'msg: "([^"]*)"')  # as in `OtherError(ParseError { ..., msg: "..." })`


# What one evaluation may cost, in units of ~60 ns of the library's time: tokens (and the
# compiles of the `matches()` patterns, which the library makes at every evaluation, and every
# value for each operation that may walk them all) x iterations of the nested comprehensions x
# KiB of the longest string, plus the conversion of each value it is given. About 15 ms. The
# library holds the GIL while it evaluates, so neither a thread nor a timeout could bound it:
# the cost is bounded before it starts instead.
MAX_EVALUATION_COST = 250_000
# What all the evaluations after one step may cost together (~30 ms): a policy may hold many
# expressions, each within MAX_EVALUATION_COST.
MAX_STEP_EVALUATION_COST = 500_000
CONVERSION_COST = 60  # a value given to the library: 1-5 µs


_SCALARS = frozenset({int, float, bool, type(None)})


class ExpressionFailed(Exception):
    """An expression that could not be evaluated, or did not yield a boolean; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ExpressionTooCostly(ExpressionFailed):
    """An expression that would cost too much to evaluate over the run's data, alone or with
    the others evaluated after the same step."""


@dataclass(slots=True)
class Budget:
    """What the evaluations after one step may still cost."""

    left: int = MAX_STEP_EVALUATION_COST


@dataclass(frozen=True, slots=True)
class Expression:
    """A checked stop condition. Build it with `compile_condition`."""

    source: str
    program: cel.Program = field(repr=False, compare=False)
    terms: int = 1  # tokens: what one pass over the expression costs
    patterns: int = 0  # what compiling its `matches()` patterns costs, once each
    walks: int = 0  # operations that may touch every value given (`==` on lists, `in`, ...)
    nests: tuple[tuple[bool, ...], ...] = ()  # its comprehensions' (`Checker.nests`)
    concats: int = 0  # concatenations: each may make a larger value to work on
    # The snapshot's variables it uses: only these are sized and handed to the library, whose
    # conversion of its input is most of an evaluation's cost (1-2 µs a value).
    variables: frozenset[str] = frozenset(VARIABLES)
    # The fields of the snapshot's objects it reads; None: it reads them all.
    projection: Projection | None = field(default=None, repr=False, compare=False)

    def evaluate(self, snapshot: Mapping[str, Any], budget: Budget | None = None) -> bool:
        """The condition's value over `snapshot` (the shape of `RunState.snapshot()`; only
        `variables` need be there), charged to `budget`, the step's.

        Raises `ExpressionTooCostly` before it starts when it would cost more than
        MAX_EVALUATION_COST, or than what is left of `budget`; `ExpressionFailed` when
        evaluation fails (an index out of range, a division by zero, a missing variable, an
        overflow) or yields something other than a boolean.
        """
        snapshot = {name: snapshot[name] for name in self.variables if name in snapshot}
        if self.projection is not None:
            snapshot = self.projection.of(snapshot)
        widest, longest, values = extent(snapshot)
        # What concatenations make is at most as large as all they join: a walk over a list, or
        # a pass over a string, they made costs that many times more.
        grown = self.concats + 1
        each = self.terms + self.patterns + self.walks * values * grown  # one pass over it
        passes = max((iterations(nest, widest, values) for nest in self.nests), default=1)
        work = each * passes * (1 + longest * grown // 1024)
        cost = work + values * CONVERSION_COST
        if cost > MAX_EVALUATION_COST or (budget is not None and cost > budget.left):
            limit = (
                f"the limit is {MAX_EVALUATION_COST:,}"
                if cost > MAX_EVALUATION_COST or budget is None
                else f"the conditions evaluated after this step had {budget.left:,} of their "
                f"{MAX_STEP_EVALUATION_COST:,} left"
            )
            raise ExpressionTooCostly(
                f"over this run's data ({values:,} values, lists of up to {widest} items, "
                f"strings of up to {longest} characters) it would cost {cost:,} units of "
                f"evaluation; {limit}"
            )
        if budget is not None:
            budget.left -= cost
        try:
            result = self.program.execute(_with_doubles(snapshot))
        except Exception as exc:  # the library raises a different class for each failure
            raise ExpressionFailed(_short_reason(exc)) from exc
        if not isinstance(result, bool):
            raise ExpressionFailed(f"yielded {type(result).__name__}, not a boolean")
        return result


def compile_condition(source: str) -> Expression:
    """`compiled` of `source`, from the last COMPILED_KEPT compiled (each a few milliseconds of
    Python: a request's may be compiled in a thread first, `precompile`)."""
    with _compiled_lock:
        known = _compiled.get(source)
        if known is not None:
            _compiled.move_to_end(source)
    if known is None:
        try:
            known = compiled(source)
        except ValueError as exc:
            known = str(exc)
        with _compiled_lock:
            _compiled[source] = known
            while len(_compiled) > COMPILED_KEPT:
                _compiled.popitem(last=False)
    if isinstance(known, str):
        raise ValueError(known)
    return known


def precompile(sources: list[str]) -> None:
    """Compiles `sources` for `compile_condition` to find: meant for a thread, the event loop
    going on meanwhile (an 8,000-character policy held it ~130 ms, 32 requests of one 2.6 s)."""
    for source in sources:
        with contextlib.suppress(ValueError):
            compile_condition(source)


# Expressions compiled, and the problems of those that do not compile, by source.
COMPILED_KEPT = 512
_compiled: OrderedDict[str, Expression | str] = OrderedDict()
_compiled_lock = threading.Lock()


def compiled(source: str) -> Expression:
    """Check and compile one `expr` stop condition.

    Raises `ValueError`, naming the problem and its `line:column`, for: a source longer than
    `MAX_EXPR_CHARS`, brackets nested deeper than `MAX_EXPR_DEPTH`, comprehensions nested deeper
    than `MAX_COMPREHENSION_DEPTH` (all three before any parser runs); invalid syntax; a variable
    other than `VARIABLES` or a comprehension's own; a function or macro outside `FUNCTIONS` and
    `MACROS`; an operation the operand types do not support; a `matches()` pattern that is not a
    valid regular expression literal; a comprehension over anything but the run's data, or a
    `map()` that builds values; and a result that cannot be a boolean.
    """
    tokens, _ = scan(source)
    try:
        program = cel.compile(source)
    except ValueError as exc:
        raise ValueError(f"invalid CEL syntax: {_library_error(exc)}") from None
    checker = Checker(source)
    result = checker.used(checker.check(Parser(source, tokens).parse()))
    if result.kind not in ("bool", "dyn"):
        raise ValueError(f"a stop condition must yield a boolean, but this one yields {result}")
    _cross_check(program, checker.bound)
    patterns = 0
    for pos, literal in checker.patterns:
        try:
            patterns += pattern_cost(str(cel.evaluate(literal)), patterns)
        except ValueError as exc:
            raise ValueError(f"{exc} (at {where(source, pos)})") from None
        _check_pattern(source, pos, literal)
    # The library's references too: a comprehension variable may carry a variable's name.
    named = checker.free | set(program.references()["variables"])
    projection = Projection(checker.fields, checker.whole)
    return Expression(
        source,
        program,
        len(tokens),
        patterns,
        checker.walks,
        tuple(checker.nests),
        checker.concats,
        frozenset(named & set(VARIABLES)),
        projection if projection.drops else None,
    )


def iterations(nest: tuple[bool, ...], widest: int, values: int) -> int:
    """How often the innermost level of a nest of comprehensions runs, at most, over data of
    lists of at most `widest` items and `values` values: each level `widest` times for each
    run of the level around it, or, one that ranges over a part of that level's element, at
    most `values` times for each run of the level around that one."""
    outer, around = 1, 1  # the runs of the level two out, and of the level around
    for descends in nest:
        runs = around * widest
        if descends:
            runs = min(runs, outer * values)
        outer, around = around, runs
    return around


def extent(value: Any) -> tuple[int, int, int]:
    """The length of the longest list or map inside `value` (at least 1), of the longest
    string, and how many values it holds: what the cost of an evaluation over `value` grows
    with."""
    widest, longest, values, pending = 1, 0, 0, [value]
    while pending:
        item = pending.pop()
        values += 1
        kind = type(item)  # the snapshot's own types first: an ABC check costs ten times more
        if kind is str:
            longest = max(longest, len(item))
        elif kind is dict:
            widest = max(widest, len(item))
            pending.extend(item.values())
        elif kind is list:
            widest = max(widest, len(item))
            pending.extend(item)
        elif kind in _SCALARS:
            continue
        elif isinstance(item, str):
            longest = max(longest, len(item))
        elif isinstance(item, Mapping):
            widest = max(widest, len(item))
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            widest = max(widest, len(item))
            pending.extend(item)
    return widest, longest, values


def _cross_check(program: cel.Program, bound: set[str]) -> None:
    """The library's own references, against the same allow-lists.

    They are not enough on their own (comprehension variables are listed with free ones, and
    macros are expanded into operators), but they come from the parse that will run: a name
    our parser missed is still caught here.
    """
    references = program.references()
    for name in references["functions"]:
        if name not in FUNCTIONS and name not in _LIBRARY_INTERNALS:
            raise ValueError(f"unknown function {name!r}")
    for name in references["variables"]:
        if name not in VARIABLES and name not in bound:
            raise ValueError(f"unknown variable {name!r}")


def _check_pattern(source: str, pos: int, literal: str) -> None:
    """A matches() pattern, compiled once by the library's own regex engine (Rust's `regex`,
    whose syntax is not Python's)."""
    try:
        cel.compile(f"''.matches({literal})").execute({})
    except Exception as exc:  # the library reports a bad pattern as a RuntimeError
        raise ValueError(
            f"invalid regular expression {literal} (at {where(source, pos)}): {_short_reason(exc)}"
        ) from None


def _library_error(exc: ValueError) -> str:
    """`problem (at line:column)` from the library's first parse error, without its echo of
    the whole source (up to MAX_EXPR_CHARS, twice) or of its internal error structure."""
    found = _LIBRARY_ERROR.search(str(exc))
    if found is None:
        return str(exc).split("\n", 1)[0]
    problem = found["problem"]
    if (inner := _LIBRARY_INNER.search(problem)) is not None:
        problem = inner[1]
    return f"{problem} (at {found['where']})"


def _short_reason(exc: Exception) -> str:
    """The first sentence of the library's message, without its advice on conversions."""
    if isinstance(exc, KeyError):
        return f"no such key: {exc.args[0]!r}" if exc.args else "no such key"
    text = str(exc).split("\n", 1)[0].split(". ", 1)[0].strip().rstrip(".:")
    return text[:200] or type(exc).__name__


def _with_doubles(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """`snapshot` with its double fields as floats: CEL never converts an int for arithmetic,
    so `cost_usd + 0.5` would fail on a cost that arrived as the JSON number 0."""
    values = dict(snapshot)
    for key in ("cost_usd", "elapsed_s"):
        if type(values.get(key)) is int:
            values[key] = float(values[key])
    steps = values.get("steps")
    if isinstance(steps, list) and any(
        isinstance(s, Mapping) and type(s.get("cost_usd")) is int for s in steps
    ):
        values["steps"] = [
            {**s, "cost_usd": float(s["cost_usd"])}
            if isinstance(s, Mapping) and type(s.get("cost_usd")) is int
            else s
            for s in steps
        ]
    return values
