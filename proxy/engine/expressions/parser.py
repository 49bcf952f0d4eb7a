"""The syntax tree of a condition, and the recursive-descent parser that builds it."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.engine.expressions.lexer import Token, where
from proxy.engine.expressions.types import BOOL, BYTES, DOUBLE, INT, NULL, STRING, UINT, Type
from proxy.engine.expressions.vocabulary import COMPREHENSIONS


@dataclass(frozen=True, slots=True)
class Lit:
    pos: int
    type: Type
    text: str


@dataclass(frozen=True, slots=True)
class Ident:
    pos: int
    name: str


@dataclass(frozen=True, slots=True)
class Select:
    pos: int
    target: Node
    field: str


@dataclass(frozen=True, slots=True)
class Index:
    pos: int
    target: Node
    index: Node


@dataclass(frozen=True, slots=True)
class Call:
    pos: int
    target: Node | None  # the receiver of a method call
    name: str
    args: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Comprehension:
    pos: int
    target: Node  # the range
    macro: str
    var: str
    args: tuple[Node, ...]  # the predicate or mapped value (map: an optional filter first)


@dataclass(frozen=True, slots=True)
class Has:
    pos: int
    select: Select


@dataclass(frozen=True, slots=True)
class List:
    pos: int
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Map:
    pos: int
    entries: tuple[tuple[Node, Node], ...]


@dataclass(frozen=True, slots=True)
class Unary:
    pos: int
    ops: str  # '!' and '-', outermost first
    operand: Node


# Operator chains and `?:` chains are flat, so their length never deepens the recursion of the
# parser or the checker: only brackets do, and those are bounded (`lexer.scan`).
@dataclass(frozen=True, slots=True)
class Chain:
    pos: int
    first: Node
    rest: tuple[tuple[str, int, Node], ...]  # (operator, its position, right operand)


@dataclass(frozen=True, slots=True)
class Cond:
    pos: int
    branches: tuple[tuple[Node, Node], ...]  # (condition, value if true)
    otherwise: Node


Node = Lit | Ident | Select | Index | Call | Comprehension | Has | List | Map | Unary | Chain | Cond
Postfix = Select | Index | Call | Comprehension

_LEVELS = (
    frozenset({"||"}),
    frozenset({"&&"}),
    frozenset({"<", "<=", ">", ">=", "==", "!=", "in"}),
    frozenset({"+", "-"}),
    frozenset({"*", "/", "%"}),
)
_LEVEL_OF = {op: level for level, ops in enumerate(_LEVELS) for op in ops}  # lower binds less
_LITERALS = {"int": INT, "uint": UINT, "double": DOUBLE, "string": STRING, "bytes": BYTES}
_KEYWORDS = {"true": BOOL, "false": BOOL, "null": NULL}


class Parser:
    """Recursive descent over CEL's grammar, for sources the library has already accepted."""

    def __init__(self, source: str, tokens: list[Token]) -> None:
        self.source = source
        self.tokens = tokens
        self.i = 0

    def parse(self) -> Node:
        node = self.expr()
        self.expect("")
        return node

    def peek(self, text: str) -> bool:
        tok = self.tokens[self.i]
        return tok.kind in ("punct", "end") and tok.text == text

    def take(self) -> Token:
        self.i += 1
        return self.tokens[self.i - 1]

    def expect(self, text: str) -> Token:
        if not self.peek(text):
            raise self.unsupported(self.tokens[self.i])
        return self.take()

    def unsupported(self, tok: Token, what: str = "syntax") -> ValueError:
        return ValueError(f"unsupported {what} (at {where(self.source, tok.pos)})")

    def expr(self) -> Node:
        branches: list[tuple[Node, Node]] = []
        node = self.binary(0)
        while self.peek("?"):
            self.take()
            value = self.binary(0)
            self.expect(":")
            branches.append((node, value))
            node = self.binary(0)
        if not branches:
            return node
        return Cond(branches[0][0].pos, tuple(branches), node)

    def binary(self, least: int) -> Node:
        """Operands joined by operators of level `least` (`_LEVELS`) or tighter: a `Chain` per
        run of operators of one level, its operands the tighter ones (precedence climbing:
        an operand costs one call, not one per level)."""
        node = self.unary()
        while (level := self._level()) is not None and level >= least:
            rest: list[tuple[str, int, Node]] = []
            while self._level() == level:
                op = self.take()
                rest.append((op.text, op.pos, self.binary(level + 1)))
            node = Chain(node.pos, node, tuple(rest))
        return node

    def _level(self) -> int | None:
        """The level of the binary operator at the current token, if it is one."""
        tok = self.tokens[self.i]
        return _LEVEL_OF.get(tok.text) if tok.kind == "punct" else None

    def unary(self) -> Node:
        start = self.i
        while self.peek("!") or self.peek("-"):
            self.take()
        end = self.i
        operand = self.member()
        if end == start:
            return operand
        ops = "".join(tok.text for tok in self.tokens[start:end])
        return Unary(self.tokens[start].pos, ops, operand)

    def member(self) -> Node:
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
                    node = Select(name.pos, node, name.text)
            elif self.peek("["):
                self.take()
                node = Index(tok.pos, node, self.expr())
                self.expect("]")
            elif self.peek("{"):
                raise self.unsupported(tok, "message construction")
            else:
                return node

    def primary(self) -> Node:
        tok = self.take()
        if tok.kind in _LITERALS:
            return Lit(tok.pos, _LITERALS[tok.kind], tok.text)
        if tok.kind == "ident":
            if tok.text in _KEYWORDS:
                return Lit(tok.pos, _KEYWORDS[tok.text], tok.text)
            if self.peek("("):
                self.take()
                return self.call(tok, None, self.items(")"))
            return Ident(tok.pos, tok.text)
        if tok.text == "(":
            node = self.expr()
            self.expect(")")
            return node
        if tok.text == "[":
            return List(tok.pos, tuple(self.items("]")))
        if tok.text == "{":
            return Map(tok.pos, tuple(self.entries()))
        raise self.unsupported(tok)  # such as a leading-dot name, `.steps`

    def ident(self) -> Token:
        tok = self.take()
        if tok.kind != "ident":
            raise self.unsupported(tok)
        return tok

    def items(self, close: str) -> list[Node]:
        items: list[Node] = []
        while not self.peek(close):
            items.append(self.expr())
            if not self.peek(close):
                self.expect(",")
        self.take()
        return items

    def entries(self) -> list[tuple[Node, Node]]:
        entries: list[tuple[Node, Node]] = []
        while not self.peek("}"):
            key = self.expr()
            self.expect(":")
            entries.append((key, self.expr()))
            if not self.peek("}"):
                self.expect(",")
        self.take()
        return entries

    def call(self, name: Token, target: Node | None, args: list[Node]) -> Node:
        """A call, or the macro the library expands it into (it goes by name and arity too)."""
        var = args[0] if args else None
        arity = (2, 3) if name.text == "map" else (2,)
        if (
            target is not None
            and name.text in COMPREHENSIONS
            and len(args) in arity
            and isinstance(var, Ident)
        ):
            return Comprehension(name.pos, target, name.text, var.name, tuple(args[1:]))
        if target is None and name.text == "has" and len(args) == 1:
            if not isinstance(args[0], Select):
                raise self.unsupported(name, "has() argument")
            return Has(name.pos, args[0])
        return Call(name.pos, target, name.text, tuple(args))
