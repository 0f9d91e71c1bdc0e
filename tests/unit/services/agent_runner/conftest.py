"""The sandboxes black-box agents are attacked in: both real backends."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="module", params=["bubblewrap", "docker"])
def sandbox(request) -> str:
    """agent.command_sandbox: bubblewrap here, and containers on a real engine (skipped where either is
    missing)."""
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    elif shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")
    return request.param
