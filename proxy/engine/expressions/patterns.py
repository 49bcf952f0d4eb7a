"""What a `matches()` pattern costs, estimated from its text before anything compiles it.

The expression library compiles a pattern with Rust's `regex` each time `matches()` runs, on
the event loop: `\\w` alone takes ~0.45 ms (a Unicode class of ~770 ranges), `\\w{10}` ~4 ms,
and `(\\w{50}){10}` ~160 ms, once per step and per item a comprehension visits. Matching is
linear in the text (the engine has no backtracking): the compile is what a pattern costs. It
grows with the size of the automaton, so the estimate adds up what each atom of the pattern
weighs (a literal little, a Unicode class much), multiplied by the counts of the repetitions
around it, in units of evaluation (`MAX_EVALUATION_COST`: ~60 ns each).
"""

from __future__ import annotations

import re

# The most the patterns of one expression may cost together, each compiled once: ~2.5 ms of
# compiling (`\w{4}` passes, `\w{10}` does not); and those of one policy.
MAX_PATTERN_COST = 40_000
MAX_POLICY_PATTERN_COST = 100_000
# Units per compile, and per atom: measured on the library's engine, rounded up.
_BASE = 400
_LITERAL = 3
_ANY = 180  # `.`: every character but a newline, in UTF-8
_NEGATED = 130  # `[^...]`, a complement: every other character, in UTF-8
_SMALL_CLASS = 20
_CASE_FOLDED = 6  # `(?i)`: literals and small classes hold their other cases
_ESCAPES = {
    "d": 700,
    "D": 1_400,
    "s": 200,
    "S": 250,
    "w": 8_000,
    "W": 8_000,
    "b": 30,  # word boundaries
    "B": 30,
}
_UNICODE_CLASS = 8_000  # `\pL`, `\p{Greek}`, `\P{...}`
_GROUP = 15  # a group, or one more alternative
_REPEAT = re.compile(r"\{\s*(\d{1,9})\s*(,\s*(\d{0,9})\s*)?\}")  # spaces are allowed
_FOLDING = re.compile(r"\(\?[a-zA-Z-]*i")
_VERBOSE = re.compile(r"\(\?[a-zA-Z-]*x")  # `(?x)`: spaces and `# comments` are not atoms
_HEX_ESCAPE = re.compile(r"\\[xuU]\{?([0-9a-fA-F]{1,8})")
_FIXED_HEX = {"x": 2, "u": 4, "U": 8}  # `\x7F`, `\u007F`, `\U0000007F`


class PatternTooCostly(ValueError):
    pass


def pattern_cost(pattern: str, spent: int = 0) -> int:
    """The estimated cost of compiling `pattern`; raises PatternTooCostly as soon as the
    estimate, with the `spent` of the expression's other patterns, passes MAX_PATTERN_COST."""
    folded = _FOLDING.search(pattern) is not None
    verbose = _VERBOSE.search(pattern) is not None
    groups: list[list[int]] = [[]]  # the cost of each item of each open group, innermost last
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        items = groups[-1]
        if verbose and char.isspace():
            i += 1
            continue
        if verbose and char == "#":
            end = pattern.find("\n", i)
            i = n if end < 0 else end + 1
            continue
        if char == "\\":
            weight, i = _escape(pattern, i + 1)
            items.append(weight * _CASE_FOLDED if folded and weight == _LITERAL else weight)
            continue
        if char == "[":
            weight, i = _class(pattern, i)
            items.append(weight * _CASE_FOLDED if folded and weight <= _SMALL_CLASS else weight)
            continue
        if char == "(":
            groups.append([_GROUP])
        elif char == ")" and len(groups) > 1:
            inner = groups.pop()
            groups[-1].append(sum(inner))
        elif char == "{" and items and (found := _REPEAT.match(pattern, i)):
            least, upto = int(found[1]), found[3]
            count = (int(upto) if upto else least + 1) if found[2] else least
            items[-1] *= max(count, 1)
            i = found.end()
            _bounded(spent + items[-1])
            continue
        elif char == ".":
            items.append(_ANY)
        elif char == "|":
            items.append(_GROUP)
        elif char not in "*+?^$":
            items.append(_LITERAL * _CASE_FOLDED if folded else _LITERAL)
        i += 1
    return _bounded(spent + _BASE + sum(sum(items) for items in groups)) - spent


def _bounded(cost: int) -> int:
    if cost > MAX_PATTERN_COST:
        raise PatternTooCostly(
            f"the regular expression would cost too much to compile at each evaluation (with "
            f"the expression's other patterns, an "
            f"estimated {cost:,} units; the limit is {MAX_PATTERN_COST:,}): Unicode classes such "
            "as \\w, \\d and \\p{L}, repeated many times, are what costs; an ASCII class such "
            "as [a-zA-Z0-9_] costs little"
        )
    return cost


def _escape(pattern: str, i: int) -> tuple[int, int]:
    """The weight of the escape whose letter is at `i`, and where the pattern goes on."""
    if i >= len(pattern):
        return _LITERAL, i
    letter = pattern[i]
    if letter in _ESCAPES:
        return _ESCAPES[letter], i + 1
    if letter in "pP":  # `\pL`, `\p{Name}`
        if pattern.startswith("{", i + 1):
            end = pattern.find("}", i + 1)
            return _UNICODE_CLASS, (end + 1 if end > 0 else len(pattern))
        return _UNICODE_CLASS, i + 2
    if letter in _FIXED_HEX:  # a character by its code: `\x{10FFFF}`, `\u{7F}`, `\x7F`
        if pattern.startswith("{", i + 1):
            end = pattern.find("}", i + 1)
            return _LITERAL, (end + 1 if end > 0 else len(pattern))
        return _LITERAL, i + 1 + _FIXED_HEX[letter]
    return _LITERAL, i + 1


def _class(pattern: str, i: int) -> tuple[int, int]:
    """The weight of the class that opens at `i` (`[...]`, nested classes and `[:alpha:]`
    within), and where the pattern goes on after it. A range past ASCII weighs as `.` does."""
    depth, weight, j, n = 0, _SMALL_CLASS, i, len(pattern)
    negated = pattern.startswith("[^", i)
    while j < n:
        char = pattern[j]
        if char == "\\":
            escaped, j = _escape(pattern, j + 1)
            weight = max(weight, escaped)
            continue
        if char == "[" and (j == i or not pattern.startswith("[:", j)):
            depth += 1
            negated |= depth > 1 and pattern.startswith("[^", j)
        elif char == "[":  # `[:alpha:]` within a class: an ASCII class
            end = pattern.find(":]", j + 2)
            j = end + 2 if end > 0 else n
            continue
        elif char == "]" and j > i + 1 + negated:
            depth -= 1
            if depth == 0:
                j += 1
                break
        j += 1
    body = pattern[i:j]
    if "-" in body and (
        any(ord(c) > 0x7F for c in body)
        or any(int(code, 16) > 0x7F for code in _HEX_ESCAPE.findall(body))
    ):
        weight = max(weight, _ANY)
    return (max(weight, _NEGATED) if negated else weight), j
