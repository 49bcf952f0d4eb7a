"""The YAML config as pydantic models; the only place configuration is read (SPEC §2)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.engine.options import PolicyOptions, problems


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Descriptors the process keeps for itself (state files, logs, listeners) before client
# connections, upstream connections and tool connections share the rest.
FD_HEADROOM = 64


def _descriptor_limit() -> int:
    """The process's soft RLIMIT_NOFILE; 1,024 where it cannot be read or is unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    return soft if 0 < soft < 2**31 else 1024


class ServerConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    keepalive_interval_s: float = Field(15.0, gt=0)
    # Client connections held at once; more are closed as they arrive. Unset: half of the
    # descriptors left after FD_HEADROOM, since a client connection may hold an upstream one.
    max_connections: int | None = Field(None, ge=1)
    header_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)  # request line + headers
    body_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)  # the whole request body
    keep_alive_timeout_s: int = Field(5, ge=1)  # an idle connection between requests
    max_concurrent_runs: int = Field(1000, ge=1)  # runs in flight; more answer 503
    tool_threads: int = Field(16, ge=1)  # threads for sync python tools and conditions
    tool_connections: int = Field(100, ge=1)  # http tools' and webhooks' connection pool
    upstream_connections: int = Field(1000, ge=1)  # the upstreams' connection pool
    upstream_pool_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    max_tool_output_bytes: int = Field(1024 * 1024, ge=1)  # each tool's own cap overrides
    workers: int = Field(1, ge=1, le=256)  # processes behind one port (`serve --workers`)
    # How `/v1/responses` shows the server tool calls that ran: as `mcp_call` output items, or
    # not at all (for a client that cannot read them).
    responses_server_calls: Literal["mcp_call", "omit"] = "mcp_call"

    def connection_limit(self) -> int:
        """Client connections held at once: `max_connections`, else derived from the
        process's descriptor limit."""
        if self.max_connections is not None:
            return self.max_connections
        return max(16, (_descriptor_limit() - FD_HEADROOM) // 2)

    def request_limit(self) -> int:
        """Requests in flight at once, health probes aside: a little below the connection
        limit, so that a probe still finds a connection and an answer when every other
        request is slow."""
        limit = self.connection_limit()
        return max(1, limit - max(8, limit // 16))


class AuthKey(_Model):
    """A proxy key and what it may use (the ownership model: README "Keys")."""

    name: str = Field(min_length=1)
    key_env: str | None = None
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


class AuthConfig(_Model):
    keys: list[AuthKey] = []
    metrics_key: bool = False  # `GET /metrics` needs a key with `metrics: true`; default open


class UpstreamConfig(_Model):
    base_url: str
    api_key_env: str | None = None
    # The longest the upstream may stay silent: to start its answer, or between two reads of it.
    timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    connect_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    # The most one step's upstream call may take in all, however the bytes trickle in: every
    # attempt, the waits between them, the whole body or stream.
    step_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    max_retries: int = Field(2, ge=0, le=10)
    # The longest wait before a retry, whatever the upstream's Retry-After asks.
    max_retry_wait_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    # What the proxy reads of one reply: the whole body or stream, one event of a stream, and
    # the tool calls of one reply (a reply over any of them is a 502 upstream_error).
    max_response_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_event_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_tool_calls_per_reply: int = Field(128, ge=1)
    reports_cost: bool = False
    forward_client_key: bool = False  # send the client's Authorization header upstream
    provider: str | None = None  # gen_ai.provider.name; guessed from base_url when unset

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")


class ModelAlias(_Model):
    upstream: str | None = None
    model: str


class Price(_Model):
    input: float = Field(ge=0)
    output: float = Field(ge=0)


class ToolConfig(_Model):
    kind: Literal["http", "python", "builtin", "mcp"]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    timeout_s: float = Field(30.0, gt=0)
    # The most output the model gets from this tool; more is a tool error. Unset:
    # `server.max_tool_output_bytes`.
    max_output_bytes: int | None = Field(None, ge=1)
    # `true` for a tool that ends the run (§7.1); for an mcp entry, the list of its tools that
    # do, by the server's name or the exposed one.
    terminal: bool | list[str] = False
    id: str | None = None
    url: str | None = None
    headers_env: dict[str, str] = {}
    callable: str | None = None
    builtin: str | None = None  # which builtin; defaults to the tool's name
    # mcp (SPEC §13): `url` (streamable HTTP) or `command` (stdio, a child of the proxy).
    command: list[str] | None = None
    env_env: dict[str, str] = {}  # the child's variables, from the proxy's environment
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

    @model_validator(mode="after")
    def _fields_for_kind(self) -> ToolConfig:
        if self.kind == "http" and not self.url:
            raise ValueError("an http tool needs url")
        if self.kind == "python" and not self.callable:
            raise ValueError("a python tool needs callable (package.module:function)")
        if self.callable is not None and not re.match(r"^[\w.]+:[\w.]+$", self.callable):
            raise ValueError("callable must look like package.module:function")
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
        if self.url is not None and not re.match(r"^https?://[^/\s]+", self.url):
            raise ValueError("url must be an http:// or https:// URL")
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
        it out (mcp)."""
        if self.include is not None and tool not in self.include:
            return None
        if tool in self.exclude:
            return None
        return f"{self.prefix or ''}{tool}"

    def is_terminal(self, tool: str, exposed: str) -> bool:
        if isinstance(self.terminal, bool):
            return self.terminal
        return tool in self.terminal or exposed in self.terminal


_MCP_ONLY = ("command", "env_env", "prefix", "include", "exclude", "required")


def could_expose(entry: Any, name: str) -> bool:
    """Whether an mcp entry of a config document (before validation) could expose a tool under
    `name`, judged by its prefix and include/exclude alone (without connecting)."""
    if not isinstance(entry, dict) or entry.get("kind") != "mcp":
        return False
    prefix = entry.get("prefix") or ""
    if not isinstance(prefix, str) or not name.startswith(prefix):
        return False
    tool = name[len(prefix) :]
    include, exclude = entry.get("include"), entry.get("exclude")
    if isinstance(include, list) and tool not in include:
        return False
    return not (isinstance(exclude, list) and tool in exclude)


class ConditionConfig(_Model):
    """A named custom stop condition for `{"webhook": name}` or `{"python": name}`."""

    kind: Literal["webhook", "python"]
    url: str | None = None
    callable: str | None = None
    timeout_s: float = Field(10.0, gt=0)
    headers_env: dict[str, str] = {}

    @model_validator(mode="after")
    def _fields_for_kind(self) -> ConditionConfig:
        if self.kind == "webhook" and not self.url:
            raise ValueError("a webhook condition needs url")
        if self.kind == "python" and not self.callable:
            raise ValueError("a python condition needs callable")
        return self


class AgentConfig(PolicyOptions):
    """An agent: a model, its tools and its loop rules (SPEC §2)."""

    model: str
    system_prompt: str | None = None
    tools: list[str] = []


class StateConfig(_Model):
    backend: Literal["memory", "sqlite", "redis"] = "sqlite"
    path: str = "./loopwarden.db"
    url_env: str = "REDIS_URL"
    key_prefix: str = "loopwarden:"  # redis
    context_ttl_s: float | None = Field(None, gt=0)  # redis: contexts expire when left alone
    # Run reports (GET /v1/runs/{id}) and held server calls (SPEC §5.1.6) are kept this long.
    run_ttl_s: float = Field(86400.0, gt=0, allow_inf_nan=False)
    # Stored responses (`/v1/responses` with `store`, SPEC §12.4) are kept this long.
    response_ttl_s: float = Field(30 * 86400.0, gt=0, allow_inf_nan=False)
    # The longest one call to the backend may wait (redis socket timeouts, sqlite's busy
    # timeout, the /readyz check) before it fails with 503 state_unavailable.
    timeout_s: float = Field(5.0, gt=0, le=300, allow_inf_nan=False)
    # A run holds its context by a lease this long (sqlite, redis), renewed every third of it:
    # a crashed process frees its contexts within one lease.
    lock_lease_s: float = Field(30.0, ge=1, le=86400, allow_inf_nan=False)
    # sqlite: `wal` (fast: no fsync per write) shares memory between processes through a mapped
    # `-shm` file, which kills the process (SIGBUS) if that file is made immutable under it;
    # `rollback` maps nothing, so any fault of the file is a 503, at an fsync per write.
    sqlite_journal: Literal["wal", "rollback"] = "wal"
    # The most a stored context may hold: the JSON of its messages, in bytes.
    max_context_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # The longest context id; ids are also refused when empty, with '/' or control characters.
    max_context_id_chars: int = Field(256, ge=1, le=4096)


class TelemetryConfig(_Model):
    service_name: str = "loopwarden"
    capture_content: bool = False


class Config(_Model):
    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig()
    upstreams: dict[str, UpstreamConfig] = {
        "openai": UpstreamConfig(base_url="https://api.openai.com/v1", api_key_env="OPENAI_API_KEY")
    }
    default_upstream: str = "openai"
    models: dict[str, ModelAlias] = {}
    pricing: dict[str, Price] = {}
    tools: dict[str, ToolConfig] = {}
    conditions: dict[str, ConditionConfig] = {}
    agents: dict[str, AgentConfig] = {}
    state: StateConfig = StateConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    @field_validator("state")
    @classmethod
    def _shared_by_the_workers(cls, state: StateConfig, info: ValidationInfo) -> StateConfig:
        server = info.data.get("server")
        if isinstance(server, ServerConfig) and server.workers > 1 and state.backend == "memory":
            raise ValueError(
                "the memory backend is per process: with server.workers above 1, thread limits "
                "and stored contexts need sqlite or redis"
            )
        return state

    def with_workers(self, workers: int) -> Config:
        """This config served by `workers` processes (`serve --workers`), checked again."""
        server = self.server.model_copy(update={"workers": workers})
        try:
            return Config.model_validate({**dict(self), "server": server})
        except ValidationError as exc:
            problems = [(".".join(map(str, e["loc"])), e["msg"]) for e in exc.errors()]
            raise ConfigError(problems) from None


class ConfigError(Exception):
    """Every problem found in a config file, each with its path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("\n".join(f"{path}: {msg}" for path, msg in problems))
        self.problems = problems


def parse_config(data: Any) -> Config:
    """Validates a config document; raises ConfigError with every problem found: those of the
    schema and, in the same report, the names it uses but does not define."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", "the config must be a mapping")])
    found = reference_problems(data)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems(exc) + found) from None
    if found:
        raise ConfigError(found)
    return config


def _entries(data: dict[str, Any], section: str) -> dict[str, Any]:
    value = data.get(section)
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def reference_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """What a config document names but does not define (and the names it must not repeat),
    read from the document itself so that it is found even where the schema fails. Agents'
    policies are checked when they are compiled against the tools (`proxy.api.planning`)."""
    errors: list[tuple[str, str]] = []
    upstreams = _entries(data, "upstreams") if "upstreams" in data else {"openai": {}}
    default = data.get("default_upstream", "openai")
    if default not in upstreams:
        errors.append(("default_upstream", f"no upstream named {default!r}"))
    models = _entries(data, "models")
    for name, alias in models.items():
        upstream = alias.get("upstream") if isinstance(alias, dict) else None
        if upstream is not None and upstream not in upstreams:
            errors.append((f"models.{name}.upstream", f"no upstream named {upstream!r}"))
    tools = _entries(data, "tools")
    ids: set[str] = set()
    for name, tool in tools.items():
        tool_id = tool.get("id") if isinstance(tool, dict) else None
        if tool_id is not None:
            if tool_id in ids or tool_id in tools:
                errors.append((f"tools.{name}.id", f"id {tool_id!r} is not unique"))
            ids.add(tool_id)
    for name, agent in _entries(data, "agents").items():
        if name in models:
            errors.append((f"agents.{name}", "an agent and a model alias share this name"))
        refs = agent.get("tools") if isinstance(agent, dict) else None
        for i, ref in enumerate(refs if isinstance(refs, list) else []):
            if isinstance(ref, str) and not _known_tool(ref, tools, ids):
                errors.append((f"agents.{name}.tools[{i}]", f"no tool named {ref!r}"))
    auth = _entries(data, "auth")
    errors.extend(_key_problems(auth, tools, ids))
    if auth.get("keys"):
        errors.extend(
            (
                f"upstreams.{name}.forward_client_key",
                "cannot be true while auth.keys are set: the client's key is the proxy's own",
            )
            for name, upstream in upstreams.items()
            if isinstance(upstream, dict) and upstream.get("forward_client_key") is True
        )
    return errors


def _known_tool(ref: str, tools: dict[str, Any], ids: set[str]) -> bool:
    """A tool entry's name or id, or a name that one of its mcp entries could expose."""
    return ref in tools or ref in ids or any(could_expose(t, ref) for t in tools.values())


def _key_problems(
    auth: dict[str, Any], tools: dict[str, Any], ids: set[str]
) -> list[tuple[str, str]]:
    """Keys' names are unique (a key's threads are named by it), the tools they list exist, and
    a protected `/metrics` has a key that may read it."""
    errors: list[tuple[str, str]] = []
    listed = auth.get("keys")
    keys = listed if isinstance(listed, list) else []
    names: set[str] = set()
    for i, key in enumerate(keys):
        if not isinstance(key, dict):
            continue  # the schema reports it
        name = key.get("name")
        if isinstance(name, str):
            if name in names:
                errors.append((f"auth.keys[{i}].name", f"name {name!r} is not unique"))
            names.add(name)
        refs = key.get("tools")
        for j, ref in enumerate(refs if isinstance(refs, list) else []):
            if isinstance(ref, str) and ref != "*" and not _known_tool(ref, tools, ids):
                errors.append((f"auth.keys[{i}].tools[{j}]", f"no tool named {ref!r}"))
    readers = [k for k in keys if isinstance(k, dict) and k.get("metrics") is True]
    if auth.get("metrics_key") is True and not readers:
        errors.append(("auth.metrics_key", "no key has metrics: true, so none could read /metrics"))
    return errors


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read the config file; no path and no LOOPWARDEN_CONFIG means the built-in default."""
    path = path or os.environ.get("LOOPWARDEN_CONFIG")
    if not path:
        return Config()
    file = Path(path)
    if not file.exists():
        raise ConfigError([(str(file), "no such file")])
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError([(str(file), f"not valid YAML: {exc}")]) from None
    return parse_config(data)
