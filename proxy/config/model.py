"""What every config model shares: unknown fields are errors, and a config never changes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
