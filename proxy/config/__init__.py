"""The YAML config as pydantic models; the only place configuration is read (SPEC §2). One
module a section; `Config` puts them together."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from proxy.config.agents import AgentConfig, ConditionConfig
from proxy.config.auth import AuthConfig
from proxy.config.document import BadDocument, read_document
from proxy.config.model import ConfigModel
from proxy.config.references import expression_problems, reference_problems
from proxy.config.server import ServerConfig
from proxy.config.state import StateConfig
from proxy.config.telemetry import TelemetryConfig
from proxy.config.tools import ToolConfig, check_tool_names
from proxy.config.upstreams import ModelAlias, Price, UpstreamConfig
from proxy.engine.option_errors import problems

# The server tools a config may define (each its schema checked as the server starts, ~2 ms).
MAX_TOOLS = 4096


class Config(ConfigModel):
    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig()
    upstreams: dict[str, UpstreamConfig] = {
        "openai": UpstreamConfig(base_url="https://api.openai.com/v1", api_key_env="OPENAI_API_KEY")
    }
    default_upstream: str = "openai"
    models: dict[str, ModelAlias] = {}
    pricing: dict[str, Price] = {}
    tools: Annotated[dict[str, ToolConfig], Field(max_length=MAX_TOOLS)] = {}
    conditions: dict[str, ConditionConfig] = {}
    agents: dict[str, AgentConfig] = {}
    state: StateConfig = StateConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    @field_validator("tools")
    @classmethod
    def _offered_names(cls, tools: dict[str, ToolConfig]) -> dict[str, ToolConfig]:
        check_tool_names(tools)
        return tools

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

    def with_server(self, **changes: object) -> Config:
        """This config with `server` settings from the command line (`serve --port`, ...),
        checked again."""
        server = {**dict(self.server), **changes}
        try:
            return Config.model_validate({**dict(self), "server": server})
        except ValidationError as exc:
            raise ConfigError(problems(exc)) from None


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
        raise ConfigError(problems(exc) + found + expression_problems(data)) from None
    if found:
        raise ConfigError(found)
    return config


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read the config file; no path and no LOOPWARDEN_CONFIG means the built-in default."""
    path = path or os.environ.get("LOOPWARDEN_CONFIG")
    if not path:
        return Config()
    file = Path(path)
    try:
        data = read_document(file)
    except FileNotFoundError:
        raise ConfigError([(str(file), "no such file")]) from None
    except BadDocument as exc:
        raise ConfigError([(str(file), str(exc))]) from None
    return parse_config(data)
