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


def test_requests_past_the_bound_are_dropped_until_one_is_answered() -> None:
    asked = AskedRequests("srv")
    assert all(asked.admit(request(n)) for n in range(MAX_ASKED))
    assert not asked.admit(request("one more"))
    asked.answered(answer(3))
    assert asked.admit(request("one more"))
    assert not asked.admit(request("and another"))


def test_one_id_asked_many_times_counts_each_time() -> None:
    """Each is a handler of its own in the SDK, whatever its id."""
    asked = AskedRequests("srv")
    assert all(asked.admit(request(7)) for _ in range(MAX_ASKED))
    assert not asked.admit(request(7))
    asked.answered(answer("7"))  # the SDK's ids: "7" and 7 are one
    assert asked.admit(request(7))


def test_a_cancelled_request_is_no_longer_open_and_answers_of_others_change_nothing() -> None:
    asked = AskedRequests("srv")
    assert all(asked.admit(request(n)) for n in range(MAX_ASKED))
    for other in ("not asked", 99, 98):
        asked.answered(answer(other))
    assert not asked.admit(request("past"))
    assert asked.admit(cancelled(0))  # notifications are always read
    assert asked.admit(request("past"))
    assert asked.admit(cancelled(0))  # settled already: nothing more
    assert not asked.admit(request("past again"))
