"""What one validation of a tool's arguments may take (`SchemaCheck`): PATTERNS_S a pattern's
match, and `work_limit_s` of its thread's time in all: WORK_S, and WORK_S_PER_VALUE for each
JSON value of the arguments (their checks grow with them: 10,000 rows, 30,000 values, took
0.4-0.8 s; not with their bytes, which a long string adds at no cost to check). A
schema whose `$ref`s share subschemas makes the work grow as 2 ** its depth (18 levels of
`anyOf` over two references to the level below: 20 s for arguments of a few bytes that do not
match), which no size bound on the schema or the arguments catches: the work itself is timed,
looked at after every match and every LOOK_EVERY keywords.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

PATTERNS_S = 0.05  # the longest one match of a pattern may take
WORK_S = 0.25  # the longest one validation of small arguments may take, its matches included
WORK_S_PER_VALUE = 30e-6  # and more for each value of the arguments (~2 times what it takes)
LOOK_EVERY = 256  # keywords evaluated between two looks at the clock


def work_limit_s(arguments: object) -> float:
    """The longest the validation of `arguments` may take."""
    return WORK_S + values_of(arguments) * WORK_S_PER_VALUE


def values_of(value: object) -> int:
    """The JSON values `value` holds, itself included."""
    count, pending = 0, [value]
    while pending:
        item = pending.pop()
        count += 1
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


class PatternTooSlow(Exception):
    """A match of one of the schema's patterns took longer than PATTERNS_S."""


class TooMuchWork(Exception):
    """The validation took longer than its `work_limit_s`."""


@dataclass(slots=True)
class Budget:
    limit_s: float
    # In the validating thread's own time: waits for the interpreter are not the validation's.
    started: float = field(default_factory=time.thread_time)
    until_look: int = LOOK_EVERY


_budget: ContextVar[Budget] = ContextVar("schema_budget")


@contextmanager
def budgeted(limit_s: float) -> Iterator[None]:
    """A validation's budget, for the keywords evaluated inside."""
    token = _budget.set(Budget(limit_s))
    try:
        yield
    finally:
        _budget.reset(token)


def charge() -> None:
    """One keyword evaluated; raises TooMuchWork once the validation took its limit."""
    budget = _budget.get()
    budget.until_look -= 1
    if budget.until_look <= 0:
        budget.until_look = LOOK_EVERY
        look(budget)


def matched() -> None:
    """A pattern matched (which may take up to PATTERNS_S); raises TooMuchWork as `charge`."""
    look(_budget.get())


def look(budget: Budget) -> None:
    if time.thread_time() - budget.started > budget.limit_s:
        raise TooMuchWork
