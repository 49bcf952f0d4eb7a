"""Proxy keys (SPEC §2 `auth`): who may call, and what each key may use: agents and models,
the server tools it may add with `loop.tools`, its own threads, and a protected `/metrics`."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from proxy.config.auth import AuthConfig, AuthKey
from proxy.config.environment import setting
from proxy.errors import AuthenticationFailed, PermissionDenied

ALL = "*"


@dataclass(frozen=True, slots=True)
class Caller:
    name: str
    agents: frozenset[str]
    metrics: bool = False

    def allows(self, model: str) -> bool:
        return ALL in self.agents or model in self.agents

    @property
    def unrestricted(self) -> bool:
        return ALL in self.agents

    def scoped(self, name: str) -> str:
        """`name` in the key's own namespace (threads, held calls): two keys that name one
        thread id have a thread each (key names have no `/`, so no two keys' names meet)."""
        return f"{self.name}/{name}"


@dataclass(frozen=True, slots=True)
class ToolScope:
    """The server tools a key may add to a run with `loop.tools`, by tool name."""

    names: frozenset[str] = frozenset()
    every: bool = False

    def allows(self, name: str | None) -> bool:
        return self.every or (name is not None and name in self.names)


def tool_scope(
    key: AuthKey, agent_tools: Mapping[str, Collection[str]], names: Mapping[str, str]
) -> ToolScope:
    """The key's `tools` (names or ids, `*` for all; `names` maps both to tool names), or when
    it lists none, the tools of the agents it may use (`agent_tools`: agent -> tool names)."""
    if key.tools is None:
        if ALL in key.agents:
            return ToolScope(every=True)
        return ToolScope(frozenset(t for a in key.agents for t in agent_tools.get(a, ())))
    if ALL in key.tools:
        return ToolScope(every=True)
    return ToolScope(frozenset(names[ref] for ref in key.tools if ref in names))


class KeyRing:
    def __init__(self, config: AuthConfig) -> None:
        self.metrics_key = config.metrics_key
        # By the SHA-256 digest of the key: a request's token is hashed and looked up, in one
        # step whatever the number of keys. What the lookup's timing could tell of the stored
        # digests is no help in finding a key: that takes a preimage of SHA-256.
        self.keys: dict[bytes, Caller] = {}
        problems: list[str] = []  # every one, in one report
        for key in config.keys:
            if key.key_sha256 is not None:
                digest = bytes.fromhex(key.key_sha256)
            else:
                assert key.key_env is not None
                secret = setting(key.key_env)
                if not secret:
                    problems.append(
                        f"auth.keys.{key.name}: environment variable {key.key_env} is not set"
                    )
                    continue
                digest = hashlib.sha256(secret.encode()).digest()
            caller = self.keys.setdefault(
                digest, Caller(key.name, frozenset(key.agents), key.metrics)
            )
            if caller.name != key.name:  # a token names one caller, never the first of two
                problems.append(f"auth.keys.{key.name}: the same key as auth.keys.{caller.name}")
        if problems:
            raise ValueError("\n".join(problems))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def caller(self, token: str | None) -> Caller | None:
        """The caller a request's bearer token names; None when auth is off."""
        if not self.keys:
            return None
        if not token:
            raise AuthenticationFailed("a proxy API key is required (Authorization: Bearer …)")
        caller = self.keys.get(hashlib.sha256(token.encode()).digest())
        if caller is None:
            raise AuthenticationFailed("the proxy API key is not valid")
        return caller

    @staticmethod
    def check(caller: Caller | None, model: str, param: str = "model") -> None:
        if caller is not None and not caller.allows(model):
            raise PermissionDenied(f"key {caller.name!r} may not use {model!r}", param=param)

    def check_metrics(self, token: str | None) -> None:
        """Raises unless `token` may read `/metrics`: anyone may, unless `auth.metrics_key`."""
        if not self.metrics_key:
            return
        caller = self.caller(token)
        if caller is None:  # no keys at all: the config check refuses that; stay closed
            raise AuthenticationFailed("/metrics needs a proxy API key, and none is configured")
        if not caller.metrics:
            raise PermissionDenied(
                f"key {caller.name!r} may not read /metrics", code="metrics_not_allowed"
            )
