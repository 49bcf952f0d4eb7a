"""What a config takes from the environment: the names it may give (`EnvName`, `HeaderName`),
and the variables it needs to serve that are not set, every one with its path."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

if TYPE_CHECKING:
    from proxy.config import Config

# A variable's name, as a shell sets it (no `=`, no NUL): one that can be set.
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)]
# An HTTP field name (RFC 9110's token): a header the proxy sends.
HeaderName = Annotated[str, Field(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", max_length=256)]


def unset_variables(config: Config, env: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(path, variable) for every variable the config needs that `env` lacks (or has empty):
    the proxy keys', redis's URL (with that backend), the headers of http tools, MCP servers
    and webhook conditions, and the variables of MCP servers' children. An upstream's
    `api_key_env` is optional: unset, no key is sent."""
    needed: list[tuple[str, str]] = []
    for i, key in enumerate(config.auth.keys):
        if key.key_env is not None:
            needed.append((f"auth.keys[{i}].key_env", key.key_env))
    if config.state.backend == "redis":
        needed.append(("state.url_env", config.state.url_env))
    for section, entries in (("tools", config.tools), ("conditions", config.conditions)):
        for name, entry in entries.items():
            for header, variable in entry.headers_env.items():
                needed.append((f"{section}.{name}.headers_env.{header}", variable))
            for variable_of_child, variable in getattr(entry, "env_env", {}).items():
                needed.append((f"{section}.{name}.env_env.{variable_of_child}", variable))
    return [(path, variable) for path, variable in needed if not env.get(variable)]


def unset_problems(unset: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(path, f"environment variable {variable} is not set") for path, variable in unset]
