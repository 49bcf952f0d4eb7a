"""JSON whose integers stay exact past 64 bits (`proxy.exact_json`)."""

from __future__ import annotations

import pytest

from proxy import exact_json


def test_integers_past_64_bits_are_read_and_written_exactly() -> None:
    value = exact_json.loads('{"n": 18446744073709551616, "small": 1.5}')
    assert value == {"n": 2**64, "small": 1.5}
    assert exact_json.dumps(value) == b'{"n":18446744073709551616,"small":1.5}'
    assert exact_json.loads(b"[1, 2]") == [1, 2]  # bytes, the usual path


@pytest.mark.parametrize(
    "text", ['{"n": 1234567890123456789, "x": NaN}', "[Infinity, 1234567890123456789]"]
)
def test_what_is_no_json_is_refused_on_either_path(text: str) -> None:
    with pytest.raises(ValueError, match="is not a JSON value"):
        exact_json.loads(text)
