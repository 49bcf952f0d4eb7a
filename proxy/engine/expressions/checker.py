"""The static check of a parsed condition against the run snapshot's schema.

Two rules bound evaluation, which cel-rust cannot interrupt: a comprehension ranges over the
run's data, never over a list built in the expression, so each level iterates at most as often
as the run has steps (or calls); and `map()` only picks values out of that data, so chained maps
cannot double a string or list at each stage.
"""

from __future__ import annotations

import cel

from proxy.engine.expressions.lexer import where
from proxy.engine.expressions.parser import (
    Call,
    Chain,
    Comprehension,
    Cond,
    Has,
    Ident,
    Index,
    List,
    Lit,
    Map,
    Node,
    Postfix,
    Select,
    Unary,
)
from proxy.engine.expressions.types import (
    BOOL,
    DYN,
    INT,
    NUMBERS,
    SCALARS,
    SCHEMA,
    STRING,
    Type,
    comparable,
    join,
    join_all,
    list_of,
    object_types,
)
from proxy.engine.expressions.vocabulary import (
    COMPREHENSIONS,
    CONVERSIONS,
    FUNCTIONS,
    MACROS,
    METHODS,
    VARIABLES,
)


def _from_run(node: Node) -> bool:
    """Whether `node` is a part of the run's data: a variable, then fields, indexes, filters
    and maps. Its size is bounded by the snapshot's, whatever the expression."""
    while not isinstance(node, Ident):
        if isinstance(node, Comprehension) and node.macro not in ("filter", "map"):
            return False
        if not isinstance(node, Select | Index | Comprehension):
            return False
        node = node.target
    return True


def _root(node: Node) -> str | None:
    """The variable a comprehension's range is picked from (`s` of `s.tool_calls`)."""
    while not isinstance(node, Ident):
        if not isinstance(node, Select | Index | Comprehension):
            return None
        node = node.target
    return node.name


def _distinct(node: Node) -> bool:
    """Whether a comprehension's range holds distinct parts of the run's data: no `map()` on
    the way to it but one that picks a part of each element (`steps.map(s, s.tool_calls)`),
    not one value for every element (`steps.map(s, steps)`)."""
    while not isinstance(node, Ident):
        if (
            isinstance(node, Comprehension)
            and node.macro == "map"
            and _root(node.args[-1]) != node.var
        ):
            return False
        if not isinstance(node, Select | Index | Comprehension):
            return False
        node = node.target
    return True


# Kinds whose comparison, membership test or concatenation walks every value inside.
_WHOLE = frozenset({"list", "map", "object", "dyn"})


class Checker:
    """Types every node against the snapshot's schema; raises ValueError at the first fault."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.scope: list[tuple[str, Type]] = []  # comprehension variables, innermost last
        self.bound: set[str] = set()
        self.free: set[str] = set()  # the snapshot's variables it uses
        # What it reads of the snapshot's objects, by type name: the fields it selects, and the
        # types it uses whole (any use but a selection, an index, a comprehension's range over
        # a list or `size()` of a list), whose every field, nested ones too, it may read.
        self.fields: dict[str, set[str]] = {}
        self.whole: set[str] = set()
        self.patterns: list[tuple[int, str]] = []  # matches() literals, checked by the library
        # Operations that walk a whole list, map or object (`==`, `!=`, `in`, a list's `+`):
        # each may touch every value it is given.
        self.walks = 0
        # Concatenations (of strings, bytes or lists): n of them may make a value n + 1 times
        # the largest given, and every operation on it costs that much more.
        self.concats = 0
        # Each nest of comprehensions, outermost first: whether a level ranges over a part of
        # the element of the level around it (`steps.exists(s, s.tool_calls.exists(...))`),
        # whose elements are distinct parts of the data, so that its iterations, all of the
        # outer's together, are at most the values given.
        self.nest: list[bool] = []
        self.nests: set[tuple[bool, ...]] = set()
        self.distinct: list[bool] = []  # whether each level's range is (`_distinct`)

    def fail(self, pos: int, problem: str) -> ValueError:
        return ValueError(f"{problem} (at {where(self.source, pos)})")

    def check(self, node: Node) -> Type:
        match node:
            case Lit():
                return node.type
            case Ident():
                return self.variable(node)
            case List():
                return list_of(join_all([self.used(self.check(item)) for item in node.items]))
            case Map():
                return self.map_literal(node)
            case Unary():
                return self.unary(node)
            case Chain():
                result = self.check(node.first)
                for op, pos, operand in node.rest:
                    result = self.binary(op, pos, result, self.check(operand))
                return result
            case Cond():
                return self.conditional(node)
            case Has():
                self.check(node.select)
                return BOOL
            case Call(target=None):
                return self.function(node, None)
        # A chain such as `a.b[0].c.size()` is walked in a loop, not by recursion: its length
        # is bounded only by the source's.
        links: list[Postfix] = []
        base: Node = node
        while isinstance(base, Postfix) and base.target is not None:
            links.append(base)
            base = base.target
        result = self.check(base)
        for link in reversed(links):
            result = self.postfix(link, result)
        return result

    def used(self, value: Type) -> Type:
        """`value` is used as a whole value (not through its fields): every object in it may be
        read whole."""
        if value.has_objects:
            self.whole.update(object_types(value))
        return value

    def postfix(self, node: Postfix, target: Type) -> Type:
        if isinstance(node, Select):
            return self.select(node.pos, target, node.field)
        if isinstance(node, Index):
            return self.index(node, target, self.used(self.check(node.index)))
        if isinstance(node, Call):
            return self.function(node, target)
        return self.comprehension(node, target)

    def variable(self, node: Ident) -> Type:
        for name, type_ in reversed(self.scope):
            if name == node.name:
                return type_
        if node.name in SCHEMA:
            self.free.add(node.name)
            return SCHEMA[node.name]
        raise self.fail(
            node.pos,
            f"unknown variable {node.name!r}; a condition can use {', '.join(VARIABLES)}"
            " and the variables its comprehensions bind",
        )

    def select(self, pos: int, target: Type, name: str) -> Type:
        if target.kind == "object":
            found = target.field(name)
            if found is None:
                fields = ", ".join(f for f, _ in target.fields)
                raise self.fail(pos, f"{target} has no field {name!r}; its fields are {fields}")
            self.fields.setdefault(target.name, set()).add(name)
            return found
        if target.kind == "map" and comparable(target.args[0], STRING):
            return target.args[1]
        if target.kind == "dyn":
            return DYN
        raise self.fail(pos, f"{target} has no fields")

    def index(self, node: Index, target: Type, index: Type) -> Type:
        if target.kind == "list":
            if index.kind not in ("int", "uint", "dyn"):
                raise self.fail(node.pos, f"a list index must be an int, not {index}")
            return target.args[0]
        if target.kind == "map":
            if not comparable(index, target.args[0]):
                raise self.fail(node.pos, f"the keys of {target} are not {index}")
            return target.args[1]
        if target.kind == "object" and index.kind in ("string", "dyn"):
            key = node.index
            if isinstance(key, Lit) and key.type == STRING:
                return self.select(node.pos, target, str(cel.evaluate(key.text)))
            self.used(target)  # any of its fields
            return DYN
        if target.kind == "dyn":
            return DYN
        raise self.fail(node.pos, f"{target} cannot be indexed by {index}")

    def function(self, node: Call, receiver: Type | None) -> Type:
        name, args = node.name, node.args
        if name in COMPREHENSIONS:
            shape = "a variable, an optional filter and a value" if name == "map" else ""
            raise self.fail(
                node.pos,
                f"{name}() is a macro that takes {shape or 'a variable and a predicate'}, as in "
                f"steps.{name}(s, {'s.index' if name == 'map' else 's.index > 0'})",
            )
        if name == "has":
            raise self.fail(node.pos, "has() takes one field selection, as in has(s.text)")
        if name not in FUNCTIONS:
            raise self.fail(
                node.pos,
                f"unknown function {name!r}; a condition can call "
                f"{', '.join(FUNCTIONS)} and the macros {', '.join(MACROS)}",
            )
        operands = [self.check(arg) for arg in args]
        if receiver is not None:
            operands.insert(0, receiver)
        if name in METHODS and receiver is None:
            raise self.fail(node.pos, f"{name}() is a method: write text.{name}(...)")
        if name in CONVERSIONS and receiver is not None:
            raise self.fail(node.pos, f"{name}() is a function: write {name}(value)")
        if len(operands) != (2 if name in METHODS else 1):
            count = "one argument" if name in METHODS else "one value"
            raise self.fail(node.pos, f"{name}() takes {count}")
        value = operands[0]
        if name == "size":
            if value.kind not in ("string", "bytes", "list", "map", "object", "dyn"):
                raise self.fail(node.pos, f"size() needs a string, bytes, list or map, not {value}")
            if value.kind != "list":  # a list's size needs none of its elements' fields
                self.used(value)
            return INT
        for operand in operands:
            self.used(operand)
        if name in CONVERSIONS:
            accepted = NUMBERS | {"string", "dyn"} | ({"bytes"} if name == "string" else set())
            if value.kind not in accepted:
                raise self.fail(node.pos, f"{name}() cannot convert {value}")
            return Type(name)
        for operand in operands:
            if operand.kind not in ("string", "dyn"):
                raise self.fail(node.pos, f"{name}() works on strings, not {operand}")
        if name == "matches":
            pattern = args[0]
            if not (isinstance(pattern, Lit) and pattern.type == STRING):
                raise self.fail(
                    node.pos, "the pattern of matches() must be a string literal, such as 'a.*b'"
                )
            self.patterns.append((pattern.pos, pattern.text))
        return BOOL

    def comprehension(self, node: Comprehension, range_: Type) -> Type:
        if not _from_run(node.target):
            raise self.fail(
                node.pos,
                f"{node.macro}() must range over the run's data (steps, usage, a step's "
                "tool_calls, ...), not over a list or map built in the expression",
            )
        if range_.kind in ("list", "map"):
            var = range_.args[0]
        elif range_.kind in ("object", "dyn"):
            if range_.kind == "object" and node.macro in ("map", "filter"):
                raise self.fail(
                    node.pos,
                    f"{node.macro}() over the field names of {range_} would list them in no "
                    "fixed order, so the condition could hold one time and not the next; "
                    "use all(), exists() or exists_one(), or name the fields",
                )
            var = STRING if range_.kind == "object" else DYN
            self.used(range_)  # its field names
        else:
            raise self.fail(node.pos, f"{node.macro}() cannot range over {range_}")
        self.bound.add(node.var)
        descends = bool(self.scope) and _root(node.target) == self.scope[-1][0]
        self.nest.append(descends and self.distinct[-1])
        self.nests.add(tuple(self.nest))
        self.distinct.append(_distinct(node.target))
        self.scope.append((node.var, var))
        try:
            types = [self.check(arg) for arg in node.args]
        finally:
            self.scope.pop()
            self.nest.pop()
            self.distinct.pop()
        predicates = types[:-1] if node.macro == "map" else types
        for predicate in predicates:
            if predicate.kind not in ("bool", "dyn"):
                raise self.fail(
                    node.pos, f"the predicate of {node.macro}() must be a boolean, not {predicate}"
                )
        if node.macro == "filter":
            return list_of(var)
        if node.macro != "map":
            return BOOL
        # A value built from an element (`s.text + s.text`, `[x, x]`) can be as large as the
        # element many times over, and a chain of such maps grows the data exponentially.
        value = types[-1]
        if value.kind not in SCALARS and not _from_run(node.args[-1]):
            raise self.fail(
                node.pos,
                "map() may only pick values out of the run's data (a field, an element, a "
                f"number or a boolean), not build a {value}",
            )
        return list_of(value)

    def unary(self, node: Unary) -> Type:
        result = self.used(self.check(node.operand))
        for op in reversed(node.ops):
            allowed = ("bool", "dyn") if op == "!" else ("int", "double", "dyn")
            if result.kind not in allowed:
                raise self.fail(node.pos, f"'{op}' cannot apply to {result}")
            result = BOOL if op == "!" else result
        return result

    def binary(self, op: str, pos: int, a: Type, b: Type) -> Type:
        self.used(a)
        self.used(b)
        kinds = {a.kind, b.kind}
        if (op in ("==", "!=", "+") and kinds & _WHOLE) or (op == "in" and b.kind in _WHOLE):
            self.walks += 1
        if op == "+" and kinds & {"string", "bytes", "list", "dyn"}:
            self.concats += 1
        if op in ("&&", "||"):
            if not kinds <= {"bool", "dyn"}:
                raise self.fail(pos, f"'{op}' needs booleans, not {a} and {b}")
            return BOOL
        if op in ("==", "!="):
            if not comparable(a, b):
                raise self.fail(pos, f"'{op}' compares {a} with {b}, which are never equal")
            return BOOL
        if op in ("<", "<=", ">", ">="):
            if "dyn" in kinds or kinds <= NUMBERS or kinds in ({"string"}, {"bytes"}, {"bool"}):
                return BOOL
            raise self.fail(pos, f"'{op}' cannot order {a} and {b}")
        if op == "in":
            return self.membership(pos, a, b)
        if "dyn" in kinds:
            known = b if a.kind == "dyn" else a
            if known.kind in NUMBERS | {"string", "bytes", "dyn"}:
                return known
            if known.kind == "list" and op == "+":
                return list_of(DYN)
            raise self.fail(pos, f"'{op}' cannot apply to {known}")
        if a.kind == b.kind:
            if a.kind in NUMBERS and (op != "%" or a.kind != "double"):
                return a
            if op == "+" and a.kind in ("string", "bytes"):
                return a
            if op == "+" and a.kind == "list":
                return list_of(join(a.args[0], b.args[0]) or DYN)
        if kinds <= NUMBERS:
            raise self.fail(
                pos,
                f"'{op}' cannot combine {a} and {b}: CEL does not convert between numbers, "
                "write double(x), int(x) or uint(x)",
            )
        raise self.fail(pos, f"'{op}' cannot combine {a} and {b}")

    def membership(self, pos: int, item: Type, container: Type) -> Type:
        if container.kind in ("list", "map"):
            if not comparable(item, container.args[0]):
                what = "elements" if container.kind == "list" else "keys"
                raise self.fail(pos, f"'in' looks for {item} among {container} {what}")
            return BOOL
        if container.kind in ("object", "dyn"):
            if container.kind == "object" and item.kind not in ("string", "dyn"):
                raise self.fail(pos, f"'in' looks for {item} among the field names of {container}")
            return BOOL
        raise self.fail(pos, f"'in' needs a list or map on its right, not {container}")

    def conditional(self, node: Cond) -> Type:
        result: Type | None = None
        for condition, value in [*node.branches, (None, node.otherwise)]:
            if condition is not None:
                test = self.used(self.check(condition))
                if test.kind not in ("bool", "dyn"):
                    raise self.fail(
                        condition.pos, f"the condition of '?:' must be a boolean, not {test}"
                    )
            branch = self.used(self.check(value))
            joined = branch if result is None else join(result, branch)
            if joined is None:
                raise self.fail(
                    value.pos, f"the branches of '?:' have different types: {result} and {branch}"
                )
            result = joined
        assert result is not None  # a `?:` chain has at least its `otherwise`
        return result

    def map_literal(self, node: Map) -> Type:
        keys = [self.used(self.check(key)) for key, _ in node.entries]
        for (key, _), key_type in zip(node.entries, keys, strict=True):
            if key_type.kind not in ("int", "uint", "bool", "string", "dyn"):
                raise self.fail(
                    key.pos, f"a map key must be an int, uint, bool or string, not {key_type}"
                )
        values = [self.used(self.check(value)) for _, value in node.entries]
        return Type("map", (join_all(keys), join_all(values)))
