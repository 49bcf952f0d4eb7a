"""What a config takes from the environment: the names it may give (`EnvName`, `HeaderName`),
and the variables it needs to serve that are not set, every one with its path."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, Field

if TYPE_CHECKING:
    from proxy.config import Config

# A variable's name, as a shell sets it (no `=`, no NUL): one that can be set.
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)]
# An HTTP field name (RFC 9110's token): a header the proxy sends.
HeaderName = Annotated[str, Field(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", max_length=256)]
# The headers of a request the client sets itself: its framing, its connection, its host.
CLIENTS_OWN = frozenset(
    {
        "connection", "content-length", "expect", "host", "keep-alive", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade",
    }
)  # fmt: skip


def _not_clients_own(name: str) -> str:
    if name.lower() in CLIENTS_OWN:
        raise ValueError(f"{name} is set by the HTTP client itself, for each request")
    return name


# A header the config has the proxy send with a value from the environment.
SentHeader = Annotated[HeaderName, AfterValidator(_not_clients_own)]


def setting(variable: str, env: Mapping[str, str] = os.environ) -> str | None:
    """A variable's value as the config uses it (a key, a header's value, a URL): without the
    whitespace around it (the line break a secret's file ends with); None when unset or empty."""
    value = env.get(variable)
    if value is None:
        return None
    return value.strip() or None


def sendable(value: str) -> bool:
    """Whether `value` can go in an HTTP header: visible ASCII, spaces and tabs."""
    return value.isascii() and all(" " <= c < "\x7f" or c == "\t" for c in value)


def unset_variables(config: Config, env: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(path, variable) for every variable the config needs that `env` lacks (or has empty):
    the proxy keys', redis's URL (with that backend), the headers of http tools, MCP servers
    and webhook conditions, and the variables of MCP servers' children. An upstream's
    `api_key_env` is optional: unset, no key is sent."""
    needed = [(path, variable) for path, variable, _ in _variables(config)]
    needed += [
        (f"tools.{name}.env_env.{of_child}", variable)
        for name, entry in config.tools.items()
        for of_child, variable in entry.env_env.items()
    ]
    return [(path, variable) for path, variable in needed if not setting(variable, env)]


def unset_keys(config: Config, env: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(path, variable) for every upstream key the config names that `env` lacks: optional
    (a local model server needs none), but an upstream that does answers 401."""
    return [
        (f"upstreams.{name}.api_key_env", upstream.api_key_env)
        for name, upstream in config.upstreams.items()
        if upstream.api_key_env is not None and not setting(upstream.api_key_env, env)
    ]


def unsendable_variables(
    config: Config, env: Mapping[str, str] = os.environ
) -> list[tuple[str, str]]:
    """(path, variable) for every set variable the proxy sends in a header (a key, a header's
    value) that holds what no header can (a line break, a control character, non-ASCII)."""
    found: list[tuple[str, str]] = []
    for path, variable, sent in _variables(config, optional=True):
        value = setting(variable, env)
        if sent and value is not None and not sendable(value):
            found.append((path, variable))
    return found


def _variables(config: Config, optional: bool = False) -> list[tuple[str, str, bool]]:
    """(path, variable, whether it is sent in a header) for the variables the config names,
    but those of MCP servers' children; `optional`: with the upstreams' keys."""
    found: list[tuple[str, str, bool]] = []
    for i, key in enumerate(config.auth.keys):
        if key.key_env is not None:
            found.append((f"auth.keys[{i}].key_env", key.key_env, True))
    if config.state.backend == "redis":
        found.append(("state.url_env", config.state.url_env, False))
    for section, entries in (("tools", config.tools), ("conditions", config.conditions)):
        for name, entry in entries.items():
            for header, variable in entry.headers_env.items():
                found.append((f"{section}.{name}.headers_env.{header}", variable, True))
    if optional:
        for name, upstream in config.upstreams.items():
            if upstream.api_key_env is not None:
                found.append((f"upstreams.{name}.api_key_env", upstream.api_key_env, True))
    return found


def environment_problems(
    config: Config, env: Mapping[str, str] = os.environ
) -> list[tuple[str, str]]:
    """(path, message) for every variable the config needs that is unset, and every one it
    sends in a header that cannot be sent."""
    problems = [
        (path, f"environment variable {variable} is not set")
        for path, variable in unset_variables(config, env)
    ]
    problems += [
        (
            path,
            f"environment variable {variable} holds what an HTTP header cannot carry (a line "
            "break inside it, a control character, or a character that is not ASCII)",
        )
        for path, variable in unsendable_variables(config, env)
    ]
    if config.state.backend == "redis":
        url = setting(config.state.url_env, env)
        if url is not None and not url.startswith(REDIS_SCHEMES):
            problems.append(
                (
                    "state.url_env",
                    f"environment variable {config.state.url_env} holds no redis URL (one "
                    f"begins {', '.join(REDIS_SCHEMES)})",
                )
            )
    return problems


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
