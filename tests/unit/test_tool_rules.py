"""SPEC §8: tool rules narrow each step's tools, force calls, block and nudge."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.engine import events as ev
from proxy.engine.options import PolicyOptions
from proxy.engine.policies.tool_rules import MAX_MATCHED_VALUES, output_value
from proxy.engine.policy import Catalog, check_references, compile_policy
from proxy.engine.stop import StopReason
from proxy.engine.values import ModelRequest
from tests.fakes import reply
from tests.unit.harness import Harness, problem, tool_spec

TOOLS = {
    name: (lambda n: lambda _: f"{n} ok")(name) for name in ("plan", "search", "fetch", "write")
}


def offered(request: ModelRequest) -> list[str]:
    return [t["function"]["name"] for t in request.tools]


def named(tool: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool}}


async def test_run_first_offers_only_its_tool_and_forces_it_on_the_first_step() -> None:
    h = Harness(
        [reply(calls=[("plan", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[{"type": "run_first", "tool_name": "plan"}],
    )
    result = await h.run()
    first, second = h.model.requests
    assert offered(first) == ["plan"]
    assert first.tool_choice == named("plan")
    assert offered(second) == ["plan", "search", "fetch", "write"]
    assert second.tool_choice is None
    assert result.stop.reason is StopReason.COMPLETED


async def test_several_run_first_rules_offer_any_of_their_tools_with_required() -> None:
    h = Harness(
        [reply(calls=[("search", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[
            {"type": "InitToolRule", "tool_name": "plan"},
            {"type": "run_first", "tool_name": "search"},
        ],
    )
    await h.run()
    assert offered(h.model.requests[0]) == ["plan", "search"]
    assert h.model.requests[0].tool_choice == "required"


async def test_a_disallowed_call_is_blocked_with_the_allowed_tools_and_the_run_goes_on() -> None:
    h = Harness(
        [reply(calls=[("write", "{}")]), reply(calls=[("plan", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[{"type": "run_first", "tool_name": "plan"}],
    )
    result = await h.run()
    assert [c[0] for c in h.tools.calls] == ["plan"]
    blocked = json.loads(result.generated[1]["content"])["error"]
    assert "'write' is not allowed" in blocked
    assert "Allowed tools: plan." in blocked
    (event,) = h.observer.of(ev.CallBlocked)
    assert event.call.name == "write"
    assert event.outcome == "blocked_rule"
    assert result.stop.reason is StopReason.COMPLETED
    assert result.tool_calls == 1


async def test_exit_loop_ends_the_run_with_the_tool_output() -> None:
    h = Harness(
        [reply(calls=[("search", "{}")]), reply(calls=[("write", "{}")])],
        TOOLS,
        tool_rules=[{"type": "TerminalToolRule", "tool_name": "write"}],
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TERMINAL_TOOL
    assert result.message["content"] == "write ok"
    assert "`write` ends your turn" in h.model.requests[0].messages[0]["content"]


async def test_constrain_child_tools_forces_a_child_after_the_tool() -> None:
    h = Harness(
        [reply(calls=[("plan", "{}")]), reply(calls=[("fetch", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[{"type": "constrain_child_tools", "tool_name": "plan", "children": ["fetch"]}],
    )
    await h.run()
    first, second, third = h.model.requests
    assert first.tool_choice is None
    assert len(offered(first)) == 4
    assert offered(second) == ["fetch"]
    assert second.tool_choice == named("fetch")
    assert len(offered(third)) == 4
    assert third.tool_choice is None


async def test_parent_last_tool_offers_children_only_right_after_the_parent() -> None:
    h = Harness(
        [
            reply(calls=[("plan", "{}")]),
            reply(calls=[("write", "{}")]),
            reply(calls=[("write", "{}")]),
            reply("done"),
        ],
        TOOLS,
        tool_rules=[{"type": "ParentToolRule", "tool_name": "plan", "children": ["write"]}],
    )
    result = await h.run()
    assert [offered(r) for r in h.model.requests[:3]] == [
        ["plan", "search", "fetch"],
        ["plan", "search", "fetch", "write"],
        ["plan", "search", "fetch"],
    ]
    assert [c[0] for c in h.tools.calls] == ["plan", "write"]  # the second write is blocked
    assert len(h.observer.of(ev.CallBlocked)) == 1
    assert result.stop.reason is StopReason.COMPLETED


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ('{"message": "found"}', ["fetch"]),
        ("missing", ["write"]),
        ("12", ["search"]),
        ("nothing matches", ["search"]),  # default_child
    ],
)
async def test_conditional_picks_the_next_tool_by_the_output(
    output: str, expected: list[str]
) -> None:
    tools = dict(TOOLS, plan=lambda _: output)
    h = Harness(
        [reply(calls=[("plan", "{}")]), reply("done")],
        tools,
        tool_rules=[
            {
                "type": "conditional",
                "tool_name": "plan",
                "child_output_mapping": {"found": "fetch", "missing": "write", "12": "search"},
                "default_child": "search",
            }
        ],
    )
    await h.run()
    assert offered(h.model.requests[1]) == expected
    assert h.model.requests[1].tool_choice == named(expected[0])


async def test_a_conditional_tool_s_output_nested_too_deep_to_write_is_matched_as_text() -> None:
    """orjson reads 1,024 levels and writes 254: such an output failed the run after its tools
    ran (a 500)."""
    deep = "[" * 300 + "]" * 300
    tools = dict(TOOLS, plan=lambda _: deep)
    rule = {"type": "conditional", "tool_name": "plan", "child_output_mapping": {deep: "fetch"}}
    h = Harness([reply(calls=[("plan", "{}")]), reply("done")], tools, tool_rules=[rule])
    result = await h.run()
    assert result.stop.reason is StopReason.COMPLETED
    assert offered(h.model.requests[1]) == ["fetch"]


@pytest.mark.parametrize(
    ("rows", "picked"),
    [
        ("0," * 20_000, ["fetch"]),  # a short `message` beside a large payload
        ("[]," * MAX_MATCHED_VALUES, ["search"]),  # too many values: matched as its text
    ],
)
async def test_a_conditional_tool_s_large_output_is_read_once_by_its_message_or_text(
    rows: str, picked: list[str]
) -> None:
    """Read once, when the output comes (every call reviewed after it parsed it again: 128
    blocked calls of 1 MiB held the loop 13 s), and not parsed past MAX_MATCHED_VALUES (1 MiB
    of nested empty arrays took 0.2 s)."""
    large = '{"message": "found", "rows": [' + rows + "0]}"
    tools = dict(TOOLS, plan=lambda _: large)
    rule = {
        "type": "conditional",
        "tool_name": "plan",
        "child_output_mapping": {"found": "fetch"},
        "default_child": "search",
    }
    h = Harness([reply(calls=[("plan", "{}")]), reply("done")], tools, tool_rules=[rule])
    await h.run()
    assert offered(h.model.requests[1]) == picked


@pytest.mark.parametrize("parallel", [False, True])
async def test_a_call_after_a_conditional_tool_in_one_reply_waits_for_its_output(
    parallel: bool,
) -> None:
    """Its output picks what may come next, in the same reply too: with parallel calls, the
    conditional tool runs first, alone, and the call after it is reviewed by its output."""
    tools = dict(TOOLS, plan=lambda _: "found")
    rule = {
        "type": "conditional",
        "tool_name": "plan",
        "child_output_mapping": {"found": "fetch"},
        "require_output_mapping": True,
    }
    script = [reply(calls=[("plan", "{}"), ("write", "{}"), ("fetch", "{}")]), reply("done")]
    h = Harness(script, tools, tool_rules=[rule], parallel=parallel)
    await h.run()
    assert [c[0] for c in h.tools.calls] == ["plan", "fetch"]  # write is blocked
    [blocked] = h.observer.of(ev.CallBlocked)
    assert blocked.call.name == "write"


async def test_conditional_without_a_match_is_free_unless_the_mapping_is_required() -> None:
    rule = {
        "type": "ConditionalToolRule",
        "tool_name": "plan",
        "child_output_mapping": {"a": "fetch", "b": "write"},
    }
    free = Harness([reply(calls=[("plan", "{}")]), reply("done")], TOOLS, tool_rules=[rule])
    await free.run()
    assert len(offered(free.model.requests[1])) == 4
    assert free.model.requests[1].tool_choice is None
    strict = Harness(
        [reply(calls=[("plan", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[dict(rule, require_output_mapping=True)],
    )
    await strict.run()
    assert offered(strict.model.requests[1]) == ["fetch", "write"]
    assert strict.model.requests[1].tool_choice == "required"


async def test_max_count_per_step_hides_the_tool_once_used_up_and_blocks_more_calls() -> None:
    h = Harness(
        [
            reply(calls=[("search", "{}"), ("search", "{}"), ("search", "{}")]),
            reply(calls=[("search", "{}")]),
            reply("done"),
        ],
        TOOLS,
        tool_rules=[{"type": "max_count_per_step", "tool_name": "search", "max_count_limit": 2}],
    )
    result = await h.run()
    assert [c[0] for c in h.tools.calls] == ["search", "search"]
    assert "search" not in offered(h.model.requests[1])
    assert len(h.observer.of(ev.CallBlocked)) == 2
    assert "Allowed tools: plan, fetch, write." in result.generated[3]["content"]


async def test_required_before_exit_nudges_until_the_tool_has_run() -> None:
    h = Harness(
        [reply("early"), reply(calls=[("write", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[{"type": "RequiredBeforeExitToolRule", "tool_name": "write"}],
    )
    result = await h.run()
    (nudge,) = h.observer.of(ev.Nudged)
    assert "first call 'write'" in nudge.message
    assert result.stop.reason is StopReason.COMPLETED
    assert result.message["content"] == "early\n\ndone"  # every step's text (SPEC §5.3)


async def test_required_before_exit_caps_at_max_steps_when_never_met() -> None:
    h = Harness(
        [reply("no")] * 3,
        TOOLS,
        max_steps=3,
        tool_rules=[{"type": "required_before_exit", "tool_name": "write"}],
    )
    result = await h.run()
    assert result.stop.reason is StopReason.MAX_STEPS
    assert len(h.observer.of(ev.Nudged)) == 3


async def test_continue_loop_nudges_a_content_only_reply_after_the_tool() -> None:
    h = Harness(
        [
            reply(calls=[("search", "{}")]),
            reply("premature"),
            reply(calls=[("fetch", "{}")]),
            reply("done"),
        ],
        TOOLS,
        tool_rules=[{"type": "continue_loop", "tool_name": "search"}],
    )
    result = await h.run()
    (nudge,) = h.observer.of(ev.Nudged)
    assert "continue after 'search'" in nudge.message
    assert result.stop.reason is StopReason.COMPLETED
    assert result.message["content"] == "premature\n\ndone"


async def test_calls_of_one_reply_are_reviewed_in_order_against_the_updated_state() -> None:
    h = Harness(
        [reply(calls=[("plan", "{}"), ("fetch", "{}"), ("write", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[
            {"type": "run_first", "tool_name": "plan"},
            {"type": "constrain_child_tools", "tool_name": "plan", "children": ["fetch"]},
        ],
    )
    await h.run()
    assert [c[0] for c in h.tools.calls] == ["plan", "fetch", "write"]


async def test_an_empty_allowed_set_at_run_time_offers_no_tools() -> None:
    h = Harness(
        [reply(calls=[("plan", "{}")]), reply(calls=[("fetch", "{}")]), reply("done")],
        TOOLS,
        tool_rules=[
            {"type": "constrain_child_tools", "tool_name": "plan", "children": ["fetch"]},
            {"type": "max_count_per_step", "tool_name": "fetch", "max_count_limit": 1},
            {"type": "constrain_child_tools", "tool_name": "fetch", "children": ["fetch"]},
        ],
    )
    await h.run()
    third = h.model.requests[2]
    assert third.tools == []
    assert third.tool_choice is None


async def test_parallel_calls_are_counted_when_admitted() -> None:
    h = Harness(
        [reply(calls=[("search", "{}")] * 3), reply("done")],
        TOOLS,
        parallel=True,
        tool_rules=[{"type": "max_count_per_step", "tool_name": "search", "max_count_limit": 2}],
    )
    await h.run()
    assert len(h.tools.calls) == 2


@pytest.mark.parametrize(
    ("rules", "param", "message"),
    [
        ([{"type": "sometimes", "tool_name": "a"}], "tool_rules[0].type", "unknown rule type"),
        ([{"type": "run_first"}], "tool_rules[0].tool_name", "is required"),
        (
            [{"type": "run_first", "tool_name": "a", "children": ["b"]}],
            "tool_rules[0].children",
            "unknown field",
        ),
        ([{"type": "ChildToolRule", "tool_name": "a"}], "tool_rules[0].children", "is required"),
        (
            [{"type": "conditional", "tool_name": "a", "child_output_mapping": {}}],
            "tool_rules[0].child_output_mapping",
            "must not be empty",
        ),
        (
            [{"type": "max_count_per_step", "tool_name": "a", "max_count_limit": 0}],
            "tool_rules[0].max_count_limit",
            "greater than or equal to 1",
        ),
        ("run_first", "tool_rules", "list"),
        ([7], "tool_rules[0]", "object"),
    ],
)
def test_malformed_rules_name_the_bad_field(rules: Any, param: str, message: str) -> None:
    path, said = problem({"tool_rules": rules})
    assert path == param
    assert message in said


@pytest.mark.parametrize(
    ("rules", "param", "message"),
    [
        (
            [{"type": "run_first", "tool_name": "nope"}],
            "tool_rules[0].tool_name",
            "not a tool of this run",
        ),
        (
            [{"type": "constrain_child_tools", "tool_name": "a", "children": ["b", "zz"]}],
            "tool_rules[0].children[1]",
            "not a tool",
        ),
        (
            [
                {
                    "type": "conditional",
                    "tool_name": "a",
                    "child_output_mapping": {"x": "b"},
                    "default_child": "q",
                }
            ],
            "tool_rules[0].default_child",
            "not a tool",
        ),
        (
            [
                {"type": "run_first", "tool_name": "b"},
                {"type": "parent_last_tool", "tool_name": "a", "children": ["b"]},
            ],
            "tool_rules[0]",
            "no run_first tool can be called first",
        ),
        (
            [
                {"type": "constrain_child_tools", "tool_name": "c", "children": ["b"]},
                {"type": "parent_last_tool", "tool_name": "a", "children": ["b"]},
            ],
            "tool_rules[0].children",
            "none of the children",
        ),
        (
            [
                {"type": "conditional", "tool_name": "c", "child_output_mapping": {"x": "b"}},
                {"type": "parent_last_tool", "tool_name": "a", "children": ["b"]},
            ],
            "tool_rules[0].child_output_mapping.x",
            "may not follow",
        ),
        (
            [{"type": "exit_loop", "tool_name": "a"}, {"type": "continue_loop", "tool_name": "a"}],
            "tool_rules[1]",
            "cannot both end",
        ),
        (  # only a is ever offered: first, then as its own only child
            [
                {"type": "run_first", "tool_name": "a"},
                {"type": "constrain_child_tools", "tool_name": "a", "children": ["a"]},
                {"type": "required_before_exit", "tool_name": "c"},
            ],
            "tool_rules[2].tool_name",
            "'c' must run before the run may end, but no step can offer it",
        ),
        (  # c may only follow b, which only an exit tool leads to
            [
                {"type": "run_first", "tool_name": "a"},
                {"type": "exit_loop", "tool_name": "a"},
                {"type": "parent_last_tool", "tool_name": "b", "children": ["c"]},
                {"type": "required_before_exit", "tool_name": "c"},
            ],
            "tool_rules[3].tool_name",
            "no step can offer it",
        ),
        (  # every output of a picks b
            [
                {"type": "run_first", "tool_name": "a"},
                {"type": "constrain_child_tools", "tool_name": "b", "children": ["a"]},
                {
                    "type": "conditional",
                    "tool_name": "a",
                    "child_output_mapping": {"x": "b"},
                    "default_child": "b",
                },
                {"type": "required_before_exit", "tool_name": "c"},
            ],
            "tool_rules[3].tool_name",
            "no step can offer it",
        ),
    ],
)
def test_rules_that_name_missing_tools_or_contradict_are_refused(
    rules: list[Any], param: str, message: str
) -> None:
    path, said = problem({"tool_rules": rules}, ("a", "b", "c"))
    assert path == param
    assert message in said


@pytest.mark.parametrize(
    "rules",
    [
        [  # after a, anything: c among it
            {"type": "run_first", "tool_name": "a"},
            {"type": "required_before_exit", "tool_name": "c"},
        ],
        [  # c follows b, b follows a
            {"type": "run_first", "tool_name": "a"},
            {"type": "constrain_child_tools", "tool_name": "a", "children": ["b"]},
            {"type": "parent_last_tool", "tool_name": "b", "children": ["c"]},
            {"type": "required_before_exit", "tool_name": "c"},
        ],
        [  # an output a does not map leaves the next step open
            {"type": "run_first", "tool_name": "a"},
            {"type": "conditional", "tool_name": "a", "child_output_mapping": {"x": "a"}},
            {"type": "required_before_exit", "tool_name": "c"},
        ],
    ],
)
def test_a_required_tool_some_step_can_offer_is_accepted(rules: list[Any]) -> None:
    specs = {name: tool_spec(name) for name in ("a", "b", "c")}
    options = PolicyOptions.model_validate({"tool_rules": rules})
    policy = compile_policy(options, list(specs), Catalog(specs))
    check_references(policy, (), "m", lambda: False)  # raises PolicyInvalid on a problem


@pytest.mark.parametrize(
    ("output", "value"),
    [('{"message": true}', "true"), ('{"message": " x "}', "x"), ("3.5", "3.5"), ("raw", "raw")],
)
def test_output_value_reads_the_message_field_or_the_text(output: str, value: str) -> None:
    assert output_value(output) == value
