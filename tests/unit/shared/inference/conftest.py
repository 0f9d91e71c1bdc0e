"""What the fleet client's tests share: servers that answer as vLLM does, made on demand and closed after."""

from __future__ import annotations

import pytest

from tests.unit.shared.inference.served_models import VllmLikeServer


@pytest.fixture
def servers():
    made: list[VllmLikeServer] = []

    def make(**kwargs) -> VllmLikeServer:
        made.append(VllmLikeServer(**kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()
