"""The YAML config as pydantic models; the only place configuration is read (SPEC §2)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from proxy.engine.policies.stop_conditions import Condition, custom_names, parse_stop_when
from proxy.engine.policies.terminal import TerminatingConfig, parse_terminating_config
from proxy.engine.policies.tool_call_limits import (
    ToolCallLimit,
    parse_tool_call_limits,
    validate_limits,
)
from proxy.engine.policies.tool_rules import RuleBook, ToolRule, parse_tool_rules
from proxy.errors import SpecError


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    keepalive_interval_s: float = Field(15.0, gt=0)


class AuthKey(_Model):
    name: str
    key_env: str | None = None
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    agents: list[str] = ["*"]

    @model_validator(mode="after")
    def _one_source(self) -> AuthKey:
        if (self.key_env is None) == (self.key_sha256 is None):
            raise ValueError("set exactly one of key_env or key_sha256")
        return self


class AuthConfig(_Model):
    keys: list[AuthKey] = []


class UpstreamConfig(_Model):
    base_url: str
    api_key_env: str | None = None
    timeout_s: float = Field(120.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
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
    terminal: bool = False
    id: str | None = None
    url: str | None = None
    headers_env: dict[str, str] = {}
    callable: str | None = None
    builtin: str | None = None  # which builtin; defaults to the tool's name
    command: list[str] | None = None
    prefix: str | None = None

    @model_validator(mode="after")
    def _fields_for_kind(self) -> ToolConfig:
        if self.kind == "http" and not self.url:
            raise ValueError("an http tool needs url")
        if self.kind == "python" and not self.callable:
            raise ValueError("a python tool needs callable (package.module:function)")
        if self.callable is not None and not re.match(r"^[\w.]+:[\w.]+$", self.callable):
            raise ValueError("callable must look like package.module:function")
        if self.kind == "mcp":
            raise ValueError("mcp tools are not available in this version")
        return self


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


class AgentConfig(_Model):
    model: str
    system_prompt: str | None = None
    tools: list[str] = []
    max_steps: int | None = Field(None, ge=1)
    stop_when: list[Any] = []
    terminating_config: dict[str, Any] | None = None
    tool_rules: list[Any] = []
    tool_call_limits: list[Any] = []
    final_answer: bool = False
    parallel_tool_calls: bool = False

    def conditions(self) -> list[Condition]:
        return parse_stop_when(self.stop_when, "stop_when")

    def terminating(self) -> TerminatingConfig | None:
        if self.terminating_config is None:
            return None
        return parse_terminating_config(self.terminating_config, "terminating_config")

    def rules(self) -> tuple[ToolRule, ...]:
        return parse_tool_rules(self.tool_rules, "tool_rules")

    def limits(self) -> tuple[ToolCallLimit, ...]:
        return parse_tool_call_limits(self.tool_call_limits, "tool_call_limits")


class StateConfig(_Model):
    backend: Literal["memory", "sqlite", "redis"] = "sqlite"
    path: str = "./loopwarden.db"
    url_env: str = "REDIS_URL"
    key_prefix: str = "loopwarden:"  # redis
    context_ttl_s: float | None = Field(None, gt=0)  # redis: contexts expire when left alone


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

    @model_validator(mode="after")
    def _references(self) -> Config:
        errors: list[tuple[str, str]] = []
        if self.default_upstream not in self.upstreams:
            errors.append(("default_upstream", f"no upstream named {self.default_upstream!r}"))
        for name, alias in self.models.items():
            if alias.upstream is not None and alias.upstream not in self.upstreams:
                errors.append((f"models.{name}.upstream", f"no upstream named {alias.upstream!r}"))
        ids: dict[str, str] = {}
        for name, tool in self.tools.items():
            if tool.id is not None:
                if tool.id in ids or tool.id in self.tools:
                    errors.append((f"tools.{name}.id", f"id {tool.id!r} is not unique"))
                ids[tool.id] = name
        for name, agent in self.agents.items():
            errors.extend(self._agent_errors(name, agent, ids))
        if errors:
            summary = "; ".join(f"{path}: {msg}" for path, msg in errors)
            raise PydanticCustomError(
                "references", "{summary}", {"summary": summary, "problems": errors}
            )
        return self

    def _agent_errors(
        self, name: str, agent: AgentConfig, ids: dict[str, str]
    ) -> list[tuple[str, str]]:
        errors: list[tuple[str, str]] = []
        where = f"agents.{name}"
        if name in self.models:
            errors.append((where, "an agent and a model alias share this name"))
        for i, tool in enumerate(agent.tools):
            if tool not in self.tools and tool not in ids:
                errors.append((f"{where}.tools[{i}]", f"no tool named {tool!r}"))
        try:
            conditions = agent.conditions()
            for kind, cname, path in custom_names(conditions):
                cond = self.conditions.get(cname)
                if cond is None or cond.kind != kind:
                    errors.append((f"{where}.{path}", f"no {kind} condition named {cname!r}"))
            enabled = {ids.get(t, t) for t in agent.tools}
            RuleBook(agent.rules()).validate(enabled)
            validate_limits(agent.limits(), enabled)
            terminating = agent.terminating()
            if terminating is not None:
                for i, tool in enumerate(terminating.tool_ids):
                    if tool not in enabled and ids.get(tool) not in enabled:
                        errors.append(
                            (
                                f"{where}.terminating_config.tool_ids[{i}]",
                                f"{tool!r} is not one of the agent's tools",
                            )
                        )
        except SpecError as exc:
            errors.append((f"{where}.{exc.param}", exc.message))
        return errors

    def tool_names(self) -> dict[str, str]:
        """Every tool's name and id, each mapped to the tool's name."""
        names = {tool.id: name for name, tool in self.tools.items() if tool.id is not None}
        names.update((name, name) for name in self.tools)
        return names


class ConfigError(Exception):
    """Every problem found in a config file, each with its path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("\n".join(f"{path}: {msg}" for path, msg in problems))
        self.problems = problems


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "model-")):
            out += f".{part}" if out else part
    return out


# Valid stand-ins for entries that failed validation, so that a second pass can still find
# the cross-reference errors of everything else (`loopwarden check` reports every error).
_STAND_INS: dict[str, dict[str, Any]] = {
    "upstreams": {"base_url": "http://stand-in"},
    "models": {"model": "stand-in"},
    "pricing": {"input": 0, "output": 0},
    "tools": {"kind": "builtin"},
    "conditions": {"kind": "python", "callable": "stand.in:check"},
    "agents": {"model": "stand-in"},
}


def _problems(exc: ValidationError) -> list[tuple[str, str, tuple[int | str, ...]]]:
    found: list[tuple[str, str, tuple[int | str, ...]]] = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ")
        path = _loc(err["loc"])
        if err["type"] == "references":
            found.extend((where, msg, ()) for where, msg in err["ctx"]["problems"])
        else:
            found.append((path or "(root)", message, tuple(err["loc"])))
    return found


def parse_config(data: Any) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", "the config must be a mapping")])
    problems: list[tuple[str, str]] = []
    current = dict(data)
    for _ in range(3):
        try:
            config = Config.model_validate(current)
        except ValidationError as exc:
            found = _problems(exc)
            problems.extend((p, m) for p, m, _ in found if (p, m) not in problems)
            replaced = False
            for _, _, loc in found:
                section = loc[0] if loc else None
                if not isinstance(section, str) or section not in current:
                    continue
                entries = current[section]
                if section in _STAND_INS and len(loc) > 1 and isinstance(entries, dict):
                    current[section] = {**entries, loc[1]: _STAND_INS[section]}
                else:
                    current.pop(section)
                replaced = True
            if not replaced:
                break
        else:
            if not problems:
                return config
            break
    raise ConfigError(problems)


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
