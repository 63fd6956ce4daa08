"""Fixtures shared by the suites."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.stub import StubEndpoint


@pytest.fixture
def stub() -> Iterator[StubEndpoint]:
    """The stub model server (tests/stub.py), closed afterwards."""
    s = StubEndpoint()
    yield s
    s.close()
