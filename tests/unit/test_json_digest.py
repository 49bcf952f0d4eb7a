"""The digest of a JSON array as it grows is that of the whole array, however it was added to;
null members are left out alike at any depth."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from proxy.api.json_digest import JsonDigest, without_nulls

VALUES = [{"b": 1, "a": [None, {"c": "é"}]}, "x", 2, [], {}, None]


@pytest.mark.parametrize("option", [None, orjson.OPT_SORT_KEYS])
def test_a_digest_added_to_in_any_pieces_is_the_whole_array_s(option: int | None) -> None:
    whole = hashlib.sha256(orjson.dumps(VALUES, option=option)).hexdigest()
    for cut in range(len(VALUES) + 1):
        digest = JsonDigest(option).extend(VALUES[:cut])
        branch = digest.copy().extend([]).extend(VALUES[cut:])
        assert branch.hexdigest() == whole
        assert (
            digest.hexdigest()
            == hashlib.sha256(orjson.dumps(VALUES[:cut], option=option)).hexdigest()
        )
    assert JsonDigest(option).hexdigest() == hashlib.sha256(b"[]").hexdigest()


def test_keys_sorted_make_one_digest_of_one_object_in_any_order() -> None:
    first = JsonDigest(orjson.OPT_SORT_KEYS).extend([{"a": 1, "b": 2}])
    second = JsonDigest(orjson.OPT_SORT_KEYS).extend([{"b": 2, "a": 1}])
    assert first.hexdigest() == second.hexdigest()
    assert (
        JsonDigest().extend([{"a": 1, "b": 2}]).hexdigest()
        != JsonDigest().extend([{"b": 2, "a": 1}]).hexdigest()
    )


def test_null_members_are_left_out_at_any_depth_and_null_values_in_lists_kept() -> None:
    assert without_nulls([{"a": None, "b": {"c": None, "d": [None, {"e": None}]}}, None]) == [
        {"b": {"d": [None, {}]}},
        None,
    ]
