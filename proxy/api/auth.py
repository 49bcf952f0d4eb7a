"""Proxy keys (SPEC §2 `auth`): who may call, and which agents and models they may use."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from proxy.config import AuthConfig
from proxy.errors import AuthenticationFailed, PermissionDenied


@dataclass(frozen=True, slots=True)
class Caller:
    name: str
    agents: frozenset[str]

    def allows(self, model: str) -> bool:
        return "*" in self.agents or model in self.agents


class KeyRing:
    def __init__(self, config: AuthConfig) -> None:
        self.keys: list[tuple[bytes, Caller]] = []
        for key in config.keys:
            if key.key_sha256 is not None:
                digest = bytes.fromhex(key.key_sha256)
            else:
                assert key.key_env is not None
                secret = os.environ.get(key.key_env)
                if not secret:
                    raise ValueError(
                        f"auth.keys.{key.name}: environment variable {key.key_env} is not set"
                    )
                digest = hashlib.sha256(secret.encode()).digest()
            self.keys.append((digest, Caller(key.name, frozenset(key.agents))))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def caller(self, token: str | None) -> Caller | None:
        """The caller a request's bearer token names; None when auth is off."""
        if not self.keys:
            return None
        if not token:
            raise AuthenticationFailed("a proxy API key is required (Authorization: Bearer …)")
        digest = hashlib.sha256(token.encode()).digest()
        for known, caller in self.keys:
            if hmac.compare_digest(known, digest):
                return caller
        raise AuthenticationFailed("the proxy API key is not valid")

    @staticmethod
    def check(caller: Caller | None, model: str) -> None:
        if caller is not None and not caller.allows(model):
            raise PermissionDenied(f"key {caller.name!r} may not use {model!r}", param="model")
