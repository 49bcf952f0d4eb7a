"""Fixtures every test layer may use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import redis_server


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
