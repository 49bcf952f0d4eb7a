"""The loop itself: steps, tool results fed back, client tools, events, failures."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Mapping
from typing import Any

import pytest

from proxy.engine import events as ev
from proxy.engine.stop import StopReason
from proxy.engine.values import ToolCall, ToolContext, ToolResult
from proxy.errors import UpstreamUnavailable
from tests.fakes import FakeTools, ManualClock, reply
from tests.unit.harness import Harness


async def test_answer_without_tools_completes_in_one_step() -> None:
    h = Harness([reply("hello")])
    result = await h.run()
    assert result.stop.reason is StopReason.COMPLETED
    assert result.message == {"role": "assistant", "content": "hello"}
    assert result.finish_reason == "stop"
    assert (result.steps, result.tool_calls) == (1, 0)


async def test_tool_results_are_fed_back_and_usage_is_summed() -> None:
    h = Harness(
        [reply(calls=[("add", '{"a": 2, "b": 3}')], prompt=10, completion=4), reply("it is 5")],
        {"add": lambda a: str(a["a"] + a["b"])},
    )
    result = await h.run()
    assert result.stop.reason is StopReason.COMPLETED
    assert result.message["content"] == "it is 5"
    second = h.model.requests[1].messages
    assert second[-2]["tool_calls"][0]["function"]["name"] == "add"
    assert second[-1]["role"] == "tool"
    assert second[-1]["content"] == "5"
    assert second[-1]["tool_call_id"] == second[-2]["tool_calls"][0]["id"]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (20, 9)
    assert result.usage.total_tokens == 29
    assert (result.steps, result.tool_calls) == (2, 1)


async def test_tool_error_goes_to_the_model_and_the_loop_goes_on() -> None:
    def boom(_: dict[str, object]) -> str:
        raise RuntimeError("disk on fire")

    h = Harness([reply(calls=[("t", "{}")]), reply("sorry")], {"t": boom})
    result = await h.run()
    tool_msg = h.model.requests[1].messages[-1]
    assert json.loads(tool_msg["content"]) == {"error": "disk on fire"}
    assert result.stop.reason is StopReason.COMPLETED
    executed = h.observer.of(ev.ToolExecuted)
    assert [e.result.outcome for e in executed] == ["error"]


async def test_client_tool_call_returns_only_client_calls_after_running_server_calls() -> None:
    h = Harness(
        [reply("", calls=[("lookup", "{}"), ("ask_user", '{"q": "?"}')])],
        {"lookup": lambda a: "found"},
        client_tools=["ask_user"],
    )
    result = await h.run()
    assert result.stop.reason is StopReason.CLIENT_TOOL_CALL
    assert result.finish_reason == "tool_calls"
    names = [c["function"]["name"] for c in result.message["tool_calls"]]
    assert names == ["ask_user"]
    assert h.tools.calls == [("lookup", {})]


async def test_unknown_tool_gets_an_error_message_naming_the_tools() -> None:
    h = Harness([reply(calls=[("nope", "{}")]), reply("ok")], {"real": lambda a: "x"})
    await h.run()
    content = json.loads(h.model.requests[1].messages[-1]["content"])
    assert "Unknown tool 'nope'" in content["error"]
    assert "real" in content["error"]


async def test_parallel_tool_calls_all_run_and_keep_their_order() -> None:
    h = Harness(
        [reply(calls=[("a", "{}"), ("b", "{}"), ("a", "{}")]), reply("done")],
        {"a": lambda _: "A", "b": lambda _: "B"},
        parallel=True,
    )
    await h.run()
    msgs = h.model.requests[1].messages
    assert [m["content"] for m in msgs[-3:]] == ["A", "B", "A"]


async def test_upstream_failure_is_an_upstream_error_stop_with_finished_event() -> None:
    def fail(_: object) -> object:
        raise UpstreamUnavailable("no route")

    h = Harness([fail])
    result = await h.run()
    assert result.stop.reason is StopReason.UPSTREAM_ERROR
    assert isinstance(result.error, UpstreamUnavailable)
    finished = h.observer.of(ev.RunFinished)
    assert [f.stop.reason for f in finished] == [StopReason.UPSTREAM_ERROR]


async def test_events_follow_the_run() -> None:
    h = Harness([reply(calls=[("t", "{}")]), reply("done")], {"t": lambda _: "x"})
    await h.run()
    kinds = [type(e).__name__ for e in h.observer.events]
    assert kinds == [
        "RunStarted",
        "StepStarted",
        "ModelReplied",
        "ToolStarted",
        "ToolExecuted",
        "StepStarted",
        "ModelReplied",
        "RunFinished",
    ]


async def test_system_prompt_and_terminal_hint_lead_the_conversation() -> None:
    h = Harness(
        [reply("x")], {"done": lambda _: "ok"}, terminal=("done",), system_prompt="Be brief."
    )
    await h.run()
    first = h.model.requests[0].messages[0]
    assert first["role"] == "system"
    assert first["content"].startswith("Be brief.")
    assert "Calling `done` ends your turn" in first["content"]


async def test_an_observer_that_raises_does_not_break_the_run() -> None:
    class Broken:
        def on_event(self, event: object) -> None:
            raise ValueError("bad observer")

    h = Harness([reply("fine")])
    h.deps.observers = [Broken(), h.observer]
    result = await h.run()
    assert result.stop.reason is StopReason.COMPLETED
    assert len(h.observer.of(ev.RunFinished)) == 1


class Sink:
    def __init__(self) -> None:
        self.items: list[object] = []

    def heard(self, head: Mapping[str, str]) -> None:
        pass

    async def begin(self) -> None:
        self.items.append("begin")

    async def content(self, text: str) -> None:
        self.items.append(text)

    async def progress(self, event: ev.RunEvent) -> None:
        if isinstance(event, ev.StepStarted | ev.ToolStarted | ev.ToolExecuted):
            self.items.append(type(event).__name__)


async def test_streaming_sends_content_and_loop_events() -> None:
    h = Harness([reply("thinking", calls=[("t", "{}")]), reply("answer")], {"t": lambda _: "x"})
    sink = Sink()
    await h.run(stream=sink)
    assert sink.items == [
        "StepStarted",
        "thinking",
        "ToolStarted",
        "ToolExecuted",
        "StepStarted",
        "\n\nanswer",  # the texts of two steps are separated by a blank line
    ]


JSON_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
ANSWER = '{"city": "Paris"}'


async def test_a_json_reply_of_a_tool_loop_is_the_last_steps_text_streamed_at_the_end() -> None:
    """The texts of steps joined are no JSON document: a client asking for one parses the last
    step's (what its server calls led to); the stream's owner sends it whole at the end."""
    h = Harness(
        [
            reply("Looking.", calls=[("t", "{}")]),
            reply("Nudged text."),
            reply(calls=[("u", "{}")]),
            reply(ANSWER),
        ],
        {"t": lambda _: "x", "u": lambda _: "y"},
        tool_rules=[{"type": "required_before_exit", "tool_name": "u"}],
    )
    sink = Sink()
    result = await h.run(stream=sink, params=JSON_FORMAT)
    assert result.message["content"] == ANSWER
    assert "Looking." not in sink.items
    assert sink.items[:3] == ["StepStarted", "begin", "ToolStarted"]
    assert not [item for item in sink.items if "." in str(item) or "{" in str(item)]


@pytest.mark.parametrize("params", [{}, {"response_format": {"type": "text"}}])
async def test_a_reply_in_text_is_every_steps_text(params: dict[str, Any]) -> None:
    h = Harness([reply("Looking.", calls=[("t", "{}")]), reply(ANSWER)], {"t": lambda _: "x"})
    sink = Sink()
    result = await h.run(stream=sink, params=params)
    assert result.message["content"] == f"Looking.\n\n{ANSWER}"
    assert "Looking." in sink.items


async def test_a_json_reply_of_one_step_streams_as_it_comes() -> None:
    """A run without server tools, rules or limits takes one step: its text is the reply."""
    h = Harness([reply(ANSWER)])
    sink = Sink()
    result = await h.run(stream=sink, params=JSON_FORMAT)
    assert result.message["content"] == ANSWER
    assert ANSWER in sink.items


async def test_content_filter_stops_the_run() -> None:
    h = Harness([reply("", finish="content_filter")], {"t": lambda _: "x"})
    result = await h.run()
    assert result.stop.reason is StopReason.CONTENT_FILTER
    assert result.finish_reason == "content_filter"


async def test_a_finished_run_is_freed_by_reference_counting() -> None:
    """A run leaves no reference cycle behind, so busy proxies do not wait on the cyclic GC."""
    h = Harness(
        [reply(calls=[("add", '{"a": 2, "b": 3}')]), reply("it is 5")],
        {"add": lambda a: str(a["a"] + a["b"])},
        stop_when=[{"expr": "size(steps) > 5"}, {"max_tokens_used": 10_000}],
        terminal=("add",),
    )
    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        await h.run()
        gc.collect()
        leaked = [o for o in gc.garbage if type(o).__module__.startswith("proxy.engine")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leaked == []


TWO_TOOLS = {"a": lambda _: "A", "b": lambda _: "B"}


class _GatedTools(FakeTools):
    """Each call waits at a gate that the second call to start opens an hour later (on the
    harness's clock); with `cut`, calls wait there for good."""

    def __init__(self, clock: ManualClock, *, cut: bool = False) -> None:
        super().__init__(TWO_TOOLS)
        self.clock, self.cut = clock, cut
        self.started = 0
        self.began = asyncio.Event()
        self.gate = asyncio.Event()

    async def execute(
        self, call: ToolCall, ctx: ToolContext, arguments: dict[str, Any] | None = None
    ) -> ToolResult:
        self.started += 1
        self.began.set()
        if self.started == 2 or self.cut:
            self.clock.now += 3600
            self.gate.set()
        if self.cut:
            await asyncio.Event().wait()
        await self.gate.wait()
        return await super().execute(call, ctx, arguments)


async def test_calls_run_together_count_their_time_once() -> None:
    """The run's tool time (what the proxy's overhead leaves out) counted each of parallel
    calls whole: two calls of an hour together made two hours, and the overhead 0."""
    h = Harness([reply(calls=[("a", "{}"), ("b", "{}")]), reply("done")], TWO_TOOLS, parallel=True)
    h.deps.tools = h.tools = _GatedTools(h.clock)
    await h.run()
    (finished,) = h.observer.of(ev.RunFinished)
    assert finished.tools_s == 3600


async def test_a_call_cut_short_counts_its_time() -> None:
    """A call the run's end cut short counted nothing: its time was the proxy's overhead."""
    h = Harness([reply(calls=[("a", "{}")]), reply("done")], TWO_TOOLS)
    h.deps.tools = h.tools = _GatedTools(h.clock, cut=True)
    running = asyncio.create_task(h.run())
    await asyncio.wait_for(h.tools.began.wait(), 10)  # (a run that never calls it: fails)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    (finished,) = h.observer.of(ev.RunFinished)
    assert finished.tools_s == 3600


class _SlowToLetGo(FakeTools):
    """`a` takes an hour (on the harness's clock) and ends; `b` runs until cut, then, asked
    `slow`, takes some turns of the loop to let go (an http tool closing its answer)."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(TWO_TOOLS)
        self.clock = clock
        self.a_done = asyncio.Event()

    async def execute(
        self, call: ToolCall, ctx: ToolContext, arguments: dict[str, Any] | None = None
    ) -> ToolResult:
        if call.name == "a":
            await asyncio.sleep(0)  # (b begins meanwhile)
            self.clock.now += 3600
            self.a_done.set()
            return ToolResult("A")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            for _ in range(20 if (arguments or {}).get("slow") else 0):
                await asyncio.sleep(0)
            raise
        raise AssertionError("unreachable")


async def test_a_batch_cut_short_counts_its_time_while_a_call_lets_go() -> None:
    """The run ended as a cut call ended (gather ends with the first) while another still let
    go: the batch's hour counted nothing."""
    batch = [("a", "{}"), ("b", "{}"), ("b", '{"slow": true}')]
    h = Harness([reply(calls=batch), reply("done")], TWO_TOOLS, parallel=True)
    tools = _SlowToLetGo(h.clock)
    h.deps.tools = h.tools = tools
    running = asyncio.create_task(h.run())
    await tools.a_done.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    (finished,) = h.observer.of(ev.RunFinished)
    assert finished.tools_s == 3600
