"""State in a redis server, shared by every proxy process: thread counts are reserved by one
Lua script (atomic), contexts may expire and are saved by compare-and-set (another Lua script),
and runs on one context are serialised by a leased lock. Every failure of the server is a
`StateUnavailable`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy.errors import StateUnavailable
from proxy.state.lease import renewed
from proxy.state.locks import LOCK_POLL_S, KeyedLocks
from proxy.state.store import (
    Holding,
    Record,
    StoredContext,
    batches,
    check_at_once,
    check_put,
    check_ttl,
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

# A store that waits for a context marks it so for this long after each try: longer than its
# tries are apart (LOCK_POLL_S).
WAITING_MARK_S = 4 * LOCK_POLL_S[1]

# Compares and sets KEYS[1], the context: ARGV[1] the version it was read from, ARGV[2] its new
# stored form, ARGV[3] its TTL in ms ('' for none). The stored form starts with {"version":N (a
# context stored before versions is version 1), so the version is read from its first bytes.
# Returns 0 when the stored version is another, having set nothing.
_COMPARE_AND_SET = """
local head = redis.call('GETRANGE', KEYS[1], 0, 31)
local current = 0
if head ~= '' then current = tonumber(string.match(head, '^{"version":(%d+)')) or 1 end
if current ~= tonumber(ARGV[1]) then return 0 end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
"""
# Returns 1 when saved, 0 otherwise.
_SAVE = _COMPARE_AND_SET + "return 1"

# A context's hold: KEYS[1] its lock, KEYS[2] the context, KEYS[3] its waiting mark; ARGV[1] the
# holder's token, ARGV[2] the lease in ms, ARGV[3] the store's id, ARGV[4] the mark's TTL in ms.
# Returns {1, the context (false: none)} when taken, else {0}, having marked the context as
# waited for by this store (so that the store holding it lets another store have it next).
_HOLD = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
  return {1, redis.call('GET', KEYS[2])}
end
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
return {0}
"""
# The lock KEYS[1] kept ARGV[2] ms more while the token ARGV[1] holds it. Returns 1 if it does.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
# The lock KEYS[1] let go, if the token ARGV[1] still holds it; returns 1 when the waiting mark
# KEYS[2] names another store than ARGV[2], else 0.
_LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
local waiting = redis.call('GET', KEYS[2])
if waiting and waiting ~= ARGV[2] then return 1 end
return 0
"""
# A hold's end: KEYS[1] the context, KEYS[2] its lock, KEYS[3] its waiting mark, then the
# records to set; ARGV[1..3] as _COMPARE_AND_SET's (ARGV[1] '': nothing to save), ARGV[4] the
# token, ARGV[5] the records' TTL in ms, ARGV[6] the store's id, then the records' values.
# Returns 0, having set nothing, when the save was refused or another token holds the lock (the
# lease was lost); else 2 when another store waits for the context, 1 when none does.
_END = (
    """local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[4] then return 0 end
if ARGV[1] ~= '' then
"""
    + _COMPARE_AND_SET
    + """end
for i = 4, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 3], 'PX', ARGV[5]) end
if holder then redis.call('DEL', KEYS[2]) end
local waiting = redis.call('GET', KEYS[3])
if waiting and waiting ~= ARGV[6] then return 2 end
return 1
"""
)

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


@contextlib.contextmanager
def _reached() -> Iterator[None]:
    """Turns the server's failures into `StateUnavailable` (their details go to the log only:
    they name hosts), and raises the cancellation the client may have dropped: it sends each
    command under `asyncio.wait_for`, which on Python 3.11 returns as if nothing happened when
    the task is cancelled as the write completes (and a run whose client left would go on).
    Only a cancellation asked for during the call is raised: cleanup that runs while an earlier
    one is handled goes on."""
    task = asyncio.current_task()
    asked = task.cancelling() if task is not None else 0
    try:
        yield
    except RedisError as exc:
        if task is not None and task.cancelling() > asked:
            raise asyncio.CancelledError from None  # what made the call fail, most likely
        log.warning("the redis state backend failed: %s: %s", type(exc).__name__, exc)
        raise StateUnavailable(
            f"the state backend (redis) is unavailable: {type(exc).__name__}"
        ) from None
    if task is not None and task.cancelling() > asked:
        raise asyncio.CancelledError


class RedisStore:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "loopwarden:",
        context_ttl_s: float | None = None,
        timeout_s: float = 5.0,
        lock_lease_s: float = 30.0,
    ) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._prefix = prefix
        self._ttl = context_ttl_s
        self._lease = lock_lease_s
        self._reserve = self._redis.register_script(_RESERVE)
        self._save = self._redis.register_script(_SAVE)
        self._put = self._redis.register_script(_PUT)
        self._get_within = self._redis.register_script(_GET_WITHIN)
        self._take = self._redis.register_script(_HOLD)
        self._renew = self._redis.register_script(_RENEW)
        self._let_go = self._redis.register_script(_LET_GO)
        self._end_script = self._redis.register_script(_END)
        self._locks = KeyedLocks()
        self._id = secrets.token_hex(8)  # this store's, in the contexts' waiting marks
        self._give_way: set[str] = set()  # contexts another store has the next turn of
        # Whether a write is on its way; the writes put meanwhile, each with the future its
        # put awaits; the task that sends them.
        self._sending = False
        self._puts: list[tuple[_Write, asyncio.Future[int]]] = []
        self._writer: asyncio.Task[None] | None = None

    def _thread(self, thread_id: str) -> str:
        return f"{self._prefix}thread:{thread_id}"

    def _context(self, context_id: str) -> str:
        return f"{self._prefix}context:{context_id}"

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        keys = list(limits)
        args: list[str | int] = ["" if ttl_s is None else _ms(ttl_s)]
        for key in keys:
            args += [key, limits[key]]
        with _reached():
            reply = await self._reserve(keys=[self._thread(thread_id)], args=args)
        return bool(reply[0]), {key: int(n) for key, n in zip(keys, reply[1:], strict=True)}

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        with _reached():
            found = await self._redis.hgetall(self._thread(thread_id))
        return {_text(key): int(value) for key, value in found.items()}

    async def load_context(self, context_id: str) -> StoredContext | None:
        with _reached():
            data = await self._redis.get(self._context(context_id))
        return None if data is None else StoredContext.loads(data)

    def _context_ttl_ms(self) -> str | int:
        return "" if self._ttl is None else max(1, round(self._ttl * 1000))

    async def save_context(self, context: StoredContext) -> None:
        version = context.version + 1
        args: list[str | int | bytes] = [context.version, context.dumps(version)]
        args.append(self._context_ttl_ms())
        with _reached():
            saved = await self._save(keys=[self._context(context.id)], args=args)
        if not saved:
            raise conflict(context.id)
        context.version = version

    async def delete_context(self, context_id: str) -> bool:
        with _reached():
            return bool(await self._redis.delete(self._context(context_id)))

    def _record(self, kind: str, key: str) -> str:
        # The kind's length keeps (kind, key) pairs apart whatever ':' either holds.
        return f"{self._prefix}record:{len(kind)}:{kind}:{key}"

    async def put_record(self, kind: str, key: str, value: bytes, ttl_s: float) -> None:
        await self.put_records((Record(kind, key, value),), ttl_s)

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
        ttl_ms = _ms(check_put(records, ttl_s, keep))
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
            with _reached():
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
                        with _reached():
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
        with _reached():
            found = await self._redis.get(self._record(kind, key))
        return None if found is None else _bytes(found)

    async def get_records(
        self, wanted: Sequence[tuple[str, str]], max_bytes: int | None = None
    ) -> list[bytes | None]:
        check_at_once(wanted)
        if not wanted:
            return []
        names = [self._record(kind, key) for kind, key in wanted]
        with _reached():
            if max_bytes is None:
                found = await self._redis.mget(names)
            else:
                found = await self._get_within(keys=names, args=[max_bytes])
        return [None if value is None else _bytes(value) for value in found]

    async def delete_record(self, kind: str, key: str) -> bool:
        return await self.delete_records([(kind, key)]) == 1

    async def delete_records(self, wanted: Sequence[tuple[str, str]]) -> int:
        check_at_once(wanted)
        if not wanted:
            return 0
        with _reached():
            return int(await self._redis.delete(*(self._record(k, key) for k, key in wanted)))

    def hold(self, context_id: str) -> AbstractAsyncContextManager[Holding]:
        return self._hold(context_id)

    @contextlib.asynccontextmanager
    async def _hold(self, context_id: str) -> AsyncIterator[Holding]:
        # One waiter per context and process asks redis; the others queue here. When the hold
        # before was let go while another store waited, that store has the next turn: this
        # one waits longer than the other's polls are apart before it asks.
        async with self._locks.hold(context_id):
            if context_id in self._give_way:
                self._give_way.discard(context_id)
                await asyncio.sleep(2 * LOCK_POLL_S[1])
            held = await self._take_hold(context_id)

            async def renew() -> bool:
                if held.ended:
                    return True
                args: list[str | int] = [held.token, _ms(self._lease)]
                with _reached():
                    kept = bool(await self._renew(keys=[held.lock], args=args))
                return kept or held.ended  # let go by its last write meanwhile

            try:
                async with renewed(f"context {context_id!r}", self._lease, renew):
                    yield held
            finally:
                if not held.ended:
                    try:
                        args = [held.token, self._id]
                        others = await self._let_go(keys=[held.lock, held.mark], args=args)
                        self._after(context_id, bool(others))
                    except RedisError as exc:  # unreachable: the lease expires on its own
                        log.warning("releasing the lock on context %r failed: %s", context_id, exc)

    def _after(self, context_id: str, others_wait: bool) -> None:
        """A hold let go: the next waiter of this process gives way to another store's."""
        if others_wait and self._locks.waiting(context_id):
            self._give_way.add(context_id)

    async def _take_hold(self, context_id: str) -> _Held:
        """Waits until this process holds the context's lock (free, or its lease over), and
        reads the context as it takes it."""
        held = _Held(self, context_id, secrets.token_hex(16))
        keys = [held.lock, self._context(context_id), held.mark]
        wait, longest = LOCK_POLL_S
        args: list[str | int] = [held.token, _ms(self._lease), self._id, _ms(WAITING_MARK_S)]
        try:
            # One attempt at a time, each checked for the cancellation the client may drop
            # (`_reached`).
            while True:
                with _reached():
                    taken = await self._take(keys=keys, args=args)
                if taken[0]:
                    break
                await asyncio.sleep(wait)
                wait = min(wait * 2, longest)
        except asyncio.CancelledError:  # the wait's last attempt may have taken it
            with contextlib.suppress(RedisError):
                await self._let_go(keys=[held.lock, held.mark], args=[held.token, self._id])
            raise
        if taken[1] is not None:
            held.context = StoredContext.loads(taken[1])
        return held

    async def _end(
        self, held: _Held, save: StoredContext | None, records: Sequence[Record], ttl_s: float
    ) -> None:
        ttl_ms = _ms(check_put(records, ttl_s, ()))
        args: list[str | int | bytes] = ["", "", ""]
        if save is not None:
            args = [save.version, save.dumps(save.version + 1), self._context_ttl_ms()]
        args += [held.token, ttl_ms, self._id, *(record.value for record in records)]
        keys = [self._context(held.context_id), held.lock, held.mark]
        keys += [self._record(kind, key) for kind, key, _ in records]
        held.ended = True  # a renewal meanwhile is no lost lease
        try:
            with _reached():
                ended = await self._end_script(keys=keys, args=args)
        except BaseException:
            held.ended = False  # let go, or tried, as the block ends
            raise
        if not ended:
            held.ended = False
            raise conflict(held.context_id)
        self._after(held.context_id, ended == 2)
        if save is not None:
            save.version += 1

    async def ping(self) -> None:
        with _reached():
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


class _Held:
    """A context held by `token`: the context as read when the hold was taken."""

    def __init__(self, store: RedisStore, context_id: str, token: str) -> None:
        self.store = store
        self.context_id = context_id
        self.lock = f"{store._prefix}lock:{context_id}"
        self.mark = f"{store._prefix}waiting:{context_id}"  # the last store that waited
        self.token = token
        self.context: StoredContext | None = None
        self.ended = False  # its last write let it go

    async def end(
        self, save: StoredContext | None, records: Sequence[Record], ttl_s: float
    ) -> None:
        await self.store._end(self, save, records, ttl_s)


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


def _ms(ttl_s: float) -> int:
    return max(1, round(check_ttl(ttl_s) * 1000))
