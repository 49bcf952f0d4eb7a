"""The Chat Completions fields the proxy hands to the upstream as they came, checked for their
JSON type as OpenAI checks them: a wrong one is a 400 naming it (SPEC §4.4), not a value a
lenient upstream takes silently and a strict one refuses with its own words. `null` is left
for the upstream (OpenAI takes it for most). Fields of other providers pass unchecked."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from proxy.errors import InvalidRequest


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(value: Any) -> bool:
    return isinstance(value, str)


def _boolean(value: Any) -> bool:
    return isinstance(value, bool)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _stop(value: Any) -> bool:
    return isinstance(value, str) or _strings(value)


KINDS: Mapping[Callable[[Any], bool], tuple[str, tuple[str, ...]]] = {
    _number: ("a number", ("temperature", "top_p", "presence_penalty", "frequency_penalty")),
    _integer: ("an integer", ("seed", "top_logprobs")),
    _boolean: ("a boolean", ("logprobs", "parallel_tool_calls", "store")),
    _string: (
        "a string",
        ("user", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier"),
    ),
    _object: (
        "an object",
        ("response_format", "metadata", "logit_bias", "prediction", "audio", "web_search_options"),
    ),
    _strings: ("a list of strings", ("modalities",)),
    _stop: ("a string or a list of strings", ("stop",)),
}
CHECKS = {field: (check, what) for check, (what, fields) in KINDS.items() for field in fields}


def check_params(body: Mapping[str, Any]) -> None:
    """Raises InvalidRequest for the first field of `body` CHECKS knows whose value is not of
    its type."""
    for field in sorted(body.keys() & CHECKS.keys()):  # (one set operation for most bodies)
        check, what = CHECKS[field]
        value = body[field]
        if value is not None and not check(value):
            raise InvalidRequest(f"must be {what}", param=field)
