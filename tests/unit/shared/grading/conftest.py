"""The sandbox every hostile grading test runs against: both real backends."""

from __future__ import annotations

import shutil

import pytest

from rollstream.shared.sandbox.backends import get_backend


@pytest.fixture(scope="module", params=["bubblewrap", "docker"])
def backend(request):
    """Every attack against both real sandboxes: bubblewrap here, and containers on a real engine."""
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    elif shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")
    return get_backend(request.param)
