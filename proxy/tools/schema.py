"""Argument validation against a tool's JSON schema.

The arguments are the model's and the schema is a config's or an MCP server's: its patterns
(`pattern`, `patternProperties`, also where `unevaluatedProperties` reads them) are matched
with `regex`, within PATTERNS_S of matching for one validation, letting go of the interpreter
while they match (Python's `re` backtracks without bound and holds it: `^([a-zA-Z]+ ?)+$`
took 3 s over 25 characters). A schema with patterns is checked in a thread of the
validations' own (`SchemaCheck.off_loop`), so that a reply of many calls does not hold the
event loop for their sum. Arguments whose patterns take longer to match are refused, as
arguments that do not match are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

import regex
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, ValidationError

from proxy.tools.base import BadArguments

PATTERNS_S = 0.05  # the longest the patterns of one validation may take together

# What is left of the patterns' bound for the validation under way in this context: seconds of
# the matching thread's own time (waits for the interpreter between matches are not theirs).
_left: ContextVar[list[float]] = ContextVar("patterns_left")


class _TooSlow(Exception):
    """The schema's patterns took longer than PATTERNS_S over the arguments."""


def _search(pattern: str, text: str) -> bool:
    left = _left.get()
    if left[0] <= 0:
        raise _TooSlow
    started = time.thread_time()
    try:  # letting go of the interpreter while it matches
        found = regex.search(pattern, text, timeout=PATTERNS_S, concurrent=True)
    except TimeoutError:
        raise _TooSlow from None
    finally:
        left[0] -= time.thread_time() - started
    return found is not None


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    extras = sorted(
        key
        for key in instance
        if key not in properties and not any(_search(p, key) for p in patterns)
    )
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        listed = ", ".join(repr(extra) for extra in extras)
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            regexes = ", ".join(repr(p) for p in sorted(patterns))
            yield ValidationError(f"{listed} {verb} not match any of the regexes: {regexes}")
        else:
            yield ValidationError(f"Additional properties are not allowed ({listed} unexpected)")


def _unevaluated_properties(
    validator: Any, unevaluated: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    evaluated = _evaluated_keys(validator, instance, schema)
    extras = [
        key
        for key, value in instance.items()
        if key not in evaluated and not _valid(validator.descend(value, unevaluated, path=key))
    ]
    if not extras:
        return
    listed = ", ".join(repr(extra) for extra in sorted(extras))
    if unevaluated is False:
        yield ValidationError(f"Unevaluated properties are not allowed ({listed} unexpected)")
    else:
        yield ValidationError(
            f"Unevaluated properties are not valid under the given schema ({listed})"
        )


def _evaluated_keys(validator: Any, instance: dict[str, Any], schema: Any) -> set[str]:
    """The keys of `instance` that `schema` evaluates, as `unevaluatedProperties` reads them:
    those its `properties`, `patternProperties` (matched as every pattern here is),
    `additionalProperties` and `unevaluatedProperties` take, and those of the subschemas
    that apply in place (`$ref`, `$dynamicRef`, `allOf`, and `anyOf`, `oneOf`,
    `dependentSchemas`, `if`/`then`/`else` where they hold)."""
    if not isinstance(schema, dict):
        return set()
    keys: set[str] = set()
    for keyword in ("$ref", "$dynamicRef"):
        if (reference := schema.get(keyword)) is not None:
            resolved = validator._resolver.lookup(reference)
            at = validator.evolve(schema=resolved.contents, _resolver=resolved.resolver)
            keys |= _evaluated_keys(at, instance, resolved.contents)
    properties = schema.get("properties")
    if isinstance(properties, dict):
        keys.update(key for key in instance if key in properties)
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict):
        keys.update(key for key in instance if any(_search(p, key) for p in patterns))
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        if (taking := schema.get(keyword)) is not None:
            keys.update(k for k, v in instance.items() if _valid(validator.descend(v, taking)))
    for key, subschema in (schema.get("dependentSchemas") or {}).items():
        if key in instance:
            keys |= _evaluated_keys(validator, instance, subschema)
    for keyword in ("allOf", "anyOf", "oneOf"):
        for subschema in schema.get(keyword) or ():
            if _valid(validator.descend(instance, subschema)):
                keys |= _evaluated_keys(validator, instance, subschema)
    if "if" in schema:
        if _valid(validator.descend(instance, schema["if"])):
            keys |= _evaluated_keys(validator, instance, schema["if"])
            keys |= _evaluated_keys(validator, instance, schema.get("then"))
        else:
            keys |= _evaluated_keys(validator, instance, schema.get("else"))
    return keys


def _valid(errors: Iterator[ValidationError]) -> bool:
    return next(errors, None) is None


_Validator = validators.extend(  # type: ignore[no-untyped-call]
    Draft202012Validator,
    {
        "pattern": _pattern,
        "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties,
        # jsonschema's own matches `patternProperties` with `re` to find the evaluated keys.
        "unevaluatedProperties": _unevaluated_properties,
    },
)


def check_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError for a schema that is not valid JSON Schema."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"not a valid JSON schema: {exc.message}") from None


class SchemaCheck:
    """Validates parsed arguments against a schema, returning them; raises BadArguments.
    `off_loop`: the schema has patterns, whose matching may take up to PATTERNS_S: call it in
    a thread of VALIDATION_THREADS (`in_thread`)."""

    __slots__ = ("_validator", "off_loop")

    def __init__(self, schema: dict[str, Any]) -> None:
        self._validator = _Validator(schema)
        self.off_loop = _has_patterns(schema)

    def __call__(self, arguments: dict[str, Any]) -> dict[str, Any]:
        started = _left.set([PATTERNS_S])
        try:
            error = next(iter(self._validator.iter_errors(arguments)), None)
        except _TooSlow:
            raise BadArguments(
                f"invalid arguments: the schema's patterns took more than {PATTERNS_S:g} s to "
                "match them"
            ) from None
        finally:
            _left.reset(started)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            raise BadArguments(f"invalid arguments at {where}: {error.message}")
        return arguments

    async def in_thread(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Validates in a thread of the validations' own (asyncio's default one resolves the
        upstreams' names: neither waits behind the other)."""
        global _threads
        if _threads is None:
            _threads = ThreadPoolExecutor(VALIDATION_THREADS, "loopwarden-schema")
        return await asyncio.get_running_loop().run_in_executor(_threads, self, arguments)


VALIDATION_THREADS = 4
_threads: ThreadPoolExecutor | None = None


def schema_validator(schema: dict[str, Any]) -> SchemaCheck:
    return SchemaCheck(schema)


def _has_patterns(schema: Any) -> bool:
    """Whether a `pattern` or `patternProperties` keyword is anywhere in `schema`."""
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if "pattern" in value or "patternProperties" in value:
                return True
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False
