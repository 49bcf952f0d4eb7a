"""CEL's types as the checker sees them, and the run snapshot's schema in those types."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Type:
    """A CEL type; `object` is one of the snapshot's maps, with fixed field names."""

    kind: str
    args: tuple[Type, ...] = ()  # a list's element, a map's key and value
    name: str = ""
    fields: tuple[tuple[str, Type], ...] = ()
    # Whether an object is in it, however deep: known as it is made, not walked for again.
    has_objects: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        inside = self.kind == "object" or any(arg.has_objects for arg in self.args)
        object.__setattr__(self, "has_objects", inside)

    def __str__(self) -> str:
        if self.kind == "object":
            return self.name
        if self.args:
            return f"{self.kind}({', '.join(str(a) for a in self.args)})"
        return self.kind

    def field(self, name: str) -> Type | None:
        return dict(self.fields).get(name)


BOOL, INT, UINT, DOUBLE = Type("bool"), Type("int"), Type("uint"), Type("double")
STRING, BYTES, NULL, DYN = Type("string"), Type("bytes"), Type("null"), Type("dyn")
NUMBERS = frozenset({"int", "uint", "double"})
SCALARS = NUMBERS | {"bool", "null"}


def list_of(elem: Type) -> Type:
    return Type("list", (elem,))


def _object(name: str, /, **fields: Type) -> Type:
    return Type("object", name=name, fields=tuple(fields.items()))


_USAGE = _object("usage", prompt_tokens=INT, completion_tokens=INT, total_tokens=INT)
_STEP = _object(
    "step",
    index=INT,
    tool_calls=list_of(_object("tool call", name=STRING, arguments=STRING)),
    tool_results=list_of(_object("tool result", name=STRING, output=STRING, is_error=BOOL)),
    usage=_USAGE,
    cost_usd=DOUBLE,
    finish_reason=STRING,
    text=STRING,
)
SCHEMA = {"steps": list_of(_STEP), "usage": _USAGE, "cost_usd": DOUBLE, "elapsed_s": DOUBLE}


def object_types(*types: Type) -> dict[str, Type]:
    """Every object type in `types`, by name: objects, the objects in their fields, and those in
    lists and maps, however deep."""
    found: dict[str, Type] = {}
    pending = list(types)
    while pending:
        type_ = pending.pop()
        if type_.kind == "object" and type_.name not in found:
            found[type_.name] = type_
            pending.extend(field for _, field in type_.fields)
        pending.extend(type_.args)
    return found


def join(a: Type, b: Type) -> Type | None:
    """The type of a value that is either an `a` or a `b`, or None if they cannot mix."""
    if a == b:
        return a
    if "dyn" in (a.kind, b.kind) or "null" in (a.kind, b.kind):
        return DYN
    if a.kind == b.kind and a.kind in ("list", "map"):
        return Type(a.kind, tuple(join(x, y) or DYN for x, y in zip(a.args, b.args, strict=True)))
    return None


def join_all(types: list[Type]) -> Type:
    """The element type of a list or map literal: `dyn` when its elements differ."""
    result = types[0] if types else DYN
    for other in types[1:]:
        result = join(result, other) or DYN
    return result


def comparable(a: Type, b: Type) -> bool:
    """Whether `a == b` can ever hold (cel-rust compares numbers across int, uint and double)."""
    if {"dyn", "null"} & {a.kind, b.kind} or {a.kind, b.kind} <= NUMBERS:
        return True
    if {a.kind, b.kind} == {"object", "map"}:
        key = a.args[0] if a.kind == "map" else b.args[0]
        return comparable(key, STRING)
    if a.kind != b.kind:
        return False
    if a.kind == "object":
        return a == b
    return all(comparable(x, y) for x, y in zip(a.args, b.args, strict=True))
