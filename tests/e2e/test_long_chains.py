"""A long chain of stored responses through the real `openai` SDK, each turn continuing the last
with `previous_response_id` (as the Agents SDK does), on sqlite: the upstream gets the whole
conversation every turn, and the records holding it grow with it, not with its square, as
each turn's record names the earlier ones instead of copying them (SPEC §12.4)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from proxy.api.stored_conversation import CONVERSATION_RECORD, TAIL_RECORD
from tests.e2e.conftest import config_file, proxy_process
from tests.scripted_upstream import ScriptedUpstream, keep, say

pytestmark = pytest.mark.e2e

TURNS = 100
TURN_TEXT = 4_000  # bytes each turn's user message carries


@pytest.fixture
def chained(upstream_url: str, tmp_path: Path) -> Iterator[tuple[OpenAI, Path]]:
    database = tmp_path / "state.db"
    config = {
        "upstreams": {"scripted": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "scripted",
        "state": {"backend": "sqlite", "path": str(database)},
    }
    with (
        proxy_process(config_file(tmp_path, config)) as base,
        OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield client, database


def stored_bytes(database: Path) -> dict[str, int]:
    """The bytes of the conversation records and tails in the state file, by kind."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute(
            "SELECT kind, sum(length(value)) FROM records WHERE kind IN (?, ?) GROUP BY kind",
            (CONVERSATION_RECORD, TAIL_RECORD),
        )
        return dict(rows.fetchall())


def named_parts(database: Path, response_id: str) -> list[str]:
    """The responses whose records hold the earlier parts of a response's conversation."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        (tail,) = db.execute(
            "SELECT value FROM records WHERE kind = ? AND key = ?", (TAIL_RECORD, response_id)
        ).fetchone()
    return [part[0] for part in json.loads(bytes(tail).partition(b"\n")[0])]


def test_a_long_chain_is_sent_whole_and_stored_in_parts(
    chained: tuple[OpenAI, Path], upstream: ScriptedUpstream
) -> None:
    client, database = chained
    upstream.script(keep(say("Noted.")))
    ids: list[str] = []
    for n in range(TURNS):
        text = f"Turn {n}: " + "x" * TURN_TEXT
        previous = ids[-1] if ids else openai.omit
        ids.append(
            client.responses.create(model="scripted", input=text, previous_response_id=previous).id
        )
    sent = upstream.bodies[-1]["messages"]
    assert len(sent) == 2 * TURNS - 1
    assert [m["content"][:8] for m in sent[::2]] == [f"Turn {n}: "[:8] for n in range(TURNS)]
    assert all(m["content"] == "Noted." for m in sent[1::2])
    conversation = sum(len(m["content"]) + 40 for m in sent)  # its JSON, near enough
    stored = stored_bytes(database)
    assert stored[TAIL_RECORD] > 0
    # Each turn a whole copy: 100 x 101 / 2 x 4 KB, 20 MB, 50 times the conversation.
    assert sum(stored.values()) < 10 * conversation, stored

    # A fork continues an earlier response; deleting a response whose record holds a part of
    # the last one's conversation leaves that one readable, but no longer to be continued.
    fork = client.responses.create(model="scripted", input="Fork.", previous_response_id=ids[10])
    assert len(upstream.bodies[-1]["messages"]) == 2 * 11 + 1
    named = named_parts(database, ids[-1])
    assert 1 < len(named) < 8
    assert ids[10] not in named
    assert client.responses.delete(named[-1]) is None
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="scripted", input="More.", previous_response_id=ids[-1])
    again = client.responses.create(model="scripted", input="Go on.", previous_response_id=fork.id)
    assert again.output_text == "Noted."
