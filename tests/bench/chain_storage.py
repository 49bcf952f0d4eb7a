"""What a chain of stored responses takes in the state backend, and what continuing it costs:
its conversation's size, the bytes of the records holding it (kept in parts), the records the
last continuation read, and the median time to read the conversation and to store a turn over
the last 20 turns; for a chain continued with `previous_response_id` (the Agents SDK's way),
one sent whole again each turn (the AI SDK's way: the conversation through the last response
is known by its fingerprint, not read), and the same chain stored whole at every turn (as
before conversations were kept in parts).

    python -m tests.bench.chain_storage [--redis] [--chains 100x4000,300x2000,...]

Each chain is stored through `ResponseStore` as the proxy stores a response (its conversation,
its input items, its outputs and response records), one turn after another.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from proxy.api.fingerprint_records import FINGERPRINT_RECORD, Lineage, parsed_fingerprint
from proxy.api.response_store import ResponseStore, StoredInput, StoredResponse
from proxy.api.stored_conversation import CONVERSATION_RECORD, TAIL_RECORD, Conversation
from proxy.config.server import ServerConfig
from proxy.state.store import StateStore
from tests.bench.state_writes import stores

CHAINS = "100x4000,300x2000,1000x500,200x20000"  # turns x bytes a turn
BOUNDS = ServerConfig(max_body_bytes=64 * 1024 * 1024, max_body_values=10_000_000)
TIMED = 20  # the last turns, timed


def turn(n: int, size: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"Turn {n}: " + "x" * size},
        {"role": "assistant", "content": "Noted."},
    ]


async def chain(
    backend: StateStore, name: str, turns: int, size: int, mode: str
) -> dict[str, float]:
    """`mode`: "chained" (each turn continues the last by id), "resent" (each turn sends the
    whole conversation again) or "whole" (each conversation stored whole)."""
    store = ResponseStore(backend, 3600)
    messages: list[dict[str, Any]] = []
    continued: Conversation | None = None
    stored = 0
    reads: list[float] = []
    writes: list[float] = []
    for n in range(turns):
        response_id = f"resp_{name}_{size}_{mode}_{n:05d}"
        messages = [*messages, *turn(n, size)]
        body = StoredResponse({"id": response_id, "output": []}, None, "m", None)
        started = time.perf_counter()
        inputs = StoredInput(None, [])
        resent = mode == "resent"
        lineage = Lineage("", 0, 1) if resent else None
        await store.save(response_id, body, messages, inputs, None, continued, lineage)
        writes.append(time.perf_counter() - started)
        kept = await backend.get_records([(kind, response_id) for kind in KINDS])
        stored += sum(len(value or b"") for value in kept)
        started = time.perf_counter()
        if resent:  # the fingerprint, and its check against the next turn's messages
            kept = await backend.get_record(FINGERPRINT_RECORD, response_id)
            fingerprint = parsed_fingerprint(kept, None)
            assert fingerprint is not None
            continued = await fingerprint.conversation.begun([*messages, *turn(n + 1, size)])
            assert continued is not None
        else:  # the conversation, read as a continuation reads it
            read = await store.conversation(response_id, BOUNDS)
            assert read is not None
            messages = read.messages
            continued = read if mode == "chained" else None
        reads.append(time.perf_counter() - started)
    parts = len(continued.parts) if continued is not None else 1
    return {
        "conversation": len(orjson.dumps(messages)),
        "stored": stored,
        "parts": parts,
        "read_ms": 1e3 * statistics.median(reads[-TIMED:]),
        "write_ms": 1e3 * statistics.median(writes[-TIMED:]),
    }


KINDS = (CONVERSATION_RECORD, TAIL_RECORD)


async def run(redis: bool, chains: list[tuple[int, int]]) -> str:
    lines = [
        "| backend | turns x bytes | conversation | stored: chained / resent / whole | parts "
        "| read ms: chained / resent / whole | store ms: chained / resent / whole |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder, stores(Path(folder), redis) as found:
        for name, backend in found:
            for turns, size in chains:
                runs = [await chain(backend, name, turns, size, mode) for mode in MODES]
                size_mb = runs[0]["conversation"] / 1e6
                lines.append(
                    f"| {name} | {turns} x {size:,} | {size_mb:.2f} MB | "
                    + " / ".join(stored(r) for r in runs)
                    + f" | {runs[0]['parts']:.0f} | "
                    + " / ".join(f"{r['read_ms']:.2f}" for r in runs)
                    + " | "
                    + " / ".join(f"{r['write_ms']:.2f}" for r in runs)
                    + " |"
                )
            await backend.close()
    return "\n".join(lines)


MODES = ("chained", "resent", "whole")


def stored(figures: dict[str, float]) -> str:
    return f"{figures['stored'] / 1e6:,.2f} MB ({figures['stored'] / figures['conversation']:.1f}x)"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", action="store_true", help="also redis (needs redis-server)")
    parser.add_argument("--chains", default=CHAINS, help="TURNSxBYTES, comma-separated")
    args = parser.parse_args(argv)
    chains = [(int(t), int(b)) for t, b in (c.split("x") for c in args.chains.split(","))]
    print(asyncio.run(run(args.redis, chains)))


if __name__ == "__main__":
    main()
