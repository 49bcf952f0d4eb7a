"""Reading a Responses event stream (SPEC §12.3) and checking the rules every stream keeps."""

from __future__ import annotations

import json
from typing import Any

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def parse_events(text: str) -> list[dict[str, Any]]:
    """The events of an SSE body; each `event:` line must name its data's `type`."""
    out: list[dict[str, Any]] = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        named = [line[7:] for line in lines if line.startswith("event: ")]
        data = [line[6:] for line in lines if line.startswith("data: ")]
        assert len(data) == 1, block
        event = json.loads(data[0])
        assert named == [event["type"]], block
        out.append(event)
    return out


def checked(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The final response of a well-formed stream: `sequence_number` rises from 0, it opens
    with `response.created` and `response.in_progress` and ends with one terminal event, one
    item is open at a time (added when all others are done, and done before the next is added:
    OpenAI's order, without which Codex drops a message's text), every item added is done (a
    server call's end told before), deltas add up to what is done, and the final `output`
    holds every item as done, at the index it was streamed at."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in TERMINAL, kinds
    assert sum(kind in TERMINAL for kind in kinds) == 1
    response_id = events[0]["response"]["id"]
    added: dict[int, dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    deltas: dict[str, str] = {}
    ends: dict[str, str] = {}  # an mcp_call's id: how it ended
    for event in events:
        kind = event["type"]
        if "response" in event:
            assert event["response"]["id"] == response_id
        if kind == "response.output_item.added":
            assert event["output_index"] not in added
            open_items = [added[i] for i in set(added) - set(done)]
            assert open_items == [], f"{open_items} still open at {event}"
            added[event["output_index"]] = event["item"]
        elif kind == "response.output_item.done":
            index = event["output_index"]
            assert added[index]["id"] == event["item"]["id"]
            if event["item"]["type"] == "mcp_call":  # its end told first (SPEC §12.3)
                ended = "failed" if event["item"]["error"] else "completed"
                assert ends.get(event["item"]["id"]) == ended, event
            done[index] = event["item"]
        elif kind in ("response.mcp_call.completed", "response.mcp_call.failed"):
            ends[event["item_id"]] = kind.rpartition(".")[2]
        elif kind.endswith(".delta"):
            assert event["output_index"] in added
            assert event["output_index"] not in done
            deltas[event["item_id"]] = deltas.get(event["item_id"], "") + event["delta"]
        elif kind == "response.output_text.done":
            assert deltas.get(event["item_id"], "") == event["text"]
        elif kind == "response.function_call_arguments.done":
            assert deltas[event["item_id"]] == event["arguments"]
        elif kind == "response.custom_tool_call_input.done":
            assert deltas[event["item_id"]] == event["input"]
    final = events[-1]["response"]
    assert set(added) == set(done)
    assert [i["id"] for i in final["output"]] == [done[i]["id"] for i in sorted(done)]
    return dict(final)


def stream_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
