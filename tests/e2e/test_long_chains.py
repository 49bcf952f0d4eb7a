"""A long chain of stored responses through the real `openai` SDK, each turn continuing the last
with `previous_response_id` (as the Agents SDK does), or sending the whole conversation again
with the earlier output items as item references (as the AI SDK does), on sqlite: the upstream
gets the whole conversation every turn, and the records holding it grow with it, not with its
square, as each turn's record names the earlier ones instead of copying them (SPEC §12.4);
unless `state.rolling_upgrade` is on."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from proxy.api.stored_conversation import CONVERSATION_RECORD, TAIL_RECORD
from tests.e2e.conftest import config_file, proxy_process
from tests.e2e.node import installed, run_ai_sdk
from tests.scripted_upstream import Reply, ScriptedUpstream, call, keep, say

pytestmark = pytest.mark.e2e

TURNS = 100
TURN_TEXT = 4_000  # bytes each turn's user message carries
CONVERSATIONS = (CONVERSATION_RECORD, TAIL_RECORD)


@contextlib.contextmanager
def chained(
    upstream_url: str, folder: Path, rolling_upgrade: bool = False
) -> Iterator[tuple[OpenAI, Path]]:
    database = folder / "state.db"
    config = {
        "upstreams": {"scripted": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "scripted",
        "state": {
            "backend": "sqlite",
            "path": str(database),
            "rolling_upgrade": rolling_upgrade,
        },
    }
    with (
        proxy_process(config_file(folder, config)) as base,
        OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield client, database


def long_chain(client: OpenAI, turns: int) -> list[str]:
    ids: list[str] = []
    for n in range(turns):
        text = f"Turn {n}: " + "x" * TURN_TEXT
        previous = ids[-1] if ids else openai.omit
        response = client.responses.create(
            model="scripted", input=text, previous_response_id=previous
        )
        ids.append(response.id)
    return ids


def resent_chain(client: OpenAI, turns: int, way: str) -> list[str]:
    """Each turn sends the whole conversation: every user message again, and the earlier
    answers as references to their output items (as the AI SDK does with `store`), or whole:
    the SDK's own objects (`input += response.output`, the function-calling guide's way) or
    dicts of every field (`model_dump()`, nulls and all)."""
    ids: list[str] = []
    items: list[Any] = []
    for n in range(turns):
        items.append({"role": "user", "content": f"Turn {n}: " + "x" * TURN_TEXT})
        response = client.responses.create(model="scripted", input=items)
        if way == "references":
            items += [{"type": "item_reference", "id": item.id} for item in response.output]
        elif way == "objects":
            items += response.output
        else:
            items += [item.model_dump() for item in response.output]
        ids.append(response.id)
    return ids


def stored_bytes(database: Path, kinds: tuple[str, ...] = CONVERSATIONS) -> dict[str, int]:
    """The bytes of the records of `kinds` in the state file, by kind."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute(
            "SELECT kind, sum(length(value)) FROM records WHERE kind IN "
            f"({', '.join('?' * len(kinds))}) GROUP BY kind",
            kinds,
        )
        return dict(rows.fetchall())


def conversation_of(database: Path, response_id: str) -> bytes | None:
    """The record that holds the conversation through a response (or its last part)."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        found = db.execute(
            "SELECT value FROM records WHERE kind IN (?, ?) AND key = ?",
            (CONVERSATION_RECORD, TAIL_RECORD, response_id),
        ).fetchone()
    return None if found is None else bytes(found[0])


def input_chains(database: Path) -> list[int]:
    """The lengths of the chains the input records make (each names the response it continued,
    or none), longest first."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute("SELECT key, value FROM records WHERE kind = 'input'").fetchall()
    previous = {key: json.loads(value)["previous"] for key, value in rows}
    continued = set(previous.values())
    lengths = []
    for last in (key for key in previous if key not in continued):
        length, current = 0, last
        while current is not None:
            length, current = length + 1, previous.get(current)
        lengths.append(length)
    return sorted(lengths, reverse=True)


def named_parts(database: Path, response_id: str) -> list[str]:
    """The responses whose records hold the earlier parts of a response's conversation."""
    tail = conversation_of(database, response_id)
    assert tail is not None
    return [part[0] for part in json.loads(tail.partition(b"\n")[0])]


def test_a_long_chain_is_sent_whole_and_stored_in_parts(
    upstream_url: str, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.script(keep(say("Noted.")))
    with chained(upstream_url, tmp_path) as (client, database):
        ids = long_chain(client, TURNS)
        sent = upstream.bodies[-1]["messages"]
        assert len(sent) == 2 * TURNS - 1
        assert [m["content"][:8] for m in sent[::2]] == [f"Turn {n}: "[:8] for n in range(TURNS)]
        assert all(m["content"] == "Noted." for m in sent[1::2])
        conversation = sum(len(m["content"]) + 40 for m in sent)  # its JSON, near enough
        stored = stored_bytes(database)
        assert stored[TAIL_RECORD] > 0
        # Each turn a whole copy: 100 x 101 / 2 x 4 KB, 20 MB, 50 times the conversation.
        assert sum(stored.values()) < 10 * conversation, stored

        # A fork continues an earlier response. Deleting a response drops its records: a later
        # one whose conversation names its part can still be read, no longer continued.
        named = named_parts(database, ids[-1])
        assert 1 < len(named) < 8
        fork = client.responses.create(
            model="scripted", input="Fork.", previous_response_id=ids[10]
        )
        assert len(upstream.bodies[-1]["messages"]) == 2 * 11 + 1
        for deleted in (named[-1], fork.id):
            assert client.responses.delete(deleted) is None
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(deleted)
            assert conversation_of(database, deleted) is None
        assert client.responses.retrieve(ids[-1]).id == ids[-1]
        with pytest.raises(openai.NotFoundError, match="is no longer kept"):
            client.responses.create(model="scripted", input="More.", previous_response_id=ids[-1])
        again = client.responses.create(model="scripted", input="On.", previous_response_id=ids[10])
        assert again.output_text == "Noted."


@pytest.mark.parametrize("way", ["references", "objects", "dumped"])
def test_a_conversation_sent_whole_each_turn_is_stored_in_parts(
    upstream_url: str, upstream: ScriptedUpstream, tmp_path: Path, way: str
) -> None:
    """Each turn's messages begin with the conversation through the response its last stored
    item names: it is stored as that response's continuation (conversation and input items),
    so a continuation and the listing of its input items see the whole of it."""
    upstream.script(keep(say("Noted.")))
    with chained(upstream_url, tmp_path) as (client, database):
        ids = resent_chain(client, TURNS, way)
        sent = upstream.bodies[-1]["messages"]
        assert len(sent) == 2 * TURNS - 1
        assert [m["content"][:8] for m in sent[::2]] == [f"Turn {n}: "[:8] for n in range(TURNS)]
        conversation = sum(len(m["content"]) + 40 for m in sent)
        stored = stored_bytes(database)
        assert stored[TAIL_RECORD] > 0
        assert sum(stored.values()) < 10 * conversation, stored
        # The input items: each turn's own (its user message), after the turn it continues.
        assert stored_bytes(database, ("input",))["input"] < 3 * conversation
        assert input_chains(database) == [TURNS]

        onward = client.responses.create(
            model="scripted", input="On.", previous_response_id=ids[-1]
        )
        assert onward.output_text == "Noted."
        answer = {"role": "assistant", "content": "Noted."}
        assert upstream.bodies[-1]["messages"][:-1] == [*sent, answer]
        listed = list(client.responses.input_items.list(ids[-1], order="asc", limit=100))
        assert len(listed) == 2 * TURNS - 1
        texts = [part.text for item in listed for part in item.content]  # type: ignore[union-attr]
        assert texts == [m["content"] for m in sent]


def test_a_rolling_upgrade_stores_responses_as_the_version_before_did(
    upstream_url: str, upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """With `state.rolling_upgrade`, for replicas of that version: each conversation whole, and
    no outputs record (an older replica's delete would leave it)."""
    upstream.script(keep(say("Noted.")))
    with chained(upstream_url, tmp_path, rolling_upgrade=True) as (client, database):
        ids = long_chain(client, 30)
        assert set(stored_bytes(database)) == {CONVERSATION_RECORD}
        conversation = conversation_of(database, ids[-1])
        assert conversation is not None
        assert len(json.loads(conversation)) == 2 * 30
        with contextlib.closing(sqlite3.connect(database)) as db:
            kinds = {kind for (kind,) in db.execute("SELECT DISTINCT kind FROM records")}
        assert kinds == {"conversation", "input", "response"}
        reference = {"type": "item_reference", "id": client.responses.retrieve(ids[3]).output[0].id}
        read = client.responses.create(model="scripted", input=[reference])  # type: ignore[list-item]
        assert read.output_text == "Noted."


def test_the_ai_sdk_s_conversation_is_stored_in_parts(
    upstream_url: str,
    upstream: ScriptedUpstream,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The real AI SDK (`generateText`, `store` on by default) sends the whole conversation each
    turn, its earlier answers as item references: each turn continues the one before (its
    input record names it), reading none of the earlier ones, and is stored as a chain's."""
    clients = installed(tmp_path_factory.getbasetemp())  # once a session, as other tests
    upstream.script(keep(say("Noted.")))
    turns = 60
    texts = [f"Turn {n}: " + "x" * TURN_TEXT for n in range(turns)]
    with chained(upstream_url, tmp_path) as (client, database):
        base = str(client.base_url).rstrip("/")
        scenario = {"baseURL": base, "model": "scripted", "mode": "generate"}
        long = {"turns": {"count": turns, "bytes": TURN_TEXT}}
        report = run_ai_sdk(clients, {**scenario, **long})
        assert report["followUps"] == ["Noted."] * (turns - 1)
        sent = upstream.bodies[-1]["messages"]
        assert [m["content"] for m in sent[1::2]] == ["Noted."] * (turns - 1)
        assert ["".join(p["text"] for p in m["content"]) for m in sent[::2]] == texts
        conversation = sum(len(t) + 60 for t in texts)
        stored = stored_bytes(database)
        assert stored[TAIL_RECORD] > 0
        # Each turn whole: 60 x 61 / 2 x 4 KB, 7.3 MB, 30 times the conversation.
        assert sum(stored.values()) < 6 * conversation, stored
        assert input_chains(database) == [turns]


def ask_every_other_turn(body: dict[str, Any]) -> Reply:
    """A call of the client's `ask_user` alone at every even turn, and an answer otherwise
    (after the call's output too)."""
    last = body["messages"][-1]
    text = last["content"] if isinstance(last["content"], str) else last["content"][0]["text"]
    if last["role"] == "user" and int(text.split(":")[0].split()[-1]) % 2 == 0:
        return call("ask_user", question="Go on?")
    return say("Noted.")


@pytest.mark.parametrize("mode", ["generate", "stream"])
def test_the_ai_sdk_s_tool_steps_each_continue_the_one_before(
    upstream_url: str,
    upstream: ScriptedUpstream,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    mode: str,
) -> None:
    """The real AI SDK with a client tool: a step that only calls the tool makes a response
    that the next step (the tool's output, the call sent back without its item's id) names by
    its call id: every response of the conversation continues the one before, one chain."""
    clients = installed(tmp_path_factory.getbasetemp())
    upstream.script(keep(ask_every_other_turn))
    turns = 12
    with chained(upstream_url, tmp_path) as (client, database):
        base = str(client.base_url).rstrip("/")
        scenario = {"baseURL": base, "model": "scripted", "mode": mode, "clientTool": True}
        report = run_ai_sdk(clients, {**scenario, "turns": {"count": turns, "bytes": 100}})
        assert report["followUps"] == ["Noted."] * (turns - 1)
        assert len(upstream.bodies) == turns + turns // 2
        assert input_chains(database) == [len(upstream.bodies)]
    sent = upstream.bodies[-1]["messages"]
    calls = [c["id"] for m in sent for c in m.get("tool_calls") or ()]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == calls
    assert len(calls) == turns // 2
