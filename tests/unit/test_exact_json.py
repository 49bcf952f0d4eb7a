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


@pytest.mark.parametrize(
    "raw", ['{"n": 1234567890123456789, "s": "\\ud800"}', b'[{"\\uDC00": 1}, 12345678901234567890]']
)
def test_a_lone_surrogate_escape_is_refused_on_either_path(raw: str | bytes) -> None:
    with pytest.raises(ValueError, match="surrogate"):
        exact_json.loads(raw)
    short = (
        raw.replace("1234567890123456789", "1")
        if isinstance(raw, str)
        else raw.replace(b"12345678901234567890", b"1")
    )
    with pytest.raises(ValueError, match="surrogate"):
        exact_json.loads(short)


def test_a_surrogate_pair_is_one_character_on_either_path() -> None:
    assert exact_json.loads('["\\ud83d\\ude00", 1234567890123456789]')[0] == "\U0001f600"
    assert exact_json.loads('["\\ud83d\\ude00", 1]')[0] == "\U0001f600"


@pytest.mark.parametrize(
    "raw", ['[123456789012345678, "12345678901234567890"]', b"[1234567890123456789]"]
)
def test_a_run_of_19_digits_anywhere_takes_the_exact_path(raw: str | bytes) -> None:
    """Found in linear time (a regex over runs of 18 digits did 18 times the work)."""
    value = exact_json.loads(raw)
    assert value in ([123456789012345678, "12345678901234567890"], [1234567890123456789])
    assert exact_json.loads('["' + "123456789012345678x" * 1000 + '"]')[0].startswith("1234")
