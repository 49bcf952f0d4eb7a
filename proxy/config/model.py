"""What every config model shares: unknown fields are errors, and a config never changes."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

_CALLABLE = re.compile(r"^[\w.]+:[\w.]+$")


def check_callable(ref: str | None) -> None:
    """A python tool's or condition's `callable`, unless unset, names `package.module:function`."""
    if ref is not None and not _CALLABLE.match(ref):
        raise ValueError("callable must look like package.module:function")


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
