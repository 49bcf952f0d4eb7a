"""The bound on what an MCP server asks of the proxy at once (`proxy/tools/mcp_asked.py`)."""

from __future__ import annotations

from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCNotification, JSONRPCRequest, JSONRPCResponse

from proxy.tools.mcp_asked import MAX_ASKED, AskedRequests


def request(id_: int | str) -> SessionMessage:
    return SessionMessage(JSONRPCRequest(jsonrpc="2.0", id=id_, method="roots/list"))


def answer(id_: int | str) -> SessionMessage:
    return SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=id_, result={}))


def cancelled(id_: int | str) -> SessionMessage:
    params = {"requestId": id_}
    return SessionMessage(
        JSONRPCNotification(jsonrpc="2.0", method="notifications/cancelled", params=params)
    )


def written(asked: AskedRequests, id_: int | str) -> None:
    """The answer to `id_` goes out and is written."""
    key = asked.writes(answer(id_))
    assert key is not None
    asked.answered(key)


def test_requests_past_the_bound_are_dropped_until_one_is_answered() -> None:
    asked = AskedRequests("srv")
    assert all(asked.admit(request(n)) for n in range(MAX_ASKED))
    assert not asked.admit(request("one more"))
    written(asked, 3)
    assert asked.admit(request("one more"))
    assert not asked.admit(request("and another"))


def test_an_id_in_flight_asked_again_is_dropped() -> None:
    """The SDK's cancel finds only the newest of a reused id: the others' answers would wait
    uncounted."""
    asked = AskedRequests("srv")
    assert asked.admit(request(7))
    assert not asked.admit(request(7))
    assert not asked.admit(request("7"))  # the SDK's ids: "7" and 7 are one
    written(asked, "7")
    assert asked.admit(request(7))


def test_a_cancel_ends_a_request_unless_its_answer_is_being_written() -> None:
    asked = AskedRequests("srv")
    assert all(asked.admit(request(n)) for n in range(MAX_ASKED))
    for other in ("not asked", 99, 98):
        written(asked, other)
    assert not asked.admit(request("past"))
    assert asked.admit(cancelled(0))  # notifications are always read; its handler ends
    assert asked.admit(request("past"))
    being_written = asked.writes(answer(1))
    assert asked.admit(cancelled(1))  # too late: the SDK writes the answer all the same
    assert not asked.admit(request("past again"))
    assert being_written is not None
    asked.answered(being_written)
    assert asked.admit(request("past again"))
    assert asked.writes(request(2)) is None  # only answers are written answers
