"""`agents` and `conditions`: agents' models, tools and loop rules, and the custom stop
conditions they name."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from proxy.config.environment import EnvName, SentHeader
from proxy.config.model import ConfigModel, HttpUrl, check_callable
from proxy.engine.options import PolicyOptions


class ConditionConfig(ConfigModel):
    """A named custom stop condition for `{"webhook": name}` or `{"python": name}`."""

    kind: Literal["webhook", "python"]
    url: HttpUrl | None = None
    callable: str | None = None
    timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    headers_env: dict[SentHeader, EnvName] = {}

    @model_validator(mode="after")
    def _fields_for_kind(self) -> ConditionConfig:
        if self.kind == "webhook" and not self.url:
            raise ValueError("a webhook condition needs url")
        if self.kind == "python" and not self.callable:
            raise ValueError("a python condition needs callable")
        check_callable(self.callable)
        return self


class AgentConfig(PolicyOptions):
    """An agent: a model, its tools and its loop rules (SPEC §2)."""

    model: str
    system_prompt: str | None = None
    tools: list[str] = []
