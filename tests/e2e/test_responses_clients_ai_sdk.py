"""The Vercel AI SDK's `openai(model)` (the Responses API) against the proxy's `/v1/responses`:
`generateText` and `streamText`, server tools shown as provider-executed `mcp.*` calls, a client
tool, and its default `store: true`, which sends earlier output items back as
`item_reference`s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.bodies import tool_results
from tests.e2e.conftest import ToolServer
from tests.e2e.node import installed, run_ai_sdk
from tests.scripted_upstream import ScriptedUpstream, call, say, say_tool_result

pytestmark = pytest.mark.e2e

STOCK = '{"item":"washers","in_stock":7}'  # what the tool server answers check_inventory


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed(tmp_path_factory.getbasetemp())


@pytest.fixture
def inventory(tool_server: tuple[str, ToolServer]) -> ToolServer:
    """The tool server behind `check_inventory`, with no calls recorded."""
    _, server = tool_server
    server.calls.clear()
    return server


def server_parts(step: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(p["type"], p["toolName"]) for p in step if p["providerExecuted"]]


@pytest.mark.parametrize("mode", ["generate", "stream"])
def test_server_tool_calls_are_provider_executed_mcp_calls(
    clients: Path, proxy_url: str, upstream: ScriptedUpstream, inventory: ToolServer, mode: str
) -> None:
    upstream.script(call("check_inventory", item="washers"), say_tool_result("Stock: {}"))
    report = run_ai_sdk(
        clients, {"baseURL": proxy_url, "model": "stock", "mode": mode, "prompt": "Washers?"}
    )
    assert report["text"] == f"Stock: {STOCK}"
    [step] = report["steps"]
    assert server_parts(step) == [
        ("tool-call", "mcp.check_inventory"),
        ("tool-result", "mcp.check_inventory"),
    ]
    result = next(p for p in step if p["type"] == "tool-result")["output"]
    assert result["name"] == "check_inventory"
    assert result["output"] == STOCK
    assert (step[-1]["type"], step[-1]["text"]) == ("text", f"Stock: {STOCK}")
    assert len(inventory.calls) == 1
    assert report["warnings"] == []
    if mode == "stream":
        assert report["errors"] == []
        assert report["parts"][0] == "start"
        assert report["parts"][-1] == "finish"
        assert "text-delta" in report["parts"]


@pytest.mark.parametrize("mode", ["generate", "stream"])
def test_client_tool_after_a_server_tool(
    clients: Path, proxy_url: str, upstream: ScriptedUpstream, inventory: ToolServer, mode: str
) -> None:
    """The SDK runs its own tool, then sends the server call back as an `item_reference` (its
    default `store: true`) with its call and output: the model sees each result once, and the
    server tool does not run again."""
    upstream.script(
        call("check_inventory", item="washers"),
        call("ask_user", question="Order more washers?"),
        say_tool_result("The user says: {}"),
    )
    report = run_ai_sdk(
        clients,
        {
            "baseURL": proxy_url,
            "model": "stock",
            "mode": mode,
            "prompt": "Washers?",
            "clientTool": True,
        },
    )
    assert report["asked"] == ["Order more washers?"]
    assert report["text"] == "The user says: the user approves"
    first, _ = report["steps"]
    assert server_parts(first) == [
        ("tool-call", "mcp.check_inventory"),
        ("tool-result", "mcp.check_inventory"),
    ]
    assert [(p["type"], p["toolName"]) for p in first if not p["providerExecuted"]] == [
        ("tool-call", "ask_user"),
        ("tool-result", "ask_user"),
    ]
    assert len(inventory.calls) == 1
    results = tool_results(upstream.bodies[-1])
    assert results.count(STOCK) == 1
    assert results[-1] == "the user approves"
    assert report["warnings"] == []
    if mode == "stream":
        assert report["errors"] == []


def test_a_second_turn_resolves_the_item_references_of_the_first(
    clients: Path, proxy_url: str, upstream: ScriptedUpstream, inventory: ToolServer
) -> None:
    """With `store: true` (the default) the second turn sends the first turn's server call and
    message as `item_reference`s: the proxy resolves them from its store."""
    upstream.script(
        call("check_inventory", item="washers"),
        say_tool_result("Stock: {}"),
        say("Ordered 3 more washers."),
    )
    report = run_ai_sdk(
        clients,
        {
            "baseURL": proxy_url,
            "model": "stock",
            "mode": "generate",
            "prompt": "Washers?",
            "followUp": "Order 3 more.",
        },
    )
    assert report["followUp"]["text"] == "Ordered 3 more washers."
    second = upstream.bodies[-1]["messages"]
    contents = [str(m.get("content")) for m in second]
    assert f"Stock: {STOCK}" in contents
    assert tool_results(upstream.bodies[-1]).count(STOCK) == 1
    assert second[-1]["role"] == "user"
    assert "Order 3 more." in str(second[-1]["content"])
    assert len(inventory.calls) == 1
    assert report["warnings"] == []


def test_store_false_sends_the_whole_conversation_back(
    clients: Path, proxy_url: str, upstream: ScriptedUpstream, inventory: ToolServer
) -> None:
    """With `store: false` the SDK sends messages in full (assistant messages with an `id` and
    no `type`) and leaves the server calls out: the proxy puts back the server call it held
    under the client call's id (SPEC §5.1 step 6), so the model still sees its result once."""
    upstream.script(
        call("check_inventory", item="washers"),
        call("ask_user", question="Order more washers?"),
        say_tool_result("The user says: {}"),
        say("Ordered."),
    )
    report = run_ai_sdk(
        clients,
        {
            "baseURL": proxy_url,
            "model": "stock",
            "mode": "stream",
            "prompt": "Washers?",
            "clientTool": True,
            "store": False,
            "followUp": "Order them.",
        },
    )
    assert report["text"] == "The user says: the user approves"
    assert report["followUp"]["text"] == "Ordered."
    assert report["asked"] == ["Order more washers?"]
    contents = [str(m.get("content")) for m in upstream.bodies[-1]["messages"]]
    assert "The user says: the user approves" in contents
    assert tool_results(upstream.bodies[2]).count(STOCK) == 1
    assert tool_results(upstream.bodies[3]).count(STOCK) == 1
    assert len(inventory.calls) == 1
