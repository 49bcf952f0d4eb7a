"""A conversation continued turn after turn is stored in parts (SPEC §12.4): each turn's record
holds what it added and names the earlier records holding the rest, copying in those no larger
than what it holds, so the bytes stored grow with the conversation's size times a logarithm,
not with its square, and a continuation reads few records. A conversation sent whole each turn
is stored alike, the conversation it begins with known by its fingerprint."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import orjson
import pytest

from proxy.api import stored_conversation as sc
from proxy.api.fingerprint_records import FINGERPRINT_RECORD, Lineage, parsed_fingerprint
from proxy.api.response_store import ResponseStore, StoredInput, StoredResponse
from proxy.config.server import ServerConfig
from proxy.state.memory import MemoryStore
from tests.records import delete_record, put_record

BOUNDS = ServerConfig(max_body_bytes=64 * 1024 * 1024, max_body_values=10_000_000)


def turn(n: int, size: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"{n}:" + "u" * size},
        {"role": "assistant", "content": f"{n}."},
    ]


async def save(
    store: ResponseStore, response_id: str, messages: list[Any], continued: sc.Conversation | None
) -> None:
    stored = StoredResponse({"id": response_id, "output": []}, None, "m", None)
    await store.save(response_id, stored, messages, StoredInput(None, []), None, continued)


async def chain(turns: int, size: int) -> tuple[ResponseStore, int, list[int], list[Any]]:
    """A chain of `turns` responses, each continued by the next, each turn adding `size` bytes:
    its store, the bytes written, the parts each continuation read, and the last messages."""
    backend = MemoryStore()
    store = ResponseStore(backend, 600)
    written, parts = 0, []
    continued = None
    messages: list[Any] = []
    for n in range(turns):
        messages = [*(continued.messages if continued else []), *turn(n, size)]
        response_id = f"resp_{n:04d}"
        await save(store, response_id, messages, continued)
        written += sum(len(backend._found(kind, response_id) or b"") for kind in _KINDS)
        continued = await store.conversation(response_id, BOUNDS)
        assert continued is not None
        assert continued.messages == messages  # whole, in order, each turn
        parts.append(len(continued.parts))
    return store, written, parts, messages


_KINDS = (sc.CONVERSATION_RECORD, sc.TAIL_RECORD)


async def test_a_long_chain_is_stored_in_space_near_linear_in_its_conversation() -> None:
    """400 turns of 2 KB (an 800 KB conversation): every turn whole a copy would be 160 MB."""
    _, written, parts, messages = await chain(400, 2_000)
    size = len(orjson.dumps(messages))
    quadratic = sum(len(orjson.dumps(messages[: 2 * (n + 1)])) for n in range(400))
    assert quadratic > 150_000_000
    doublings = math.log2(size / sc.MIN_PART_BYTES)
    # A message is copied about once a doubling, and the small parts at each turn.
    assert written < 2 * doublings * size
    assert written < quadratic / 20
    assert max(parts) <= doublings + 2


async def test_a_short_conversation_is_one_conversation_record() -> None:
    """As every version stores it: one that does not know parts reads it."""
    store, _, parts, messages = await chain(20, 1_000)
    assert parts == [1] * 20
    found = await store.store.get_record(sc.CONVERSATION_RECORD, "resp_0019")
    assert found is not None
    assert orjson.loads(found) == messages


async def test_a_tail_names_the_parts_before_it_and_keeps_them_as_long() -> None:
    messages = turn(0, 100_000)
    record, parts = sc.stored_form("resp_a", messages, None)
    assert (record.kind, parts) == (sc.CONVERSATION_RECORD, [])
    first = sc.whole("resp_a", record.value, messages)
    more = [*messages, *turn(1, 1_000)]
    record, parts = sc.stored_form("resp_b", more, first)
    assert (record.kind, parts) == (sc.TAIL_RECORD, list(first.parts))
    assert [part.record for part in parts] == [(sc.CONVERSATION_RECORD, "resp_a")]
    line, own = record.value.split(b"\n")
    assert orjson.loads(line) == [["resp_a", True, len(orjson.dumps(messages))]]
    assert orjson.loads(own) == turn(1, 1_000)


async def test_a_part_no_larger_than_the_new_one_is_copied_into_it() -> None:
    """So the parts a conversation names shrink with their age: few of them."""
    big = sc.Conversation(turn(0, 100_000), (sc.Part("resp_a", True, 100_030, 2),))
    record, parts = sc.stored_form("resp_b", [*big.messages, *turn(1, 120_000)], big)
    assert (record.kind, parts) == (sc.CONVERSATION_RECORD, [])


@pytest.mark.parametrize(
    "line",
    [b"", b"{}", b"[]", b'[["resp_a", 1, 10]]', b'[["resp_a", true, "10"]]', b"[1]", b"[[1,2]]"],
)
async def test_a_tail_in_a_form_this_version_did_not_write_reads_as_gone(line: bytes) -> None:
    with pytest.raises(sc.Gone):
        sc.named_parts("resp_b", line + b"\n[]")


async def test_a_part_gone_or_replaced_leaves_the_conversation_gone() -> None:
    """Its response deleted, or expired: the conversation is not sent upstream without it."""
    store, *_ = await chain(200, 2_000)
    continued = await store.conversation("resp_0199", BOUNDS)
    assert continued is not None
    assert len(continued.parts) > 1
    first = continued.parts[0]
    value = await store.store.get_record(*first.record)
    assert value is not None
    await put_record(store.store, *first.record, value[:-2] + b"]", 60)  # shorter
    assert await store.conversation("resp_0199", BOUNDS) is None
    await put_record(store.store, *first.record, value[:-1] + b", {}]", 60)  # longer
    assert await store.conversation("resp_0199", BOUNDS) is None
    await put_record(store.store, *first.record, value[:-1] + b"," + b" " * 100_000 + b"]", 60)
    assert await store.conversation("resp_0199", BOUNDS) is None
    same_size = b"{" + b" " * (len(value) - 2) + b"}"  # not a JSON array
    await put_record(store.store, *first.record, same_size, 60)
    assert await store.conversation("resp_0199", BOUNDS) is None
    await delete_record(store.store, *first.record)
    assert await store.conversation("resp_0199", BOUNDS) is None


async def resent(turns: int, size: int) -> tuple[ResponseStore, int, list[Any]]:
    """A conversation sent whole each turn: each response stored as the continuation of the
    conversation its fingerprint finds at the start of the next turn's."""
    backend = MemoryStore()
    store = ResponseStore(backend, 600)
    written = 0
    continued = None
    messages: list[Any] = []
    for n in range(turns):
        messages = [*messages, *turn(n, size)]
        if continued is not None:
            assert continued.messages == messages[: len(continued.messages)]
        response_id = f"resp_{n:04d}"
        stored = StoredResponse({"id": response_id, "output": []}, None, "m", None)
        inputs = StoredInput(None, [])
        lineage = Lineage("", 0, 1)
        await store.save(response_id, stored, messages, inputs, None, continued, lineage)
        written += sum(len(backend._found(kind, response_id) or b"") for kind in _KINDS)
        kept = parsed_fingerprint(await backend.get_record(FINGERPRINT_RECORD, response_id), None)
        assert kept is not None
        # The digest of the whole conversation's canonical JSON, whether hashed whole or gone
        # on from the one before.
        canonical = orjson.dumps(sc.canonical(messages))
        assert kept.conversation.digest == hashlib.sha256(canonical).hexdigest()
        continued = await kept.conversation.begun([*messages, *turn(n + 1, size)])
        assert continued is not None
        assert (await store.conversation(response_id, BOUNDS)) == sc.Conversation(
            messages, continued.parts
        )
    return store, written, messages


async def test_a_conversation_sent_whole_each_turn_is_stored_as_a_chain_is() -> None:
    """Known by its fingerprint, not read: the same parts as a chain's, in as little space."""
    _, written, messages = await resent(400, 2_000)
    _, chained, _, same = await chain(400, 2_000)
    assert messages == same
    assert written == chained


async def test_a_fingerprint_finds_only_the_conversation_it_was_made_of() -> None:
    messages = [*turn(0, 100_000), *turn(1, 1_000)]
    record, _ = sc.stored_form("resp_a", messages[:2], None)
    first = await sc.fingerprint("resp_a", record, [], messages[:2], None)
    found = await first.begun(messages)
    assert found is not None
    assert (found.messages, found.parts) == (messages[:2], first.parts)
    assert await first.begun(messages[:2]) is not None  # nothing after it yet
    assert await first.begun(messages[:1]) is None  # fewer messages
    changed = [{**messages[0], "content": messages[0]["content"][:-1] + "v"}, *messages[1:]]
    assert await first.begun(changed) is None  # one byte other, the same size
    assert await first.begun([messages[1], messages[0], *messages[2:]]) is None
    assert sc.Fingerprint.read(first.form()) == first


async def test_a_fingerprint_is_of_what_items_carry_of_a_message() -> None:
    """An upstream's reply holds more than its output items give back (`refusal: null`,
    `annotations`, `reasoning_content`, a call's extra fields): the conversation sent back
    without them begins as the stored one; a call's id, name or arguments, or a message's role
    or content, changed does not."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    sent_back = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "Done."},
    ]
    replied = [
        sent_back[0],
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "reasoning_content": "thinking",
            "tool_calls": [{**call, "extra_content": {"google": {"thought_signature": "x"}}}],
        },
        sent_back[2],
        {"content": "Done.", "role": "assistant", "annotations": [], "tool_calls": []},
    ]
    record, _ = sc.stored_form("resp_a", replied, None)
    kept = await sc.fingerprint("resp_a", record, [], replied, None)
    found = await kept.begun([*sent_back, {"role": "user", "content": "More?"}])
    assert found is not None
    assert orjson.loads(record.value) == replied  # stored as the upstream gave it
    other_call = {**call, "function": {"name": "f", "arguments": '{"a": 1}'}}
    for changed in (
        {**sent_back[1], "tool_calls": [other_call]},
        {**sent_back[1], "tool_calls": [{**call, "id": "c2"}]},
        {"role": "user", "content": None, "tool_calls": [call]},
        {**sent_back[1], "content": ""},
    ):
        assert await kept.begun([sent_back[0], changed, *sent_back[2:]]) is None


async def test_a_fingerprint_holds_no_call_ids_but_which_result_answers_which_call() -> None:
    """A server call stored under the upstream's id is sent back under its item's (`mcp_…`);
    an upstream may give every turn the same ids (`call_0`): the conversation is the same.
    A result answering another call than before is not."""

    def step(call_id: str, city: str) -> list[dict[str, Any]]:
        function = {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}
        called = {"id": call_id, "type": "function", "function": function}
        return [
            {"role": "assistant", "content": None, "tool_calls": [called]},
            {"role": "tool", "tool_call_id": call_id, "content": city},
        ]

    stored = [*step("call_0", "Lima"), *step("call_0", "Oslo")]
    record, _ = sc.stored_form("resp_a", stored, None)
    kept = await sc.fingerprint("resp_a", record, [], stored, None)
    sent_back = [*step("mcp_a_0", "Lima"), *step("mcp_b_0", "Oslo")]
    assert await kept.begun(sent_back) is not None
    crossed = [sent_back[0], sent_back[2], sent_back[1], sent_back[3]]
    assert await kept.begun(crossed) is None
    both = {
        **sent_back[0],
        "tool_calls": [*sent_back[0]["tool_calls"], *sent_back[2]["tool_calls"]],
    }
    swapped = [both, sent_back[3], sent_back[1]]  # the results in the other order
    record, _ = sc.stored_form("resp_b", [both, sent_back[1], sent_back[3]], None)
    parallel = await sc.fingerprint("resp_b", record, [], [both, sent_back[1], sent_back[3]], None)
    assert await parallel.begun(swapped) is None


@pytest.mark.parametrize(
    "form",
    [
        None,
        [],
        ["d"],
        ["d", []],
        [1, [["resp_a", True, 10, 2]]],
        ["d", [["resp_a", True, 10]]],
        ["d", [["resp_a", True, 10, -1]]],
        ["d", [["resp_a", True, 10, "2"]]],
        ["d", [["resp_a", True, 10, 2]] * (sc.MAX_PARTS + 1)],
        ["d", "resp_a"],
    ],
)
def test_a_fingerprint_in_another_form_is_none(form: Any) -> None:
    """The conversation is then stored whole, as it was sent."""
    assert sc.Fingerprint.read(form) is None
