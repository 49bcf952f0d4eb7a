"""What every config model shares: unknown fields are errors, and a config never changes; and
the checks of the values several take (a callable's name, an http URL)."""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict

_CALLABLE = re.compile(r"^[\w.]+:[\w.]+$")


def check_callable(ref: str | None) -> None:
    """A python tool's or condition's `callable`, unless unset, names `package.module:function`."""
    if ref is not None and not _CALLABLE.match(ref):
        raise ValueError("callable must look like package.module:function")


def http_url(value: str) -> str:
    """`value`, an http:// or https:// URL a request can go to: a host, a port that is a
    number from 1 to 65535 if any, no whitespace or control character anywhere."""
    if any(c.isspace() or c < " " or c == "\x7f" for c in value):
        raise ValueError(
            "must be an http:// or https:// URL (it holds a space or a control character)"
        )
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:  # a port that is no number, or out of range; a broken IPv6 host
        raise ValueError(f"must be an http:// or https:// URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ValueError("must be an http:// or https:// URL with a host")
    return value


HttpUrl = Annotated[str, AfterValidator(http_url)]


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
