"""SPEC §6 `expr`: CEL stop conditions are checked when compiled and never fail silently."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import cel
import pytest

from proxy.engine.expressions import (
    MAX_COMPREHENSION_DEPTH,
    MAX_EXPR_CHARS,
    MAX_EXPR_DEPTH,
    Expression,
    ExpressionFailed,
    ExpressionTooCostly,
    compile_condition,
    extent,
)
from proxy.engine.expressions.parser import Lit, Parser
from proxy.engine.expressions.types import BOOL
from proxy.engine.state import RunState, StepRecord
from proxy.engine.usage import Usage
from proxy.engine.values import ToolCall

WORDS = ("error", "failed", "denied", "timeout", "fatal", "abort", "panic", "crash", "killed", "x")
SPEC_EXAMPLE = "size(steps) >= 3 && steps.exists(s, s.tool_calls.exists(c, c.name == 'search'))"


def step(
    index: int,
    *,
    calls: tuple[str, ...] = (),
    finish_reason: str = "stop",
    text: str = "",
    tokens: int = 10,
    cost: float = 0.01,
) -> dict[str, Any]:
    return {
        "index": index,
        "tool_calls": [{"name": name, "arguments": "{}"} for name in calls],
        "tool_results": [{"name": name, "output": "ok", "is_error": False} for name in calls],
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "cost_usd": cost,
        "finish_reason": finish_reason,
        "text": text,
    }


def snapshot(
    *steps: dict[str, Any], tokens: int = 0, cost: float = 0.0, elapsed: float = 0.0
) -> dict[str, Any]:
    return {
        "steps": list(steps),
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "cost_usd": cost,
        "elapsed_s": elapsed,
    }


def rejection(source: str) -> str:
    """The message `compile_condition` refuses `source` with."""
    try:
        compile_condition(source)
    except ValueError as exc:
        return str(exc)
    pytest.fail(f"accepted {source!r}")


@pytest.mark.parametrize(
    ("source", "holds", "fails"),
    [
        (
            SPEC_EXAMPLE,
            snapshot(step(0), step(1, calls=("search",)), step(2)),
            snapshot(step(0, calls=("search",)), step(1)),
        ),
        (
            SPEC_EXAMPLE,
            snapshot(step(0), step(1, calls=("search",)), step(2)),
            snapshot(step(0), step(1, calls=("fetch",)), step(2)),
        ),
        ("usage.total_tokens > 100", snapshot(tokens=101), snapshot(tokens=100)),
        ("cost_usd >= 0.5", snapshot(cost=0.5), snapshot(cost=0.49)),
        ("elapsed_s > 2.0", snapshot(elapsed=2.5), snapshot(elapsed=2.0)),
        (
            "steps.exists(s, s.finish_reason == 'length')",
            snapshot(step(0), step(1, finish_reason="length")),
            snapshot(step(0), step(1)),
        ),
        (
            "size(steps) > 0 && steps[size(steps)-1].text.contains('done')",
            snapshot(step(0), step(1, text="all done")),
            snapshot(step(0, text="done"), step(1, text="working")),
        ),
        (
            "size(steps) > 0 && steps[size(steps)-1].text.contains('done')",
            snapshot(step(0, text="done")),
            snapshot(),
        ),
        (
            "steps.all(s, s.tool_results.all(r, !r.is_error)) && size(steps) >= 2",
            snapshot(step(0, calls=("a",)), step(1)),
            snapshot(step(0)),
        ),
        (
            "steps.map(s, s.usage.total_tokens).exists(t, t >= 50)",
            snapshot(step(0, tokens=10), step(1, tokens=50)),
            snapshot(step(0, tokens=49)),
        ),
        (
            "'length' in steps.map(s, s.finish_reason)",
            snapshot(step(0, finish_reason="length")),
            snapshot(step(0)),
        ),
        (
            "size(steps.filter(s, size(s.tool_calls) > 0)) == 2",
            snapshot(step(0, calls=("a",)), step(1), step(2, calls=("b", "c"))),
            snapshot(step(0, calls=("a",))),
        ),
        (
            "steps.exists(s, s.text.matches('^(yes|done)[.!]?$'))",
            snapshot(step(0, text="done!")),
            snapshot(step(0, text="undone")),
        ),
        (
            "steps.exists_one(s, s.cost_usd > 0.05) && double(usage.total_tokens) / 2.0 < 10.0",
            snapshot(step(0, cost=0.1), step(1), tokens=19),
            snapshot(step(0, cost=0.1), step(1, cost=0.1), tokens=19),
        ),
        (
            "has(usage.total_tokens) && 'total_tokens' in usage && usage['total_tokens'] == 7",
            snapshot(tokens=7),
            snapshot(tokens=8),
        ),
        (
            "cost_usd > 1.0 ? elapsed_s > 60.0 : elapsed_s > 120.0",
            snapshot(cost=2.0, elapsed=61.0),
            snapshot(cost=0.5, elapsed=61.0),
        ),
        ("usage.total_tokens >= 1.5", snapshot(tokens=2), snapshot(tokens=1)),
        ("steps.exists(s, s.cost_usd + 0.5 > 0.75)", snapshot(step(0, cost=1)), snapshot(step(0))),
    ],
)
def test_valid_conditions_evaluate_true_and_false(
    source: str, holds: dict[str, Any], fails: dict[str, Any]
) -> None:
    expression = compile_condition(source)
    assert expression.source == source
    assert expression.evaluate(holds) is True
    assert expression.evaluate(fails) is False


def test_a_condition_is_given_only_the_fields_it_reads() -> None:
    expression = compile_condition(SPEC_EXAMPLE)
    assert expression.projection is not None
    snap = snapshot(step(0, calls=("search",), text="long"), step(1), tokens=5)
    assert expression.projection.of({"steps": snap["steps"]}) == {
        "steps": [{"tool_calls": [{"name": "search"}]}, {"tool_calls": []}]
    }
    assert compile_condition("steps[0] == steps[1]").projection is None  # compared whole
    # Every field of a step read, none of its calls': the calls inside still lose theirs.
    every = (
        "steps.exists(s, s.index >= 0 && size(s.tool_calls) >= 0 && size(s.tool_results) >= 0"
        " && has(s.usage) && s.cost_usd >= 0.0 && s.finish_reason != '' && s.text == 'hi')"
    )
    projection = compile_condition(every).projection
    assert projection is not None
    (read,) = projection.of({"steps": [step(0, calls=("a",), text="hi")]})["steps"]
    assert (read["tool_calls"], read["tool_results"], read["usage"]) == ([{}], [{}], {})
    assert read["text"] == "hi"


# Two steps that differ only in fields a projection could leave out: their texts, their calls'
# arguments, their results' outputs.
TWINS = snapshot(step(0, calls=("a",), text="one"), step(0, calls=("a",), text="two"))
TWINS["steps"][1]["tool_calls"][0]["arguments"] = '{"x": 1}'
TWINS["steps"][1]["tool_results"][0]["output"] = "other"


@pytest.mark.parametrize(
    "source",
    [
        "steps[0] == steps[1]",
        "steps[0] != steps[1]",
        "steps[0].tool_calls == steps[1].tool_calls",
        "steps[0].tool_results[0] == steps[1].tool_results[0]",
        "steps[0] in [steps[1]]",
        "[steps[0]] == [steps[1]]",
        "steps.filter(s, s.index == 0) == [steps[1], steps[1]]",
        "steps.map(s, s)[0] == steps[1]",
        "steps.map(s, s.tool_calls)[0] == steps[1].tool_calls",
        "(size(steps) > 1 ? steps[0] : steps[1]) == steps[1]",
        "size(steps[0]) == 7",
        "'text' in steps[0] && size(steps[0].tool_calls[0]) == 2",
        "steps[0].exists(k, k == 'text')",
        "steps[0].exists(k, steps[0][k] == 'one')",
        "steps.exists(s, s.tool_calls.exists(c, c.name == 'a')) && steps[0].usage == usage",
        "has(steps[1].text) && size(steps[1].tool_results) == 1",
        "steps.exists(s, s.text == 'two')",
        "steps.map(s, s.tool_results[0].output).exists(o, o == 'other')",
        "size(steps) == 2 && size(steps[0].tool_calls) == 1",
    ],
)
def test_what_a_condition_is_given_leaves_its_value_unchanged(source: str) -> None:
    """Evaluated over the fields it reads, and over the whole snapshot: the same value, on data
    where any field left out by mistake would change it."""
    expression = compile_condition(source)
    whole = replace(expression, projection=None)
    for snap in (TWINS, snapshot(step(0, text="one"), step(0, text="one"), tokens=10)):
        assert outcome(expression, snap) == outcome(whole, snap)
    assert isinstance(outcome(expression, TWINS), bool)


def outcome(expression: Expression, snap: dict[str, Any]) -> bool | str:
    try:
        return expression.evaluate(snap)
    except ExpressionFailed as exc:
        return exc.reason


def test_conditions_read_the_snapshot_a_run_state_produces() -> None:
    run = RunState(run_id="r", model="m", started_at=10.0, messages=[], now=13.5)
    run.steps.append(
        StepRecord(
            0,
            tool_calls=[ToolCall("c1", "search", '{"q": "x"}')],
            tool_results=[{"name": "search", "output": "found", "is_error": False}],
            usage=Usage(5, 7, 12),
            cost_usd=0.25,
            finish_reason="tool_calls",
            text="looking",
        )
    )
    run.usage = Usage(5, 7, 12)
    run.cost_usd = 0.25
    source = (
        "steps[0].tool_calls[0].arguments.contains('q') && steps[0].tool_results[0].output "
        "== 'found' && steps[0].usage.completion_tokens == 7 && steps[0].cost_usd == 0.25 && "
        "steps[0].finish_reason == 'tool_calls' && steps[0].index == 0 && "
        "steps[0].text.startsWith('look') && usage.prompt_tokens == 5 && cost_usd == 0.25 && "
        "elapsed_s == 3.5"
    )
    assert compile_condition(source).evaluate(run.snapshot()) is True


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "__import__('os').system('true')",
            "unknown function '__import__'; a condition can call size, contains, startsWith, "
            "endsWith, matches, int, uint, double, string and the macros has, all, exists, "
            "exists_one, map, filter (at 1:1)",
        ),
        ("steps[0].text.lowerAscii() == 'a'", "unknown function 'lowerAscii';"),
        ("max(usage.total_tokens, 1) > 3", "unknown function 'max';"),
        ("type(cost_usd) == double", "unknown function 'type';"),
        (
            "tokens > 3",
            "unknown variable 'tokens'; a condition can use steps, usage, cost_usd, elapsed_s "
            "and the variables its comprehensions bind (at 1:1)",
        ),
        ("steps.exists(s, true) && s.index > 0", "unknown variable 's';"),
        ("steps.exists(s, steps.exists(t, true) && t.index > 0)", "unknown variable 't';"),
        ("size(steps)", "a stop condition must yield a boolean, but this one yields int"),
        ("'a' + 'b'", "a stop condition must yield a boolean, but this one yields string"),
        ("usage.total_tokens", "a stop condition must yield a boolean, but this one yields int"),
        ("steps", "a stop condition must yield a boolean, but this one yields list(step)"),
        (
            "steps.map(s, s.index)",
            "a stop condition must yield a boolean, but this one yields list(int)",
        ),
        (
            "steps[0].finish_reasn == 'stop'",
            "step has no field 'finish_reasn'; its fields are index, tool_calls, tool_results, "
            "usage, cost_usd, finish_reason, text (at 1:10)",
        ),
        ("usage['tokens'] > 1", "usage has no field 'tokens';"),
        ("has(steps[0].tool_calls[0].id)", "tool call has no field 'id';"),
        ("cost_usd.amount > 1.0", "double has no fields (at 1:10)"),
        (
            "cost_usd + 1 > 2.0",
            "'+' cannot combine double and int: CEL does not convert between numbers, write "
            "double(x), int(x) or uint(x) (at 1:10)",
        ),
        (
            "usage.total_tokens == '100'",
            "'==' compares int with string, which are never equal (at 1:20)",
        ),
        ("1 < 2 < 3", "'<' cannot order bool and int (at 1:7)"),
        ("cost_usd && true", "'&&' needs booleans, not double and bool"),
        ("!usage.total_tokens", "'!' cannot apply to int"),
        ("steps['0'].index == 0", "a list index must be an int, not string"),
        ("steps[0].text[0] == 'a'", "string cannot be indexed by int"),
        ("size(cost_usd) > 0", "size() needs a string, bytes, list or map, not double"),
        ("int(steps) > 0", "int() cannot convert list(step)"),
        ("contains(steps[0].text, 'x')", "contains() is a method: write text.contains(...)"),
        ("cost_usd.int() > 0", "int() is a function: write int(value)"),
        ("steps[0].index.startsWith('1')", "startsWith() works on strings, not int"),
        ("'a'.endsWith('a', 'b')", "endsWith() takes one argument"),
        ("1 in steps", "'in' looks for int among list(step) elements"),
        ("cost_usd > 1.0 ? 1 : true", "the branches of '?:' have different types: int and bool"),
        ("cost_usd ? true : false", "the condition of '?:' must be a boolean, not double"),
        (
            "steps.exists(s)",
            "exists() is a macro that takes a variable and a predicate, as in "
            "steps.exists(s, s.index > 0) (at 1:7)",
        ),
        ("all(steps, s, true)", "all() is a macro that takes a variable and a predicate"),
        ("steps.exists(s, s.index)", "the predicate of exists() must be a boolean, not int"),
        ("cost_usd.exists(x, true)", "exists() cannot range over double"),
        (
            "[1, 2, 3].exists(x, x > 2)",
            "exists() must range over the run's data (steps, usage, a step's tool_calls, ...), "
            "not over a list or map built in the expression (at 1:11)",
        ),
        ("(steps + steps).all(s, true)", "all() must range over the run's data"),
        (
            "size(steps.map(s, s.text + s.text)) > 0",
            "map() may only pick values out of the run's data (a field, an element, a number or "
            "a boolean), not build a string (at 1:12)",
        ),
        ("size(steps.map(s, [s, s])) > 0", "map() may only pick values out of the run's data"),
        (
            "steps[0].map(k, k)[0] == 'text'",
            "map() over the field names of step would list them in no fixed order, so the "
            "condition could hold one time and not the next; use all(), exists() or "
            "exists_one(), or name the fields (at 1:10)",
        ),
        ("size(usage.filter(k, k != '')) == 3", "filter() over the field names of usage"),
        (
            "steps.exists(s, s.text.matches(s.finish_reason))",
            "the pattern of matches() must be a string literal, such as 'a.*b' (at 1:24)",
        ),
        (
            "steps.exists(s, s.text.matches('(unclosed'))",
            "invalid regular expression '(unclosed' (at 1:32): Function 'matches' error: "
            "'(unclosed' not a valid regex",
        ),
        ("Foo{a: 1} == 1", "unsupported message construction (at 1:4)"),
        (".steps == []", "unsupported syntax (at 1:1)"),
    ],
)
def test_invalid_conditions_are_refused_with_what_is_wrong(source: str, message: str) -> None:
    assert rejection(source).startswith(message)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "size(steps) >= ",
            "invalid CEL syntax: mismatched input '<EOF>' expecting {",
        ),
        ("size(steps) >= 3 &&\n  steps[0] ==", "(at 2:14)"),
        ("has(steps)", "invalid CEL syntax: invalid argument to has() macro (at 1:5)"),
        ("let == 1", "invalid CEL syntax: reserved identifier: let (at 1:1)"),
        ("steps.?x", "invalid CEL syntax: unsupported syntax '.?' (at 1:6)"),
        ("steps[0].text == 'done", "invalid CEL syntax: unterminated string (at 1:18)"),
        ("'a\nb' == ''", "invalid CEL syntax: unterminated string (at 1:1)"),
        ("'\\q' == ''", "invalid CEL syntax: invalid escape sequence (at 1:2)"),
        ("'\\x4' == ''", "invalid CEL syntax: invalid escape sequence (at 1:2)"),
        ("cost_usd = 1.0", "invalid CEL syntax: unexpected '=' (at 1:10)"),
        ("true ? true : " * 100 + "false", "invalid CEL syntax: Recursion limit of 96 exceeded"),
    ],
)
def test_syntax_errors_say_where(source: str, message: str) -> None:
    found = rejection(source)
    assert message in found
    assert found.startswith("invalid CEL syntax: ")
    assert "Failed to parse expression" not in found  # not the library's echo of the source


@pytest.mark.parametrize(
    "source",
    [
        "\"size(x)\" == 'a'",
        "steps.exists(s, s.text == \"__import__('os').system('true')\")",
        "steps.exists(s, s.text.contains('foo(bar) && baz.exists(q, q)'))",
        "steps.exists(s, s.text == '\\'unknown(\\' + \"x\"')",
        "steps.exists(s, s.text == '''it's \"max(1, 2)\" ''')",
        "steps.exists(s, s.text == r'\\' || s.text == R\"tokens\\\")",
        'steps.exists(s, s.text == """a "quoted" steps2\nline""")',
        "size(steps) >= 0 // a comment mentioning forbidden(names) and unclosed ( ' \"",
    ],
)
def test_string_literals_and_comments_that_mention_names_are_not_code(source: str) -> None:
    held = compile_condition(source).evaluate(snapshot(step(0)))  # (its text is empty)
    assert held is source.startswith("size(steps)")


def test_escaped_and_raw_strings_keep_their_values() -> None:
    source = "steps[0].text == 'it\\'s \\x41' && steps[0].finish_reason == r'a\\n'"
    assert compile_condition(source).evaluate(
        snapshot(step(0, text="it's A", finish_reason="a\\n"))
    )


@pytest.mark.parametrize(
    ("source", "snap", "reason"),
    [
        ("steps[5].index == 1", snapshot(step(0), step(1)), "index out of bounds: 5"),
        ("steps[0].text == 'x'", snapshot(), "index out of bounds: 0"),
        ("usage.total_tokens / 0 > 1", snapshot(), "division by zero in CEL expression"),
        ("usage.total_tokens % 0 > 1", snapshot(), "modulo by zero in CEL expression"),
        (
            "usage.total_tokens * 9223372036854775807 > 1",
            snapshot(tokens=2),
            "Arithmetic overflow in 'mul' on 2 and 9223372036854775807",
        ),
        ("int(steps[0].text) > 1", snapshot(step(0, text="many")), "Function 'int' error"),
        ("cost_usd > 1.0", {"steps": []}, "Undefined variable or function: 'cost_usd'"),
        ("steps.exists(s, s.text == 'x')", snapshot({"index": 0}), "no such key: 'text'"),
        ("[true, 1][1]", snapshot(), "yielded int, not a boolean"),
    ],
)
def test_evaluation_failures_raise_expression_failed(
    source: str, snap: dict[str, Any], reason: str
) -> None:
    expression = compile_condition(source)
    with pytest.raises(ExpressionFailed) as caught:
        expression.evaluate(snap)
    assert caught.value.reason.startswith(reason)
    assert str(caught.value) == caught.value.reason
    assert "CEL does not coerce" not in caught.value.reason  # the library's advice is dropped


@pytest.mark.parametrize(
    ("source", "variables"),
    [
        ("cost_usd > 0.5 || elapsed_s > 60.0", {"cost_usd", "elapsed_s"}),
        ("usage.total_tokens > 10", {"usage"}),
        (SPEC_EXAMPLE, {"steps"}),
        # A comprehension variable with a variable's name: taken as used, never left out.
        ("steps.exists(usage, usage.cost_usd > 1.0)", {"steps", "usage"}),
        ("'steps' == 'usage'", set()),
    ],
)
def test_an_expression_knows_the_variables_it_reads(source: str, variables: set[str]) -> None:
    assert compile_condition(source).variables == variables


def test_only_the_variables_an_expression_reads_are_sized_and_converted() -> None:
    """Data the expression never reads costs it nothing: not converted for the library, and not
    counted against the evaluation's bound (which text this long would pass for an expression
    of this size that read it)."""
    long_text = step(0, text="x" * 800_000)
    cheap = compile_condition(" || ".join(["cost_usd > 1.0"] * 100))
    assert cheap.evaluate(snapshot(long_text, cost=2.0)) is True
    assert cheap.evaluate({"cost_usd": 2.0}) is True  # a snapshot of what it reads is enough
    costly = compile_condition(" || ".join(["cost_usd > 1.0"] * 97) + " || steps[0].text == ''")
    with pytest.raises(ExpressionTooCostly):
        costly.evaluate(snapshot(long_text, cost=2.0))


def test_a_chain_of_string_concatenations_costs_the_string_it_makes() -> None:
    """Each `+` copies what the ones before it made: 300 of them over a 10 KB text write ~450
    MB (seconds of the event loop), where one over it is cheap."""
    text = step(0, text="t" * 10_000)
    one = compile_condition("steps.map(s, s.text).exists(t, size(t + t) < 0)")
    assert one.evaluate(snapshot(text)) is False
    chain = " + ".join(["t"] * 300)
    many = compile_condition(f"steps.map(s, s.text).exists(t, size({chain}) < 0)")
    with pytest.raises(ExpressionTooCostly):
        many.evaluate(snapshot(text))


def test_a_chain_of_list_concatenations_costs_the_list_it_makes() -> None:
    """320 `steps +` over 25 steps copy ~50,000 lists of them: seconds of the event loop."""
    steps = [step(i, calls=("a", "b")) for i in range(25)]
    chain = "+".join(["steps"] * 320)
    many = compile_condition(f"size({chain}) < 0")
    with pytest.raises(ExpressionTooCostly):
        many.evaluate(snapshot(*steps))
    assert compile_condition("size(steps + steps) < 0").evaluate(snapshot(*steps)) is False


def test_a_comprehension_over_each_steps_calls_costs_the_calls_not_the_widest_squared() -> None:
    """Every step's calls, all steps together, are at most the values given: a reply of 100
    parallel calls made this ~300,000 units (the widest list at each level) and the run ended
    `condition_error`, a model's output deciding it."""
    steps = [step(i, calls=("a",) * (100 if i == 3 else 1)) for i in range(8)]
    nested = "size(steps) >= 8 && steps.exists(s, s.tool_calls.exists(c, c.name == 'x'))"
    assert compile_condition(nested).evaluate(snapshot(*steps)) is False
    calls = "steps.map(s, s.tool_calls).exists(l, l.exists(c, c.name == 'a'))"
    assert compile_condition(calls).evaluate(snapshot(*steps)) is True


@pytest.mark.parametrize(
    "crossed",
    [
        "steps.exists(s, steps.exists(t, steps.exists(u, u.index + t.index < s.index)))",
        # A map may pick one value for every element: its elements are no distinct parts.
        "steps.map(s, steps).exists(a, a.exists(b, steps.exists(c, b.index > c.index + 9)))",
    ],
)
def test_comprehensions_over_lists_of_their_own_cost_each_list_at_each_level(
    crossed: str,
) -> None:
    steps = [step(i, calls=("a",)) for i in range(40)]
    with pytest.raises(ExpressionTooCostly):  # 40 x 40 x 40 iterations (~70 ms)
        compile_condition(crossed).evaluate(snapshot(*steps))


def test_a_whole_list_compared_costs_its_conversion_though_nothing_iterates_it() -> None:
    """`steps == []` has no comprehension, but the library converts every value it is given."""
    expression = compile_condition("steps == []")
    busy = [step(i, calls=tuple(f"t{j}" for j in range(128))) for i in range(8)]
    assert expression.evaluate(snapshot(*busy[:1])) is False
    with pytest.raises(ExpressionTooCostly, match=r"over this run's data \([\d,]+ values"):
        expression.evaluate(snapshot(*busy))


@pytest.mark.parametrize(
    "pattern",
    [
        "(\\\\w{50}){10}",
        "\\\\W{200}",
        "\\\\p{L}{20}",
        "[^\\\\W]{10}",
        "a{100000}",
        "\\\\w{ 100 }",  # spaces inside a repetition
        "\\\\w{20 ,40}",
        "(?x)\\\\w {100}",  # verbose: spaces and comments are no atoms
        "(?x)\\\\w #c\\n{100}",
        "[:]\\\\w{100}",  # a class that opens with a colon
        "[\\\\x{80}-\\\\x{10FFFF}]{1900}",  # a range past ASCII
    ],
)
def test_a_pattern_too_costly_to_compile_is_refused_before_it_is_compiled(pattern: str) -> None:
    message = rejection(f"steps.exists(s, s.text.matches('{pattern}'))")
    assert message.startswith("the regular expression would cost too much to compile")
    assert "[a-zA-Z0-9_] costs little" in message
    assert message.endswith("(at 1:32)")


@pytest.mark.parametrize(
    "pattern",
    [
        "^[a-z]+@example\\\\.com$",
        "\\\\w+",
        "\\\\w{4}",
        "[a-zA-Z0-9_]{50}",
        "(?i)error|fail",
        "|".join(f"\\\\b{word}\\\\b" for word in WORDS),
        "\\\\u{10000}\\\\u{10001}",  # characters by their codes
        "\\\\U{100000}",
    ],
)
def test_patterns_that_cost_little_to_compile_are_accepted(pattern: str) -> None:
    expression = compile_condition(f"steps.exists(s, s.text.matches('{pattern}'))")
    assert expression.patterns > 0
    assert expression.evaluate(snapshot(step(0, text="-"))) is False


@pytest.mark.parametrize(
    "source",
    [
        "steps[0].tool_results.exists(r, steps[0].tool_results == steps[0].tool_results)",
        "steps[0].tool_results.exists(r, r in steps[0].tool_results)",
    ],
)
def test_comparing_whole_lists_is_charged_for_every_value_they_hold(source: str) -> None:
    """Each `==` or `in` of a comprehension over 900 results walks 900 results (it ran 0.4-1.3
    s here): charged as one token, it passed."""
    results = [{"name": "t", "output": "o", "is_error": False}] * 900
    busy = {**step(0), "tool_results": results}
    expression = compile_condition(source)
    assert expression.walks == 1
    assert expression.evaluate(snapshot({**step(0), "tool_results": results[:3]})) is True
    with pytest.raises(ExpressionTooCostly):
        expression.evaluate(snapshot(busy))


def test_the_extent_of_data_counts_its_widest_list_or_map_and_longest_string() -> None:
    from types import MappingProxyType

    assert extent({"cost_usd": 1.5, "elapsed_s": None}) == (2, 0, 3)  # the map and its two
    # A step has 7 fields; its longest string is its finish reason, "stop".
    assert extent(snapshot(step(0, text="abc"), step(1, calls=("a", "b", "c"))))[:2] == (7, 4)
    # Other mappings and sequences count as the snapshot's own dicts and lists do: the map,
    # the proxy, the tuple and its nine strings are 12 values.
    other = MappingProxyType({"a": ("x" * 7, "y", "z", "w", "v", "u", "t", "s", "r")})
    assert extent({"v": other}) == (9, 7, 12)


def test_a_run_state_snapshots_only_the_variables_asked_for() -> None:
    run = RunState("run_1", "gpt-x", 0.0, [], now=2.5)
    run.steps.append(StepRecord(1, [], [], Usage(3, 4, 7), 0.25, "stop", "hi"))
    run.usage, run.cost_usd = Usage(3, 4, 7), 0.25
    assert run.snapshot({"cost_usd", "elapsed_s"}) == {"cost_usd": 0.25, "elapsed_s": 2.5}
    assert set(run.snapshot()) == {"steps", "usage", "cost_usd", "elapsed_s"}


def test_integer_costs_and_durations_are_read_as_doubles() -> None:
    expression = compile_condition(
        "cost_usd + 0.5 >= 1.5 && elapsed_s * 2.0 == 4.0 && steps[0].cost_usd + 0.5 == 2.5"
    )
    snap = snapshot(step(0, cost=2), cost=1, elapsed=2)
    assert expression.evaluate(snap) is True
    assert type(snap["cost_usd"]) is int  # the caller's snapshot is left as it was


@pytest.fixture
def library_compile(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every source handed to `cel.compile`."""
    seen: list[str] = []
    real = cel.compile

    def recording(source: str) -> cel.Program:
        seen.append(source)
        return real(source)

    monkeypatch.setattr(cel, "compile", recording)
    return seen


def nested_brackets(depth: int) -> str:
    return "(" * (depth - 1) + "size(steps)" + ")" * (depth - 1) + " >= 0"


def nested_comprehensions(depth: int) -> str:
    source = "true"
    for level in range(depth):
        source = f"steps.exists(s{level}, {source})"
    return source


def test_length_limit(library_compile: list[str]) -> None:
    longest = "cost_usd >= 0.0" + " " * (MAX_EXPR_CHARS - 15)
    assert compile_condition(longest).evaluate(snapshot()) is True
    assert rejection(longest + " ") == (
        f"the expression is {MAX_EXPR_CHARS + 1} characters long; the limit is {MAX_EXPR_CHARS}"
    )
    assert library_compile == [longest]


def test_bracket_nesting_limit(library_compile: list[str]) -> None:
    assert compile_condition(nested_brackets(MAX_EXPR_DEPTH)).evaluate(snapshot()) is True
    library_compile.clear()
    deeper = MAX_EXPR_DEPTH + 1
    for source, column in (
        (nested_brackets(deeper), MAX_EXPR_DEPTH + len("size(")),
        ("[" * deeper + "]" * deeper + " == []", deeper),
        ("{'a': " * deeper + "1" + "}" * deeper + " == {}", MAX_EXPR_DEPTH * len("{'a': ") + 1),
    ):
        expected = f"brackets nest deeper than {MAX_EXPR_DEPTH} levels (at 1:{column})"
        assert rejection(source) == expected
    assert library_compile == []


def test_comprehension_nesting_limit(library_compile: list[str]) -> None:
    deepest = compile_condition(nested_comprehensions(MAX_COMPREHENSION_DEPTH))
    assert deepest.evaluate(snapshot(step(0), step(1))) is True
    assert deepest.evaluate(snapshot()) is False
    library_compile.clear()
    source = nested_comprehensions(MAX_COMPREHENSION_DEPTH + 1)
    assert rejection(source) == (
        "comprehensions (all, exists, exists_one, map, filter) nest deeper than "
        f"{MAX_COMPREHENSION_DEPTH} levels (at 1:{source.rindex('(') + 1})"
    )
    mixed = "size(steps.map(a, steps.map(b, steps.filter(c, steps.all(d, true))))) > 0"
    assert rejection(mixed).startswith("comprehensions (all, exists, exists_one, map, filter)")
    assert library_compile == []


def test_bounds_ignore_brackets_and_macros_inside_strings() -> None:
    inside = "(" * 40 + ".exists(a, .all(b, .map(c, .filter(d," + "[" * 40
    source = f"steps.exists(s, s.text == '{inside}' || s.text == \"{inside}\")"
    assert compile_condition(source).evaluate(snapshot(step(0, text=inside))) is True


def test_long_operator_chains_are_checked_without_deep_recursion() -> None:
    terms = (MAX_EXPR_CHARS - 10) // 2
    assert compile_condition("+".join(["1"] * terms) + " > 0").evaluate(snapshot())
    assert compile_condition("!" * (MAX_EXPR_CHARS - 10) + "true").evaluate(snapshot())
    chain = "steps" + ".filter(s, true)" * 100 + ".size() == 1"
    assert compile_condition(chain).evaluate(snapshot(step(0)))


def test_a_50000_term_expression_is_refused_without_crashing() -> None:
    # In a child process: if the bound ever let it through, the library's segfault would end
    # the child, not the test run.
    script = textwrap.dedent(
        """
        from proxy.engine.expressions import compile_condition
        source = "+".join(["1"] * 50_000) + " > 0"
        try:
            compile_condition(source)
        except ValueError as exc:
            print(exc)
        """
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "the expression is 100003 characters long; the limit is 2000"


def test_the_library_references_are_checked_even_if_our_parse_missed_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Our parser is trusted to see every name; this is the net under it.
    harmless = Lit(0, BOOL, "true")
    monkeypatch.setattr(Parser, "parse", lambda self: harmless)
    assert rejection("system('x') || true") == "unknown function 'system'"
    assert rejection("secret || true") == "unknown variable 'secret'"
