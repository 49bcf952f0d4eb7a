"""What one validation of a tool's arguments may take (`SchemaCheck`): PATTERNS_S a pattern's
match, WORK_S of its thread's time in all. A schema whose `$ref`s share subschemas makes the
work grow as 2 ** its depth (18 levels of `anyOf` over two references to the level below: 20 s
for arguments that do not match), which no size bound on the schema or the arguments catches:
the work itself is timed, looked at after every match and every LOOK_EVERY keywords.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

PATTERNS_S = 0.05  # the longest one match of a pattern may take
WORK_S = 0.25  # the longest one validation may take, its matches included
LOOK_EVERY = 256  # keywords evaluated between two looks at the clock


class PatternTooSlow(Exception):
    """A match of one of the schema's patterns took longer than PATTERNS_S."""


class TooMuchWork(Exception):
    """The validation took longer than WORK_S."""


@dataclass(slots=True)
class Budget:
    # In the validating thread's own time: waits for the interpreter are not the validation's.
    started: float = field(default_factory=time.thread_time)
    until_look: int = LOOK_EVERY


_budget: ContextVar[Budget] = ContextVar("schema_budget")


@contextmanager
def budgeted() -> Iterator[None]:
    """A validation's budget, for the keywords evaluated inside."""
    token = _budget.set(Budget())
    try:
        yield
    finally:
        _budget.reset(token)


def charge() -> None:
    """One keyword evaluated; raises TooMuchWork once the validation took WORK_S."""
    budget = _budget.get()
    budget.until_look -= 1
    if budget.until_look <= 0:
        budget.until_look = LOOK_EVERY
        look(budget)


def matched() -> None:
    """A pattern matched (which may take up to PATTERNS_S); raises TooMuchWork as `charge`."""
    look(_budget.get())


def look(budget: Budget) -> None:
    if time.thread_time() - budget.started > WORK_S:
        raise TooMuchWork
