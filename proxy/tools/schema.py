"""Argument validation against a tool's JSON schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from proxy.tools.base import BadArguments


def check_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError for a schema that is not valid JSON Schema."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"not a valid JSON schema: {exc.message}") from None


def schema_validator(schema: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    validator = Draft202012Validator(schema)

    def validate(arguments: dict[str, Any]) -> dict[str, Any]:
        error = next(iter(validator.iter_errors(arguments)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            raise BadArguments(f"invalid arguments at {where}: {error.message}")
        return arguments

    return validate
