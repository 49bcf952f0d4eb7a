"""The keywords of a tool's JSON schema that match patterns, as the validator reads them:
`pattern`, `patternProperties`, `additionalProperties` (which reads `patternProperties`) and
`unevaluatedProperties` (which finds the keys `patternProperties` take), matched with `regex`
each match within PATTERNS_S (`schema_budget`), in place of jsonschema's, which match with
Python's `re`: it backtracks without bound and holds the interpreter (`^([a-zA-Z]+ ?)+$` took
3 s over 25 characters).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import regex
from jsonschema.exceptions import ValidationError

from proxy.tools.schema_budget import PATTERNS_S, PatternTooSlow, charge, matched

MATCH_TRIES = 4  # of one match whose time ran out while its thread waited for a core


def _search(pattern: str, text: str) -> bool:
    """Whether `pattern` matches in `text`, in PATTERNS_S of this thread's own time. The
    engine's timeout is of the wall clock, which a busy machine moves on while the thread
    waits for a core: a match timed out with less than half its bound spent is tried again
    (a match that takes long takes most of its wall time when it runs)."""
    spent = 0.0
    for _ in range(MATCH_TRIES):
        started = time.thread_time()
        try:  # letting go of the interpreter while it matches
            found = regex.search(pattern, text, timeout=PATTERNS_S, concurrent=True)
        except TimeoutError:
            spent += time.thread_time() - started
            if spent < PATTERNS_S / 2:
                continue
            break
        matched()
        return found is not None
    raise PatternTooSlow


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
    charge()
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


KEYWORDS = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "unevaluatedProperties": _unevaluated_properties,
}
