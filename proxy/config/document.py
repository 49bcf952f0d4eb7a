"""A config file read into a YAML document, bounded before the work: a file of at most
MAX_CONFIG_BYTES, UTF-8, nested at most MAX_CONFIG_DEPTH levels, whose aliases expand to at
most MAX_CONFIG_VALUES values, and whose mappings name each key once. What breaks a bound is
a ConfigError naming the file; nothing of it is a traceback."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from proxy.engine.option_errors import shortened

MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_CONFIG_DEPTH = 64
# Values of the document with its aliases expanded: what the proxy will walk and send (a tool's
# `parameters` goes upstream with every request that offers the tool).
MAX_CONFIG_VALUES = 1_000_000
# Pairs merge keys (`<<`) may copy: each is two values (a key and its value) to construct.
MAX_MERGED_PAIRS = MAX_CONFIG_VALUES // 2

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
    """The document with its aliases expanded: at most MAX_CONFIG_VALUES values and
    MAX_CONFIG_DEPTH levels (aliases can nest what the text does not), and no value inside
    itself. Each shared value is measured once, without recursion."""
    measured: dict[int, tuple[int, int]] = {}  # id -> (values, depth), with aliases expanded
    open_ids: set[int] = set()  # being measured: met again inside itself, it is a cycle
    stack: list[tuple[Any, bool]] = [(document, False)]
    while stack:
        value, children_done = stack.pop()
        if not isinstance(value, dict | list | tuple | set):
            continue
        key = id(value)
        inner = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
        if not children_done:
            if key in measured:
                continue
            if key in open_ids:
                raise BadDocument("a value holds itself (an alias inside its own anchor)")
            open_ids.add(key)
            stack.append((value, True))
            stack.extend((child, False) for child in inner)
            continue
        values, depth = 1, 1
        for child in inner:
            child_values, child_depth = measured.get(id(child), (1, 0))
            values += child_values
            depth = max(depth, child_depth + 1)
        if depth > MAX_CONFIG_DEPTH:
            raise BadDocument(f"nested more than {MAX_CONFIG_DEPTH} levels deep, with aliases")
        if values > MAX_CONFIG_VALUES:
            raise BadDocument(f"its aliases expand to more than {MAX_CONFIG_VALUES:,} values")
        measured[key] = (values, depth)
        open_ids.discard(key)


class _UniqueKeys(_Loader):  # type: ignore[misc, valid-type]
    """A safe loader that refuses a key given twice in one mapping (YAML keeps the last), and
    reads numbers in exponent form as YAML 1.2 and JSON do (`5e-3`, `1.5e3`: YAML 1.1 has them
    strings unless they have a dot and a signed exponent; Helm's `toYaml` writes small numbers
    so) as numbers."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        merging = _refuse_repeated_keys(node)  # before merges are flattened into mappings
        _check_merges(merging)
        return self.construct_document(node)


_MERGE = "tag:yaml.org,2002:merge"


def _refuse_repeated_keys(root: yaml.Node) -> list[yaml.MappingNode]:
    """Every mapping of the node graph names a scalar key once (merge keys, `<<`, aside).
    Returns the mappings with merge keys."""
    seen_nodes: set[int] = set()
    merging: list[yaml.MappingNode] = []
    pending = [root]
    while pending:
        node = pending.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for key_node, value_node in node.value:
                pending.extend((key_node, value_node))
                if key_node.tag == _MERGE:
                    if not merging or merging[-1] is not node:
                        merging.append(node)
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = (key_node.tag, key_node.value)
                if key in keys:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"found the key {shortened(key_node.value)!r} twice",
                        key_node.start_mark,
                    )
                keys.add(key)
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)
    return merging


def _merged(node: yaml.MappingNode) -> list[yaml.MappingNode]:
    """The mappings `node`'s merge keys name."""
    found: list[yaml.MappingNode] = []
    for key_node, value_node in node.value:
        if key_node.tag != _MERGE:
            continue
        named = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        found += [n for n in named if isinstance(n, yaml.MappingNode)]
    return found


def _check_merges(merging: list[yaml.MappingNode]) -> None:
    """The pairs merge keys copy at most MAX_MERGED_PAIRS: PyYAML copies every pair of each
    mapping merged (its own merges flattened first) into the mapping that merges it, each
    time, before repeated keys are dropped (100,000 merges of one 4,000-key mapping took
    100 s; a chain of 3,000 mappings each merging the one before, 14 s)."""
    flat: dict[int, int] = {}  # a mapping's pairs, its merges flattened
    work = 0
    for mapping in merging:
        for merged in _merged(mapping):
            work += _flat_size(merged, flat)
            if work > MAX_MERGED_PAIRS:
                raise BadDocument(f"its merge keys (<<) copy more than {MAX_MERGED_PAIRS:,} pairs")


def _flat_size(root: yaml.MappingNode, flat: dict[int, int]) -> int:
    """The pairs of `root` with its merges flattened, without recursion (a mapping met again
    inside itself counts none: PyYAML refuses it)."""
    stack: list[tuple[yaml.MappingNode, bool]] = [(root, False)]
    open_ids: set[int] = set()
    while stack:
        node, merges_done = stack.pop()
        if id(node) in flat:
            continue
        merged = _merged(node)
        if not merges_done:
            if id(node) in open_ids:
                continue
            open_ids.add(id(node))
            stack.append((node, True))
            stack.extend((m, False) for m in merged)
            continue
        own = sum(key.tag != _MERGE for key, _ in node.value)
        flat[id(node)] = min(own + sum(flat.get(id(m), 0) for m in merged), MAX_MERGED_PAIRS + 1)
    return flat[id(root)]


_UniqueKeys.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    """An integer, as YAML reads it; one past Python's digits (4,300) named at its place,
    not a traceback."""
    try:
        value = yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:  # (decimal digits past Python's bound)
        value = None
    if value is None or value.bit_length() > MAX_INT_BITS:  # (hex, octal: no bound of theirs)
        raise yaml.constructor.ConstructorError(
            None, None, "an integer of too many digits", node.start_mark
        )
    return value


# As many as Python's 4,300 decimal digits hold.
MAX_INT_BITS = 14_000


_UniqueKeys.add_constructor("tag:yaml.org,2002:int", _int)
