"""probe_sandbox makes a real sandbox and runs a command in it: a backend that is installed but cannot make a
sandbox (bwrap refused its namespaces, an engine without the image) is unavailable, with its own words and
what to do.

    python -m pytest tests/unit/shared/sandbox/test_probe.py -q
"""

from __future__ import annotations

import shutil

import pytest

from rollstream.shared.errors import BackendUnavailable
from rollstream.shared.sandbox.backends import probe_sandbox
from tests.support import BWRAP_NO_USERNS, break_bwrap, repair_bwrap, sandbox_bin_dir

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (`bwrap`) is not installed")


@pytest.fixture
def bin_dir(monkeypatch):
    """A directory first on PATH, where the test puts the `bwrap` the sandbox finds."""
    path = sandbox_bin_dir()
    monkeypatch.setenv("PATH", f"{path}:/usr/bin:/bin")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_bwrap
def test_a_bwrap_that_cannot_create_its_namespaces_fails_the_probe_with_its_words_and_what_to_do(bin_dir):
    repair_bwrap(bin_dir)
    probe_sandbox("bubblewrap")  # the real one makes a sandbox here

    break_bwrap(bin_dir)
    with pytest.raises(BackendUnavailable) as caught:
        probe_sandbox("bubblewrap")
    said = str(caught.value)
    assert BWRAP_NO_USERNS in said and "exit 1" in said
    assert "kernel.apparmor_restrict_unprivileged_userns" in said and "seccomp=unconfined" in said


def test_without_bwrap_the_probe_says_how_to_install_it(bin_dir, monkeypatch):
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(BackendUnavailable, match="apt-get install bubblewrap"):
        probe_sandbox("bubblewrap")


def test_a_docker_engine_without_the_sandbox_image_fails_the_probe(docker_engine):
    probe_sandbox("docker")  # the engine makes a sandbox from its default image
    with pytest.raises(BackendUnavailable, match="docker could not make a sandbox: .*rollstream-test-absent"):
        probe_sandbox("docker", default_image="rollstream-test-absent:none")
