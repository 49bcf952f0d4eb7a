"""The structured answer of the SDKs' `parse` helpers and the Agents SDK's `output_type`: one
JSON document, after a tool step that said something beside its call (`stock` agent)."""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel

from tests.scripted_upstream import Reply, call, say


class Stock(BaseModel):
    item: str
    count: int


BOLTS = Stock(item="bolts", count=7)


def looked_then_answered() -> tuple[Reply, Reply]:
    """A step that says "Let me look." beside its server call, then the answer alone."""
    looked = replace(call("check_inventory", item="bolts"), content="Let me look.")
    return looked, say(BOLTS.model_dump_json())
