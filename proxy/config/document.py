"""A config file read into a YAML document, bounded before the work: a file of at most
MAX_CONFIG_BYTES, UTF-8, nested at most MAX_CONFIG_DEPTH levels, whose aliases expand to at
most MAX_CONFIG_VALUES values, and whose mappings name each key once. What breaks a bound is
a ConfigError naming the file; nothing of it is a traceback."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_CONFIG_DEPTH = 64
# Values of the document with its aliases expanded: what the proxy will walk and send (a tool's
# `parameters` goes upstream with every request that offers the tool).
MAX_CONFIG_VALUES = 1_000_000

_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # C when built


class BadDocument(ValueError):
    pass


def read_document(file: Path) -> Any:
    """The YAML document in `file`. Raises FileNotFoundError, or BadDocument saying what is
    wrong with it."""
    if not file.exists():
        raise FileNotFoundError(file)
    if not file.is_file():
        raise BadDocument("not a regular file")
    try:
        with file.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise BadDocument(f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise BadDocument(f"larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadDocument(f"not UTF-8 (byte {exc.start})") from None
    try:
        _check_depth(text)
        document = yaml.load(text, Loader=_UniqueKeys)
    except yaml.YAMLError as exc:
        where = str(exc).replace('in "<unicode string>", ', "at ")
        raise BadDocument(f"not valid YAML: {where}") from None
    _check_expansion(document)
    return document


def _check_depth(text: str) -> None:
    """Nesting, from the parser's events (no tree is built, nothing recurses)."""
    depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                mark = event.start_mark
                where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
                raise BadDocument(f"nested more than {MAX_CONFIG_DEPTH} levels deep{where}")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_expansion(document: Any) -> None:
    """The values the document holds with its aliases expanded, each shared value counted once
    for each place it is used (a value is sized once, however often it is shared)."""
    sizes: dict[int, int] = {}

    def size(value: Any) -> int:
        if not isinstance(value, dict | list):
            return 1
        known = sizes.get(id(value))
        if known is None:  # depth is bounded: the recursion is too
            children = value.values() if isinstance(value, dict) else value
            known = sizes[id(value)] = 1 + sum(size(child) for child in children)
        return known

    total = size(document)
    if total > MAX_CONFIG_VALUES:
        raise BadDocument(
            f"its aliases expand to {total:,} values, more than {MAX_CONFIG_VALUES:,}"
        )


class _UniqueKeys(_Loader):  # type: ignore[misc, valid-type]
    """A safe loader that refuses a key given twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may repeat
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found the key {key!r} twice",
                    key_node.start_mark,
                )
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep)
        return mapping
