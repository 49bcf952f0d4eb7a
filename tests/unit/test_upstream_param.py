"""An upstream error's message in the client's terms (`proxy.api.upstream_param`)."""

from __future__ import annotations

import pytest

from proxy.api.upstream_param import client_message


@pytest.mark.parametrize(
    ("message", "sent", "param", "said"),
    [
        (
            "messages[3] has no content; see messages[3].content",
            "messages[3].content",
            "messages[2].content",
            "messages[2] has no content; see messages[2].content",
        ),
        (
            "Invalid 'messages[0].content'",
            "messages[0].content",
            None,
            "Invalid 'messages[0].content (of the request sent upstream)'",
        ),
        ("Bad value for temperature", "temperature", "temperature", "Bad value for temperature"),
        ("tools[1] is invalid", "tools[1].function", "tools[1].parameters", "tools[1] is invalid"),
    ],
)
def test_the_message_names_the_part_as_the_client_knows_it(
    message: str, sent: str, param: str | None, said: str
) -> None:
    assert client_message(message, sent, param) == said
