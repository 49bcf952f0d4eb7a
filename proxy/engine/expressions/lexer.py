"""CEL's lexical grammar, and the bounds on a source checked from its tokens alone.

Work is bounded before any parser sees the source: its length, its bracket nesting and its
comprehension nesting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.engine.expressions.vocabulary import COMPREHENSIONS

MAX_EXPR_CHARS = 2_000
# All the expressions of one policy (an agent's, or a request's `loop`) together.
MAX_POLICY_EXPR_CHARS = 8_000
MAX_EXPR_DEPTH = 32
MAX_COMPREHENSION_DEPTH = 3


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # ident, punct, int, uint, double, string, bytes, end
    text: str
    pos: int


# One token at a time, in this order: a string literal's opening (its prefix and quote: the
# literal is read by `_string_end`), numbers, names, operators; spaces and comments between.
_TOKEN = re.compile(
    r"(?P<space>[ \t\r\n\f]+|//[^\n]*)"
    r"|(?P<string>[bB]?[rR]?['\"])"
    r"|(?P<uint>(?:0x[0-9a-fA-F]+|[0-9]+)[uU])"
    r"|(?P<double>[0-9]*\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)"
    r"|(?P<int>0x[0-9a-fA-F]+|[0-9]+)"
    r"|(?P<ident>[_a-zA-Z][_a-zA-Z0-9]*)"
    r"|(?P<punct>==|!=|<=|>=|&&|\|\||[<>!+\-*/%?:.,()\[\]{}])"
)
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


def where(source: str, pos: int) -> str:
    """`line:column` of `pos`, both from 1, as the library reports them."""
    line_start = source.rfind("\n", 0, pos) + 1
    return f"{source.count(chr(10), 0, pos) + 1}:{pos - line_start + 1}"


def scan(source: str) -> tuple[list[Token], int]:
    """The tokens of `source`, once its length and nesting are known to be within bounds, and
    how deep its comprehensions nest (0 without any).

    Raises `ValueError` for a source longer than `MAX_EXPR_CHARS` (before reading it), a
    lexical error, brackets nested deeper than `MAX_EXPR_DEPTH` or comprehensions nested deeper
    than `MAX_COMPREHENSION_DEPTH`.
    """
    if len(source) > MAX_EXPR_CHARS:
        raise ValueError(
            f"the expression is {len(source)} characters long; the limit is {MAX_EXPR_CHARS}"
        )
    tokens = _tokenize(source)
    return tokens, _check_nesting(source, tokens)


def _opens_comprehension(tokens: list[Token], k: int) -> bool:
    """Whether the bracket at `k` is the `(` of a comprehension call (`.exists(`)."""
    return (
        tokens[k].text == "("
        and k >= 2
        and tokens[k - 1].kind == "ident"
        and tokens[k - 1].text in COMPREHENSIONS
        and tokens[k - 2].text == "."
    )


def _tokenize(source: str) -> list[Token]:
    """CEL's lexical grammar. A string literal is one token, so nothing inside it is code."""
    tokens: list[Token] = []
    i, n = 0, len(source)
    while i < n:
        found = _TOKEN.match(source, i)
        if found is None:
            raise ValueError(
                f"invalid CEL syntax: unexpected {source[i]!r} (at {where(source, i)})"
            )
        kind = found.lastgroup
        if kind == "string":
            quote = found.end() - 1
            prefix = source[i:quote].lower()
            end = _string_end(source, quote, raw="r" in prefix)
            tokens.append(Token("bytes" if "b" in prefix else "string", source[i:end], i))
            i = end
            continue
        if kind != "space":
            text = found.group()
            tokens.append(Token("punct" if text == "in" else str(kind), text, i))
        i = found.end()
    tokens.append(Token("end", "", n))
    return tokens


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
    raise ValueError(f"invalid CEL syntax: unterminated string (at {where(source, quote)})")


def _escape_end(source: str, i: int) -> int:
    """The index just past the escape sequence at `i`; a malformed one is a syntax error."""
    letter = source[i + 1 : i + 2]
    if letter and letter in _SIMPLE_ESCAPES:
        return i + 2
    digits, count, offset = _ESCAPE_DIGITS.get(letter, (frozenset(), 0, 0))
    start = i + offset
    body = source[start : start + count]
    if count == 0 or len(body) != count or any(c not in digits for c in body):
        raise ValueError(f"invalid CEL syntax: invalid escape sequence (at {where(source, i)})")
    return start + count


def _check_nesting(source: str, tokens: list[Token]) -> int:
    """Bracket and comprehension nesting, from the tokens alone: nothing has parsed them yet.
    Returns how deep the comprehensions nest.

    A call of a comprehension name (`.exists(`) counts as a comprehension whatever its
    arguments: over-counting can only refuse an expression that would be refused anyway.
    """
    open_brackets: list[bool] = []  # one per open bracket: whether it opened a comprehension
    comprehensions = deepest = 0
    for k, tok in enumerate(tokens):
        if tok.kind != "punct":
            continue
        if tok.text in _OPENERS:
            is_macro = _opens_comprehension(tokens, k)
            open_brackets.append(is_macro)
            comprehensions += is_macro
            deepest = max(deepest, comprehensions)
            if len(open_brackets) > MAX_EXPR_DEPTH:
                raise ValueError(
                    f"brackets nest deeper than {MAX_EXPR_DEPTH} levels "
                    f"(at {where(source, tok.pos)})"
                )
            if comprehensions > MAX_COMPREHENSION_DEPTH:
                raise ValueError(
                    f"comprehensions (all, exists, exists_one, map, filter) nest deeper than "
                    f"{MAX_COMPREHENSION_DEPTH} levels (at {where(source, tok.pos)})"
                )
        elif tok.text in _CLOSERS and open_brackets:
            comprehensions -= open_brackets.pop()
    return deepest
