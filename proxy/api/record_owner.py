"""Who made a stored response's record: each record ends with the key that made it, read
there before the record is parsed, so that another key's record is never parsed (nor its size
learnt)."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.api.auth import Caller


def owned_by(record: bytes, key: str) -> bool:
    """Whether a stored response's record was made by `key`: its last field, read unparsed."""
    return record.endswith(b'"key":' + orjson.dumps(key) + b"}")


def owned_fields(record: bytes | None, caller: Caller | None) -> dict[str, Any] | None:
    """A record's fields, None unless `caller` made it."""
    if record is None or (caller is not None and not owned_by(record, caller.name)):
        return None  # first: another key's record has no size for it either
    fields: dict[str, Any] = orjson.loads(record)
    if caller is not None and fields["key"] != caller.name:
        return None
    return fields
