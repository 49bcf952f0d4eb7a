"""The fields of a request body, each checked as it is read: a wrong one is a 400 naming it
(`param`). One rule a kind of field, for every route."""

from __future__ import annotations

import re
from typing import Any

from proxy.engine.options import MAX_COUNT, MAX_NAME_CHARS, UNSAFE_IN_NAMES
from proxy.errors import InvalidRequest

# The characters no `SafeName` holds, found in a name checked by hand (a model's, a context
# id's, a header's).
UNSAFE_NAME = re.compile(f"[{UNSAFE_IN_NAMES}]")


def name(value: Any, param: str) -> str:
    """A model, thread or context name: a non-empty string of at most MAX_NAME_CHARS."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} is required and must be a string", param=param)
    if len(value) > MAX_NAME_CHARS:
        raise InvalidRequest(f"{param} is longer than {MAX_NAME_CHARS} characters", param=param)
    if UNSAFE_NAME.search(value):
        raise InvalidRequest(
            f"{param} must not contain control or text direction characters", param=param
        )
    return value


def boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest("must be a boolean", param=param)
    return value


def string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest("must be a string", param=param)
    return value


def text(value: Any, param: str) -> str:
    """A string with something in it."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest("must be a non-empty string", param=param)
    return value


def number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest("must be a number", param=param)
    return value


def object_field(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest("must be an object", param=param)
    return value


def positive_int(value: Any, param: str) -> int | None:
    """An optional count: None when absent, else an integer of at least 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise InvalidRequest(f"must be a positive integer of at most {MAX_COUNT}", param=param)
    return value


def optional(body: dict[str, Any], key: str, kind: type, what: str) -> Any:
    """`body[key]` when it is there, of `kind` (`what` says which, as in "a string"); else
    None."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidRequest(f"{key} must be {what}", param=key)
    return value
