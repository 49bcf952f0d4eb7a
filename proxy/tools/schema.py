"""Argument validation against a tool's JSON schema.

The arguments are the model's and the schema is a config's or an MCP server's. Its patterns are
matched with `regex` (`schema_keywords`); a validation takes at most `work_limit_s`
(`schema_budget`: more for arguments of more values), however the schema's references multiply the
work; a `$ref` resolves only within the schema (jsonschema would fetch any other URL, on the
event loop, with no timeout). A schema with patterns or references, and arguments over
ON_LOOP_BYTES, are checked in a thread of the validations' own (`SchemaCheck.needs_thread`), so
that a reply of many calls does not hold the event loop for their sum. Arguments whose check
takes longer are refused, as arguments that do not match are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jsonschema import (
    Draft4Validator,
    Draft6Validator,
    Draft7Validator,
    Draft201909Validator,
    Draft202012Validator,
    validators,
)
from jsonschema.exceptions import SchemaError
from referencing import Registry
from referencing.exceptions import Unresolvable

from proxy.tools.base import BadArguments
from proxy.tools.schema_budget import (
    PATTERNS_S,
    PatternTooSlow,
    TooMuchWork,
    budgeted,
    charge,
    work_limit_s,
)
from proxy.tools.schema_keywords import KEYWORDS

Keyword = Callable[[Any, Any, Any, dict[str, Any]], Any]


def _charged(check: Keyword) -> Keyword:
    def charged(validator: Any, value: Any, instance: Any, schema: dict[str, Any]) -> Any:
        charge()
        return check(validator, value, instance, schema)

    return charged


def _bounded(draft: Any) -> Any:
    """`draft`'s validator with every keyword charged to the budget, and its pattern keywords
    matched with `regex`."""
    checks = {**draft.VALIDATORS, **{k: v for k, v in KEYWORDS.items() if k in draft.VALIDATORS}}
    return validators.extend(draft, {name: _charged(check) for name, check in checks.items()})  # type: ignore[no-untyped-call]


# Each draft a schema may name in `$schema` (TypeScript servers' zod schemas say draft-07, whose
# `items` may be a list), 2020-12 for one that names none or another.
_DRAFTS = (
    Draft202012Validator,
    Draft201909Validator,
    Draft7Validator,
    Draft6Validator,
    Draft4Validator,
)
_BOUNDED = {draft: _bounded(draft) for draft in _DRAFTS}


def _draft(schema: dict[str, Any]) -> Any:
    if not isinstance(schema.get("$schema", ""), str):  # no draft's name: 2020-12 refuses it
        return Draft202012Validator
    found = validators.validator_for(schema, default=Draft202012Validator)
    return found if found in _BOUNDED else Draft202012Validator


# No retrieval: a reference is to a part of the schema (or to a subschema's `$id` in it).
_NOWHERE: Registry[Any] = Registry()


def check_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError for a schema that is not valid JSON Schema. A schema met before is
    not checked again (1.7 ms a tool: a config's tools share schemas, an MCP server's list is
    read again each time it changes)."""
    try:  # (the standard library's JSON: `Infinity` is not `null`, as orjson writes it)
        key: str | None = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError):  # not JSON: checked, not kept
        key = None
    if key is None or len(key) > KEPT_SCHEMA_CHARS:  # what is kept stays small
        problem = _problem(schema)
    elif key in _checked:
        problem = _checked[key]
    else:
        problem = _checked[key] = _problem(schema)
        if len(_checked) > KEPT_SCHEMAS:
            _checked.clear()
    if problem is not None:
        raise ValueError(problem)


# The schemas checked, by their JSON with sorted keys: each one's problem, or None.
KEPT_SCHEMAS = 1024
KEPT_SCHEMA_CHARS = 16 * 1024
_checked: dict[str, str | None] = {}


def _problem(schema: dict[str, Any]) -> str | None:
    try:
        _draft(schema).check_schema(schema)
    except SchemaError as exc:
        return f"not a valid JSON schema: {exc.message}"
    except RecursionError:  # nested deeper than the checker goes (150 `not`s do)
        return "not a JSON schema that can be checked: nested too deeply"
    return None


class SchemaCheck:
    """Validates parsed arguments (or what else `what` names: an MCP tool's structured
    content) against a schema, returning them; raises BadArguments. `off_loop`: the schema
    has patterns or references, whose work may take long: call it in a thread of
    VALIDATION_THREADS (`in_thread`)."""

    __slots__ = ("_validator", "off_loop", "what")

    def __init__(self, schema: dict[str, Any], what: str = "arguments") -> None:
        self._validator = _BOUNDED[_draft(schema)](schema, registry=_NOWHERE)
        self.off_loop = _has_any(schema, _THREADED)
        self.what = what

    def __call__(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Within `work_limit_s` of the arguments (longer for more of them)."""
        limit_s = work_limit_s(arguments)
        try:
            with budgeted(limit_s):
                error = next(iter(self._validator.iter_errors(arguments)), None)
        except PatternTooSlow:
            raise BadArguments(
                f"invalid {self.what}: a pattern of the schema took more than {PATTERNS_S:g} s "
                "to match them"
            ) from None
        except TooMuchWork:
            raise BadArguments(
                f"invalid {self.what}: checking them against the schema took more than "
                f"{limit_s:.3g} s"
            ) from None
        except Unresolvable as exc:
            raise BadArguments(
                f"the tool's schema refers to {exc.ref!r}, which is not within it"
            ) from None
        except RecursionError:
            raise BadArguments("the tool's schema refers to itself without end") from None
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or self.what
            raise BadArguments(f"invalid {self.what} at {where}: {error.message}")
        return arguments

    async def in_thread(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Validates in a thread of the validations' own (asyncio's default one resolves the
        upstreams' names: neither waits behind the other)."""
        global _threads
        if _threads is None:
            _threads = ThreadPoolExecutor(VALIDATION_THREADS, "loopwarden-schema")
        return await asyncio.get_running_loop().run_in_executor(_threads, self, arguments)

    def needs_thread(self, size: int) -> bool:
        """Whether arguments of `size` bytes are checked in a thread: those of a schema with
        patterns or references, and long ones (their check is long too)."""
        return self.off_loop or size > ON_LOOP_BYTES


VALIDATION_THREADS = 4
ON_LOOP_BYTES = 16 * 1024  # arguments checked on the event loop are no longer (~20 ms)
_threads: ThreadPoolExecutor | None = None


def schema_validator(schema: dict[str, Any]) -> SchemaCheck:
    return SchemaCheck(schema)


# The keywords whose work may be long: patterns, and references (shared subschemas).
_THREADED = frozenset({"pattern", "patternProperties", "$ref", "$dynamicRef"})


def _has_any(schema: Any, keywords: frozenset[str]) -> bool:
    """Whether one of `keywords` is anywhere in `schema`."""
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if not keywords.isdisjoint(value):
                return True
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False
