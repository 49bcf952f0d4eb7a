"""SPEC §6: every stop condition, alone and combined, with its stop_details."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.engine import events as ev
from proxy.engine.options import CONDITION_KINDS, PolicyOptions
from proxy.engine.stop import StopReason
from proxy.engine.values import Prices
from tests.fakes import FakeChecks, reply
from tests.unit.harness import Harness, problem

TOOLS = {"search": lambda _: "r", "fetch": lambda _: "f"}


def looping(n: int = 10, name: str = "search", **kw: Any) -> list[Any]:
    return [reply(calls=[(name, "{}")], **kw) for _ in range(n)]


async def test_step_count_is() -> None:
    h = Harness(looping(), TOOLS, stop_when=[{"step_count_is": 3}])
    result = await h.run()
    assert result.stop.reason is StopReason.MAX_STEPS
    assert result.steps == 3
    assert result.finish_reason == "length"
    assert result.stop.details == {
        "condition": "stop_when[0]",
        "kind": "step_count_is",
        "threshold": 3,
        "observed": 3,
        "step": 3,
    }


async def test_agent_max_steps_caps_the_run() -> None:
    h = Harness(looping(), TOOLS, max_steps=2)
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.MAX_STEPS, 2)
    assert result.stop.details["condition"] == "max_steps"


async def test_default_max_steps_is_25_when_server_tools_exist() -> None:
    h = Harness(looping(30), TOOLS)
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.MAX_STEPS, 25)


async def test_has_tool_call_accepts_a_name_or_a_list() -> None:
    script = [reply(calls=[("search", "{}")]), reply(calls=[("fetch", "{}")]), *looping()]
    h = Harness(script, TOOLS, stop_when=[{"has_tool_call": ["fetch", "other"]}])
    result = await h.run()
    assert result.stop.reason is StopReason.TOOL_CALLED
    assert result.stop.details["observed"] == ["fetch"]
    assert result.steps == 2
    assert result.finish_reason == "stop"


async def test_has_tool_call_holds_for_a_call_that_ran_not_for_one_blocked() -> None:
    h = Harness(
        [reply(calls=[("fetch", "{}")]), reply(calls=[("search", "{}")]), *looping()],
        TOOLS,
        stop_when=[{"has_tool_call": "fetch"}, {"has_tool_call": "search"}],
        tool_rules=[{"type": "run_first", "tool_name": "search"}],
    )
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.TOOL_CALLED, 2)
    assert result.stop.details["observed"] == ["search"]  # fetch was blocked: it did not run


async def test_max_tokens_used() -> None:
    h = Harness(looping(prompt=1000, completion=500), TOOLS, stop_when=[{"max_tokens_used": 2000}])
    result = await h.run()
    assert result.stop.reason is StopReason.TOKEN_BUDGET
    assert result.stop.details["observed"] == 3000
    assert result.stop.details["threshold"] == 2000


async def test_max_cost_uses_reported_cost_first() -> None:
    h = Harness(looping(cost=0.004), TOOLS, stop_when=[{"max_cost": 0.01}])
    result = await h.run()
    assert result.stop.reason is StopReason.COST_BUDGET
    assert result.steps == 3
    assert result.cost_usd == pytest.approx(0.012)


async def test_max_cost_with_prices() -> None:
    prices = Prices(input=1e-6, output=1e-6)  # 2,000 tokens a step -> 0.002 USD
    script = looping(prompt=1000, completion=1000)
    h = Harness(script, TOOLS, stop_when=[{"max_cost": 0.005}], prices=prices)
    result = await h.run()
    assert result.stop.reason is StopReason.COST_BUDGET
    assert result.steps == 3
    assert result.cost_usd == pytest.approx(0.006)


async def test_finish_reason_is() -> None:
    script = [reply(calls=[("search", "{}")]), reply(calls=[("search", "{}")], finish="length")]
    h = Harness([*script, *looping()], TOOLS, stop_when=[{"finish_reason_is": "length"}])
    result = await h.run()
    assert result.stop.reason is StopReason.FINISH_REASON
    assert result.finish_reason == "length"
    assert result.steps == 2


async def test_max_duration_s_uses_the_clock() -> None:
    h = Harness([], TOOLS, stop_when=[{"max_duration_s": 5}])

    def slow(_: object) -> Any:
        h.clock.now += 2
        return reply(calls=[("search", "{}")])

    h.model.script = [slow] * 10
    result = await h.run()
    assert result.stop.reason is StopReason.TIME_BUDGET
    assert result.steps == 3
    assert result.stop.details["observed"] == 6.0


async def test_any_reports_the_entry_that_held() -> None:
    cond = {"any": [{"step_count_is": 9}, {"has_tool_call": "fetch", "id": "fetched"}]}
    script = [reply(calls=[("fetch", "{}")]), *looping()]
    h = Harness(script, TOOLS, stop_when=[{"step_count_is": 20}, cond])
    result = await h.run()
    assert result.stop.reason is StopReason.TOOL_CALLED
    assert result.stop.details["condition"] == "stop_when[1].any[1]"
    assert result.stop.details["id"] == "fetched"


async def test_any_gives_its_own_id_to_an_entry_that_has_none() -> None:
    """SPEC §6: every entry may carry `id` for reporting: an `any`'s was never told."""
    named = {"id": "limits", "any": [{"step_count_is": 9}, {"has_tool_call": "fetch"}]}
    both = {"id": "limits", "any": [{"has_tool_call": "fetch", "id": "fetched"}]}
    for cond, told in [(named, "limits"), (both, "fetched")]:
        h = Harness([reply(calls=[("fetch", "{}")]), *looping()], TOOLS, stop_when=[cond])
        result = await h.run()
        assert result.stop.reason is StopReason.TOOL_CALLED
        assert result.stop.details["condition"] == f"stop_when[0].any[{len(cond['any']) - 1}]"
        assert result.stop.details["id"] == told


async def test_all_needs_every_entry_and_is_a_custom_condition() -> None:
    cond = {"all": [{"step_count_is": 2}, {"has_tool_call": "fetch"}]}
    script = [*looping(2), reply(calls=[("fetch", "{}")]), *looping()]
    h = Harness(script, TOOLS, stop_when=[cond])
    result = await h.run()
    assert result.stop.reason is StopReason.CUSTOM_CONDITION
    assert result.steps == 3
    assert result.stop.details["kind"] == "all"


async def test_not_holds_when_its_entry_does_not() -> None:
    cond = {"not": {"has_tool_call": "search"}}
    h = Harness([reply(calls=[("fetch", "{}")]), *looping()], TOOLS, stop_when=[cond])
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.CUSTOM_CONDITION, 1)


@pytest.mark.parametrize(
    "failing",
    [
        {"expr": "steps[1].index == 2"},  # no second step after the first: an index error
        {"webhook": "broken"},
        {"any": [{"step_count_is": 9}, {"python": "broken"}]},
        {"all": [{"step_count_is": 1}, {"python": "broken"}]},
    ],
)
async def test_a_condition_that_cannot_be_evaluated_holds_not_even_under_not(
    failing: dict[str, Any],
) -> None:
    """A failed check does not hold (README): `not` of it is no stop either (three-valued, as
    `any` and `all` of it are), and the failure is on the trace."""
    checks = FakeChecks({"broken": None})
    h = Harness(looping(3), TOOLS, stop_when=[{"not": failing}], checks=checks, max_steps=2)
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.MAX_STEPS, 2)
    assert h.observer.of(ev.ConditionFailed)


async def test_cel_expression_over_steps() -> None:
    expr = "size(steps) >= 2 && steps.exists(s, s.tool_calls.exists(c, c.name == 'fetch'))"
    script = [reply(calls=[("fetch", "{}")]), *looping()]
    h = Harness(script, TOOLS, stop_when=[{"expr": expr}])
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.CUSTOM_CONDITION, 2)
    assert result.stop.details["threshold"] == expr


async def test_an_expression_too_costly_for_the_run_data_ends_the_run() -> None:
    """Three nested comprehensions are cheap over two steps and refused over forty: the library
    holds the GIL while it evaluates, so the cost is bounded before it starts."""
    expr = "steps.exists(a, steps.exists(b, steps.exists(c, a.index + b.index + c.index < 0)))"
    h = Harness(looping(50), TOOLS, stop_when=[{"any": [{"step_count_is": 99}, {"expr": expr}]}])
    result = await h.run()
    assert result.stop.reason is StopReason.CONDITION_ERROR
    assert 2 < result.steps < 40
    details = result.stop.details
    assert (details["condition"], details["kind"]) == ("stop_when[0].any[1]", "expr")
    assert "the limit is 250,000" in details["error"]
    assert result.finish_reason == "stop"
    assert result.message["content"] == (
        "Stopped: the stop condition stop_when[0].any[1] could not be evaluated."
    )
    (failed,) = h.observer.of(ev.ConditionFailed)
    assert failed.path == "stop_when[0].any[1]"
    assert h.observer.of(ev.ConditionHeld) == []


async def test_expressions_cheap_alone_but_costly_together_end_the_run_at_the_step_budget() -> None:
    """Forty conditions over the steps' 40 KB texts: each is far within the limit, but after
    some step they are not together, and the run ends at the one that passes the step's
    budget, before it is evaluated."""
    expr = "steps.exists(s, s.text == 'never')"
    many = [{"expr": f"{expr} && size(steps) > {i}"} for i in range(40)]
    h = Harness(looping(50, text="x" * 40_000), TOOLS, stop_when=many, max_steps=50)
    result = await h.run()
    assert result.stop.reason is StopReason.CONDITION_ERROR
    assert 2 < result.steps < 50
    details = result.stop.details
    assert "of their 500,000 left" in details["error"]
    assert details["condition"] != "stop_when[0]"  # the first ones had budget left


async def test_an_expression_is_charged_for_compiling_its_patterns_each_time() -> None:
    """The library compiles a `matches()` pattern at every call: over the steps, a Unicode
    class makes a comprehension too costly sooner than a literal does."""
    costly = "steps.exists(s, s.text.matches('\\\\w{4}'))"
    cheap = "steps.exists(s, s.text.matches('abcd'))"
    ended = await Harness(looping(30), TOOLS, stop_when=[{"expr": costly}]).run()
    assert ended.stop.reason is StopReason.CONDITION_ERROR
    assert ended.steps < 10
    ran = await Harness(looping(30), TOOLS, stop_when=[{"expr": cheap}], max_steps=30).run()
    assert (ran.stop.reason, ran.steps) == (StopReason.MAX_STEPS, 30)


async def test_cel_sees_tool_results_usage_and_cost() -> None:
    expr = "steps[0].tool_results[0].output == 'r' && usage.total_tokens >= 30 && cost_usd == 0.0"
    h = Harness(looping(), TOOLS, stop_when=[{"expr": expr}])
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.CUSTOM_CONDITION, 2)


async def test_webhook_and_python_conditions_ask_the_checks_port() -> None:
    checks = FakeChecks({"stop-now": True, "never": False})
    h = Harness(
        looping(), TOOLS, stop_when=[{"python": "never"}, {"webhook": "stop-now"}], checks=checks
    )
    result = await h.run()
    assert (result.stop.reason, result.steps) == (StopReason.CUSTOM_CONDITION, 1)
    assert result.stop.details["kind"] == "webhook"
    assert checks.seen[0]["steps"][0]["tool_calls"] == [{"name": "search", "arguments": "{}"}]


async def test_a_reply_without_tools_keeps_its_own_stop_reason() -> None:
    h = Harness([reply("done")], TOOLS, stop_when=[{"step_count_is": 1}])
    result = await h.run()
    assert result.stop.reason is StopReason.COMPLETED


async def test_final_answer_turns_a_limit_stop_into_one_tool_free_call() -> None:
    h = Harness([*looping(2), reply("summary")], TOOLS, max_steps=2, final_answer=True)
    result = await h.run()
    assert result.stop.reason is StopReason.MAX_STEPS
    assert result.message == {"role": "assistant", "content": "summary"}
    assert result.stop.details["final_answer"] is True
    last = h.model.requests[-1]
    assert last.tool_choice == "none"
    assert "cannot call tools" in last.messages[-1]["content"]
    assert result.usage.total_tokens == 45  # three calls counted


async def test_limit_stop_without_final_answer_returns_last_text() -> None:
    script = [reply("step one", calls=[("search", "{}")]), reply(calls=[("search", "{}")])]
    h = Harness(script, TOOLS, max_steps=2)
    result = await h.run()
    assert result.message == {"role": "assistant", "content": "step one"}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"step_count_is": 0}, "stop_when[0].step_count_is"),
        ({"step_count_is": True}, "stop_when[0].step_count_is"),
        ({"max_cost": "1"}, "stop_when[0].max_cost"),
        ({"max_cost": -1}, "stop_when[0].max_cost"),
        ({"max_tokens": 5}, "stop_when[0].max_tokens"),
        ({"any": []}, "stop_when[0].any"),
        ({"any": [{"max_cost": 0}]}, "stop_when[0].any[0].max_cost"),
        ({"not": {"expr": "size("}}, "stop_when[0].not.expr"),
        ({"has_tool_call": []}, "stop_when[0].has_tool_call"),
        ({"step_count_is": 1, "max_cost": 1}, "stop_when[0].max_cost"),
        ({"id": 3, "step_count_is": 1}, "stop_when[0].id"),
        ("step_count_is", "stop_when[0]"),
    ],
)
def test_bad_conditions_name_their_path(raw: Any, param: str) -> None:
    assert problem({"stop_when": [raw]})[0] == param


def test_a_long_key_is_named_cut_short() -> None:
    """A client's key of any length was echoed whole in the error (and a `conditional` rule's
    outputs had no bound: 1 MB was taken)."""
    assert problem({"stop_when": [{"y" * 5000: 1}]}) == (
        "stop_when[0]." + "y" * 256 + "…",
        "unknown stop condition '"
        + "y" * 256
        + "…'; expected one of "
        + ", ".join(CONDITION_KINDS),
    )
    rule = {"type": "conditional", "tool_name": "t", "child_output_mapping": {"x" * 4097: "u"}}
    assert problem({"tool_rules": [rule]}) == (
        "tool_rules[0].child_output_mapping." + "x" * 256 + "….[key]",
        "must have at most 4096 characters",
    )


def test_a_policy_holds_at_most_1024_conditions_however_nested() -> None:
    """Six entries of 150 `any` conditions each, within every other bound, are refused before
    any of them is validated; six of them are 906 and pass."""
    wide = {"any": [{"step_count_is": i + 1} for i in range(150)]}
    assert problem({"stop_when": [wide] * 7}) == (
        "stop_when",
        "more than 1024 conditions in all (those inside any / all / not included)",
    )
    assert len(PolicyOptions.model_validate({"stop_when": [wide] * 6}).stop_when) == 6


def test_stop_when_must_be_a_list() -> None:
    assert problem({"stop_when": {"step_count_is": 1}}) == ("stop_when", "must be a list")


async def test_a_condition_keeps_its_id() -> None:
    h = Harness(looping(), TOOLS, stop_when=[{"step_count_is": 1, "id": "cap"}])
    assert (await h.run()).stop.details["id"] == "cap"


def test_the_patterns_of_an_expression_and_of_a_policy_are_bounded_together() -> None:
    """Each is cheap alone; what the library compiles at check and at every evaluation is the
    sum."""
    word = "steps.exists(s, s.text.matches('\\\\w+'))"
    path, message = problem({"stop_when": [{"expr": " || ".join([word] * 5)}]})
    assert path == "stop_when[0].expr"
    assert "with the expression's other patterns, an estimated 42,000 units" in message
    two = {"expr": f"{word} || {word}"}
    path, message = problem({"stop_when": [two] * 5 + [{"any": [two]}]})  # 16,800 each
    assert path == "stop_when[5].any[0].expr"
    assert (
        message == "the matches() patterns of one policy may cost 100,000 units of compiling in all"
    )
