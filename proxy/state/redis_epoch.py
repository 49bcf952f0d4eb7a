"""Whether redis still holds what the proxy wrote there: a redis restarted without persistence,
flushed or evicting keys loses thread counts, contexts and stored responses, and the limits
start again from zero. Each process reads one key of the proxy's (its epoch: a random value
the first process to miss it sets) as calls are made, at most every CHECK_S, and at each
readiness check; an epoch gone or changed since it last read it is told in the log and to
`on_lost` (the metrics count it). Redis evicting keys (`maxmemory-policy` other than
`noeviction`) is told at the first check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

CHECK_S = 5.0


class Epoch:
    def __init__(
        self, redis: aioredis.Redis, key: str, on_lost: Callable[[], None] = lambda: None
    ) -> None:
        self.redis = redis
        self.key = key
        self.on_lost = on_lost
        self.seen: bytes | str | None = None  # the epoch last read
        self.due_at = 0.0  # monotonic
        self.checking: asyncio.Task[None] | None = None
        self.policy_told = False

    def watch(self) -> None:
        """A check in the background, when one is due (a call was made)."""
        now = time.monotonic()
        if now < self.due_at or self.checking is not None:
            return
        self.due_at = now + CHECK_S
        self.checking = asyncio.ensure_future(self._quietly())
        self.checking.add_done_callback(self._checked)

    def _checked(self, _: asyncio.Task[None]) -> None:
        self.checking = None

    async def _quietly(self) -> None:
        with contextlib.suppress(RedisError):  # (the calls themselves tell a backend down)
            await self.check()

    def close(self) -> None:
        if self.checking is not None:
            self.checking.cancel()

    async def check(self) -> None:
        """Reads the epoch (sets one when there is none) and tells one gone or changed."""
        found = await self.redis.get(self.key)
        if found is None:
            await self.redis.set(self.key, secrets.token_hex(8), nx=True)
            found = await self.redis.get(self.key)
        if self.seen is None:
            await self._policy()
        elif found != self.seen:
            log.error(
                "redis lost the proxy's data since it was last read (restarted without "
                "persistence, flushed, or evicting keys): tool call limits count again from "
                "zero, and the contexts and stored responses it held are gone"
            )
            self.on_lost()
        self.seen = found

    async def _policy(self) -> None:
        if self.policy_told:
            return
        self.policy_told = True
        try:
            reply: Any = await self.redis.config_get("maxmemory-policy")
        except RedisError:  # CONFIG may be refused (a managed redis): nothing to tell then
            return
        values = [_text(v) for k, v in dict(reply).items() if _text(k) == "maxmemory-policy"]
        policy = values[0] if values else None
        if policy is not None and policy != "noeviction":
            log.warning(
                "redis evicts keys (maxmemory-policy %s): at its memory limit it drops thread "
                "counts, contexts and stored responses; set maxmemory-policy noeviction",
                policy,
            )


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
