"""A real local Redis-protocol server for the kvdir tests (no fakes: the Lua script,
pipelines and expiry are what is under test)."""

from __future__ import annotations

import itertools

import pytest

from cluster.kvdir.embedded import start_local_server

_ids = itertools.count()


@pytest.fixture(scope="session")
def redis_url():
    url, stop = start_local_server()
    yield url
    stop()


@pytest.fixture
def ns(request) -> str:
    """A cluster name no other test uses, so tests sharing the server never see each other."""
    return f"{request.node.name}-{next(_ids)}"
