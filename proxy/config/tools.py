"""`tools`: the server's tools (http, python, builtin) and MCP sources."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import Field, model_validator

from proxy.config.environment import EnvName, SentHeader
from proxy.config.model import ConfigModel, HttpUrl, check_callable


class ToolConfig(ConfigModel):
    kind: Literal["http", "python", "builtin", "mcp"]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # The most output the model gets from this tool; more is a tool error. Unset:
    # `server.max_tool_output_bytes`.
    max_output_bytes: int | None = Field(None, ge=1)
    # `true` for a tool that ends the run (§7.1); for an mcp entry, the list of its tools that
    # do, by the server's name or the exposed one.
    terminal: bool | list[str] = False
    id: str | None = None
    url: HttpUrl | None = None
    headers_env: dict[SentHeader, EnvName] = {}
    callable: str | None = None
    builtin: str | None = None  # which builtin; defaults to the tool's name
    # mcp (SPEC §13): `url` (streamable HTTP) or `command` (stdio, a child of the proxy).
    command: list[str] | None = None
    env_env: dict[EnvName, EnvName] = {}  # the child's variables, from the proxy's environment
    prefix: str | None = None  # exposed names: <prefix><tool>
    include: list[str] | None = None  # the server's tool names to expose; default: all
    exclude: list[str] = []
    required: bool = False  # start-up fails when it cannot connect
    # The longest one attempt to connect and list the tools may take (start-up and reconnects).
    connect_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    # Reconnects wait 0.5 s, then twice as long each time, up to this.
    reconnect_max_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # The most tools one source exposes; the rest are left out (and logged).
    max_tools: int = Field(128, ge=1, le=4096)
    # The largest message the server may send: a stdio line (a longer one ends the session),
    # an HTTP JSON answer or event (a longer one fails its call).
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)

    @model_validator(mode="after")
    def _fields_for_kind(self) -> ToolConfig:
        if self.kind == "http" and not self.url:
            raise ValueError("an http tool needs url")
        if self.kind == "python" and not self.callable:
            raise ValueError("a python tool needs callable (package.module:function)")
        check_callable(self.callable)
        if self.kind == "mcp":
            self._check_mcp()
        else:
            wrong = [f for f in _MCP_ONLY if f in self.model_fields_set]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: only for kind mcp")
            if isinstance(self.terminal, list):
                raise ValueError("terminal is true or false (a list is for kind mcp)")
        return self

    def _check_mcp(self) -> None:
        if (self.url is None) == (self.command is None):
            raise ValueError("an mcp entry needs url (streamable HTTP) or command (stdio): one")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError("command must name a program: [program, arg, ...]")
        if self.headers_env and self.url is None:
            raise ValueError("headers_env is for a url entry; a command entry takes env_env")
        if self.env_env and self.command is None:
            raise ValueError("env_env is for a command entry; a url entry takes headers_env")
        given = self.model_fields_set
        wrong = [f for f in ("parameters", "callable", "builtin", "id") if f in given]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: not for kind mcp (the server gives them)")
        if self.include is not None and self.exclude:
            raise ValueError("set include or exclude, not both")
        if self.terminal is True:
            raise ValueError("terminal lists the tools of this entry that end the run")

    def exposed_name(self, tool: str) -> str | None:
        """The name a server tool `tool` is exposed under, or None when include/exclude leave
        it out (mcp): the prefix and its name, as a function name (`function_name`)."""
        if self.include is not None and tool not in self.include:
            return None
        if tool in self.exclude:
            return None
        return function_name(f"{self.prefix or ''}{tool}")

    def is_terminal(self, tool: str, exposed: str) -> bool:
        if isinstance(self.terminal, bool):
            return self.terminal
        return tool in self.terminal or exposed in self.terminal


# What OpenAI-compatible APIs take as a function's name (OpenAI refuses any other with a 400).
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_-]")


def function_name(name: str) -> str:
    """`name` as a function name: `.`, `/`, spaces and any other character a name cannot hold
    become `_` (an MCP server's `github.get_issue`: `github_get_issue`), and a name past 64
    characters keeps its first 55 and 8 hex digits of its digest."""
    if FUNCTION_NAME.match(name):
        return name
    made = _NOT_IN_A_NAME.sub("_", name) or "_"
    return made if len(made) <= 64 else digest_name(name)


def digest_name(name: str) -> str:
    """`name` as a function name that no other name is: its first 55 characters (others as
    `_`) and 8 hex digits of its digest (for a name that another takes as `function_name`)."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{(_NOT_IN_A_NAME.sub('_', name) or '_')[:55]}_{digest}"


def check_tool_names(tools: dict[str, ToolConfig]) -> None:
    """The config's own tools are offered under their names: each must be a function name
    (an mcp entry's name is not offered, its tools' are)."""
    for name, tool in tools.items():
        if tool.kind != "mcp" and not FUNCTION_NAME.match(name):
            raise ValueError(
                f"{name!r} is no function name a model API takes: letters, digits, _ and -, "
                "at most 64"
            )


_MCP_ONLY = ("command", "env_env", "prefix", "include", "exclude", "required", "max_message_bytes")


def could_expose(entry: Any, name: str) -> bool:
    """Whether an mcp entry of a config document (before validation) could expose a tool under
    `name`, judged by its prefix and include/exclude alone (without connecting)."""
    if not isinstance(entry, dict) or entry.get("kind") != "mcp":
        return False
    prefix = entry.get("prefix") or ""
    if not isinstance(prefix, str):
        return False
    include, exclude = entry.get("include"), entry.get("exclude")
    # (The entries' own types are checked with the rest of the config.)
    listed = [t for t in include if isinstance(t, str)] if isinstance(include, list) else None
    excluded = [t for t in exclude if isinstance(t, str)] if isinstance(exclude, list) else []
    return might_expose(prefix, listed, excluded, name)


def might_expose(prefix: str, include: list[str] | None, exclude: list[str], name: str) -> bool:
    """Whether an mcp entry of this prefix and include/exclude lists could offer a tool as
    `name`: a tool included, under its name as made or its digest name (when another tool has
    the made one); without `include`, any name that begins as the prefix does but one an
    excluded tool is offered under as it is (a made name may be another tool's too)."""
    if include is not None:
        names = set(include) - set(exclude)
        made = {function_name(prefix + t) for t in names}
        return name in made or name in {digest_name(prefix + t) for t in names}
    start = offered_prefix(prefix)
    excluded = {start + t for t in exclude if FUNCTION_NAME.match(t)}
    return name.startswith(start) and name not in excluded


def offered_prefix(prefix: str | None) -> str:
    """How the names an entry exposes begin: its prefix as a name holds it."""
    return function_name(prefix) if prefix else ""
