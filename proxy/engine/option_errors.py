"""A validation's errors as a client or an operator reads them (SPEC §4.4): each at the JSON
path of the field it is about, in words of its own, what it echoes of the input bounded."""

from __future__ import annotations

from pydantic import ValidationError

from proxy.engine.options import CONDITION_KINDS, CONDITION_TAG, MAX_NAME_CHARS, RULE_TAG

_FRIENDLY = {
    "extra_forbidden": "unknown field",
    "missing": "is required",
    "int_type": "must be an integer",
    "bool_type": "must be a boolean",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "too_short": "must not be empty",
    "string_too_short": "must be a non-empty string",
}


def json_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """`("stop_when", 0, "condition:max_cost", "max_cost")` -> `stop_when[0].max_cost`.

    Union tags and pydantic's validator markers are not part of the document, so they are
    left out."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith((CONDITION_TAG, RULE_TAG, "function-", "model-")):
            continue
        else:
            out += f".{shortened(part)}" if out else shortened(part)
    return out


# A key of the document named in an error: told in full up to this many characters (a name's).
MAX_KEY_SHOWN = MAX_NAME_CHARS


def shortened(key: str) -> str:
    """A key as an error names it: a long one (a client's, of any length) cut, marked so."""
    return key if len(key) <= MAX_KEY_SHOWN else f"{key[:MAX_KEY_SHOWN]}…"


def problems(exc: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """Every error of a validation, as (JSON path, message), in document order."""
    found: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        kind = err["type"]
        last = loc[-1] if loc else None
        if kind == "extra_forbidden" and isinstance(last, str):
            tags = [p for p in loc if isinstance(p, str) and p.startswith(CONDITION_TAG)]
            if tags and tags[-1] == CONDITION_TAG + "unknown":
                message = (
                    f"unknown stop condition {shortened(last)!r}; expected one of "
                    f"{', '.join(CONDITION_KINDS)}"
                )
            elif tags and last in CONDITION_KINDS:
                message = "a stop condition has exactly one kind"
            else:
                message = _FRIENDLY[kind]
        elif kind == "rule_type":
            if isinstance(err.get("input"), dict):
                loc = (*loc, "type")
            else:
                message = "a rule must be an object"
        elif kind in _FRIENDLY:
            message = _FRIENDLY[kind]
        elif kind == "literal_error":
            message = message.replace("Input should be", "must be")
        elif kind == "too_long":  # (pydantic's: "List should have at most 256 items after ...")
            message = f"must have at most {err.get('ctx', {}).get('max_length')} entries"
        elif kind == "string_pattern_mismatch":
            message = f"must match {err.get('ctx', {}).get('pattern')} (is {err.get('input')!r})"
        else:
            message = message.replace("Input should be", "must be")
            message = message.replace("String should have", "must have")
        found.append((json_path(loc, prefix) or prefix.rstrip(".") or "(root)", message))
    return found
