"""Fixtures every test layer may use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proxy.api import responses
from proxy.state import redis_calls
from proxy.throttled_log import ThrottledWarnings
from proxy.upstream import reply
from tests.servers import redis_server


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(autouse=True)
def throttles_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's warnings told as if none came before: the process-wide ones tell one a
    second, and a test's line would go untold behind an earlier test's."""
    for module in (reply, redis_calls, responses):
        for name, value in vars(module).items():
            if isinstance(value, ThrottledWarnings):
                monkeypatch.setattr(module, name, ThrottledWarnings(value.log, value.interval_s))
