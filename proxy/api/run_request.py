"""What every endpoint's parser produces: one run to plan, whatever the wire format."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, StrictBool, ValidationError

from proxy.api.body_fields import UNSAFE_NAME
from proxy.api.headers import THREAD_HEADER
from proxy.engine.option_errors import problems
from proxy.engine.options import (
    MAX_ENTRIES,
    MAX_NAME_CHARS,
    Name,
    PolicyOptions,
    SafeName,
)
from proxy.errors import InvalidRequest, PolicyInvalid

# The most server tools a request's `loop.tools` may name (an MCP source may expose 4,096).
MAX_LOOP_TOOLS = 4096


class LoopOptions(PolicyOptions):
    """A request's `loop` object (SPEC §4.1): policy options plus what only a request sets."""

    agent: Name | None = None
    tools: Annotated[list[Name], Field(max_length=MAX_LOOP_TOOLS)] = []
    thread_id: SafeName | None = None
    include_messages: StrictBool = False
    include_loop_events: StrictBool = False


NO_LOOP = LoopOptions()


# The most JSON values a request's `loop` holds: far more than a loop needs (though less than
# every list of it at its own bound), and a bound on what a validation that fails reports
# (every bad value is an error pydantic builds: 49,000 of them held the event loop 200 ms).
MAX_LOOP_VALUES = 16_384


def parse_loop(value: Any, path: str = "loop") -> LoopOptions:
    """Raises InvalidRequest naming the first bad field (`loop.stop_when[0].max_cost`)."""
    if not isinstance(value, dict):
        raise InvalidRequest("must be an object", param=path)
    _check_size(value, path)
    try:
        return LoopOptions.model_validate(value)
    except ValidationError as exc:
        raise PolicyInvalid(problems(exc, path)) from None


def _check_size(loop: dict[str, Any], path: str) -> None:
    """Refuses a `loop` past MAX_LOOP_VALUES values, an object in it past MAX_ENTRIES
    members or a list past MAX_LOOP_TOOLS items (the longest a loop has), before it is
    validated."""
    # (value, the path of its container, its key there): a path is written for containers
    # only, and only when they are looked at.
    pending: list[tuple[Any, str, str | int | None]] = [(loop, path, None)]
    seen = 0
    while pending:
        value, parent, key = pending.pop()
        seen += 1
        if seen > MAX_LOOP_VALUES:
            raise InvalidRequest(f"holds more than {MAX_LOOP_VALUES} values", param=path)
        if not isinstance(value, dict | list):
            continue
        where = _member_path(parent, key)
        if isinstance(value, dict):
            if len(value) > MAX_ENTRIES:
                raise InvalidRequest(f"has more than {MAX_ENTRIES} members", param=where)
            pending.extend((member, where, name) for name, member in value.items())
        else:
            if len(value) > MAX_LOOP_TOOLS:
                raise InvalidRequest(f"has more than {MAX_LOOP_TOOLS} items", param=where)
            pending.extend((item, where, i) for i, item in enumerate(value))


def _member_path(parent: str, key: str | int | None) -> str:
    if key is None:
        return parent
    return f"{parent}[{key}]" if isinstance(key, int) else f"{parent}.{key}"


@dataclass(slots=True)
class RunRequest:
    """An endpoint-neutral run: the conversation, the client's tools and fields, and `loop`."""

    model: str
    messages: list[dict[str, Any]]
    loop: LoopOptions = NO_LOOP
    has_loop: bool = False
    client_tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    params: dict[str, Any] = field(default_factory=dict)  # passed to the upstream as they are
    thread_id: str | None = None  # from `loop.thread_id`, or the endpoint's own source
    # `thread_id` is a name the client chose (`loop.thread_id`, a header), so with proxy keys
    # it names a thread of the caller's key; a stored context's thread is the context's own.
    client_thread: bool = False
    # Where the client named each of `client_tools`, for errors: Chat Completions'
    # `tools[i].function.name` when empty.
    tool_params: list[str] = field(default_factory=list)
    # Where the client named the tool `tool_choice` forces: Chat Completions' path when None.
    choice_param: str | None = None


def thread_of(loop: LoopOptions, header: str | None) -> str | None:
    """The thread a request names, by `loop.thread_id` or the header; both, naming two threads,
    are a 400 (one was silently dropped)."""
    named = header_thread(header)
    if named is not None and loop.thread_id is not None and named != loop.thread_id:
        raise InvalidRequest(
            f"names another thread than the {THREAD_HEADER} header: give one of them",
            param="loop.thread_id",
        )
    return loop.thread_id or named


def header_thread(value: str | None) -> str | None:
    """The thread the `x-loopwarden-thread-id` header names, checked as `loop.thread_id` is."""
    if not value:  # none, or empty: none
        return None
    with contextlib.suppress(UnicodeError):  # its bytes were read as latin-1: UTF-8 as meant
        value = value.encode("latin-1").decode()
    if len(value) > MAX_NAME_CHARS or UNSAFE_NAME.search(value):
        raise InvalidRequest(
            f"{THREAD_HEADER} must be at most {MAX_NAME_CHARS} characters, none of them a "
            "control or text direction character",
            param=THREAD_HEADER,
        )
    return value
