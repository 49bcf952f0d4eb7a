"""Checks of single JSON fields, shared by every parser of client- and config-given policy.

Each returns the value or raises `SpecError` naming the field's path.
"""

from __future__ import annotations

import math
from typing import Any

from proxy.errors import SpecError


def int_at_least(value: Any, param: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer ≥ {minimum}"
        raise SpecError(f"must be {wanted}", param=param)
    return value


def positive_number(value: Any, param: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise SpecError("must be a positive number", param=param)
    return float(value)


def boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError("must be a boolean", param=param)
    return value


def text(value: Any, param: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise SpecError("must be a non-empty string", param=param)
    return value


def known_object(
    value: Any, param: str, fields: tuple[str, ...], not_object: str = "must be an object"
) -> dict[str, Any]:
    """An object whose keys are all among `fields`."""
    if not isinstance(value, dict):
        raise SpecError(not_object, param=param)
    for key in value:
        if key not in fields:
            raise SpecError(
                f"unknown field; expected one of {', '.join(fields)}", param=f"{param}.{key}"
            )
    return value
