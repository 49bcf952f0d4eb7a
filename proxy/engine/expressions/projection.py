"""The part of a run's snapshot a condition reads.

The expression library converts every value it is given, at 1-5 µs a value, before it evaluates
anything, and a condition is evaluated after each step over all the steps so far. A condition
that reads `steps[i].tool_calls[j].name` is given steps that hold their tool calls' names and
nothing else. An object the condition uses whole keeps every field, down to the objects inside
it: any use but a field's selection, an element's index, a range of a comprehension over a
list and `size()` of a list (an operand of any operator, a `?:` branch, an item of a literal,
a range iterated by field name, an index by a computed name, `size()` of the object itself).
What the checker found: `Checker.fields`, `Checker.whole`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from proxy.engine.expressions.types import SCHEMA, Type, object_types


class Projection:
    """Takes from a snapshot the fields of each object type that `fields` names (by type name),
    all of them for the types in `whole`."""

    __slots__ = ("_keep", "drops")

    def __init__(self, fields: Mapping[str, Iterable[str]], whole: Iterable[str]) -> None:
        # Per object type not used whole: the fields kept, with their types (all of them, for a
        # type whose every field is read: the objects inside it may still lose some).
        self._keep: dict[str, tuple[tuple[str, Type], ...]] = {}
        self.drops = False  # whether any field is left out: else the snapshot goes as it is
        kept_whole = set(whole)
        for type_ in _OBJECT_TYPES:
            if type_.name in kept_whole:
                continue
            read = set(fields.get(type_.name, ()))
            self._keep[type_.name] = tuple((n, t) for n, t in type_.fields if n in read)
            self.drops |= len(self._keep[type_.name]) < len(type_.fields)

    def of(self, snapshot: Mapping[str, Any]) -> dict[str, Any]:
        """`snapshot` (a variable's name to its value) with only the fields read."""
        return {name: self._value(value, SCHEMA[name]) for name, value in snapshot.items()}

    def _value(self, value: Any, type_: Type) -> Any:
        if type_.kind == "object":
            keep = self._keep.get(type_.name)
            if keep is None or not isinstance(value, Mapping):
                return value
            return {name: self._value(value[name], t) for name, t in keep if name in value}
        if type_.kind == "list" and isinstance(value, list) and type_.args[0].has_objects:
            return [self._value(item, type_.args[0]) for item in value]
        return value


_OBJECT_TYPES = tuple(object_types(*SCHEMA.values()).values())  # of the snapshot's schema
