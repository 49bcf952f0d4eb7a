"""Runs on one context serialised between every process that shares a redis server: a hold is
a leased lock taken with the context read, renewed while it is held, and let go by the hold's
last write (the save, the run's records) in the same call. The waiters of one process take
their turns in the process, and a store that waits marks the context so, for the store holding
it to let it have the next turn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy.errors import StateUnavailable
from proxy.state.lease import LateReleases, renewed
from proxy.state.locks import LOCK_POLL_S, KeyedLocks
from proxy.state.redis_calls import ms, reached
from proxy.state.store import Holding, Record, StoredContext, check_put, conflict

log = logging.getLogger(__name__)

# A hold's last save is refused when redis runs it past this share of the store's `timeout_s`
# after it was sent (a paused server runs what it was sent once it resumes: a run told 503 was
# saved all the same); what is left of the timeout is for its answer to come back.
IN_TIME = 0.8
# A store that waits for a context marks it so for this long after each try: longer than its
# tries are apart (LOCK_POLL_S).
WAITING_MARK_S = 4 * LOCK_POLL_S[1]

# Compares and sets KEYS[1], the context: ARGV[1] the version it was read from, ARGV[2] its new
# stored form, ARGV[3] its TTL in ms ('' for none). The stored form starts with {"version":N (a
# context stored before versions is version 1), so the version is read from its first bytes.
# Returns 0 when the stored version is another, having set nothing.
_SAME_VERSION = """
local head = redis.call('GETRANGE', KEYS[1], 0, 31)
local current = 0
if head ~= '' then current = tonumber(string.match(head, '^{"version":(%d+)')) or 1 end
if current ~= tonumber(ARGV[1]) then return 0 end
"""
_SET_CONTEXT = """
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
"""
COMPARE_AND_SET = _SAME_VERSION + _SET_CONTEXT

# A context's hold: KEYS[1] its lock, KEYS[2] the context, KEYS[3] its waiting mark; ARGV[1] the
# holder's token, ARGV[2] the lease in ms, ARGV[3] the store's id, ARGV[4] the mark's TTL in ms.
# Returns {1, the context (false: none)} when taken, else {0}, having marked the context as
# waited for by this store (so that the store holding it lets another store have it next).
# Taken too when the token holds it already: the try sent again after its answer was lost.
_HOLD = """
if redis.call('GET', KEYS[1]) == ARGV[1]
    or redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
  return {1, redis.call('GET', KEYS[2]), redis.call('TIME')}
end
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
return {0}
"""
# The lock KEYS[1] kept ARGV[2] ms more while the token ARGV[1] holds it, or taken again when
# no one does (its lease ran out with no one waiting, or redis restarted without its keys: as a
# sqlite lock row, whose lease runs out but which stays its holder's until another takes it).
# Returns 1 when held, 2 when taken again, 0 when another token holds it.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
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
# records to set; ARGV[1..3] as COMPARE_AND_SET's (ARGV[1] '': nothing to save), ARGV[4] the
# token, ARGV[5] the records' TTL in ms, ARGV[6] the store's id, ARGV[7] the server's time (unix
# ms) by which it runs in time, then the records' values. A context that ended (its TTL) while
# the hold had it is saved all the same. Returns 0, having set nothing, when the save was
# refused or another token holds the lock (the lease was lost); -1, having set nothing, when it
# runs too late (redis held it past most of the store's timeout: the store may have told its
# run that the save failed); else 2 when another store waits for the context, 1 when none does.
_END = (
    """redis.replicate_commands()
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[4] then return 0 end
if ARGV[1] ~= '' and (not holder or redis.call('EXISTS', KEYS[1]) == 1) then
"""
    + _SAME_VERSION
    + """end
local now = redis.call('TIME')
if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[7]) then
  return -1
end
if ARGV[1] ~= '' then
"""
    + _SET_CONTEXT
    + """end
for i = 4, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 4], 'PX', ARGV[5]) end
if holder then redis.call('DEL', KEYS[2]) end
local waiting = redis.call('GET', KEYS[3])
if waiting and waiting ~= ARGV[6] then return 2 end
return 1
"""
)


class ContextHolds:
    """The holds of contexts on the server `client` talks to, under `prefix`: leases of
    `lease_s`; contexts saved for `context_ttl_ms` ('' for good) at the keys `context_key`
    names, records at those `record_key` names."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        lease_s: float,
        context_ttl_ms: str | int,
        context_key: Callable[[str], str],
        record_key: Callable[[str, str], str],
        timeout_s: float,
    ) -> None:
        self.prefix = prefix
        self._lease = lease_s
        self._timeout_s = timeout_s
        self._context_ttl_ms = context_ttl_ms
        self._context_key = context_key
        self._record_key = record_key
        self._take = client.register_script(_HOLD)
        self._renew = client.register_script(_RENEW)
        self._let_go = client.register_script(_LET_GO)
        self._end_script = client.register_script(_END)
        self._locks = KeyedLocks()
        self.late = LateReleases()
        self._id = secrets.token_hex(8)  # this store's, in the contexts' waiting marks
        # Contexts another store has the next turn of, each with when that turn is over
        # (monotonic): the next waiter of this process waits until then before it asks.
        self._give_way: dict[str, float] = {}

    def hold(self, context_id: str) -> AbstractAsyncContextManager[Holding]:
        return self._hold(context_id)

    @contextlib.asynccontextmanager
    async def _hold(self, context_id: str) -> AsyncIterator[Holding]:
        # One waiter per context and process asks redis; the others queue here. When the hold
        # before was let go while another store waited, that store has the next turn: this
        # one waits until that turn is over before it asks.
        async with self._locks.hold(context_id):
            if (wait := self._give_way.pop(context_id, 0.0) - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            held = await self._take_hold(context_id)

            async def renew() -> bool:
                if held.ended:
                    return True
                args: list[str | int] = [held.token, ms(self._lease)]
                held.renewing = True
                try:
                    with reached():
                        kept = await self._renew(keys=[held.lock], args=args)
                finally:
                    held.renewing = False
                if kept == 2 and not held.ended:
                    log.warning(
                        "the lease on context %r had run out; no one had taken it: taken again",
                        context_id,
                    )
                return bool(kept) or held.ended  # let go by its last write meanwhile

            try:
                async with renewed(f"context {context_id!r}", self._lease, renew):
                    yield held
            finally:
                # A renewal the hold's end overtook may have taken the lock again after it.
                if not held.ended or held.overtook:

                    async def let_go() -> None:
                        args = [held.token, self._id]
                        others = await self._let_go(keys=[held.lock, held.mark], args=args)
                        self._after(context_id, bool(others))

                    try:
                        await let_go()
                    except RedisError as exc:  # tried again while the lease lasts
                        log.warning("releasing the lock on context %r failed: %s", context_id, exc)
                        self.late.retry(f"context {context_id!r}", self._lease, let_go)

    def _after(self, context_id: str, others_wait: bool) -> None:
        """A hold let go: the next waiter of this process gives way to another store's, for
        longer than that store's tries are apart. (A turn that passed unused, its waiter gone,
        is dropped here.)"""
        if others_wait and self._locks.waiting(context_id):
            now = time.monotonic()
            self._give_way = {c: t for c, t in self._give_way.items() if t > now}
            self._give_way[context_id] = now + 2 * LOCK_POLL_S[1]

    async def _take_hold(self, context_id: str) -> _Held:
        """Waits until this process holds the context's lock (free, or its lease over), and
        reads the context as it takes it."""
        held = _Held(self, context_id, secrets.token_hex(16))
        keys = [held.lock, self._context_key(context_id), held.mark]
        wait, longest = LOCK_POLL_S
        args: list[str | int] = [held.token, ms(self._lease), self._id, ms(WAITING_MARK_S)]
        try:
            # One attempt at a time, each checked for the cancellation the client may drop
            # (`redis_calls.reached`).
            while True:
                with reached():
                    taken = await self._take(keys=keys, args=args)
                if taken[0]:
                    # The server's clock when it took it, and this process's as the answer
                    # came (a wait for a connection before the take does not count).
                    held.server_s = int(taken[2][0]) + int(taken[2][1]) / 1e6
                    held.taken_at = time.monotonic()
                    break
                await asyncio.sleep(wait)
                wait = min(wait * 2, longest)
        except asyncio.CancelledError:  # the wait's last attempt may have taken it
            with contextlib.suppress(RedisError):
                await self._let_go(keys=[held.lock, held.mark], args=[held.token, self._id])
            raise
        except StateUnavailable:  # a paused redis runs the last attempt once it resumes: it
            # would hold the context, for no one, for the whole lease

            async def let_go() -> None:
                await self._let_go(keys=[held.lock, held.mark], args=[held.token, self._id])

            self.late.retry(f"context {context_id!r}", self._lease, let_go)
            raise
        if taken[1] is not None:
            held.context = StoredContext.loads(taken[1])
        return held

    async def _end(
        self, held: _Held, save: StoredContext | None, records: Sequence[Record], ttl_s: float
    ) -> None:
        ttl_ms = ms(check_put(records, ttl_s, ()))
        args: list[str | int | bytes] = ["", "", ""]
        if save is not None:
            args = [save.version, save.dumps(save.version + 1), self._context_ttl_ms]
        # In time: run before the store could have given up on it (`timeout_s` from now at the
        # soonest), by the server's clock: as the hold's take read it, and as much later as
        # this process's steady clock says passed since (the waits and stalls around the take
        # make it seem earlier than it is: a save refused sooner, never a late one let in).
        now = held.server_s + (time.monotonic() - held.taken_at)
        by = now + IN_TIME * self._timeout_s
        args += [held.token, ttl_ms, self._id, int(by * 1000), *(r.value for r in records)]
        keys = [self._context_key(held.context_id), held.lock, held.mark]
        keys += [self._record_key(kind, key) for kind, key, _ in records]
        held.ended = True  # a renewal meanwhile is no lost lease
        held.overtook = held.renewing
        try:
            with reached():
                ended = await self._end_script(keys=keys, args=args)
        except BaseException:
            held.ended = False  # let go, or tried, as the block ends
            raise
        if ended == -1:
            held.ended = False
            raise StateUnavailable(
                "the state backend (redis) ran the context's save too late: nothing was saved"
            )
        if not ended:
            held.ended = False
            raise conflict(held.context_id)
        self._after(held.context_id, ended == 2)
        if save is not None:
            save.version += 1


class _Held:
    """A context held by `token`: the context as read when the hold was taken."""

    def __init__(self, holds: ContextHolds, context_id: str, token: str) -> None:
        self.holds = holds
        self.context_id = context_id
        self.lock = f"{holds.prefix}lock:{context_id}"
        self.mark = f"{holds.prefix}waiting:{context_id}"  # the last store that waited
        self.token = token
        self.context: StoredContext | None = None
        self.ended = False  # its last write let it go
        self.renewing = False  # a renewal is on its way
        self.server_s = 0.0  # the server's clock (unix seconds) as it took the hold
        self.taken_at = 0.0  # this process's steady clock as the take's answer came
        self.overtook = False  # the last write went while a renewal was on its way

    async def end(
        self, save: StoredContext | None, records: Sequence[Record], ttl_s: float
    ) -> None:
        await self.holds._end(self, save, records, ttl_s)
