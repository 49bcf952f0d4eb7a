"""CEL stop conditions (SPEC §6 `expr`): checked when compiled, evaluated after each step.

`compile_condition` accepts only a boolean expression over the run's snapshot (`steps`,
`usage`, `cost_usd`, `elapsed_s`) that calls CEL's standard functions and macros, and refuses
anything else with a `ValueError` that says what is wrong and where (`line:column`).
`Expression.evaluate` returns the boolean, or raises `ExpressionFailed`; it never turns a
failure into False.

The `cel` package (bindings of cel-rust) parses and evaluates, but it has no type checker and
exposes no syntax tree: `Program.references()` lists the names an expression uses, with
comprehension variables mixed in with free ones, and macros already expanded into operators.
So this module tokenizes and parses the source itself and checks it against the snapshot's
schema. The library stays the authority on syntax (a source it refuses is refused with its
message), and its reference lists are checked again after ours.

Work is bounded before any parser sees the source: its length, its bracket nesting and its
comprehension nesting. Two further rules bound evaluation, which cel-rust cannot interrupt:
a comprehension ranges over the run's data, never over a list built in the expression, so each
level iterates at most as often as the run has steps (or calls); and `map()` only picks values
out of that data, so chained maps cannot double a string or list at each stage.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cel

MAX_EXPR_CHARS = 2_000
MAX_EXPR_DEPTH = 32
MAX_COMPREHENSION_DEPTH = 3

VARIABLES = ("steps", "usage", "cost_usd", "elapsed_s")
FUNCTIONS = (
    "size",
    "contains",
    "startsWith",
    "endsWith",
    "matches",
    "int",
    "uint",
    "double",
    "string",
)
MACROS = ("has", "all", "exists", "exists_one", "map", "filter")

_COMPREHENSIONS = frozenset(MACROS) - {"has"}
_METHODS = frozenset({"contains", "startsWith", "endsWith", "matches"})
_CONVERSIONS = frozenset({"int", "uint", "double", "string"})
# Operator and macro-expansion names that `Program.functions()` reports besides named functions.
_LIBRARY_INTERNALS = frozenset(
    {"_&&_", "_||_", "!_", "-_", "_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_", "_+_", "_-_"}
    | {"_*_", "_/_", "_%_", "_[_]", "_?_:_", "@in", "@not_strictly_false"}
)


class ExpressionFailed(Exception):
    """An expression that could not be evaluated, or did not yield a boolean; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Expression:
    """A checked stop condition. Build it with `compile_condition`."""

    source: str
    program: cel.Program = field(repr=False, compare=False)

    def evaluate(self, snapshot: Mapping[str, Any]) -> bool:
        """The condition's value over `snapshot` (the shape of `RunState.snapshot()`).

        Raises `ExpressionFailed` when evaluation fails (an index out of range, a division by
        zero, a missing variable, an overflow) or yields something other than a boolean.
        """
        try:
            result = self.program.execute(_with_doubles(snapshot))
        except Exception as exc:  # the library raises a different class for each failure
            raise ExpressionFailed(_short_reason(exc)) from exc
        if not isinstance(result, bool):
            raise ExpressionFailed(f"yielded {type(result).__name__}, not a boolean")
        return result


def compile_condition(source: str) -> Expression:
    """Check and compile one `expr` stop condition.

    Raises `ValueError`, naming the problem and its `line:column`, for: a source longer than
    `MAX_EXPR_CHARS`, brackets nested deeper than `MAX_EXPR_DEPTH`, comprehensions nested deeper
    than `MAX_COMPREHENSION_DEPTH` (all three before any parser runs); invalid syntax; a variable
    other than `VARIABLES` or a comprehension's own; a function or macro outside `FUNCTIONS` and
    `MACROS`; an operation the operand types do not support; a `matches()` pattern that is not a
    valid regular expression literal; a comprehension over anything but the run's data, or a
    `map()` that builds values; and a result that cannot be a boolean.
    """
    if len(source) > MAX_EXPR_CHARS:
        raise ValueError(
            f"the expression is {len(source)} characters long; the limit is {MAX_EXPR_CHARS}"
        )
    tokens = _tokenize(source)
    _check_nesting(source, tokens)
    try:
        program = cel.compile(source)
    except ValueError as exc:
        raise ValueError(f"invalid CEL syntax: {_library_error(exc)}") from None
    checker = _Checker(source)
    result = checker.check(_Parser(source, tokens).parse())
    if result.kind not in ("bool", "dyn"):
        raise ValueError(f"a stop condition must yield a boolean, but this one yields {result}")
    _cross_check(program, checker.bound)
    for pos, literal in checker.patterns:
        _check_pattern(source, pos, literal)
    return Expression(source, program)


# --- Types --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Type:
    """A CEL type; `object` is one of the snapshot's maps, with fixed field names."""

    kind: str
    args: tuple[_Type, ...] = ()  # a list's element, a map's key and value
    name: str = ""
    fields: tuple[tuple[str, _Type], ...] = ()

    def __str__(self) -> str:
        if self.kind == "object":
            return self.name
        if self.args:
            return f"{self.kind}({', '.join(str(a) for a in self.args)})"
        return self.kind

    def field(self, name: str) -> _Type | None:
        return dict(self.fields).get(name)


_BOOL, _INT, _UINT, _DOUBLE = _Type("bool"), _Type("int"), _Type("uint"), _Type("double")
_STRING, _BYTES, _NULL, _DYN = _Type("string"), _Type("bytes"), _Type("null"), _Type("dyn")
_NUMBERS = frozenset({"int", "uint", "double"})
_SCALARS = _NUMBERS | {"bool", "null"}


def _list(elem: _Type) -> _Type:
    return _Type("list", (elem,))


def _object(name: str, /, **fields: _Type) -> _Type:
    return _Type("object", name=name, fields=tuple(fields.items()))


_USAGE = _object("usage", prompt_tokens=_INT, completion_tokens=_INT, total_tokens=_INT)
_STEP = _object(
    "step",
    index=_INT,
    tool_calls=_list(_object("tool call", name=_STRING, arguments=_STRING)),
    tool_results=_list(_object("tool result", name=_STRING, output=_STRING, is_error=_BOOL)),
    usage=_USAGE,
    cost_usd=_DOUBLE,
    finish_reason=_STRING,
    text=_STRING,
)
_SCHEMA = {"steps": _list(_STEP), "usage": _USAGE, "cost_usd": _DOUBLE, "elapsed_s": _DOUBLE}


def _join(a: _Type, b: _Type) -> _Type | None:
    """The type of a value that is either an `a` or a `b`, or None if they cannot mix."""
    if a == b:
        return a
    if "dyn" in (a.kind, b.kind) or "null" in (a.kind, b.kind):
        return _DYN
    if a.kind == b.kind and a.kind in ("list", "map"):
        return _Type(
            a.kind, tuple(_join(x, y) or _DYN for x, y in zip(a.args, b.args, strict=True))
        )
    return None


def _comparable(a: _Type, b: _Type) -> bool:
    """Whether `a == b` can ever hold (cel-rust compares numbers across int, uint and double)."""
    if {"dyn", "null"} & {a.kind, b.kind} or {a.kind, b.kind} <= _NUMBERS:
        return True
    if {a.kind, b.kind} == {"object", "map"}:
        key = a.args[0] if a.kind == "map" else b.args[0]
        return _comparable(key, _STRING)
    if a.kind != b.kind:
        return False
    if a.kind == "object":
        return a == b
    return all(_comparable(x, y) for x, y in zip(a.args, b.args, strict=True))


# --- Tokens and bounds --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # ident, punct, int, uint, double, string, bytes, end
    text: str
    pos: int


_IDENT = re.compile(r"[_a-zA-Z][_a-zA-Z0-9]*")
_NUMBER = re.compile(
    r"(?P<uint>(?:0x[0-9a-fA-F]+|[0-9]+)[uU])"
    r"|(?P<double>[0-9]*\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)"
    r"|(?P<int>0x[0-9a-fA-F]+|[0-9]+)"
)
_PUNCT = ("==", "!=", "<=", ">=", "&&", "||", *"<>!+-*/%?:.,()[]{}")
_SIMPLE_ESCAPES = frozenset("abfnrtv\"'\\?`")
_HEX = frozenset("0123456789abcdefABCDEF")
_OCTAL = frozenset("01234567")
# The letter after a backslash: which digits follow, how many, and where they start (the
# first of an octal escape's three digits is the letter itself).
_ESCAPE_DIGITS = {
    **{letter: (_HEX, n, 2) for letter, n in (("x", 2), ("X", 2), ("u", 4), ("U", 8))},
    **{digit: (_OCTAL, 3, 1) for digit in "0123"},
}
_OPENERS, _CLOSERS = "([{", ")]}"
_LIBRARY_ERROR = re.compile(
    r"ERROR: <input>:(?P<where>\d+:\d+): (?:Syntax error: )?(?P<problem>.*)"
)
_LIBRARY_INNER = re.compile(r'msg: "([^"]*)"')  # as in `OtherError(ParseError { ..., msg: "..." })`


def _where(source: str, pos: int) -> str:
    """`line:column` of `pos`, both from 1, as the library reports them."""
    line_start = source.rfind("\n", 0, pos) + 1
    return f"{source.count(chr(10), 0, pos) + 1}:{pos - line_start + 1}"


def _tokenize(source: str) -> list[_Token]:
    """CEL's lexical grammar. A string literal is one token, so nothing inside it is code."""
    tokens: list[_Token] = []
    i, n = 0, len(source)
    while i < n:
        ch = source[i]
        if ch in " \t\r\n\f":
            i += 1
        elif source.startswith("//", i):
            end = source.find("\n", i)
            i = n if end < 0 else end
        elif (quote := _string_start(source, i)) is not None:
            prefix = source[i:quote].lower()
            end = _string_end(source, quote, raw="r" in prefix)
            tokens.append(_Token("bytes" if "b" in prefix else "string", source[i:end], i))
            i = end
        elif (number := _NUMBER.match(source, i)) is not None:
            assert number.lastgroup is not None  # every alternative is a named group
            tokens.append(_Token(number.lastgroup, number.group(), i))
            i = number.end()
        elif (ident := _IDENT.match(source, i)) is not None:
            kind = "punct" if ident.group() == "in" else "ident"
            tokens.append(_Token(kind, ident.group(), i))
            i = ident.end()
        else:
            punct = next((p for p in _PUNCT if source.startswith(p, i)), None)
            if punct is None:
                raise ValueError(f"invalid CEL syntax: unexpected {ch!r} (at {_where(source, i)})")
            tokens.append(_Token("punct", punct, i))
            i += len(punct)
    tokens.append(_Token("end", "", n))
    return tokens


def _string_start(source: str, i: int) -> int | None:
    """The index of the opening quote of a literal starting at `i` ([bB]?[rR]?quote), or None."""
    j = i + 1 if source[i] in "bB" else i
    j = j + 1 if source[j : j + 1] in ("r", "R") else j
    return j if source[j : j + 1] in ("'", '"') else None


def _string_end(source: str, quote: int, *, raw: bool) -> int:
    """The index just past the literal whose opening quote is at `quote`."""
    delimiter = source[quote] * 3 if source.startswith(source[quote] * 3, quote) else source[quote]
    i = quote + len(delimiter)
    while i < len(source):
        if source.startswith(delimiter, i):
            return i + len(delimiter)
        ch = source[i]
        if ch in "\r\n" and len(delimiter) == 1:
            break
        i = i + 1 if raw or ch != "\\" else _escape_end(source, i)
    raise ValueError(f"invalid CEL syntax: unterminated string (at {_where(source, quote)})")


def _escape_end(source: str, i: int) -> int:
    """The index just past the escape sequence at `i`; a malformed one is a syntax error."""
    letter = source[i + 1 : i + 2]
    if letter and letter in _SIMPLE_ESCAPES:
        return i + 2
    digits, count, offset = _ESCAPE_DIGITS.get(letter, (frozenset(), 0, 0))
    start = i + offset
    body = source[start : start + count]
    if count == 0 or len(body) != count or any(c not in digits for c in body):
        raise ValueError(f"invalid CEL syntax: invalid escape sequence (at {_where(source, i)})")
    return start + count


def _check_nesting(source: str, tokens: list[_Token]) -> None:
    """Bracket and comprehension nesting, from the tokens alone: nothing has parsed them yet.

    A call of a comprehension name (`.exists(`) counts as a comprehension whatever its
    arguments: over-counting can only refuse an expression that would be refused anyway.
    """
    open_brackets: list[bool] = []  # one per open bracket: whether it opened a comprehension
    comprehensions = 0
    for k, tok in enumerate(tokens):
        if tok.kind != "punct":
            continue
        if tok.text in _OPENERS:
            is_macro = (
                tok.text == "("
                and k >= 2
                and tokens[k - 1].kind == "ident"
                and tokens[k - 1].text in _COMPREHENSIONS
                and tokens[k - 2].text == "."
            )
            open_brackets.append(is_macro)
            comprehensions += is_macro
            if len(open_brackets) > MAX_EXPR_DEPTH:
                raise ValueError(
                    f"brackets nest deeper than {MAX_EXPR_DEPTH} levels "
                    f"(at {_where(source, tok.pos)})"
                )
            if comprehensions > MAX_COMPREHENSION_DEPTH:
                raise ValueError(
                    f"comprehensions (all, exists, exists_one, map, filter) nest deeper than "
                    f"{MAX_COMPREHENSION_DEPTH} levels (at {_where(source, tok.pos)})"
                )
        elif tok.text in _CLOSERS and open_brackets:
            comprehensions -= open_brackets.pop()


# --- Syntax tree --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Lit:
    pos: int
    type: _Type
    text: str


@dataclass(frozen=True, slots=True)
class _Ident:
    pos: int
    name: str


@dataclass(frozen=True, slots=True)
class _Select:
    pos: int
    target: _Node
    field: str


@dataclass(frozen=True, slots=True)
class _Index:
    pos: int
    target: _Node
    index: _Node


@dataclass(frozen=True, slots=True)
class _Call:
    pos: int
    target: _Node | None  # the receiver of a method call
    name: str
    args: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Comprehension:
    pos: int
    target: _Node  # the range
    macro: str
    var: str
    args: tuple[_Node, ...]  # the predicate or mapped value (map: an optional filter first)


@dataclass(frozen=True, slots=True)
class _Has:
    pos: int
    select: _Select


@dataclass(frozen=True, slots=True)
class _List:
    pos: int
    items: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Map:
    pos: int
    entries: tuple[tuple[_Node, _Node], ...]


@dataclass(frozen=True, slots=True)
class _Unary:
    pos: int
    ops: str  # '!' and '-', outermost first
    operand: _Node


# Operator chains and `?:` chains are flat, so their length never deepens the recursion of the
# parser or the checker: only brackets do, and those are bounded.
@dataclass(frozen=True, slots=True)
class _Chain:
    pos: int
    first: _Node
    rest: tuple[tuple[str, int, _Node], ...]  # (operator, its position, right operand)


@dataclass(frozen=True, slots=True)
class _Cond:
    pos: int
    branches: tuple[tuple[_Node, _Node], ...]  # (condition, value if true)
    otherwise: _Node


_Node = (
    _Lit | _Ident | _Select | _Index | _Call | _Comprehension | _Has | _List | _Map | _Unary
) | (_Chain | _Cond)
_Postfix = _Select | _Index | _Call | _Comprehension

_LEVELS = (
    frozenset({"||"}),
    frozenset({"&&"}),
    frozenset({"<", "<=", ">", ">=", "==", "!=", "in"}),
    frozenset({"+", "-"}),
    frozenset({"*", "/", "%"}),
)
_LITERALS = {"int": _INT, "uint": _UINT, "double": _DOUBLE, "string": _STRING, "bytes": _BYTES}
_KEYWORDS = {"true": _BOOL, "false": _BOOL, "null": _NULL}


class _Parser:
    """Recursive descent over CEL's grammar, for sources the library has already accepted."""

    def __init__(self, source: str, tokens: list[_Token]) -> None:
        self.source = source
        self.tokens = tokens
        self.i = 0

    def parse(self) -> _Node:
        node = self.expr()
        self.expect("")
        return node

    def peek(self, text: str) -> bool:
        tok = self.tokens[self.i]
        return tok.kind in ("punct", "end") and tok.text == text

    def take(self) -> _Token:
        self.i += 1
        return self.tokens[self.i - 1]

    def expect(self, text: str) -> _Token:
        if not self.peek(text):
            raise self.unsupported(self.tokens[self.i])
        return self.take()

    def unsupported(self, tok: _Token, what: str = "syntax") -> ValueError:
        return ValueError(f"unsupported {what} (at {_where(self.source, tok.pos)})")

    def expr(self) -> _Node:
        branches: list[tuple[_Node, _Node]] = []
        node = self.binary(0)
        while self.peek("?"):
            self.take()
            value = self.binary(0)
            self.expect(":")
            branches.append((node, value))
            node = self.binary(0)
        if not branches:
            return node
        return _Cond(branches[0][0].pos, tuple(branches), node)

    def binary(self, level: int) -> _Node:
        if level == len(_LEVELS):
            return self.unary()
        first = self.binary(level + 1)
        rest: list[tuple[str, int, _Node]] = []
        while self.tokens[self.i].kind == "punct" and self.tokens[self.i].text in _LEVELS[level]:
            op = self.take()
            rest.append((op.text, op.pos, self.binary(level + 1)))
        return _Chain(first.pos, first, tuple(rest)) if rest else first

    def unary(self) -> _Node:
        start = self.i
        while self.peek("!") or self.peek("-"):
            self.take()
        end = self.i
        operand = self.member()
        if end == start:
            return operand
        ops = "".join(tok.text for tok in self.tokens[start:end])
        return _Unary(self.tokens[start].pos, ops, operand)

    def member(self) -> _Node:
        node = self.primary()
        while True:
            tok = self.tokens[self.i]
            if self.peek("."):
                self.take()
                name = self.ident()
                if self.peek("("):
                    self.take()
                    node = self.call(name, node, self.items(")"))
                else:
                    node = _Select(name.pos, node, name.text)
            elif self.peek("["):
                self.take()
                node = _Index(tok.pos, node, self.expr())
                self.expect("]")
            elif self.peek("{"):
                raise self.unsupported(tok, "message construction")
            else:
                return node

    def primary(self) -> _Node:
        tok = self.take()
        if tok.kind in _LITERALS:
            return _Lit(tok.pos, _LITERALS[tok.kind], tok.text)
        if tok.kind == "ident":
            if tok.text in _KEYWORDS:
                return _Lit(tok.pos, _KEYWORDS[tok.text], tok.text)
            if self.peek("("):
                self.take()
                return self.call(tok, None, self.items(")"))
            return _Ident(tok.pos, tok.text)
        if tok.text == "(":
            node = self.expr()
            self.expect(")")
            return node
        if tok.text == "[":
            return _List(tok.pos, tuple(self.items("]")))
        if tok.text == "{":
            return _Map(tok.pos, tuple(self.entries()))
        raise self.unsupported(tok)  # such as a leading-dot name, `.steps`

    def ident(self) -> _Token:
        tok = self.take()
        if tok.kind != "ident":
            raise self.unsupported(tok)
        return tok

    def items(self, close: str) -> list[_Node]:
        items: list[_Node] = []
        while not self.peek(close):
            items.append(self.expr())
            if not self.peek(close):
                self.expect(",")
        self.take()
        return items

    def entries(self) -> list[tuple[_Node, _Node]]:
        entries: list[tuple[_Node, _Node]] = []
        while not self.peek("}"):
            key = self.expr()
            self.expect(":")
            entries.append((key, self.expr()))
            if not self.peek("}"):
                self.expect(",")
        self.take()
        return entries

    def call(self, name: _Token, target: _Node | None, args: list[_Node]) -> _Node:
        """A call, or the macro the library expands it into (it goes by name and arity too)."""
        var = args[0] if args else None
        arity = (2, 3) if name.text == "map" else (2,)
        if (
            target is not None
            and name.text in _COMPREHENSIONS
            and len(args) in arity
            and isinstance(var, _Ident)
        ):
            return _Comprehension(name.pos, target, name.text, var.name, tuple(args[1:]))
        if target is None and name.text == "has" and len(args) == 1:
            if not isinstance(args[0], _Select):
                raise self.unsupported(name, "has() argument")
            return _Has(name.pos, args[0])
        return _Call(name.pos, target, name.text, tuple(args))


# --- Checks -------------------------------------------------------------------------------


def _from_run(node: _Node) -> bool:
    """Whether `node` is a part of the run's data: a variable, then fields, indexes, filters
    and maps. Its size is bounded by the snapshot's, whatever the expression."""
    while not isinstance(node, _Ident):
        if isinstance(node, _Comprehension) and node.macro not in ("filter", "map"):
            return False
        if not isinstance(node, _Select | _Index | _Comprehension):
            return False
        node = node.target
    return True


class _Checker:
    """Types every node against the snapshot's schema; raises ValueError at the first fault."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.scope: list[tuple[str, _Type]] = []  # comprehension variables, innermost last
        self.bound: set[str] = set()
        self.patterns: list[tuple[int, str]] = []  # matches() literals, checked by the library

    def fail(self, pos: int, problem: str) -> ValueError:
        return ValueError(f"{problem} (at {_where(self.source, pos)})")

    def check(self, node: _Node) -> _Type:
        match node:
            case _Lit():
                return node.type
            case _Ident():
                return self.variable(node)
            case _List():
                return _list(_join_all([self.check(item) for item in node.items]))
            case _Map():
                return self.map_literal(node)
            case _Unary():
                return self.unary(node)
            case _Chain():
                result = self.check(node.first)
                for op, pos, operand in node.rest:
                    result = self.binary(op, pos, result, self.check(operand))
                return result
            case _Cond():
                return self.conditional(node)
            case _Has():
                self.select(node.select.pos, self.check(node.select.target), node.select.field)
                return _BOOL
            case _Call(target=None):
                return self.function(node, None)
        # A chain such as `a.b[0].c.size()` is walked in a loop, not by recursion: its length
        # is bounded only by the source's.
        links: list[_Postfix] = []
        base: _Node = node
        while isinstance(base, _Postfix) and base.target is not None:
            links.append(base)
            base = base.target
        result = self.check(base)
        for link in reversed(links):
            result = self.postfix(link, result)
        return result

    def postfix(self, node: _Postfix, target: _Type) -> _Type:
        if isinstance(node, _Select):
            return self.select(node.pos, target, node.field)
        if isinstance(node, _Index):
            return self.index(node, target, self.check(node.index))
        if isinstance(node, _Call):
            return self.function(node, target)
        return self.comprehension(node, target)

    def variable(self, node: _Ident) -> _Type:
        for name, type_ in reversed(self.scope):
            if name == node.name:
                return type_
        if node.name in _SCHEMA:
            return _SCHEMA[node.name]
        raise self.fail(
            node.pos,
            f"unknown variable {node.name!r}; a condition can use {', '.join(VARIABLES)}"
            " and the variables its comprehensions bind",
        )

    def select(self, pos: int, target: _Type, name: str) -> _Type:
        if target.kind == "object":
            found = target.field(name)
            if found is None:
                fields = ", ".join(f for f, _ in target.fields)
                raise self.fail(pos, f"{target} has no field {name!r}; its fields are {fields}")
            return found
        if target.kind == "map" and _comparable(target.args[0], _STRING):
            return target.args[1]
        if target.kind == "dyn":
            return _DYN
        raise self.fail(pos, f"{target} has no fields")

    def index(self, node: _Index, target: _Type, index: _Type) -> _Type:
        if target.kind == "list":
            if index.kind not in ("int", "uint", "dyn"):
                raise self.fail(node.pos, f"a list index must be an int, not {index}")
            return target.args[0]
        if target.kind == "map":
            if not _comparable(index, target.args[0]):
                raise self.fail(node.pos, f"the keys of {target} are not {index}")
            return target.args[1]
        if target.kind == "object" and index.kind in ("string", "dyn"):
            key = node.index
            if isinstance(key, _Lit) and key.type == _STRING:
                return self.select(node.pos, target, str(cel.evaluate(key.text)))
            return _DYN
        if target.kind == "dyn":
            return _DYN
        raise self.fail(node.pos, f"{target} cannot be indexed by {index}")

    def function(self, node: _Call, receiver: _Type | None) -> _Type:
        name, args = node.name, node.args
        if name in _COMPREHENSIONS:
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
        if name in _METHODS and receiver is None:
            raise self.fail(node.pos, f"{name}() is a method: write text.{name}(...)")
        if name in _CONVERSIONS and receiver is not None:
            raise self.fail(node.pos, f"{name}() is a function: write {name}(value)")
        if len(operands) != (2 if name in _METHODS else 1):
            count = "one argument" if name in _METHODS else "one value"
            raise self.fail(node.pos, f"{name}() takes {count}")
        value = operands[0]
        if name == "size":
            if value.kind not in ("string", "bytes", "list", "map", "object", "dyn"):
                raise self.fail(node.pos, f"size() needs a string, bytes, list or map, not {value}")
            return _INT
        if name in _CONVERSIONS:
            accepted = _NUMBERS | {"string", "dyn"} | ({"bytes"} if name == "string" else set())
            if value.kind not in accepted:
                raise self.fail(node.pos, f"{name}() cannot convert {value}")
            return _Type(name)
        for operand in operands:
            if operand.kind not in ("string", "dyn"):
                raise self.fail(node.pos, f"{name}() works on strings, not {operand}")
        if name == "matches":
            pattern = args[0]
            if not (isinstance(pattern, _Lit) and pattern.type == _STRING):
                raise self.fail(
                    node.pos, "the pattern of matches() must be a string literal, such as 'a.*b'"
                )
            self.patterns.append((pattern.pos, pattern.text))
        return _BOOL

    def comprehension(self, node: _Comprehension, range_: _Type) -> _Type:
        if not _from_run(node.target):
            raise self.fail(
                node.pos,
                f"{node.macro}() must range over the run's data (steps, usage, a step's "
                "tool_calls, ...), not over a list or map built in the expression",
            )
        if range_.kind in ("list", "map"):
            var = range_.args[0]
        elif range_.kind in ("object", "dyn"):
            var = _STRING if range_.kind == "object" else _DYN
        else:
            raise self.fail(node.pos, f"{node.macro}() cannot range over {range_}")
        self.bound.add(node.var)
        self.scope.append((node.var, var))
        try:
            types = [self.check(arg) for arg in node.args]
        finally:
            self.scope.pop()
        predicates = types[:-1] if node.macro == "map" else types
        for predicate in predicates:
            if predicate.kind not in ("bool", "dyn"):
                raise self.fail(
                    node.pos, f"the predicate of {node.macro}() must be a boolean, not {predicate}"
                )
        if node.macro == "filter":
            return _list(var)
        if node.macro != "map":
            return _BOOL
        # A value built from an element (`s.text + s.text`, `[x, x]`) can be as large as the
        # element many times over, and a chain of such maps grows the data exponentially.
        value = types[-1]
        if value.kind not in _SCALARS and not _from_run(node.args[-1]):
            raise self.fail(
                node.pos,
                "map() may only pick values out of the run's data (a field, an element, a "
                f"number or a boolean), not build a {value}",
            )
        return _list(value)

    def unary(self, node: _Unary) -> _Type:
        result = self.check(node.operand)
        for op in reversed(node.ops):
            allowed = ("bool", "dyn") if op == "!" else ("int", "double", "dyn")
            if result.kind not in allowed:
                raise self.fail(node.pos, f"'{op}' cannot apply to {result}")
            result = _BOOL if op == "!" else result
        return result

    def binary(self, op: str, pos: int, a: _Type, b: _Type) -> _Type:
        kinds = {a.kind, b.kind}
        if op in ("&&", "||"):
            if not kinds <= {"bool", "dyn"}:
                raise self.fail(pos, f"'{op}' needs booleans, not {a} and {b}")
            return _BOOL
        if op in ("==", "!="):
            if not _comparable(a, b):
                raise self.fail(pos, f"'{op}' compares {a} with {b}, which are never equal")
            return _BOOL
        if op in ("<", "<=", ">", ">="):
            if "dyn" in kinds or kinds <= _NUMBERS or kinds in ({"string"}, {"bytes"}, {"bool"}):
                return _BOOL
            raise self.fail(pos, f"'{op}' cannot order {a} and {b}")
        if op == "in":
            return self.membership(pos, a, b)
        if "dyn" in kinds:
            known = b if a.kind == "dyn" else a
            if known.kind in _NUMBERS | {"string", "bytes", "dyn"}:
                return known
            if known.kind == "list" and op == "+":
                return _list(_DYN)
            raise self.fail(pos, f"'{op}' cannot apply to {known}")
        if a.kind == b.kind:
            if a.kind in _NUMBERS and (op != "%" or a.kind != "double"):
                return a
            if op == "+" and a.kind in ("string", "bytes"):
                return a
            if op == "+" and a.kind == "list":
                return _list(_join(a.args[0], b.args[0]) or _DYN)
        if kinds <= _NUMBERS:
            raise self.fail(
                pos,
                f"'{op}' cannot combine {a} and {b}: CEL does not convert between numbers, "
                "write double(x), int(x) or uint(x)",
            )
        raise self.fail(pos, f"'{op}' cannot combine {a} and {b}")

    def membership(self, pos: int, item: _Type, container: _Type) -> _Type:
        if container.kind in ("list", "map"):
            if not _comparable(item, container.args[0]):
                what = "elements" if container.kind == "list" else "keys"
                raise self.fail(pos, f"'in' looks for {item} among {container} {what}")
            return _BOOL
        if container.kind in ("object", "dyn"):
            if container.kind == "object" and item.kind not in ("string", "dyn"):
                raise self.fail(pos, f"'in' looks for {item} among the field names of {container}")
            return _BOOL
        raise self.fail(pos, f"'in' needs a list or map on its right, not {container}")

    def conditional(self, node: _Cond) -> _Type:
        result: _Type | None = None
        for condition, value in [*node.branches, (None, node.otherwise)]:
            if condition is not None:
                test = self.check(condition)
                if test.kind not in ("bool", "dyn"):
                    raise self.fail(
                        condition.pos, f"the condition of '?:' must be a boolean, not {test}"
                    )
            branch = self.check(value)
            joined = branch if result is None else _join(result, branch)
            if joined is None:
                raise self.fail(
                    value.pos, f"the branches of '?:' have different types: {result} and {branch}"
                )
            result = joined
        assert result is not None  # a `?:` chain has at least its `otherwise`
        return result

    def map_literal(self, node: _Map) -> _Type:
        keys = [self.check(key) for key, _ in node.entries]
        for (key, _), key_type in zip(node.entries, keys, strict=True):
            if key_type.kind not in ("int", "uint", "bool", "string", "dyn"):
                raise self.fail(
                    key.pos, f"a map key must be an int, uint, bool or string, not {key_type}"
                )
        values = [self.check(value) for _, value in node.entries]
        return _Type("map", (_join_all(keys), _join_all(values)))


def _join_all(types: list[_Type]) -> _Type:
    """The element type of a list or map literal: `dyn` when its elements differ."""
    result = types[0] if types else _DYN
    for other in types[1:]:
        result = _join(result, other) or _DYN
    return result


def _cross_check(program: cel.Program, bound: set[str]) -> None:
    """The library's own references, against the same allow-lists.

    They are not enough on their own (comprehension variables are listed with free ones, and
    macros are expanded into operators), but they come from the parse that will run: a name
    our parser missed is still caught here.
    """
    references = program.references()
    for name in references["functions"]:
        if name not in FUNCTIONS and name not in _LIBRARY_INTERNALS:
            raise ValueError(f"unknown function {name!r}")
    for name in references["variables"]:
        if name not in VARIABLES and name not in bound:
            raise ValueError(f"unknown variable {name!r}")


def _check_pattern(source: str, pos: int, literal: str) -> None:
    """A matches() pattern, compiled once by the library's own regex engine (Rust's `regex`,
    whose syntax is not Python's)."""
    try:
        cel.compile(f"''.matches({literal})").execute({})
    except Exception as exc:  # the library reports a bad pattern as a RuntimeError
        raise ValueError(
            f"invalid regular expression {literal} (at {_where(source, pos)}): {_short_reason(exc)}"
        ) from None


def _library_error(exc: ValueError) -> str:
    """`problem (at line:column)` from the library's first parse error, without its echo of
    the whole source (up to MAX_EXPR_CHARS, twice) or of its internal error structure."""
    found = _LIBRARY_ERROR.search(str(exc))
    if found is None:
        return str(exc).split("\n", 1)[0]
    problem = found["problem"]
    if (inner := _LIBRARY_INNER.search(problem)) is not None:
        problem = inner[1]
    return f"{problem} (at {found['where']})"


def _short_reason(exc: Exception) -> str:
    """The first sentence of the library's message, without its advice on conversions."""
    if isinstance(exc, KeyError):
        return f"no such key: {exc.args[0]!r}" if exc.args else "no such key"
    text = str(exc).split("\n", 1)[0].split(". ", 1)[0].strip().rstrip(".:")
    return text[:200] or type(exc).__name__


def _with_doubles(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """`snapshot` with its double fields as floats: CEL never converts an int for arithmetic,
    so `cost_usd + 0.5` would fail on a cost that arrived as the JSON number 0."""
    values = dict(snapshot)
    for key in ("cost_usd", "elapsed_s"):
        if type(values.get(key)) is int:
            values[key] = float(values[key])
    steps = values.get("steps")
    if isinstance(steps, list) and any(
        isinstance(s, Mapping) and type(s.get("cost_usd")) is int for s in steps
    ):
        values["steps"] = [
            {**s, "cost_usd": float(s["cost_usd"])}
            if isinstance(s, Mapping) and type(s.get("cost_usd")) is int
            else s
            for s in steps
        ]
    return values
