"""Records written to each state backend with 1 and with 64 writers at once: writes per second
and CPU per write, in this process (event loop and the store's threads). A write is a run's
report (one record), or a stored response: its four records and its chain's thread, in one
write as the proxy makes it, and in five one after another to show what that saves; and one
whose conversation is kept in parts (three earlier ones named and kept as long).

    python -m tests.bench.state_writes [--writes 6000] [--redis]

The sqlite store commits the records put meanwhile in one transaction, so many writers at once
share its commits; one writer pays a commit for each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

from proxy.state.memory import MemoryStore
from proxy.state.redis import RedisStore
from proxy.state.sqlite import SqliteStore
from proxy.state.store import Record, StateStore
from tests.records import put_record
from tests.servers import redis_server

RESPONSE_KINDS = ("conversation", "input", "outputs", "response")  # as the proxy writes them
RECORD = b'{"run_id": "run_x", "stop_reason": "completed", "usage": {}}' + b" " * 540


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


Write = Callable[[StateStore, str], Awaitable[None]]


async def report(store: StateStore, key: str) -> None:
    await put_record(store, "run", key, RECORD, 3600)


async def response(store: StateStore, key: str) -> None:
    records = [Record(kind, key, RECORD) for kind in RESPONSE_KINDS]
    await store.put_records(records, 3600, keep_thread=f"resp_{key}")


async def response_in_parts(store: StateStore, key: str) -> None:
    """A stored response whose conversation names three earlier parts, kept as long: the
    conversation records of the responses the row before wrote (so they are there, as a
    conversation's parts are; one that is not makes more work)."""
    writer, _, turn = key.rpartition("-")
    parts = [f"{writer}-{int(turn) + n}" for n in range(3)]
    records = [Record("conversation_tail", key, RECORD)]
    records += [Record(kind, key, RECORD) for kind in RESPONSE_KINDS[1:]]
    kept = [("conversation", part) for part in parts]
    await store.put_records(records, 3600, keep_thread=f"resp_{key}", keep=kept)


async def response_one_by_one(store: StateStore, key: str) -> None:
    for kind in RESPONSE_KINDS:
        await put_record(store, kind, key, RECORD, 3600)
    await store.put_records([], 3600, keep_thread=f"resp_{key}")


WRITES: dict[str, Write] = {
    "run report": report,
    "stored response": response,
    "stored response, in parts": response_in_parts,
    "stored response, one by one": response_one_by_one,
}


async def measure(
    store: StateStore, write: Write, writers: int, writes: int
) -> tuple[float, float]:
    """Writes per second and CPU µs per write of `writers` making `writes` writes in all."""
    each = max(1, writes // writers)

    async def writer(w: int) -> None:
        for i in range(each):
            await write(store, f"{w}-{i}")

    await store.reserve(f"resp_{-1}-{0}", {"x": 1}, ttl_s=3600)  # one thread has counters
    await writer(-1)  # the schema, the connection: once
    cpu, started = cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    elapsed, spent = time.perf_counter() - started, cpu_seconds() - cpu
    return writers * each / elapsed, 1e6 * spent / (writers * each)


@contextlib.contextmanager
def stores(folder: Path, redis: bool) -> Iterator[list[tuple[str, StateStore]]]:
    with contextlib.ExitStack() as stack:
        found: list[tuple[str, StateStore]] = [
            ("memory", MemoryStore()),
            ("sqlite", SqliteStore(folder / "state.db")),
        ]
        if redis:
            url = stack.enter_context(redis_server(folder))
            found.append(("redis", RedisStore(url)))
        yield found


async def run(writes: int, redis: bool) -> str:
    lines = ["| backend | write | writers | writes/s | CPU µs/write |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder, stores(Path(folder), redis) as found:
        for name, store in found:
            for what, write in WRITES.items():
                for writers in (1, 64):
                    rate, cpu = await measure(store, write, writers, writes)
                    lines.append(f"| {name} | {what} | {writers} | {rate:,.0f} | {cpu:.1f} |")
            await store.close()
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=6000, help="records per row")
    parser.add_argument("--redis", action="store_true", help="also redis (needs redis-server)")
    args = parser.parse_args(argv)
    print(asyncio.run(run(args.writes, args.redis)))


if __name__ == "__main__":
    main()
