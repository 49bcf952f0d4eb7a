"""SPEC §4.1: a request's loop tightens an agent's policy and never loosens it; what a policy
names is checked against what the run has."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from proxy.engine.expressions import MAX_EXPR_CHARS, MAX_POLICY_EXPR_CHARS
from proxy.engine.options import PolicyOptions
from proxy.engine.policy import Catalog, LoopPolicy, check_references, compile_policy, tighten
from proxy.errors import PolicyInvalid
from tests.unit.harness import tool_spec

SPECS = {name: tool_spec(name, tool_id=f"id-{name}") for name in ("search", "fetch", "submit")}
CATALOG = Catalog(SPECS, {"hook": "webhook"})


def policy(options: dict[str, Any], tools: list[str], path: str = "") -> LoopPolicy:
    return compile_policy(PolicyOptions.model_validate(options), tools, CATALOG, path)


AGENT = policy(
    {
        "max_steps": 10,
        "stop_when": [{"step_count_is": 8}],
        "terminating_config": {"tool_ids": ["submit"], "consecutive_nudges": 2},
        "tool_call_limits": [{"tool_name": "search", "run_limit": 3}],
        "parallel_tool_calls": True,
    },
    ["search", "submit"],
)


def test_a_request_tightens_numbers_and_adds_its_rules() -> None:
    request = policy(
        {
            "max_steps": 50,
            "stop_when": [{"max_tokens_used": 1000}],
            "terminating_config": {"tool_ids": ["id-submit"], "consecutive_nudges": 5},
            "tool_call_limits": [{"run_limit": 4}],
            "final_answer": True,
        },
        ["id-fetch"],
        "loop.",
    )
    merged = tighten(AGENT, request)
    assert merged.max_steps == 10  # a larger max_steps is ignored
    assert list(merged.tools) == ["search", "submit", "fetch"]  # ids resolve to names
    assert [c.path for c in merged.stop_when] == ["stop_when[0]", "loop.stop_when[0]"]
    assert merged.terminating is not None
    assert merged.terminating.consecutive_nudges == 2
    # The number that holds is named where it was given (the request's path named it: 5).
    assert merged.terminating.path_of("consecutive_nudges") == (
        "terminating_config.consecutive_nudges"
    )
    assert merged.terminating.path_of("max_invocations") == (
        "loop.terminating_config.max_invocations"  # (both 64: the request's)
    )
    assert merged.terminating.tool_ids == ("submit",)
    assert [lim.path for lim in merged.tool_call_limits] == [
        "tool_call_limits[0]",
        "loop.tool_call_limits[0]",
    ]
    assert merged.final_answer is True
    assert merged.parallel_tool_calls is True  # the request did not say


def test_a_smaller_max_steps_and_a_false_parallel_flag_win() -> None:
    request = policy({"max_steps": 3, "parallel_tool_calls": False}, [], "loop.")
    merged = tighten(AGENT, request)
    assert (merged.max_steps, merged.parallel_tool_calls) == (3, False)


def test_a_request_cannot_turn_final_answer_off() -> None:
    agent = policy({"final_answer": True}, [])
    assert tighten(agent, policy({"final_answer": False}, [], "loop.")).final_answer is True


def test_compiling_reports_every_problem_with_its_path() -> None:
    with pytest.raises(PolicyInvalid) as err:
        policy(
            {
                "stop_when": [{"webhook": "missing"}, {"expr": "size(steps)"}],
                "terminating_config": {"tool_ids": ["ghost"]},
            },
            ["search", "nope"],
            "loop.",
        )
    assert [path for path, _ in err.value.problems] == [
        "loop.tools[1]",
        "loop.stop_when[1].expr",
        "loop.stop_when[0].webhook",
        "loop.terminating_config.tool_ids[0]",
    ]


def test_references_are_checked_on_the_merged_policy() -> None:
    request = policy({"tool_rules": [{"type": "run_first", "tool_name": "ask"}]}, [], "loop.")
    merged = tighten(AGENT, request)
    check_references(merged, ["ask"], "m", lambda: True)  # a client tool may be named
    with pytest.raises(PolicyInvalid) as err:
        check_references(merged, [], "m", lambda: True)
    assert err.value.param == "loop.tool_rules[0].tool_name"


def test_a_cost_condition_needs_a_price_and_only_then_asks_for_one() -> None:
    asked: list[bool] = []

    def priced() -> bool:
        asked.append(True)
        return False

    check_references(AGENT, [], "m", priced)
    assert asked == []
    costly = policy({"stop_when": [{"any": [{"max_cost": 1}]}]}, [])
    with pytest.raises(PolicyInvalid) as err:
        check_references(costly, [], "gpt-x", priced)
    assert (err.value.param, err.value.code) == ("model", "unknown_model_price")
    assert "'gpt-x'" in err.value.message


def test_the_expressions_of_one_policy_are_bounded_together() -> None:
    """Each may hold 2,000 characters; five of them 8,000 in all: compiling them is work on
    the event loop, bounded before it starts."""
    long = "cost_usd >= 0.0" + " " * (MAX_EXPR_CHARS - 15)
    assert len(long) * 4 == MAX_POLICY_EXPR_CHARS
    policy({"stop_when": [{"expr": long}] * 4}, [])
    with pytest.raises(PolicyInvalid) as caught:
        policy({"stop_when": [{"any": [{"expr": long}] * 5}]}, [], "loop.")
    assert caught.value.problems == [
        (
            "loop.stop_when[0].any[4].expr",
            "the expressions of one policy may hold 8000 characters in all",
        )
    ]


def test_a_request_s_terminating_tools_come_first_where_their_places_name_them() -> None:
    agent = policy({"terminating_config": {"tool_ids": ["submit"]}}, ["submit", "search"])
    request = policy({"terminating_config": {"tool_ids": ["search", "search", "fetch"]}}, [])
    request = replace(request, terminating=replace(request.terminating, path="loop.t"))
    merged = tighten(agent, request)
    assert merged.terminating is not None
    assert merged.terminating.tool_ids == ("search", "search", "fetch", "submit")
    with pytest.raises(PolicyInvalid) as err:  # fetch: not a tool of the run
        check_references(merged, [], "m", lambda: True)
    assert [path for path, _ in err.value.problems] == ["loop.t.tool_ids[2]"]
