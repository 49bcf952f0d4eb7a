"""The digest of a JSON array as it grows is that of the whole array, however it was added to;
null members are left out alike at any depth."""

from __future__ import annotations

import asyncio
import hashlib

import orjson
import pytest

from proxy.api.json_digest import HASHED_AWAY, PIECE, JsonDigest, without_nulls

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


async def test_a_long_array_is_hashed_a_piece_at_a_time_with_the_loop_given_between() -> None:
    """Other requests run between its pieces (no single hold of the loop for all of it), and
    the digest is the whole array's."""
    values = [{"n": n, "gone": None} for n in range(10 * PIECE + 1)]
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    running = asyncio.create_task(other())
    await asyncio.sleep(0)
    before = turns
    digest = await JsonDigest().extended(values, without_nulls)
    running.cancel()
    assert turns - before >= 10
    expected = hashlib.sha256(orjson.dumps(without_nulls(values))).hexdigest()
    assert digest.hexdigest() == expected


def test_a_long_piece_hashed_on_a_thread_gives_the_digest_of_the_whole_array() -> None:
    long = "é" * HASHED_AWAY
    values = [1, {"a": long}, "x", [long, 2], None]
    digest = asyncio.run(JsonDigest().extended(values[:2]))
    asyncio.run(digest.extended(values[2:], form=lambda piece: piece))
    assert digest.hexdigest() == hashlib.sha256(orjson.dumps(values)).hexdigest()
