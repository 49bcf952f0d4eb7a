"""The `model` field of a `multipart/form-data` body (an audio transcription's, say), read as
the body passes by python-multipart's parser, which keeps no part in memory."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

MAX_MODEL_BYTES = 256  # a longer value is no model name
# The most parts of a form read (an audio upload has a handful): each costs some 5 µs of
# Python, and 256 KiB of empty parts would hold the event loop for 90 ms.
MAX_PARTS = 256


class AmbiguousModel(ValueError):
    """A form that names its model more than once, or that the parser cannot read past where
    it named it: an upstream could read another model in it than the one checked."""


# A header's parameters, each `; key` with its value (a quoted string whole, `;`s and all).
_PARAMETER = re.compile(rb';\s*([^\s=;]*)\s*(?:=\s*(?:"(?:[^"\\]|\\.)*"|[^;]*))?')


def form_boundary(content_type: str | None) -> tuple[bytes, bool] | None:
    """The boundary of a `multipart/form-data` content type, and whether it is all the type
    says (no `charset` or other parameter, which an upstream may read the form by); else
    None."""
    if content_type is None:
        return None
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        return None
    return boundary, options.keys() - {b""} == {b"boundary"}  # a `;` at its end is nothing


class FormModel:
    """Reads a form's chunks for its parts named `model` (in any case, as some upstreams match
    it): `names` the names of those begun, `values` the values of those ended, as text (None:
    a file, or too long for a model name). `broken`: the parser could not read the form, or it
    has more than MAX_PARTS parts (the rest is not read).

    `strict`, for a form whose model is checked: a form that parsers could read otherwise is
    broken too: a part header given twice (parsers take the first or the last), a name given
    twice or in RFC 2231's form (`name*=`), a name that is not plain ASCII (with a `\\` or a
    `%`, which some decode) and a `_charset_` part (which some read the other names by)."""

    def __init__(self, boundary: bytes, strict: bool = False) -> None:
        self.names: list[str] = []
        self.values: list[str | None] = []
        self.broken = False
        self.strict = strict
        self._parts = 0
        self._header = self._header_text = b""  # the header being read: its name, its value
        self._headers: dict[bytes, bytes] = {}
        self._reading = False  # the part being read is named `model`
        self._value: bytearray | None = None  # its value so far, when it may be a model name
        callbacks: Any = {
            "on_part_begin": self._begin,
            "on_header_field": self._field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }
        self._parser: MultipartParser | None = None
        try:
            self._parser = MultipartParser(boundary, callbacks)
        except ValueError:  # a boundary the parser does not take (over 256 bytes)
            self.broken = True

    @property
    def model(self) -> str | None:
        """The form's model: the value of its first part named `model` (if none in another case
        came before it), once that part ended."""
        if self.broken or not self.values or self.names[0] != "model":
            return None
        return self.values[0]

    def feed(self, chunk: bytes) -> None:
        if self.broken or self._parser is None:
            return
        try:
            self._parser.write(chunk)
        except MultipartParseError:
            self.broken = True

    async def checked(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`chunks`, read as they go by: raises AmbiguousModel as soon as another part named
        `model` begins, or the form cannot be read."""
        async for chunk in chunks:
            self.feed(chunk)
            if self.broken or len(self.names) > 1:
                raise AmbiguousModel("the form names `model` more than once, or cannot be read")
            yield chunk

    def _begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise MultipartParseError(f"a form of more than {MAX_PARTS} parts")
        self._headers = {}

    def _field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_text += data[start:end]

    def _header_end(self) -> None:
        name = self._header.lower()
        if self.strict and name in self._headers:
            raise MultipartParseError("a part header given twice")
        self._headers[name] = self._header_text
        self._header = self._header_text = b""

    def _headers_finished(self) -> None:
        disposition = self._headers.get(b"content-disposition", b"")
        _, options = parse_options_header(disposition)
        name = options.get(b"name", b"").decode("latin-1")
        if self.strict and not _plain(name, disposition):
            raise MultipartParseError("a part name that parsers may read otherwise")
        self._reading = name.lower() == "model"
        if self._reading:
            self.names.append(name)
            self._value = None if b"filename" in options else bytearray()

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._value is not None:
            self._value += data[start:end]
            if len(self._value) > MAX_MODEL_BYTES:
                self._value = None

    def _end(self) -> None:
        if self._reading:
            value, self._value, self._reading = self._value, None, False
            self.values.append(None if value is None else value.decode("utf-8", errors="replace"))


def _plain(name: str, disposition: bytes) -> bool:
    """Whether every parser reads the part's name as `name`."""
    keys = [match.group(1).lower() for match in _PARAMETER.finditer(disposition)]
    return (
        keys.count(b"name") <= 1
        and b"name*" not in keys  # RFC 2231's, which parsers decode each their way
        and name.isascii()
        and name.isprintable()
        and "\\" not in name
        and "%" not in name
        and name.lower() != "_charset_"
    )
