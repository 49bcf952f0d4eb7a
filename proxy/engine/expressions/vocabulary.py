"""The names a stop condition may use: the snapshot's variables, CEL's standard functions and
macros, and nothing else."""

from __future__ import annotations

from proxy.engine.expressions.types import SCHEMA

VARIABLES = tuple(SCHEMA)
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

COMPREHENSIONS = frozenset(MACROS) - {"has"}
METHODS = frozenset({"contains", "startsWith", "endsWith", "matches"})
CONVERSIONS = frozenset({"int", "uint", "double", "string"})
