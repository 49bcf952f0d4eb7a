"""State in a redis server, shared by every proxy process: thread counts are reserved by one
Lua script (atomic), contexts may expire and are saved by compare-and-set (another Lua script),
and runs on one context are serialised by a leased lock (`redis_holds`). Every failure of the
server is a `StateUnavailable`."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as ConnectionLost

from proxy.errors import StateUnavailable
from proxy.state import redis_calls
from proxy.state.redis_calls import ms, reached
from proxy.state.redis_epoch import Epoch
from proxy.state.redis_holds import COMPARE_AND_SET, ContextHolds
from proxy.state.store import (
    Holding,
    Record,
    StoredContext,
    batches,
    check_at_once,
    check_put,
    conflict,
    settle,
)

log = logging.getLogger(__name__)

# KEYS[1]: the thread's hash; ARGV: its TTL in ms ('' for none), key1, limit1, key2, limit2...
# Returns {ok, count1, count2, ...}: the counts after, or as they are when one is at its limit.
_RESERVE = """
local n = (#ARGV - 1) / 2
local counts = {}
local ok = 1
for i = 1, n do
  counts[i] = tonumber(redis.call('HGET', KEYS[1], ARGV[2 * i]) or '0')
  if counts[i] >= tonumber(ARGV[2 * i + 1]) then ok = 0 end
end
if ok == 1 then
  for i = 1, n do counts[i] = redis.call('HINCRBY', KEYS[1], ARGV[2 * i], 1) end
end
if ARGV[1] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
table.insert(counts, 1, ok)
return counts
"""

# KEYS[1]: the thread's hash, KEYS[2]: this release's own key; ARGV[1]: that key's TTL in ms,
# then key1, n1, key2, n2...: n taken from each, none below 0. Once only: a release sent again
# (its reply lost, `connected` sends a command once more) finds its key and takes nothing; a
# release taken twice would let a thread run more calls than its limit.
_RELEASE = """
if not redis.call('SET', KEYS[2], 1, 'NX', 'PX', ARGV[1]) then return 0 end
for i = 2, #ARGV, 2 do
  local count = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if count > 0 then
    redis.call('HSET', KEYS[1], ARGV[i], math.max(0, count - tonumber(ARGV[i + 1])))
  end
end
return 1
"""

# How long a release's own key stays: past any resend of it.
RELEASED_MS = 60_000

# A context saved by compare-and-set: 1 when saved, 0 otherwise.
_SAVE = COMPARE_AND_SET + "return 1"

# KEYS: the records to set, the records to keep, then the threads to keep; ARGV[1]: how many
# records to set, ARGV[2]: how many to keep, then each set one's TTL in ms and value, then each
# kept key's TTL in ms. One call: the records of one put are written together and in order, and
# with those put meanwhile (group commit). Returns the places (from 1) among the records kept of
# those that were not there.
_PUT = """
local n, k = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, n do redis.call('SET', KEYS[i], ARGV[2 * i + 2], 'PX', ARGV[2 * i + 1]) end
local gone = {}
for i = n + 1, #KEYS do
  local there = redis.call('PEXPIRE', KEYS[i], ARGV[n + i + 2])
  if there == 0 and i <= n + k then gone[#gone + 1] = i - n end
end
return gone
"""

# KEYS: records to read, in order; ARGV[1]: the most bytes of values to read, the first record
# read whatever its size. Returns the values read (false: none), a prefix of KEYS: the sizes
# are looked at first, so what is not read is not sent.
_GET_WITHIN = """
local most = tonumber(ARGV[1])
local found = {}
local total = 0
for i = 1, #KEYS do
  total = total + redis.call('STRLEN', KEYS[i])
  if i > 1 and total > most then break end
  found[i] = redis.call('GET', KEYS[i])
end
return found
"""

# The most bytes of records in one call of a group commit (a put larger alone): redis reads a
# call whole before it runs it, and runs it without a pause. A record weighs its key and value,
# and at least RECORD_WEIGHT: at most 1,000 records a call, however small.
CALL_BYTES = 4 * 1024 * 1024
RECORD_WEIGHT = CALL_BYTES // 1000


# A process's connections to redis. A call past them waits for one, up to the store's
# `timeout_s` (redis-py's own pool refuses at once: past 100 calls at a time, 503s).
MAX_CONNECTIONS = 100


def connected(url: str, timeout_s: float) -> aioredis.Redis:
    """A client of the server at `url`. A command that finds its connection closed is sent
    once more on a new one: after the server restarts (or fails over) every pooled connection
    is closed, and each would fail a request though the server got none of them. (Were a reply
    lost after the server ran the command, a reservation would count twice or a save meet a
    conflict: a strict answer, never a lost write; a release is made to be taken once.)"""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionLost,)),
        retry_on_error=[ConnectionLost],
    )
    return aioredis.Redis.from_pool(pool)


class RedisStore:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "loopwarden:",
        context_ttl_s: float | None = None,
        timeout_s: float = 5.0,
        lock_lease_s: float = 30.0,
        on_data_lost: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_data_lost`: told each time redis is found to have lost the proxy's data."""
        self._redis = connected(url, timeout_s)
        self._prefix = prefix
        self._ttl = context_ttl_s
        self._reserve = self._redis.register_script(_RESERVE)
        self._release = self._redis.register_script(_RELEASE)
        self._save = self._redis.register_script(_SAVE)
        self._put = self._redis.register_script(_PUT)
        self._get_within = self._redis.register_script(_GET_WITHIN)
        self._holds = ContextHolds(
            self._redis,
            prefix,
            lock_lease_s,
            self._context_ttl_ms(),
            self._context,
            self._record,
            timeout_s,
        )
        # Whether a write is on its way; the writes put meanwhile, each with the future its
        # put awaits; the task that sends them.
        self._sending = False
        self._puts: list[tuple[_Write, asyncio.Future[int]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._epoch = Epoch(self._redis, f"{prefix}epoch", on_data_lost)  # its data lost: told

    def _thread(self, thread_id: str) -> str:
        return f"{self._prefix}thread:{thread_id}"

    def _context(self, context_id: str) -> str:
        return f"{self._prefix}context:{context_id}"

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        keys = list(limits)
        args: list[str | int] = ["" if ttl_s is None else ms(ttl_s)]
        for key in keys:
            args += [key, limits[key]]
        self._epoch.watch()
        with reached():
            reply = await self._reserve(keys=[self._thread(thread_id)], args=args)
        return bool(reply[0]), {key: int(n) for key, n in zip(keys, reply[1:], strict=True)}

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        args: list[str | int] = [RELEASED_MS]
        args += [v for key, n in counts.items() for v in (key, n)]
        once = f"{self._prefix}released:{secrets.token_hex(12)}"
        with reached():
            await self._release(keys=[self._thread(thread_id), once], args=args)

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        with reached():
            found = await self._redis.hgetall(self._thread(thread_id))
        return {_text(key): int(value) for key, value in found.items()}

    async def load_context(self, context_id: str) -> StoredContext | None:
        with reached():
            data = await self._redis.get(self._context(context_id))
        return None if data is None else StoredContext.loads(data)

    def _context_ttl_ms(self) -> str | int:
        return "" if self._ttl is None else max(1, round(self._ttl * 1000))

    async def save_context(self, context: StoredContext) -> None:
        version = context.version + 1
        args: list[str | int | bytes] = [context.version, context.dumps(version)]
        args.append(self._context_ttl_ms())
        with reached():
            saved = await self._save(keys=[self._context(context.id)], args=args)
        if not saved:
            raise conflict(context.id)
        context.version = version

    async def delete_context(self, context_id: str) -> bool:
        with reached():
            return bool(await self._redis.delete(self._context(context_id)))

    def _record(self, kind: str, key: str) -> str:
        # The kind's length keeps (kind, key) pairs apart whatever ':' either holds.
        return f"{self._prefix}record:{len(kind)}:{kind}:{key}"

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Sent at once when no other write is on its way, else with every write put
        meanwhile, in one call after it (group commit): it returns once the server has taken
        its records."""
        self._epoch.watch()
        ttl_ms = ms(check_put(records, ttl_s, keep))
        named = [(self._record(kind, key), value) for kind, key, value in records]
        kept = [self._record(kind, key) for kind, key in keep]
        thread = None if keep_thread is None else self._thread(keep_thread)
        write = _Write(named, ttl_ms, kept, thread)
        if self._sending:
            done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._puts.append((write, done))
            return await done
        self._sending = True
        try:
            with reached():
                (found,) = await self._write([write])
                return found
        finally:
            self._send_the_rest()

    async def _write(self, writes: list[_Write]) -> list[int]:
        """How many of the records each write keeps were there."""
        keys: list[str] = []
        args: list[str | int | bytes] = [0, 0]
        kept: list[str] = []
        ends: list[str | int | bytes] = []
        threads: list[str] = []
        thread_ends: list[str | int | bytes] = []
        for write in writes:
            for name, value in write.records:
                keys.append(name)
                args += [write.ttl_ms, value]
            kept += write.kept
            ends += [write.ttl_ms] * len(write.kept)
            if write.thread is not None:
                threads.append(write.thread)
                thread_ends.append(write.ttl_ms)
        args[0], args[1] = len(keys), len(kept)
        gone = await self._put(keys=keys + kept + threads, args=args + ends + thread_ends)
        found = [len(write.kept) for write in writes]
        if gone:  # which write kept each
            owners = [i for i, write in enumerate(writes) for _ in write.kept]
            for place in gone:
                found[owners[int(place) - 1]] -= 1
        return found

    def _send_the_rest(self) -> None:
        if self._puts:
            self._writer = asyncio.create_task(self._write_puts())
        else:
            self._sending = False

    async def _write_puts(self) -> None:
        """Sends what was put, in calls of at most CALL_BYTES, until nothing is left. Cancelled
        (the loop shuts down), it fails what it was sending and what is left: a put waiting for
        the next one to carry it could wait for ever, then land after a newer value."""
        try:
            while self._puts:
                puts, self._puts = self._puts, []
                for batch in batches(puts, lambda put: put[0].size, CALL_BYTES):
                    error: BaseException | None = None
                    found: list[int] = []
                    try:
                        with reached():
                            found = await self._write([write for write, _ in batch])
                    except Exception as exc:  # every put of the call fails with it
                        error = exc
                    settle([done for _, done in batch], error, found)
        except asyncio.CancelledError:
            stopped = StateUnavailable(
                "the state backend (redis) writer was stopped: records may not have been written"
            )
            settle([done for _, done in [*puts, *self._puts]], stopped)
            self._puts = []
            raise
        finally:
            self._sending = False

    async def get_record(self, kind: str, key: str) -> bytes | None:
        with reached():
            found = await self._redis.get(self._record(kind, key))
        return None if found is None else _bytes(found)

    async def get_records(
        self, wanted: Sequence[tuple[str, str]], max_bytes: int | None = None
    ) -> list[bytes | None]:
        check_at_once(wanted)
        if not wanted:
            return []
        names = [self._record(kind, key) for kind, key in wanted]
        with reached():
            if max_bytes is None:
                found = await self._redis.mget(names)
            else:
                found = await self._get_within(keys=names, args=[max_bytes])
        return [None if value is None else _bytes(value) for value in found]

    async def delete_records(self, wanted: Sequence[tuple[str, str]]) -> int:
        check_at_once(wanted)
        if not wanted:
            return 0
        with reached():
            return int(await self._redis.delete(*(self._record(k, key) for k, key in wanted)))

    def hold(self, context_id: str) -> AbstractAsyncContextManager[Holding]:
        self._epoch.watch()
        return self._holds.hold(context_id)

    async def ping(self) -> None:
        """Redis answers and takes a write (one at its memory limit, `noeviction`, refuses
        every write and answers pings), and still holds what the proxy wrote (`Epoch`)."""
        with reached():
            await self._redis.set(f"{self._prefix}ready", b"1", px=60_000)
            await self._epoch.check()

    async def close(self) -> None:
        await self._holds.late.close()
        self._epoch.close()
        await self._redis.aclose()
        redis_calls.failures.close("the redis state backend failed")  # the count not told yet


class _Write(NamedTuple):
    records: list[tuple[str, bytes]]  # redis key, value
    ttl_ms: int
    kept: list[str]  # the redis keys of the records to keep as long
    thread: str | None  # and of the thread

    @property
    def size(self) -> int:
        """What it weighs in a call (CALL_BYTES)."""
        weights = (max(RECORD_WEIGHT, len(key) + len(value)) for key, value in self.records)
        return sum(weights, RECORD_WEIGHT * (len(self.kept) + (self.thread is not None)))


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
