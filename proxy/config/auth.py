"""`auth`: the proxy keys and what each may use."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from proxy.config.environment import EnvName
from proxy.config.model import ConfigModel


class AuthKey(ConfigModel):
    """A proxy key and what it may use (the ownership model: README "Keys")."""

    name: str = Field(min_length=1)
    key_env: EnvName | None = None
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    agents: list[str] = ["*"]  # agents and models; `*` for all
    # The server tools `loop.tools` may add, by name or id, `*` for all; unset: the tools of
    # the agents this key may use (all of them with `agents: ["*"]`).
    tools: list[str] | None = None
    metrics: bool = False  # may read `GET /metrics` when `auth.metrics_key` protects it

    @field_validator("name")
    @classmethod
    def _no_slash(cls, value: str) -> str:
        if "/" in value:
            raise ValueError("must not contain '/': a key's threads are named <key name>/<id>")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> AuthKey:
        if (self.key_env is None) == (self.key_sha256 is None):
            raise ValueError("set exactly one of key_env or key_sha256")
        return self


class AuthConfig(ConfigModel):
    keys: list[AuthKey] = []
    metrics_key: bool = False  # `GET /metrics` needs a key with `metrics: true`; default open
